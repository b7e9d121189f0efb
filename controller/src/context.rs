//! What virt-controller's reconcilers share: the client, the configuration, metrics, the
//! Event sink, the error type and per-object retry backoff. The generic helpers (writes,
//! conditions, owners, backoff) are `controller_runtime`'s, shared with virt-handler.

use std::sync::Arc;
use std::time::Duration;

use api::migratability::EvictionStrategy;
use controller_runtime::{is_conflict, EventSink, RetryBackoff};
use kube::runtime::controller::Action;
use kube::{Client, Resource, ResourceExt};

use crate::metrics::Metrics;
use crate::pod::PodConfig;
use api::kubevirt::ClusterSettings;

/// virt-controller's settings (flags of `virt-controller run`). The cluster-wide ones among
/// them (migration limits, the default eviction strategy, the HostDisk gate) are defaults:
/// the KubeVirt CR's `spec.configuration` overrides them live (see [`Context::settings`]).
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
    /// Who fills DataVolumes: microvirt's importer unless CDI is installed (see `cdi`).
    pub datavolume_import: crate::cdi::DataVolumeImport,
    pub importer: crate::cdi::importer_pod::ImporterConfig,
    /// How often a running import's progress is read (CDI: every reconcile, ~2 s).
    pub import_progress_interval: Duration,
    /// virt-controller's own namespace (where the upload signing key is kept).
    pub namespace: String,
}

impl ControllerConfig {
    /// The cluster-wide settings these flags give, before the KubeVirt CR's.
    pub fn cluster_settings(&self) -> ClusterSettings {
        let mut s = ClusterSettings {
            parallel_migrations_per_cluster: self.parallel_migrations_per_cluster,
            parallel_outbound_migrations_per_node: self.parallel_outbound_migrations_per_node,
            eviction_strategy: self.default_eviction_strategy,
            ..Default::default()
        };
        if self.pod.host_disks.feature_gate {
            s.feature_gates.insert("HostDisk".into());
        }
        s
    }
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
            drain_taint_key: Some(api::labels::DEFAULT_DRAIN_TAINT.into()),
            evacuation_retry_base: Duration::from_secs(20),
            datavolume_import: Default::default(),
            importer: Default::default(),
            import_progress_interval: Duration::from_secs(2),
            namespace: "microvirt".into(),
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

pub struct Context {
    pub client: Client,
    pub config: ControllerConfig,
    pub metrics: Arc<Metrics>,
    pub events: EventSink,
    pub backoff: RetryBackoff,
    /// Held while a migration is admitted against the limits (see `migration.rs`).
    pub migration_admission: tokio::sync::Mutex<()>,
    pub cdi: crate::cdi::CdiPresence,
    /// The flags' cluster-wide settings with the KubeVirt CR's configuration over them.
    pub settings: controller_runtime::LiveSettings,
    /// The launcher Pods and VMIs as the watches see them (see `caches`).
    pub caches: crate::caches::Caches,
    /// The VM and VMI reconcilers' writes not yet seen in their caches: a pass on an older
    /// copy waits for the echo instead of writing again.
    pub unseen_writes: controller_runtime::UnseenWrites,
}

impl Context {
    pub fn new(client: Client, config: ControllerConfig, metrics: Arc<Metrics>) -> Arc<Context> {
        let (client_for_settings, config_defaults) = (client.clone(), config.cluster_settings());
        Arc::new(Context {
            events: EventSink::new(
                client.clone(),
                "virt-controller",
                std::env::var("POD_NAME").ok(),
            ),
            client,
            config,
            metrics,
            backoff: RetryBackoff::default(),
            migration_admission: tokio::sync::Mutex::new(()),
            cdi: Default::default(),
            settings: controller_runtime::LiveSettings::follow(
                client_for_settings,
                config_defaults,
            ),
            caches: Default::default(),
            unseen_writes: Default::default(),
        })
    }

    /// The cluster-wide settings in force now.
    pub fn settings(&self) -> Arc<ClusterSettings> {
        self.settings.current()
    }

    /// The launcher Pod settings, with the HostDisk gate as the cluster has it now.
    pub fn pod_config(&self) -> PodConfig {
        let mut pod = self.config.pod.clone();
        pod.host_disks.feature_gate = self.settings().feature_gate("HostDisk");
        pod
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
        let ev = controller_runtime::events::event(warning, reason, action, note);
        self.events.publish(obj, ev).await
    }

    /// The Action after a failed reconcile, with this object's backoff.
    pub fn retry<K: Resource>(&self, controller: &str, obj: &K, err: &Error) -> Action {
        self.metrics.reconcile_error(controller, err.reason());
        let key = format!(
            "{controller}/{}/{}",
            obj.namespace().unwrap_or_default(),
            obj.name_any()
        );
        let conflict = matches!(err, Error::Kube(e) if is_conflict(e));
        let delay = self.backoff.after_failure(
            &key,
            conflict,
            self.config.retry_base,
            self.config.retry_max,
        );
        if conflict {
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
