//! The KubeVirt CR's reconciler: the first CR in the cluster is the installation; its
//! objects are applied (server-side, as the operator's field manager), its workloads watched
//! until ready, and its status written as KubeVirt writes it. Deleting the CR removes what
//! was installed — unless workloads still exist and `uninstallStrategy` blocks it.

use std::sync::Arc;
use std::time::Duration;

use api::kubevirt::{
    ClusterSettings, KubeVirt, BLOCK_UNINSTALL_IF_WORKLOADS_EXIST, FINALIZER,
    HONOURED_CONFIGURATION, KNOWN_FEATURE_GATES,
};
use api::{
    VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceReplicaSet, VirtualMachinePool,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Client, ResourceExt};
use serde_json::Value;

use crate::certs::{self, Lifetime, Rotation};
use crate::install::{self, Release, Workload, WorkloadKind};
use crate::status::{self, Observed, WorkloadState};
use crate::workloads::{self, UpdateStrategy};
use controller_runtime::{finalizer_patch, has_finalizer, is_not_found, write_status};

/// The field manager of every object the operator applies.
pub const FIELD_MANAGER: &str = "virt-operator";

pub struct Context {
    pub client: Client,
    /// The registry of this operator's release, the default `imageRegistry`.
    pub registry: String,
    /// When the last batch of workload updates started.
    pub last_batch: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Context {
    pub fn new(client: Client, registry: String) -> Context {
        Context {
            client,
            registry,
            last_batch: Default::default(),
        }
    }

    /// Whether a new batch of workload updates may start (one per `interval`).
    fn batch_due(&self, interval: Duration) -> bool {
        let last = *self.last_batch.lock().unwrap_or_else(|e| e.into_inner());
        last.is_none_or(|t| t.elapsed() >= interval)
    }

    fn batch_started(&self) {
        *self.last_batch.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(std::time::Instant::now());
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Install(#[from] install::InstallError),
}

/// The rotation in force while the CR's cannot be taken (KubeVirt's defaults).
const DEFAULT_ROTATION: Rotation = Rotation {
    ca: Lifetime {
        duration: Duration::from_secs(7 * 24 * 3600),
        renew_before: Duration::from_secs(7 * 24 * 3600 / 5),
    },
    server: Lifetime {
        duration: Duration::from_secs(24 * 3600),
        renew_before: Duration::from_secs(24 * 3600 / 5),
    },
};

/// How often an installation that is not yet available, or is being removed, is looked at.
const WHILE_CHANGING: Duration = Duration::from_secs(2);
/// How often a settled installation is checked against its objects (a deleted or edited
/// object is put back).
const WHILE_SETTLED: Duration = Duration::from_secs(60);

pub async fn reconcile(kv: Arc<KubeVirt>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = kv.namespace().unwrap_or_default();
    let kvs: Api<KubeVirt> = Api::namespaced(ctx.client.clone(), &ns);
    if let Some(active) = active_elsewhere(&ctx.client, &kv).await? {
        write_status(&kvs, &kv, status::ignored(&kv, &active)).await?;
        if kv.metadata.deletion_timestamp.is_some() && has_finalizer(kv.as_ref(), FINALIZER) {
            patch_finalizer(&kvs, &kv, false).await?;
        }
        return Ok(Action::await_change());
    }
    if kv.metadata.deletion_timestamp.is_some() {
        return uninstall(&kvs, &kv, &ctx).await;
    }
    // The finalizer first, so nothing is installed that a deletion could leave behind.
    let kv = if has_finalizer(kv.as_ref(), FINALIZER) {
        kv
    } else {
        Arc::new(patch_finalizer(&kvs, &kv, true).await?)
    };
    let release = Release::of(&kv, &ctx.registry);
    let rotation = Rotation::of(&kv);
    let issued = certs::ensure(
        &ctx.client,
        &kv,
        rotation.as_ref().unwrap_or(&DEFAULT_ROTATION),
    )
    .await?;
    let objects = install::objects(&kv, &release, Some(&issued.bundle))?;
    let (apply_error, workloads) = roll_out(&ctx.client, &kv, &release, &objects).await?;
    let mut observed = Observed {
        kv: &kv,
        release: &release,
        operator_version: &install::operator_version(),
        apply_error,
        workloads,
        not_honoured: not_honoured(&kv),
        invalid_configuration: ClusterSettings::default()
            .with(&kv.spec.configuration.clone().unwrap_or_default())
            .err(),
    };
    let strategy = UpdateStrategy::of(&kv);
    for why in [strategy.as_ref().err(), rotation.as_ref().err()]
        .into_iter()
        .flatten()
    {
        observed.invalid_configuration.get_or_insert(why.clone());
    }
    let mut status = status::installing(&observed);
    let settled = status.observed_kube_virt_version.as_deref() == Some(release.tag.as_str())
        && observed.apply_error.is_none();
    if settled {
        // Workloads follow only a finished rollout: the new launcher is what virt-controller
        // now puts in every target Pod.
        let running = workloads::running(&ctx.client).await?;
        let outdated = workloads::outdated(&running, &release.image("virt-launcher"));
        status.outdated_virtual_machine_instance_workloads = Some(outdated.len() as i32);
        if let Ok(strategy) = &strategy {
            if !outdated.is_empty() && ctx.batch_due(strategy.batch_interval) {
                let started = workloads::update(&ctx.client, strategy, &outdated).await?;
                if started > 0 {
                    ctx.batch_started();
                }
            }
        }
    }
    let outdated = status
        .outdated_virtual_machine_instance_workloads
        .unwrap_or(0);
    write_status(&kvs, &kv, status).await?;
    let next = if settled && outdated == 0 {
        WHILE_SETTLED
    } else {
        WHILE_CHANGING
    };
    // Back in time to replace the next certificate that falls due.
    let renewal = issued
        .next_renewal
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    Ok(Action::requeue(
        next.min(renewal.max(Duration::from_secs(1))),
    ))
}

/// Applies the release. The shared objects (definitions, permissions, services, webhooks)
/// go first. On an upgrade the workloads follow one at a time in KubeVirt's order —
/// virt-handler, then virt-controller, then virt-api — each only once the one before runs the
/// new release; on a first install they all go at once. Returns the first apply failure and
/// the workloads as they are now.
async fn roll_out(
    client: &Client,
    kv: &KubeVirt,
    release: &Release,
    objects: &[Value],
) -> Result<(Option<String>, Vec<WorkloadState>), Error> {
    let workloads = install::workloads(objects);
    let is_workload = |o: &Value| workloads.iter().any(|w| w.is(o));
    let (staged, shared): (Vec<&Value>, Vec<&Value>) = objects.iter().partition(|o| is_workload(o));
    let mut apply_error = apply_all(client, shared).await;
    let status = kv.status.clone().unwrap_or_default();
    let upgrading = status.observed_kube_virt_version.is_some()
        && (status.observed_kube_virt_version.as_deref() != Some(release.tag.as_str())
            || status.observed_kube_virt_registry.as_deref() != Some(release.registry.as_str()));
    if !upgrading {
        if let Some(e) = apply_all(client, staged).await {
            apply_error.get_or_insert(e);
        }
        return Ok((apply_error, observe(client, kv, release, &workloads).await?));
    }
    for w in install::UPGRADE_ORDER {
        let Some(obj) = staged.iter().find(|o| o["metadata"]["name"] == *w) else {
            continue;
        };
        if let Some(e) = apply_all(client, [*obj]).await {
            apply_error.get_or_insert(e);
        }
        let now = observe(client, kv, release, &workloads).await?;
        if now.iter().any(|s| s.workload.name == *w && !s.ready) {
            break;
        }
    }
    Ok((apply_error, observe(client, kv, release, &workloads).await?))
}

pub fn error_policy(kv: Arc<KubeVirt>, err: &Error, _: Arc<Context>) -> Action {
    // A conflict only means the CR changed under a reconcile: the next one reads it anew.
    if matches!(err, Error::Kube(e) if controller_runtime::is_conflict(e)) {
        return Action::requeue(Duration::from_millis(200));
    }
    tracing::warn!(kubevirt = %kv.name_any(), error = %err, "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

/// The CR the cluster is installed from, when it is another one: the oldest, then by
/// namespace and name, as KubeVirt honours only one.
async fn active_elsewhere(client: &Client, kv: &KubeVirt) -> Result<Option<String>, Error> {
    let all: Api<KubeVirt> = Api::all(client.clone());
    let list = all.list(&ListParams::default()).await?;
    let key = |k: &KubeVirt| {
        (
            k.metadata.creation_timestamp.clone().map(|t| t.0),
            k.namespace(),
            k.name_any(),
        )
    };
    let active = list.items.iter().min_by_key(|k| key(k));
    Ok(active
        .filter(|a| a.uid() != kv.uid())
        .map(|a| format!("{}/{}", a.namespace().unwrap_or_default(), a.name_any())))
}

/// Adds or removes the finalizer; returns the CR as written.
async fn patch_finalizer(
    kvs: &Api<KubeVirt>,
    kv: &KubeVirt,
    present: bool,
) -> Result<KubeVirt, Error> {
    let patch = Patch::Merge(finalizer_patch(kv, FINALIZER, present));
    Ok(kvs
        .patch(&kv.name_any(), &PatchParams::default(), &patch)
        .await?)
}

/// Applies every object in order; the first failure is named and the rest still tried, so
/// one bad object never holds back the others.
async fn apply_all<'a>(
    client: &Client,
    objects: impl IntoIterator<Item = &'a Value>,
) -> Option<String> {
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let mut first_error = None;
    for obj in objects {
        let (api, kind, name) = api_for(client, obj);
        if let Err(e) = api.patch(name, &pp, &Patch::Apply(obj)).await {
            tracing::warn!(%kind, %name, error = %e, "apply failed");
            first_error.get_or_insert(format!("{kind} {name}: {e}"));
        }
    }
    first_error
}

/// The API of a rendered object, its kind and its name.
fn api_for<'a>(client: &Client, obj: &'a Value) -> (Api<DynamicObject>, String, &'a str) {
    let (ar, namespaced) = install::resource_of(obj);
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    let api = if namespaced {
        let ns = obj["metadata"]["namespace"].as_str().unwrap_or_default();
        Api::namespaced_with(client.clone(), ns, &ar)
    } else {
        Api::all_with(client.clone(), &ar)
    };
    (api, ar.kind, name)
}

/// Whether each workload runs `release`: labelled with it, rolled out at its current
/// generation, and ready.
async fn observe(
    client: &Client,
    kv: &KubeVirt,
    release: &Release,
    workloads: &[Workload],
) -> Result<Vec<WorkloadState>, Error> {
    let at_release = |meta: &kube::api::ObjectMeta| {
        meta.labels
            .as_ref()
            .and_then(|l| l.get(api::kubevirt::labels::VERSION))
            == Some(&release.tag)
    };
    let ns = kv.namespace().unwrap_or_default();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), &ns);
    let mut out = Vec::new();
    for w in workloads {
        let ready = match w.kind {
            WorkloadKind::Deployment => deployments
                .get_opt(&w.name)
                .await?
                .is_some_and(|d| at_release(&d.metadata) && deployment_ready(&d)),
            WorkloadKind::DaemonSet => daemonsets
                .get_opt(&w.name)
                .await?
                .is_some_and(|d| at_release(&d.metadata) && daemonset_ready(&d)),
        };
        out.push(WorkloadState {
            workload: w.clone(),
            ready,
        });
    }
    Ok(out)
}

/// Rolled out at its generation, every replica updated, at least one ready.
pub fn deployment_ready(d: &Deployment) -> bool {
    let Some(s) = &d.status else { return false };
    let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    s.observed_generation >= d.metadata.generation
        && s.updated_replicas.unwrap_or(0) >= want
        && s.ready_replicas.unwrap_or(0) > 0
}

/// Rolled out at its generation on every node it is meant for, and meant for at least one.
pub fn daemonset_ready(d: &DaemonSet) -> bool {
    let Some(s) = &d.status else { return false };
    s.observed_generation >= d.metadata.generation
        && s.desired_number_scheduled > 0
        && s.number_ready == s.desired_number_scheduled
        && s.updated_number_scheduled.unwrap_or(0) == s.desired_number_scheduled
}

/// The spec fields microvirt acts on besides `spec.configuration`'s.
const HONOURED: &[&str] = &[
    "spec.imageTag",
    "spec.imageRegistry",
    "spec.imagePullPolicy",
    "spec.uninstallStrategy",
    "spec.workloadUpdateStrategy",
    "spec.certificateRotateStrategy",
];

/// The spec fields set (to more than an empty value) that microvirt keeps but does not act
/// on, by path, and the feature gates it does not know.
fn not_honoured(kv: &KubeVirt) -> Vec<String> {
    let spec = serde_json::to_value(&kv.spec).unwrap_or_default();
    let mut out = Vec::new();
    let mut visit = |path: String, v: &Value| {
        if !is_empty(v)
            && !HONOURED.contains(&path.as_str())
            && !HONOURED_CONFIGURATION.contains(&path.as_str())
        {
            out.push(path);
        }
    };
    for (k, v) in spec.as_object().into_iter().flatten() {
        let path = format!("spec.{k}");
        if k != "configuration" {
            visit(path, v);
            continue;
        }
        // Two levels down: `spec.configuration.migrations.bandwidthPerMigration`.
        for (ck, cv) in v.as_object().into_iter().flatten() {
            let cpath = format!("{path}.{ck}");
            match cv.as_object() {
                Some(fields) => fields
                    .iter()
                    .for_each(|(f, fv)| visit(format!("{cpath}.{f}"), fv)),
                None => visit(cpath, cv),
            }
        }
    }
    let gates = kv
        .spec
        .configuration
        .as_ref()
        .and_then(|c| c.developer_configuration.as_ref());
    for g in gates.iter().flat_map(|d| &d.feature_gates) {
        if !KNOWN_FEATURE_GATES.contains(&g.as_str()) {
            out.push(format!("feature gate {g}"));
        }
    }
    out
}

/// Null, or an object, list or string with nothing in it (`featureGates: []`, `infra: {}`).
fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.iter().all(is_empty),
        Value::Object(o) => o.values().all(is_empty),
        _ => false,
    }
}

