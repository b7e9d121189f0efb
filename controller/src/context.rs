//! What every reconciler shares: the client, the configuration, metrics, the event recorder,
//! the error type, per-object retry backoff and small helpers for conditions and owners.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::migratability::EvictionStrategy;
use api::Condition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};

use crate::metrics::Metrics;
use crate::pod::PodConfig;

/// virt-controller's settings (flags of `virt-controller run`).
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub pod: PodConfig,
    /// KubeVirt's `parallelMigrationsPerCluster` (default 5).
    pub parallel_migrations_per_cluster: usize,
    /// KubeVirt's `parallelOutboundMigrationsPerNode` (default 2).
    pub parallel_outbound_migrations_per_node: usize,
    /// How long a Pending migration waits before the limits are checked again.
    pub migration_queue_recheck: Duration,
    /// Retry backoff after a failed reconcile: base, doubling per consecutive failure, cap.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// The eviction strategy of VMIs that set none (KubeVirt's cluster-wide `evictionStrategy`).
    pub default_eviction_strategy: EvictionStrategy,
    /// Nodes with a taint of this key are drained of VMs (KubeVirt's `nodeDrainTaintKey`);
    /// `None` turns the drain-taint controller off.
    pub drain_taint_key: Option<String>,
    /// The pause after the first failed evacuation migration of a VMI, doubling per failure.
    pub evacuation_retry_base: Duration,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            pod: PodConfig {
                launcher_image: "quay.io/microvirt/virt-launcher:v0.1.0".into(),
                ..Default::default()
            },
            parallel_migrations_per_cluster: 5,
            parallel_outbound_migrations_per_node: 2,
            migration_queue_recheck: Duration::from_secs(2),
            retry_base: Duration::from_millis(200),
            retry_max: Duration::from_secs(300),
            default_eviction_strategy: EvictionStrategy::None,
            drain_taint_key: Some(crate::evacuation::DEFAULT_DRAIN_TAINT.into()),
            evacuation_retry_base: Duration::from_secs(20),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("rendering the launcher Pod: {0}")]
    Render(#[from] crate::pod::RenderError),
}

impl Error {
    /// The label value for `kubevirt_virt_controller_reconcile_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(s)) if s.code == 409 => "conflict",
            Error::Kube(kube::Error::Api(s)) if s.code >= 500 => "server_error",
            Error::Kube(kube::Error::Api(_)) => "api_error",
            Error::Kube(_) => "transport",
            Error::Render(_) => "render",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

pub fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// Per-object consecutive failures, for exponential retry backoff (client-go's per-item rate
/// limiter does the same): a conflict retries after the base delay, anything else doubles.
#[derive(Default)]
pub struct RetryBackoff {
    failures: Mutex<HashMap<String, (u32, Instant)>>,
}

impl RetryBackoff {
    pub fn delay(&self, key: &str, base: Duration, max: Duration) -> Duration {
        let mut f = self.failures.lock().unwrap();
        let entry = f.entry(key.to_string()).or_insert((0, Instant::now()));
        entry.0 += 1;
        entry.1 = Instant::now();
        let d = base.saturating_mul(1 << (entry.0 - 1).min(20));
        d.min(max)
    }
    pub fn reset(&self, key: &str) {
        self.failures.lock().unwrap().remove(key);
    }
}

pub struct Context {
    pub client: Client,
    pub config: ControllerConfig,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    pub backoff: RetryBackoff,
    /// Held while a migration is admitted against the limits (see `migration.rs`).
    pub migration_admission: tokio::sync::Mutex<()>,
}

impl Context {
    pub fn new(client: Client, config: ControllerConfig, metrics: Arc<Metrics>) -> Arc<Context> {
        let reporter = Reporter {
            controller: "virt-controller".into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Arc::new(Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            config,
            metrics,
            backoff: RetryBackoff::default(),
            migration_admission: tokio::sync::Mutex::new(()),
        })
    }

    /// Publishes an Event about `obj`; failures to record are logged, never fatal.
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        self.event_related(obj, warning, reason, action, note, None)
            .await
    }

    /// `event`, naming a second object it concerns (the recorder aggregates Events per
    /// object pair, so Events about different related objects stay apart).
    pub async fn event_related<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
        related: Option<k8s_openapi::api::core::v1::ObjectReference>,
    ) {
        let ev = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: related,
        };
        if let Err(e) = self.recorder.publish(&ev, &obj.object_ref(&())).await {
            tracing::warn!(object = %obj.name_any(), error = %e, "recording an event failed");
        }
    }

    /// The Action after a failed reconcile, with this object's backoff.
    pub fn retry<K: Resource>(&self, controller: &str, obj: &K, err: &Error) -> Action {
        self.metrics.reconcile_error(controller, err.reason());
        let key = format!(
            "{controller}/{}/{}",
            obj.namespace().unwrap_or_default(),
            obj.name_any()
        );
        let base = if matches!(err, Error::Kube(e) if is_conflict(e)) {
            self.config.retry_base / 4
        } else {
            self.config.retry_base
        };
        let delay = self.backoff.delay(&key, base, self.config.retry_max);
        if matches!(err, Error::Kube(e) if is_conflict(e)) {
            // Expected when the cache lags our own last write; not worth a warning.
            tracing::debug!(controller, object = %key, retry_in = ?delay, "conflict, retrying");
        } else {
            tracing::warn!(controller, object = %key, error = %err, retry_in = ?delay, "reconcile failed");
        }
        Action::requeue(delay)
    }

    pub fn succeeded<K: Resource>(&self, controller: &str, obj: &K) {
        let key = format!(
            "{controller}/{}/{}",
            obj.namespace().unwrap_or_default(),
            obj.name_any()
        );
        self.backoff.reset(&key);
    }
}

