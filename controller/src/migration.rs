//! The VirtualMachineInstanceMigration controller.
//!
//! Phases: Pending (queued until the cluster and source-node limits allow it) → Scheduling
//! (target Pod created: same launcher, label `kubevirt.io/migrationJobUID`, required
//! anti-affinity on `kubevirt.io/created-by` over `kubernetes.io/hostname` so it lands on another
//! node) → Scheduled (target Pod bound) → PreparingTarget (target Pod running; the hand-off is
//! written to `vmi.status.migrationState` and the VMI is labelled
//! `kubevirt.io/migrationTargetNodeName`) → TargetReady (the target virt-handler set
//! `targetNodeAddress`) → Running (the source virt-handler set `startTimestamp`) → Succeeded
//! (`completed`: the VMI now lives in the target Pod and node, the source Pod is deleted) or
//! Failed (`failed`, target Pod lost, source lost, or the migration was deleted): the target Pod
//! is removed and the VMI keeps running on its source.
//!
//! Migrations reconcile in parallel, except admission (Pending → Scheduling), which is
//! serialized and counts admitted migrations from the API server, so the limits hold exactly
//! even when many migrations are created at once, and a slow request for one migration does not
//! hold up the others once they are admitted.

use std::collections::BTreeMap;
use std::sync::Arc;

use api::{
    MigrationConfiguration, MigrationPhase, MigrationPolicy, MigrationState, PhaseTransition,
    VirtualMachineInstance, VirtualMachineInstanceMigration, VirtualMachineInstanceMigrationStatus,
    VmiPhase,
};
use k8s_openapi::api::core::v1::{Affinity, Namespace, Pod, PodAffinityTerm, PodAntiAffinity};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;

use crate::context::{Context, Error, Result};
use controller_runtime::time::now_rfc3339;
use controller_runtime::{
    delete_if_present, finalizer_patch, has_finalizer, set_condition, write_status,
};

const CONTROLLER: &str = "migration";

/// The policy that applies to a VMI, as KubeVirt picks it: every selector label must match
/// (VMI labels and namespace labels); the policy matching the most labels wins, ties by name.
pub fn matching_policy<'a>(
    policies: &'a [MigrationPolicy],
    vmi_labels: &BTreeMap<String, String>,
    ns_labels: &BTreeMap<String, String>,
) -> Option<&'a MigrationPolicy> {
    let subset = |want: &Option<BTreeMap<String, String>>, have: &BTreeMap<String, String>| {
        want.iter().flatten().all(|(k, v)| have.get(k) == Some(v))
    };
    let weight = |p: &MigrationPolicy| {
        p.spec
            .selectors
            .virtual_machine_instance_selector
            .as_ref()
            .map_or(0, |m| m.len())
            + p.spec
                .selectors
                .namespace_selector
                .as_ref()
                .map_or(0, |m| m.len())
    };
    let mut matching: Vec<&MigrationPolicy> = policies
        .iter()
        .filter(|p| {
            subset(
                &p.spec.selectors.virtual_machine_instance_selector,
                vmi_labels,
            ) && subset(&p.spec.selectors.namespace_selector, ns_labels)
        })
        .collect();
    matching.sort_by(|a, b| {
        weight(b)
            .cmp(&weight(a))
            .then(a.name_any().cmp(&b.name_any()))
    });
    matching.first().copied()
}

/// The settings of a migration: the cluster's (`defaults`), with a matching policy's over them.
pub fn configuration(
    defaults: &MigrationConfiguration,
    policy: Option<&MigrationPolicy>,
) -> MigrationConfiguration {
    let mut c = defaults.clone();
    if let Some(p) = policy {
        let s = &p.spec;
        if s.bandwidth_per_migration.is_some() {
            c.bandwidth_per_migration = s.bandwidth_per_migration.clone();
        }
        if s.completion_timeout_per_gi_b.is_some() {
            c.completion_timeout_per_gi_b = s.completion_timeout_per_gi_b;
        }
        if s.allow_auto_converge.is_some() {
            c.allow_auto_converge = s.allow_auto_converge;
        }
        if s.allow_post_copy.is_some() {
            c.allow_post_copy = s.allow_post_copy;
        }
    }
    c
}