/// Removes the installation once no workload keeps it (or the strategy removes them too).
async fn uninstall(kvs: &Api<KubeVirt>, kv: &KubeVirt, ctx: &Context) -> Result<Action, Error> {
    if !has_finalizer(kv, FINALIZER) {
        return Ok(Action::await_change());
    }
    let strategy = kv
        .spec
        .uninstall_strategy
        .as_deref()
        .unwrap_or(BLOCK_UNINSTALL_IF_WORKLOADS_EXIST);
    if strategy == BLOCK_UNINSTALL_IF_WORKLOADS_EXIST {
        if let Some(why) = workloads_present(&ctx.client).await? {
            write_status(kvs, kv, status::deleting(kv, Some(&why))).await?;
            return Ok(Action::requeue(WHILE_CHANGING));
        }
    }
    write_status(kvs, kv, status::deleting(kv, None)).await?;
    let release = Release::of(kv, &ctx.registry);
    let objects = install::objects(kv, &release, None)?;
    // In reverse: the workloads go before the permissions and definitions they use.
    for obj in objects.iter().rev() {
        let (api, _, name) = api_for(&ctx.client, obj);
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    certs::remove(&ctx.client, &kv.namespace().unwrap_or_default()).await?;
    patch_finalizer(kvs, kv, false).await?;
    Ok(Action::await_change())
}

/// What keeps a `BlockUninstallIfWorkloadsExist` installation: KubeVirt's message naming the
/// first kind that still has objects.
pub async fn workloads_present(client: &Client) -> Result<Option<String>, Error> {
    /// Whether any object of kind `K` exists, in any namespace.
    async fn any<K>(client: &Client) -> Result<bool, kube::Error>
    where
        K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let lp = ListParams::default().limit(1);
        Ok(!Api::<K>::all(client.clone())
            .list(&lp)
            .await?
            .items
            .is_empty())
    }
    let present = [
        (
            any::<VirtualMachineInstance>(client).await?,
            "Virtual Machine Instances",
        ),
        (any::<VirtualMachine>(client).await?, "Virtual Machines"),
        (
            any::<VirtualMachineInstanceReplicaSet>(client).await?,
            "Virtual Machine Instance Replica Sets",
        ),
        (
            any::<VirtualMachinePool>(client).await?,
            "Virtual Machine Pools",
        ),
    ];
    Ok(present
        .into_iter()
        .find(|(p, _)| *p)
        .map(|(_, what)| format!("there are still {what} present")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_fields_are_not_reported_set_ones_are() {
        let text = include_str!("../../../deploy/kubevirt-cr.yaml");
        let kv: KubeVirt = serde_yaml::from_str(text).unwrap();
        assert_eq!(not_honoured(&kv), Vec::<String>::new());
        let kv: KubeVirt = serde_yaml::from_str(&text.replace(
            "customizeComponents: {}",
            "customizeComponents: {flags: {api: {v: '4'}}}\n  infra: {replicas: 3}",
        ))
        .unwrap();
        assert_eq!(
            not_honoured(&kv),
            ["spec.customizeComponents", "spec.infra"]
        );
        let kv: KubeVirt = serde_yaml::from_str(&text.replace(
            "featureGates: []",
            "featureGates: [HostDisk, Snapshot]\n    migrations: {bandwidthPerMigration: 1Gi, disableTLS: true}\n    vmStateStorageClass: local",
        ))
        .unwrap();
        assert_eq!(
            not_honoured(&kv),
            [
                "spec.configuration.migrations.disableTLS",
                "feature gate Snapshot"
            ]
        );
    }

    #[test]
    fn operator_yaml_carries_the_generated_crd() {
        use kube::CustomResourceExt;
        let text = include_str!("../../../deploy/operator.yaml");
        let generated = serde_json::to_value(KubeVirt::crd()).unwrap();
        let found = serde_yaml::Deserializer::from_str(text)
            .map(|d| <Value as serde::Deserialize>::deserialize(d).unwrap())
            .find(|d| d["kind"] == "CustomResourceDefinition")
            .expect("deploy/operator.yaml has the KubeVirt CRD");
        assert!(
            found == generated,
            "deploy/operator.yaml's CRD drifted from api::kubevirt: paste `virt-operator crd` in"
        );
    }
}
