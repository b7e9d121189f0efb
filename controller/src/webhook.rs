//! The admission webhook (HTTPS, admission.k8s.io/v1), served by every virt-controller replica:
//! - `/validate`: VMs, VMIs, ReplicaSets and Migrations through the `api` crate's validation, so
//!   `kubectl apply` of a bad object fails with the same message `virt-launcher run` prints;
//!   the deprecated `spec.running` is admitted with a warning, as KubeVirt does;
//! - `/mutate`: KubeVirt's defaulting (`api::validation::default_*`) as a JSON patch;
//! - `/eviction`: `pods/eviction` of a launcher Pod, decided by its VMI's eviction strategy
//!   (see `crate::evacuation::evict`): refused with 429 (so `kubectl drain` keeps retrying)
//!   after marking the VMI `status.evacuationNodeName` when it is to move; the VMI controller
//!   then live-migrates it, and once it has left the node the Pod is gone and the drain ends.

use std::sync::Arc;

use api::{
    VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration,
    VirtualMachineInstanceReplicaSet,
};
use axum::extract::State;
use axum::routing::post;
use axum::Json;
use kube::api::Api;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::DynamicObject;
use kube::{Client, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

pub const RUNNING_DEPRECATED: &str =
    "spec.running is deprecated, please use spec.runStrategy instead.";

#[derive(Clone)]
pub struct WebhookState {
    /// For `/eviction`, which reads the Pod and VMI and marks the VMI, and for admitting
    /// migrations, which reads their VMI.
    pub client: Option<Client>,
    /// The cluster's settings now: the eviction strategy of VMIs that set none, whether the
    /// HostDisk gate is on.
    pub settings: controller_runtime::LiveSettings,
    /// Where tenants may use hostDisks (the gate is the settings').
    pub host_disk_prefixes: Vec<String>,
}

impl WebhookState {
    fn host_disks(&self) -> api::validation::HostDiskPolicy {
        api::validation::HostDiskPolicy {
            feature_gate: self.settings.current().feature_gate("HostDisk"),
            allowed_prefixes: self.host_disk_prefixes.clone(),
        }
    }
}

pub fn router(state: WebhookState) -> axum::Router {
    axum::Router::new()
        .route("/validate", post(validate))
        .route("/mutate", post(mutate))
        .route("/eviction", post(eviction))
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .with_state(Arc::new(state))
}

type Review = Json<AdmissionReview<DynamicObject>>;

/// `review` answered with what `decide` makes of its request; a body that is not an
/// AdmissionReview request is answered as invalid.
async fn answer<F: std::future::Future<Output = AdmissionResponse>>(
    review: AdmissionReview<DynamicObject>,
    decide: impl FnOnce(AdmissionRequest<DynamicObject>) -> F,
) -> Json<AdmissionReview<DynamicObject>> {
    let req: Result<AdmissionRequest<DynamicObject>, _> = review.try_into();
    let resp = match req {
        Ok(req) => decide(req).await,
        Err(e) => AdmissionResponse::invalid(format!("not an AdmissionReview request: {e}")),
    };
    Json(resp.into_review())
}

fn decode<T: DeserializeOwned>(obj: &DynamicObject, kind: &str) -> Result<T, String> {
    let v = serde_json::to_value(obj).map_err(|e| e.to_string())?;
    serde_json::from_value(v).map_err(|e| format!("{kind} cannot be decoded: {e}"))
}

/// The admission decision for one object, as the launcher would judge it, and then as the
/// cluster's policy does (hostDisks).
pub fn validate_object(
    kind: &str,
    obj: &DynamicObject,
    host_disks: &api::validation::HostDiskPolicy,
    network: &api::validation::NetworkDefaults,
) -> Result<Vec<String>, String> {
    let mut warnings = vec![];
    let checked = match kind {
        "VirtualMachine" => {
            let vm: VirtualMachine = decode(obj, kind)?;
            if vm.spec.running.is_some() {
                warnings.push(RUNNING_DEPRECATED.to_string());
            }
            warnings.extend(api::validation::warnings_vm(&vm));
            // Judged as its VMI will be made: defaulted (the template itself is not).
            let mut defaulted = vm;
            api::validation::default_vm_with(&mut defaulted, network);
            api::validation::validate_vm(&defaulted).and_then(|()| {
                match &defaulted.spec.template.spec {
                    Some(spec) => cluster_rules(
                        kind,
                        &defaulted.metadata,
                        spec,
                        "spec.template.spec",
                        host_disks,
                        network,
                    ),
                    None => Ok(()),
                }
            })
        }
        "VirtualMachineInstance" => {
            let vmi: VirtualMachineInstance = decode(obj, kind)?;
            warnings.extend(api::validation::warnings_vmi(&vmi));
            api::validation::validate_vmi(&vmi).and_then(|()| {
                cluster_rules(kind, &vmi.metadata, &vmi.spec, "spec", host_disks, network)
            })
        }
        "VirtualMachineInstanceReplicaSet" => {
            let mut rs: VirtualMachineInstanceReplicaSet = decode(obj, kind)?;
            if let Some(spec) = rs.spec.template.spec.as_mut() {
                api::validation::default_vmi_spec_with(spec, network);
            }
            api::validation::validate_vmirs(&rs).and_then(|()| match &rs.spec.template.spec {
                Some(spec) => cluster_rules(
                    kind,
                    &rs.metadata,
                    spec,
                    "spec.template.spec",
                    host_disks,
                    network,
                ),
                None => Ok(()),
            })
        }
        "VirtualMachineInstanceMigration" => {
            api::validation::validate_migration(&decode(obj, kind)?)
        }
        "VirtualMachineSnapshot" => {
            let s: api::snapshot::VirtualMachineSnapshot = decode(obj, kind)?;
            api::snapshot::validate_snapshot(&s.spec)?;
            return Ok(warnings);
        }
        "VirtualMachineRestore" => {
            let r: api::snapshot::VirtualMachineRestore = decode(obj, kind)?;
            api::snapshot::validate_restore(&r.spec)?;
            return Ok(warnings);
        }
        "VirtualMachineClone" => {
            let c: api::clone::VirtualMachineClone = decode(obj, kind)?;
            api::clone::validate_clone(&c.spec)?; // its source is judged, not needed here
            return Ok(warnings);
        }
        _ => return Ok(warnings),
    };
    checked.map_err(|e| e.to_string())?;
    Ok(warnings)
}

/// KubeVirt's admission of a new migration: its VMI exists, runs, can be live-migrated and is
/// not being migrated already. (The migration controller checks the same again, since a
/// webhook may be bypassed.)
pub async fn admit_migration(client: &Client, obj: &DynamicObject) -> Result<(), String> {
    let m: VirtualMachineInstanceMigration = decode(obj, "VirtualMachineInstanceMigration")?;
    let ns = obj.namespace().unwrap_or_default();
    let vmi_name = &m.spec.vmi_name;
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), &ns);
    let vmi = vmis
        .get_opt(vmi_name)
        .await
        .map_err(|e| format!("cannot read VirtualMachineInstance {vmi_name:?}: {e}"))?
        .ok_or_else(|| {
            format!("spec.vmiName: VirtualMachineInstance {vmi_name:?} does not exist in namespace {ns:?}")
        })?;
    let status = vmi.status.clone().unwrap_or_default();
    if status.phase != Some(api::VmiPhase::Running) {
        return Err(format!(
            "spec.vmiName: VirtualMachineInstance {vmi_name:?} is {:?}; only a Running VMI can be migrated",
            status.phase.unwrap_or(api::VmiPhase::Pending)
        ));
    }
    if let Some(Err(why)) = api::conditions::published_migratability(&status) {
        return Err(format!(
            "spec.vmiName: VirtualMachineInstance {vmi_name:?} cannot be live-migrated: {why}"
        ));
    }
    let migrations: Api<VirtualMachineInstanceMigration> = Api::namespaced(client.clone(), &ns);
    let others = migrations
        .list(&Default::default())
        .await
        .map_err(|e| format!("cannot list migrations: {e}"))?;
    if let Some(busy) = VirtualMachineInstanceMigration::unfinished_of(&others.items, vmi_name) {
        return Err(format!(
            "spec.vmiName: VirtualMachineInstance {vmi_name:?} is already being migrated by {:?}",
            busy.name_any()
        ));
    }
    Ok(())
}