/// The target Pod: the VMI's launcher Pod, marked as this migration's and kept off the nodes
/// where the VMI already has a Pod.
pub fn target_pod(
    vmi: &VirtualMachineInstance,
    migration: &VirtualMachineInstanceMigration,
    cfg: &crate::pod::PodConfig,
) -> Result<Pod> {
    let mut pod = crate::pod::render(vmi, cfg)?;
    let uid = vmi.uid().unwrap_or_default();
    pod.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert(
            api::labels::MIGRATION_JOB.into(),
            migration.uid().unwrap_or_default(),
        );
    let spec = pod.spec.get_or_insert_with(Default::default);
    let affinity = spec.affinity.get_or_insert_with(Affinity::default);
    let anti = affinity
        .pod_anti_affinity
        .get_or_insert_with(PodAntiAffinity::default);
    anti.required_during_scheduling_ignored_during_execution
        .get_or_insert_with(Vec::new)
        .push(PodAffinityTerm {
            label_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(api::labels::CREATED_BY.to_string(), uid)])),
                ..Default::default()
            }),
            topology_key: "kubernetes.io/hostname".into(),
            ..Default::default()
        });
    Ok(pod)
}

pub async fn reconcile(
    m: Arc<VirtualMachineInstanceMigration>,
    ctx: Arc<Context>,
) -> Result<Action> {
    let started = std::time::Instant::now();
    let r = reconcile_inner(&m, &ctx).await;
    ctx.metrics.observe_reconcile(CONTROLLER, started.elapsed());
    if r.is_ok() {
        ctx.succeeded(CONTROLLER, m.as_ref());
    }
    r
}

pub fn error_policy(
    m: Arc<VirtualMachineInstanceMigration>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.retry(CONTROLLER, m.as_ref(), err)
}

struct Apis {
    migrations: Api<VirtualMachineInstanceMigration>,
    vmis: Api<VirtualMachineInstance>,
    pods: Api<Pod>,
}

/// One reconcile of one migration: the object, where to write, and the status being built.
struct Pass<'a> {
    m: &'a VirtualMachineInstanceMigration,
    ctx: &'a Context,
    apis: Apis,
    status: VirtualMachineInstanceMigrationStatus,
}

/// The healthy target Pod of a migration past admission, and what the phases read of it.
struct Target {
    pod: Pod,
    /// The Pod's phase ("Pending", "Running", ...).
    phase: String,
    node: Option<String>,
}