pub fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap_or_else(|_| jiff::Timestamp::now())
        .to_string()
}

pub fn now_unix() -> i64 {
    jiff::Timestamp::now().as_second()
}

pub fn parse_unix(ts: &str) -> Option<i64> {
    ts.parse::<jiff::Timestamp>().ok().map(|t| t.as_second())
}

pub fn unix_rfc3339(secs: i64) -> String {
    jiff::Timestamp::from_second(secs)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// Sets a condition, keeping its lastTransitionTime when the status does not change.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: Option<&str>,
    message: Option<String>,
) {
    let status = if status { "True" } else { "False" }.to_string();
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.last_transition_time = Some(now_rfc3339());
            }
            c.status = status;
            c.reason = reason.map(str::to_string);
            c.message = message;
        }
        None => conditions.push(Condition {
            type_: type_.into(),
            status,
            reason: reason.map(str::to_string),
            message,
            last_transition_time: Some(now_rfc3339()),
            last_probe_time: None,
        }),
    }
}

pub fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) {
    conditions.retain(|c| c.type_ != type_);
}

/// A controller owner reference to `owner` (blocks the owner's foreground deletion).
pub fn controller_ref<K: Resource<DynamicType = ()>>(owner: &K) -> Option<OwnerReference> {
    let mut r = owner.controller_owner_ref(&())?;
    r.block_owner_deletion = Some(true);
    Some(r)
}

/// Whether `obj` is controlled by the object with this uid.
pub fn controlled_by<K: Resource>(obj: &K, uid: &str) -> bool {
    obj.owner_references()
        .iter()
        .any(|r| r.controller == Some(true) && r.uid == uid)
}

/// A merge patch that adds or removes a finalizer, guarded by the resourceVersion it was
/// computed from so that a concurrent change is a conflict rather than a lost finalizer.
pub fn finalizer_patch<K: Resource>(obj: &K, finalizer: &str, present: bool) -> serde_json::Value {
    let mut f: Vec<String> = obj
        .finalizers()
        .iter()
        .filter(|x| *x != finalizer)
        .cloned()
        .collect();
    if present {
        f.push(finalizer.to_string());
    }
    serde_json::json!({
        "metadata": {"finalizers": f, "resourceVersion": obj.resource_version()}
    })
}

pub fn has_finalizer<K: Resource>(obj: &K, finalizer: &str) -> bool {
    obj.finalizers().iter().any(|f| f == finalizer)
}

/// Replaces `status` (PUT …/status, guarded by the object's resourceVersion) when it differs
/// from what the object has; a stale read is a conflict, retried by the error policy.
pub async fn write_status<K>(api: &kube::Api<K>, obj: &K, status: K::Status) -> Result<K>
where
    K: kube::core::object::HasStatus
        + Resource
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::Status: PartialEq,
{
    if obj.status() == Some(&status) {
        return Ok(obj.clone());
    }
    let mut new = obj.clone();
    *new.status_mut() = Some(status);
    Ok(api
        .replace_status(&obj.name_any(), &kube::api::PostParams::default(), &new)
        .await?)
}

/// Sets the object's labels to `labels` with a merge patch guarded by its resourceVersion
/// (labels it had and `labels` lacks are removed); returns the object as written.
pub async fn write_labels<K>(
    api: &kube::Api<K>,
    obj: &K,
    labels: &std::collections::BTreeMap<String, String>,
) -> Result<K>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if labels == obj.labels() {
        return Ok(obj.clone());
    }
    let mut l: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    for k in obj.labels().keys().filter(|k| !labels.contains_key(*k)) {
        l.insert(k.clone(), serde_json::Value::Null);
    }
    let p =
        serde_json::json!({"metadata": {"labels": l, "resourceVersion": obj.resource_version()}});
    Ok(api
        .patch(
            &obj.name_any(),
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&p),
        )
        .await?)
}

/// Deletes an object; one that is already gone is fine.
pub async fn delete_if_present<K>(
    api: &kube::Api<K>,
    name: &str,
    dp: &kube::api::DeleteParams,
) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, dp).await {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e.into()),
    }
}