/// KubeVirt's snapshots, restores and clones are requests: their spec cannot change once made.
fn unchanged_spec(kind: &str, old: &DynamicObject, new: &DynamicObject) -> Result<(), String> {
    let immutable = matches!(
        kind,
        "VirtualMachineSnapshot" | "VirtualMachineRestore" | "VirtualMachineClone"
    );
    if immutable && old.data.get("spec") != new.data.get("spec") {
        return Err(format!(
            "spec: a {kind}'s spec cannot be changed after it is created; delete it and create \
             another"
        ));
    }
    Ok(())
}

async fn validate(
    State(state): State<Arc<WebhookState>>,
    Json(review): Review,
) -> Json<AdmissionReview<DynamicObject>> {
    answer(review, |req| validation(state, req)).await
}

/// Whether the object `req` creates or updates is valid, with its warnings.
async fn validation(
    state: Arc<WebhookState>,
    req: AdmissionRequest<DynamicObject>,
) -> AdmissionResponse {
    let mut resp = AdmissionResponse::from(&req);
    if let (Some(obj), Operation::Create | Operation::Update) = (&req.object, &req.operation) {
        let mut verdict = validate_object(
            &req.kind.kind,
            obj,
            &state.host_disks(),
            &state.settings.current().network,
        );
        if let (Ok(_), Some(old), Operation::Update) = (&verdict, &req.old_object, &req.operation) {
            if let Err(e) = unchanged_spec(&req.kind.kind, old, obj) {
                verdict = Err(e);
            }
        }
        if let (Ok(_), Some(client), "VirtualMachineInstanceMigration", Operation::Create) = (
            &verdict,
            &state.client,
            req.kind.kind.as_str(),
            &req.operation,
        ) {
            if let Err(e) = admit_migration(client, obj).await {
                verdict = Err(e);
            }
        }
        match verdict {
            Ok(w) if !w.is_empty() => resp.warnings = Some(w),
            Ok(_) => {}
            Err(msg) => {
                resp = resp.deny(msg);
                resp.result.code = 422;
                resp.result.reason = "Invalid".into();
            }
        }
    }
    resp
}