/// Why the VMI cannot be migrated now: the VMI as read, the Failed reason, the message.
struct SourceRefused(Option<VirtualMachineInstance>, &'static str, String);

async fn reconcile_inner(m: &VirtualMachineInstanceMigration, ctx: &Context) -> Result<Action> {
    let ns = m.namespace().unwrap_or_default();
    let mut pass = Pass {
        m,
        ctx,
        apis: Apis {
            migrations: Api::namespaced(ctx.client.clone(), &ns),
            vmis: Api::namespaced(ctx.client.clone(), &ns),
            pods: Api::namespaced(ctx.client.clone(), &ns),
        },
        status: m.status.clone().unwrap_or_default(),
    };
    let vmi = pass.apis.vmis.get_opt(&m.spec.vmi_name).await?;
    let finished = pass.status.phase.is_some_and(MigrationPhase::is_final);
    if m.metadata.deletion_timestamp.is_some() {
        return pass.finalize(vmi.as_ref(), finished).await;
    }
    if finished {
        return Ok(Action::await_change());
    }
    if !has_finalizer(m, api::labels::MIGRATION_FINALIZER) {
        return pass.set_finalizer(true).await;
    }
    if let Err(e) = api::validation::validate_migration(m) {
        return pass.fail(vmi.as_ref(), "InvalidSpec", e.to_string()).await;
    }
    let phase = pass.status.phase.unwrap_or(MigrationPhase::Pending);
    let vmi = match pass.running_source(vmi, phase) {
        Ok(vmi) => vmi,
        Err(refused) => {
            let SourceRefused(vmi, reason, why) = *refused;
            return pass.fail(vmi.as_ref(), reason, why).await;
        }
    };
    match phase {
        MigrationPhase::Pending => pass.admit(&vmi).await,
        MigrationPhase::Succeeded | MigrationPhase::Failed => Ok(Action::await_change()),
        _ => {
            let Some(target) = pass.target(&vmi, phase).await? else {
                return Ok(Action::await_change());
            };
            match phase {
                MigrationPhase::Scheduling => pass.bind(target).await,
                MigrationPhase::Scheduled if target.phase == "Running" => {
                    pass.hand_off(&vmi, target).await
                }
                MigrationPhase::Scheduled => Ok(Action::await_change()),
                _ => pass.follow(&vmi, target).await,
            }
        }
    }
}

impl Pass<'_> {
    fn name(&self) -> String {
        self.m.name_any()
    }

    fn uid(&self) -> String {
        self.m.uid().unwrap_or_default()
    }

    /// Ends the migration as Failed (see [`fail`]); nothing more to do until it changes.
    async fn fail(
        &mut self,
        vmi: Option<&VirtualMachineInstance>,
        reason: &str,
        message: String,
    ) -> Result<Action> {
        fail(
            &self.apis,
            self.m,
            vmi,
            &mut self.status,
            reason,
            message,
            self.ctx,
        )
        .await?;
        Ok(Action::await_change())
    }

    async fn write(&mut self) -> Result<Action> {
        write_status(&self.apis.migrations, self.m, self.status.clone()).await?;
        Ok(Action::await_change())
    }

    async fn set_finalizer(&self, present: bool) -> Result<Action> {
        let p = finalizer_patch(self.m, api::labels::MIGRATION_FINALIZER, present);
        self.apis
            .migrations
            .patch(&self.name(), &PatchParams::default(), &Patch::Merge(&p))
            .await?;
        Ok(Action::await_change())
    }

    /// Deleted: an unfinished migration is canceled, then the finalizer lets it go.
    async fn finalize(
        &mut self,
        vmi: Option<&VirtualMachineInstance>,
        finished: bool,
    ) -> Result<Action> {
        if !finished {
            let why = "the migration was deleted (canceled)".to_string();
            self.fail(vmi, "MigrationCanceled", why).await?;
        }
        if has_finalizer(self.m, api::labels::MIGRATION_FINALIZER) {
            self.set_finalizer(false).await?;
        }
        Ok(Action::await_change())
    }

    /// The VMI to migrate, if it can be: it exists, runs, and (before admission) is
    /// migratable; else the reason the migration fails and its message.
    fn running_source(
        &self,
        vmi: Option<VirtualMachineInstance>,
        phase: MigrationPhase,
    ) -> std::result::Result<VirtualMachineInstance, Box<SourceRefused>> {
        let Some(vmi) = vmi.filter(|v| v.metadata.deletion_timestamp.is_none()) else {
            let why = format!(
                "VirtualMachineInstance {} does not exist or is being deleted",
                self.m.spec.vmi_name
            );
            return Err(Box::new(SourceRefused(None, "VMINotFound", why)));
        };
        let vstatus = vmi.status.clone().unwrap_or_default();
        if vstatus.phase != Some(VmiPhase::Running) {
            let why = format!(
                "VirtualMachineInstance {} is {:?}, not Running{}",
                vmi.name_any(),
                vstatus.phase.unwrap_or(VmiPhase::Pending),
                if phase == MigrationPhase::Pending {
                    ""
                } else {
                    " (the source was lost)"
                }
            );
            return Err(Box::new(SourceRefused(Some(vmi), "VMINotRunning", why)));
        }
        if phase == MigrationPhase::Pending {
            if let Some(Err(why)) = api::conditions::published_migratability(&vstatus) {
                let why = format!(
                    "VirtualMachineInstance {} cannot be live-migrated: {why}",
                    vmi.name_any()
                );
                return Err(Box::new(SourceRefused(Some(vmi), "VMINotMigratable", why)));
            }
        }
        Ok(vmi)
    }

    /// Pending: admitted to Scheduling once the limits allow, else queued.
    async fn admit(&mut self, vmi: &VirtualMachineInstance) -> Result<Action> {
        let source_node = vmi
            .status
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        // Admission is serialized (one reconcile at a time decides, and writes its decision
        // before the next looks) so the limits are exact; everything else runs in parallel.
        let _admission = self.ctx.migration_admission.lock().await;
        if let Some(wait) = queue_position(self.ctx, self.m, vmi, &source_node).await? {
            if self.status.phase.is_none() {
                enter(&mut self.status, MigrationPhase::Pending);
                self.write().await?;
            }
            tracing::debug!(migration = %self.name(), reason = %wait, "migration queued");
            return Ok(Action::requeue(self.ctx.config.migration_queue_recheck));
        }
        let uid = self.uid();
        let ms = self
            .status
            .migration_state
            .get_or_insert_with(Default::default);
        ms.migration_uid = Some(uid);
        ms.source_node = Some(source_node);
        enter(&mut self.status, MigrationPhase::Scheduling);
        self.write().await
    }

    /// Past admission: the target Pod, created in Scheduling if there is none (a retry after
    /// a lost write finds it by label), and recorded. `None` when this pass has ended (the Pod
    /// was just created, or it is lost and the migration failed).
    async fn target(
        &mut self,
        vmi: &VirtualMachineInstance,
        phase: MigrationPhase,
    ) -> Result<Option<Target>> {
        let found = target_pods(&self.apis.pods, &self.uid(), vmi, self.ctx)
            .await?
            .into_iter()
            .next();
        let recorded = self
            .status
            .migration_state
            .as_ref()
            .and_then(|s| s.target_pod.clone());
        if phase == MigrationPhase::Scheduling && found.is_none() && recorded.is_none() {
            self.create_target(vmi).await?;
            return Ok(None);
        }
        if let (Some(t), None) = (&found, &recorded) {
            let ms = self
                .status
                .migration_state
                .get_or_insert_with(Default::default);
            ms.target_pod = Some(t.name_any());
        }
        // From here on the target Pod must exist and be healthy.
        let Some(pod) = found.filter(|p| p.metadata.deletion_timestamp.is_none()) else {
            let why = "the migration target pod is gone".to_string();
            self.fail(Some(vmi), "TargetPodLost", why).await?;
            return Ok(None);
        };
        let phase = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        if phase == "Failed" || phase == "Succeeded" {
            let why = format!(
                "the migration target pod {} ended ({phase})",
                pod.name_any()
            );
            self.fail(Some(vmi), "TargetPodFailed", why).await?;
            return Ok(None);
        }
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty());
        Ok(Some(Target { pod, phase, node }))
    }

    /// Scheduling, admitted: the target Pod is made.
    async fn create_target(&mut self, vmi: &VirtualMachineInstance) -> Result<()> {
        let pod = target_pod(vmi, self.m, &self.ctx.pod_config())?;
        let pod = self.apis.pods.create(&PostParams::default(), &pod).await?;
        let note = format!("Created migration target pod {}", pod.name_any());
        self.ctx
            .event(self.m, false, "SuccessfulCreate", "Migrate", note)
            .await;
        let ms = self
            .status
            .migration_state
            .get_or_insert_with(Default::default);
        ms.target_pod = Some(pod.name_any());
        self.write().await?;
        Ok(())
    }

    /// Scheduling: Scheduled once the target Pod is bound to a node.
    async fn bind(&mut self, target: Target) -> Result<Action> {
        let Some(node) = target.node else {
            return Ok(Action::await_change());
        };
        let ms = self
            .status
            .migration_state
            .get_or_insert_with(Default::default);
        ms.target_node = Some(node);
        enter(&mut self.status, MigrationPhase::Scheduled);
        self.write().await
    }

    /// Scheduled, target Pod running: the hand-off (nodes, Pod, the policy's configuration)
    /// written to the VMI for the two virt-handlers, and the VMI labelled with the target node.
    async fn hand_off(&mut self, vmi: &VirtualMachineInstance, target: Target) -> Result<Action> {
        let node = target.node.unwrap_or_default();
        let client = &self.ctx.client;
        let ns_labels = Api::<Namespace>::all(client.clone())
            .get_opt(&vmi.namespace().unwrap_or_default())
            .await?
            .map(|n| n.labels().clone())
            .unwrap_or_default();
        let policies = Api::<MigrationPolicy>::all(client.clone())
            .list(&ListParams::default())
            .await?
            .items;
        let policy = matching_policy(&policies, vmi.labels(), &ns_labels);
        let configuration = configuration(&self.ctx.settings().migrations, policy);
        let mut vstatus = vmi.status.clone().unwrap_or_default();
        let hand_off = MigrationState {
            migration_uid: Some(self.uid()),
            source_node: Some(vstatus.node_name.clone().unwrap_or_default()),
            target_node: Some(node.clone()),
            target_pod: Some(target.pod.name_any()),
            mode: Some(
                if configuration.allow_post_copy == Some(true) {
                    "PostCopy"
                } else {
                    "PreCopy"
                }
                .into(),
            ),
            migration_configuration: Some(configuration),
            migration_policy_name: policy.map(|p| p.name_any()),
            ..Default::default()
        };
        let mut labels = vmi.labels().clone();
        labels.insert(api::labels::MIGRATION_TARGET_NODE.into(), node);
        vstatus.migration_state = Some(hand_off.clone());
        crate::vmi::write(
            &self.apis.vmis,
            vmi,
            Some(labels),
            vstatus,
            &self.ctx.unseen_writes,
        )
        .await?;
        self.status.migration_state = Some(hand_off);
        enter(&mut self.status, MigrationPhase::PreparingTarget);
        self.write().await
    }

    /// PreparingTarget, TargetReady, Running: the phase follows what the virt-handlers report
    /// in the VMI's hand-off, until it completes or fails.
    async fn follow(&mut self, vmi: &VirtualMachineInstance, target: Target) -> Result<Action> {
        let uid = self.uid();
        let phase = self.status.phase.unwrap_or(MigrationPhase::Pending);
        let reported = vmi
            .status
            .as_ref()
            .and_then(|s| s.migration_state.clone())
            .filter(|s| s.migration_uid.as_deref() == Some(&uid));
        let Some(vms) = reported else {
            let why = "vmi.status.migrationState no longer describes this migration".to_string();
            return self.fail(Some(vmi), "HandOffLost", why).await;
        };
        if vms.failed == Some(true) {
            let why = "virt-handler reported the migration failed".to_string();
            return self.fail(Some(vmi), "MigrationFailed", why).await;
        }
        if vms.completed == Some(true) {
            succeed(
                &self.apis,
                self.m,
                vmi,
                &target.pod,
                vms,
                &mut self.status,
                self.ctx,
            )
            .await?;
            return Ok(Action::await_change());
        }
        let next = if vms.start_timestamp.is_some() {
            MigrationPhase::Running
        } else if vms.target_node_address.is_some() {
            MigrationPhase::TargetReady
        } else {
            phase
        };
        if next == phase {
            return Ok(Action::await_change());
        }
        self.status.migration_state = Some(vms);
        enter(&mut self.status, next);
        self.write().await
    }
}

