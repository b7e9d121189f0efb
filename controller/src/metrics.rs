//! `/metrics` in Prometheus text format, with KubeVirt's metric names where they exist:
//! `kubevirt_vmi_phase_count`, `kubevirt_vmi_migrations_in_{pending,scheduling,running,unset}_phase`,
//! `kubevirt_vmi_migration_succeeded`, `kubevirt_vmi_migration_failed`,
//! `kubevirt_virt_controller_leading_status`, `kubevirt_virt_controller_ready_status`,
//! `kubevirt_vmi_non_evictable`; and
//! microvirt's own reconcile timings and errors under the `kubevirt_virt_controller_` prefix.
//! Phase counts are taken from the controllers' caches when scraped, as KubeVirt does.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use api::migratability::EvictionStrategy;
use api::{MigrationPhase, VirtualMachineInstance, VirtualMachineInstanceMigration};
use kube::runtime::reflector::Store;
use kube::ResourceExt;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;
type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

fn reconcile_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

pub struct Metrics {
    registry: Mutex<Registry>,
    reconcile_duration: HistogramFamily,
    reconcile_errors: Family<Labels, Counter>,
    leading: Gauge,
    ready: Gauge,
    vmi_phase: Family<Labels, Gauge>,
    migration_phase: BTreeMap<&'static str, Gauge>,
    migration_succeeded: Gauge,
    migration_failed: Gauge,
    non_evictable: Family<Labels, Gauge>,
    vmis: OnceLock<(
        Store<VirtualMachineInstance>,
        controller_runtime::LiveSettings,
    )>,
    migrations: OnceLock<Store<VirtualMachineInstanceMigration>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::default();
        let reconcile_duration = HistogramFamily::new_with_constructor(reconcile_histogram);
        let reconcile_errors = Family::<Labels, Counter>::default();
        let leading = Gauge::default();
        let ready = Gauge::default();
        let vmi_phase = Family::<Labels, Gauge>::default();
        let non_evictable = Family::<Labels, Gauge>::default();
        let migration_succeeded = Gauge::default();
        let migration_failed = Gauge::default();
        r.register(
            "kubevirt_virt_controller_reconcile_duration_seconds",
            "Time one reconcile of an object took, per controller",
            reconcile_duration.clone(),
        );
        // prometheus-client appends `_total` to counters.
        r.register(
            "kubevirt_virt_controller_reconcile_errors",
            "Reconciles that failed and were requeued with backoff, per controller and reason",
            reconcile_errors.clone(),
        );
        r.register(
            "kubevirt_virt_controller_leading_status",
            "1 when this virt-controller holds the leader Lease",
            leading.clone(),
        );
        r.register(
            "kubevirt_virt_controller_ready_status",
            "1 when this virt-controller's caches are synced and it is reconciling",
            ready.clone(),
        );
        r.register(
            "kubevirt_vmi_phase_count",
            "VirtualMachineInstances per phase and node",
            vmi_phase.clone(),
        );
        r.register(
            "kubevirt_vmi_non_evictable",
            "1 for a VMI whose evictionStrategy is LiveMigrate but which cannot be live-migrated \
             (it blocks the drain of its node)",
            non_evictable.clone(),
        );
        let mut migration_phase = BTreeMap::new();
        for phase in ["pending", "scheduling", "running", "unset"] {
            let g = Gauge::default();
            r.register(
                format!("kubevirt_vmi_migrations_in_{phase}_phase"),
                format!("VirtualMachineInstanceMigrations in the {phase} phase"),
                g.clone(),
            );
            migration_phase.insert(phase, g);
        }
        r.register(
            "kubevirt_vmi_migration_succeeded",
            "VirtualMachineInstanceMigrations that succeeded (objects present)",
            migration_succeeded.clone(),
        );
        r.register(
            "kubevirt_vmi_migration_failed",
            "VirtualMachineInstanceMigrations that failed (objects present)",
            migration_failed.clone(),
        );
        Metrics {
            registry: Mutex::new(r),
            reconcile_duration,
            reconcile_errors,
            leading,
            ready,
            vmi_phase,
            non_evictable,
            migration_phase,
            migration_succeeded,
            migration_failed,
            vmis: OnceLock::new(),
            migrations: OnceLock::new(),
        }
    }

    pub fn observe_reconcile(&self, controller: &str, took: Duration) {
        self.reconcile_duration
            .get_or_create(&vec![("controller".into(), controller.into())])
            .observe(took.as_secs_f64());
    }

    pub fn reconcile_error(&self, controller: &str, reason: &str) {
        self.reconcile_errors
            .get_or_create(&vec![
                ("controller".into(), controller.into()),
                ("reason".into(), reason.into()),
            ])
            .inc();
    }

    /// Reconciles run so far by a controller (the histogram's count), for tests and the bench.
    pub fn reconciles(&self, controller: &str) -> u64 {
        let text = self.render();
        let prefix = format!(
            "kubevirt_virt_controller_reconcile_duration_seconds_count{{controller=\"{controller}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    pub fn set_leading(&self, leading: bool) {
        self.leading.set(leading as i64);
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.set(ready as i64);
    }

    /// VMI metrics come from this cache; `settings` has the cluster's eviction strategy for
    /// VMIs that set none.
    pub fn watch_vmis(
        &self,
        store: Store<VirtualMachineInstance>,
        settings: controller_runtime::LiveSettings,
    ) {
        let _ = self.vmis.set((store, settings));
    }

    pub fn watch_migrations(&self, store: Store<VirtualMachineInstanceMigration>) {
        let _ = self.migrations.set(store);
    }

    fn refresh(&self) {
        if let Some((store, settings)) = self.vmis.get() {
            let default_strategy = settings.current().eviction_strategy;
            self.vmi_phase.clear();
            self.non_evictable.clear();
            for vmi in store.state() {
                let status = vmi.status.clone().unwrap_or_default();
                let stuck = EvictionStrategy::of(&vmi.spec, default_strategy)
                    == EvictionStrategy::LiveMigrate
                    && matches!(
                        api::conditions::published_migratability(&status),
                        Some(Err(_))
                    );
                if stuck {
                    self.non_evictable
                        .get_or_create(&vec![
                            ("node".into(), status.node_name.clone().unwrap_or_default()),
                            ("namespace".into(), vmi.namespace().unwrap_or_default()),
                            ("name".into(), vmi.name_any()),
                        ])
                        .set(1);
                }
                let phase = status
                    .phase
                    .map(|p| format!("{p:?}").to_lowercase())
                    .unwrap_or_else(|| "unset".into());
                let node = status.node_name.unwrap_or_default();
                self.vmi_phase
                    .get_or_create(&vec![("node".into(), node), ("phase".into(), phase)])
                    .inc();
            }
        }
        if let Some(store) = self.migrations.get() {
            let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
            let (mut ok, mut failed) = (0, 0);
            for m in store.state() {
                let bucket = match m.status.as_ref().and_then(|s| s.phase) {
                    None => "unset",
                    Some(MigrationPhase::Pending) => "pending",
                    Some(
                        MigrationPhase::Scheduling
                        | MigrationPhase::Scheduled
                        | MigrationPhase::PreparingTarget
                        | MigrationPhase::TargetReady,
                    ) => "scheduling",
                    Some(MigrationPhase::Running) => "running",
                    Some(MigrationPhase::Succeeded) => {
                        ok += 1;
                        continue;
                    }
                    Some(MigrationPhase::Failed) => {
                        failed += 1;
                        continue;
                    }
                };
                *counts.entry(bucket).or_default() += 1;
            }
            for (phase, g) in &self.migration_phase {
                g.set(counts.get(phase).copied().unwrap_or(0));
            }
            self.migration_succeeded.set(ok);
            self.migration_failed.set(failed);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.refresh();
        let mut out = String::new();
        encode(&mut out, &self.registry.lock().unwrap()).expect("encoding to a String cannot fail");
        out
    }
}

/// Serves `/metrics` and `/healthz` over plain HTTP.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: std::sync::Arc<Metrics>,
) -> std::io::Result<()> {
    controller_runtime::metrics_http::serve_text(listener, move || metrics.render()).await
}