fn defaulted<T: DeserializeOwned + Serialize>(
    obj: &DynamicObject,
    kind: &str,
    f: impl FnOnce(&mut T),
) -> Result<(Value, Value), String> {
    let before = serde_json::to_value(obj).map_err(|e| e.to_string())?;
    let mut typed: T = decode(obj, kind)?;
    f(&mut typed);
    let mut after = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    // Keep what the typed view does not carry (e.g. a null status) as it was.
    if before.get("status").is_none() {
        if let Some(o) = after.as_object_mut() {
            o.remove("status");
        }
    }
    Ok((before, after))
}

/// KubeVirt's defaulting as a JSON patch against the submitted object.
/// The cluster's own rules for a VMI spec: where hostDisks may be, whether the pod network may
/// be bridged.
fn cluster_rules(
    kind: &str,
    meta: &kube::api::ObjectMeta,
    spec: &api::VirtualMachineInstanceSpec,
    base: &str,
    host_disks: &api::validation::HostDiskPolicy,
    network: &api::validation::NetworkDefaults,
) -> Result<(), api::validation::ValidationError> {
    host_disks
        .check(kind, meta, spec, base)
        .and_then(|()| network.check(kind, meta, spec, base))
}

pub fn default_patch(
    kind: &str,
    obj: &DynamicObject,
    network: &api::validation::NetworkDefaults,
) -> Result<Option<json_patch::Patch>, String> {
    let (before, after) = match kind {
        // KubeVirt's VM mutator: the instance type's and preference's kinds, nothing in the
        // template. The VMI is defaulted when virt-controller makes it; defaults written into
        // the template's lists would turn every later `kubectl apply` of the same file into a
        // change (a merge patch replaces lists whole).
        "VirtualMachine" => defaulted::<VirtualMachine>(obj, kind, |vm| {
            if let Some(m) = vm.spec.instancetype.as_mut() {
                if let (None, Ok((k, _))) = (&m.kind, api::instancetype::instancetype_kind(m)) {
                    m.kind = Some(k.to_string());
                }
            }
            if let Some(m) = vm.spec.preference.as_mut() {
                if let (None, Ok((k, _))) = (&m.kind, api::instancetype::preference_kind(m)) {
                    m.kind = Some(k.to_string());
                }
            }
        })?,
        "VirtualMachineInstance" => defaulted::<VirtualMachineInstance>(obj, kind, |v| {
            api::validation::default_vmi_spec_with(&mut v.spec, network)
        })?,
        "VirtualMachineInstanceReplicaSet" => {
            // The template, like a VM's, is defaulted in each VMI made from it.
            defaulted::<VirtualMachineInstanceReplicaSet>(obj, kind, |rs| {
                rs.spec.target.replicas.get_or_insert(1);
            })?
        }
        _ => return Ok(None),
    };
    let patch = json_patch::diff(&before, &after);
    Ok((!patch.0.is_empty()).then_some(patch))
}