/// None when the migration may start, or why it waits: at most
/// `parallel_migrations_per_cluster` in flight, `parallel_outbound_migrations_per_node` leaving
/// one node, one per VMI (earliest created first).
async fn queue_position(
    ctx: &Context,
    m: &VirtualMachineInstanceMigration,
    vmi: &VirtualMachineInstance,
    source_node: &str,
) -> Result<Option<String>> {
    let all = Api::<VirtualMachineInstanceMigration>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let uid = m.uid();
    let in_flight: Vec<&VirtualMachineInstanceMigration> = all
        .iter()
        .filter(|o| o.uid() != uid)
        .filter(|o| {
            let p = o.status.as_ref().and_then(|s| s.phase);
            !p.is_some_and(MigrationPhase::is_final)
                && p.is_some()
                && p != Some(MigrationPhase::Pending)
        })
        .collect();
    if in_flight
        .iter()
        .any(|o| o.spec.vmi_name == vmi.name_any() && o.namespace() == vmi.namespace())
    {
        return Ok(Some("another migration of this VMI is in progress".into()));
    }
    let settings = ctx.settings();
    if in_flight.len() >= settings.parallel_migrations_per_cluster {
        return Ok(Some(format!(
            "{} migrations are running in the cluster",
            in_flight.len()
        )));
    }
    let outbound = in_flight
        .iter()
        .filter(|o| {
            o.status
                .as_ref()
                .and_then(|s| s.migration_state.as_ref())
                .and_then(|s| s.source_node.as_deref())
                == Some(source_node)
        })
        .count();
    if outbound >= settings.parallel_outbound_migrations_per_node {
        return Ok(Some(format!(
            "{outbound} migrations are leaving node {source_node}"
        )));
    }
    Ok(None)
}

fn enter(status: &mut VirtualMachineInstanceMigrationStatus, phase: MigrationPhase) {
    status.phase = Some(phase);
    status.phase_transition_timestamps.push(PhaseTransition {
        phase: format!("{phase:?}"),
        phase_transition_timestamp: now_rfc3339(),
    });
}

/// The VMI moves to the target: its Pod, node and labels; the source Pod is deleted (its
/// launcher has already handed the guest over).
async fn succeed(
    apis: &Apis,
    m: &VirtualMachineInstanceMigration,
    vmi: &VirtualMachineInstance,
    target: &Pod,
    mut vms: MigrationState,
    status: &mut VirtualMachineInstanceMigrationStatus,
    ctx: &Context,
) -> Result<()> {
    let target_node = vms.target_node.clone().unwrap_or_default();
    vms.end_timestamp.get_or_insert_with(now_rfc3339);
    let mut vstatus = vmi.status.clone().unwrap_or_default();
    let old_pods = vstatus.active_pods.clone().unwrap_or_default();
    vstatus.node_name = Some(target_node.clone());
    vstatus.active_pods = Some(BTreeMap::from([(
        target.uid().unwrap_or_default(),
        target_node.clone(),
    )]));
    vstatus.migration_state = Some(vms.clone());
    if vstatus.evacuation_node_name.is_some() {
        vstatus.evacuation_node_name = None;
    }
    let mut labels = vmi.labels().clone();
    labels.remove(api::labels::MIGRATION_TARGET_NODE);
    labels.insert(api::labels::NODE_NAME.into(), target_node.clone());
    crate::vmi::write(&apis.vmis, vmi, Some(labels), vstatus, &ctx.unseen_writes).await?;
    // Source Pods: the ones the VMI ran in before.
    for p in crate::vmi::pods_of(&apis.pods, vmi, ctx).await? {
        if p.uid().is_some_and(|u| old_pods.contains_key(&u)) {
            delete_pod(&apis.pods, &p.name_any()).await?;
        }
    }
    status.migration_state = Some(vms);
    set_condition(
        &mut status.conditions,
        "Succeeded",
        true,
        Some("MigrationSucceeded"),
        None,
    );
    enter(status, MigrationPhase::Succeeded);
    write_status(&apis.migrations, m, status.clone()).await?;
    ctx.event(
        m,
        false,
        "SuccessfulMigration",
        "Migrate",
        format!(
            "VirtualMachineInstance {} migrated to node {target_node}",
            vmi.name_any()
        ),
    )
    .await;
    Ok(())
}