/// kube-core serializes `patch` (Go `[]byte`) as an array of numbers; the API server's
/// canonical form is base64, which is what every other webhook sends.
fn base64_patch(review: AdmissionReview<DynamicObject>) -> Json<Value> {
    use base64::Engine;
    let mut v = serde_json::to_value(&review).unwrap_or_default();
    if let Some(bytes) = v.pointer("/response/patch").and_then(Value::as_array) {
        let raw: Vec<u8> = bytes
            .iter()
            .filter_map(|b| b.as_u64().map(|b| b as u8))
            .collect();
        v["response"]["patch"] = base64::engine::general_purpose::STANDARD.encode(raw).into();
    }
    Json(v)
}

async fn mutate(state: State<Arc<WebhookState>>, review: Review) -> Json<Value> {
    base64_patch(mutate_review(state, review).await.0)
}

async fn mutate_review(
    State(state): State<Arc<WebhookState>>,
    Json(review): Review,
) -> Json<AdmissionReview<DynamicObject>> {
    let network = state.settings.current().network;
    answer(review, |req| async move { defaulting(&req, &network) }).await
}

/// The patch that fills in KubeVirt's defaults (and the cluster's) on the object `req`
/// carries.
fn defaulting(
    req: &AdmissionRequest<DynamicObject>,
    network: &api::validation::NetworkDefaults,
) -> AdmissionResponse {
    let resp = AdmissionResponse::from(req);
    let Some(obj) = &req.object else {
        return resp;
    };
    match default_patch(&req.kind.kind, obj, network) {
        Ok(Some(p)) => match resp.clone().with_patch(p) {
            Ok(r) => r,
            Err(e) => resp.deny(format!("building the defaulting patch: {e}")),
        },
        Ok(None) => resp,
        Err(msg) => resp.deny(msg),
    }
}

async fn eviction(
    State(state): State<Arc<WebhookState>>,
    Json(review): Review,
) -> Json<AdmissionReview<DynamicObject>> {
    answer(review, |req| eviction_verdict(state, req)).await
}

/// Whether the eviction `req` asks for may go ahead now (429 while it waits on a migration).
async fn eviction_verdict(
    state: Arc<WebhookState>,
    req: AdmissionRequest<DynamicObject>,
) -> AdmissionResponse {
    let resp = AdmissionResponse::from(&req);
    let (Some(client), Some(ns)) = (&state.client, req.namespace.as_deref()) else {
        return resp;
    };
    match crate::evacuation::evict(
        client,
        state.settings.current().eviction_strategy,
        ns,
        &req.name,
    )
    .await
    {
        Ok(None) => resp,
        Ok(Some(msg)) => {
            let mut r = resp.deny(msg);
            r.result.code = 429;
            r.result.reason = "TooManyRequests".into();
            r
        }
        // Failing closed would block drains forever on an API hiccup; refusing with 500 lets
        // the client retry.
        Err(e) => {
            let mut r = resp.deny(format!("cannot decide the eviction: {e}"));
            r.result.code = 500;
            r
        }
    }
}