/// Ends a migration as Failed: the target Pod is deleted, the VMI's hand-off is marked failed
/// and its target label removed; the VMI keeps running where it is.
async fn fail(
    apis: &Apis,
    m: &VirtualMachineInstanceMigration,
    vmi: Option<&VirtualMachineInstance>,
    status: &mut VirtualMachineInstanceMigrationStatus,
    reason: &str,
    message: String,
    ctx: &Context,
) -> Result<()> {
    let muid = m.uid().unwrap_or_default();
    // Without the VMI no Pod can be its: the garbage collector removes what it controlled.
    let targets = match vmi {
        Some(vmi) => target_pods(&apis.pods, &muid, vmi, ctx).await?,
        None => Vec::new(),
    };
    for p in targets
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
        delete_pod(&apis.pods, &p.name_any()).await?;
    }
    if let Some(vmi) = vmi {
        let mut vstatus = vmi.status.clone().unwrap_or_default();
        if let Some(vms) = vstatus
            .migration_state
            .as_mut()
            .filter(|s| s.migration_uid.as_deref() == Some(&muid))
        {
            vms.failed = Some(true);
            vms.completed = Some(false);
            vms.end_timestamp.get_or_insert_with(now_rfc3339);
            if reason == "MigrationCanceled" {
                vms.abort_status = Some("Succeeded".into());
            }
        }
        let mut labels = vmi.labels().clone();
        labels.remove(api::labels::MIGRATION_TARGET_NODE);
        crate::vmi::write(&apis.vmis, vmi, Some(labels), vstatus, &ctx.unseen_writes).await?;
    }
    if let Some(ms) = status.migration_state.as_mut() {
        ms.failed = Some(true);
        ms.end_timestamp.get_or_insert_with(now_rfc3339);
    }
    set_condition(
        &mut status.conditions,
        "Failed",
        true,
        Some(reason),
        Some(message.clone()),
    );
    enter(status, MigrationPhase::Failed);
    write_status(&apis.migrations, m, status.clone()).await?;
    ctx.event(m, true, reason, "Migrate", message).await;
    Ok(())
}

async fn delete_pod(pods: &Api<Pod>, name: &str) -> Result<()> {
    Ok(delete_if_present(pods, name, &DeleteParams::default()).await?)
}

/// The target Pods of a migration (by its uid label) that the VMI controls, from the API
/// server: a Pod a tenant labelled with the uid is never taken as the target.
async fn target_pods(
    pods: &Api<Pod>,
    migration_uid: &str,
    vmi: &VirtualMachineInstance,
    ctx: &Context,
) -> Result<Vec<Pod>> {
    crate::vmi::owned_pods(pods, api::labels::MIGRATION_JOB, migration_uid, vmi, ctx).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::kubevirt::ClusterSettings;
    use api::{MigrationPolicySpec, MigrationSelectors};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn policy(name: &str, vmi: &[(&str, &str)], ns: &[(&str, &str)], bw: &str) -> MigrationPolicy {
        let map = |l: &[(&str, &str)]| {
            (!l.is_empty()).then(|| {
                l.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
        };
        MigrationPolicy::new(
            name,
            MigrationPolicySpec {
                bandwidth_per_migration: Some(Quantity(bw.into())),
                selectors: MigrationSelectors {
                    virtual_machine_instance_selector: map(vmi),
                    namespace_selector: map(ns),
                },
                ..Default::default()
            },
        )
    }

    #[test]
    fn the_most_specific_matching_policy_wins() {
        let ps = vec![
            policy("a", &[("tier", "db")], &[], "10Mi"),
            policy("b", &[("tier", "db")], &[("env", "prod")], "20Mi"),
            policy("c", &[("tier", "web")], &[], "30Mi"),
        ];
        let l = |kv: &[(&str, &str)]| {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let pick = |vmi: &[(&str, &str)], ns: &[(&str, &str)]| {
            matching_policy(&ps, &l(vmi), &l(ns)).map(|p| p.name_any())
        };
        assert_eq!(
            pick(&[("tier", "db")], &[("env", "prod")]),
            Some("b".into())
        );
        assert_eq!(pick(&[("tier", "db")], &[]), Some("a".into()));
        assert_eq!(pick(&[("tier", "cache")], &[]), None);
        let c = configuration(
            &ClusterSettings::default().migrations,
            matching_policy(&ps, &l(&[("tier", "web")]), &l(&[])),
        );
        assert_eq!(c.bandwidth_per_migration, Some(Quantity("30Mi".into())));
        assert_eq!(c.completion_timeout_per_gi_b, Some(150));
    }
}
