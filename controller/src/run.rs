//! Wiring: the kube-runtime `Controller`s (VMs, VMIs, ReplicaSets, Migrations and the node
//! drain taint), behind leader election.

use std::future::Future;
use std::sync::Arc;

use api::{
    VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration,
    VirtualMachineInstanceReplicaSet, VirtualMachinePool,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};

use crate::context::{Context, ControllerConfig};
use crate::leader::{LeaderElector, LeaseConfig};
use crate::metrics::Metrics;

/// Runs the VM, VMI, ReplicaSet, Migration and drain-taint controllers until `shutdown`
/// resolves.
pub async fn run_controllers(
    ctx: Arc<Context>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let wc = watcher::Config::default;
    let (tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let stop = |tx: &tokio::sync::broadcast::Sender<()>| {
        let mut rx = tx.subscribe();
        async move {
            let _ = rx.recv().await;
        }
    };
    let launcher_pods = || {
        wc().labels(&api::labels::selector(
            api::labels::APP,
            api::labels::APP_LAUNCHER,
        ))
    };

    let vm = Controller::new(Api::<VirtualMachine>::all(client.clone()), wc())
        .owns(Api::<VirtualMachineInstance>::all(client.clone()), wc())
        .graceful_shutdown_on(stop(&tx))
        .run(crate::vm::reconcile, crate::vm::error_policy, ctx.clone())
        .for_each(|_| async {});

    let vmi_controller = Controller::new(Api::<VirtualMachineInstance>::all(client.clone()), wc())
        .owns(Api::<Pod>::all(client.clone()), launcher_pods())
        // A failed evacuation migration is retried by its VMI (after a pause).
        .watches(
            Api::<VirtualMachineInstanceMigration>::all(client.clone()),
            wc(),
            |m| {
                m.annotations()
                    .contains_key(api::labels::ANNOTATION_EVACUATION)
                    .then(|| {
                        ObjectRef::<VirtualMachineInstance>::new(&m.spec.vmi_name)
                            .within(&m.namespace().unwrap_or_default())
                    })
            },
        );
    ctx.metrics
        .watch_vmis(vmi_controller.store(), ctx.config.default_eviction_strategy);
    let vmi = vmi_controller
        .graceful_shutdown_on(stop(&tx))
        .run(crate::vmi::reconcile, crate::vmi::error_policy, ctx.clone())
        .for_each(|_| async {});

    let rs = Controller::new(
        Api::<VirtualMachineInstanceReplicaSet>::all(client.clone()),
        wc(),
    )
    .owns(Api::<VirtualMachineInstance>::all(client.clone()), wc())
    .graceful_shutdown_on(stop(&tx))
    .run(
        crate::replicaset::reconcile,
        crate::replicaset::error_policy,
        ctx.clone(),
    )
    .for_each(|_| async {});

    let pool = Controller::new(Api::<VirtualMachinePool>::all(client.clone()), wc())
        .owns(Api::<VirtualMachine>::all(client.clone()), wc())
        .graceful_shutdown_on(stop(&tx))
        .run(
            crate::pool::reconcile,
            crate::pool::error_policy,
            ctx.clone(),
        )
        .for_each(|_| async {});

    let mig_controller = Controller::new(
        Api::<VirtualMachineInstanceMigration>::all(client.clone()),
        wc(),
    );
    let store = mig_controller.store();
    ctx.metrics.watch_migrations(store.clone());
    let by_vmi = store.clone();
    let by_pod = store;
    let migration = mig_controller
        // A VMI's hand-off progress (set by virt-handler) drives its migrations.
        .watches(
            Api::<VirtualMachineInstance>::all(client.clone()),
            wc(),
            move |vmi| {
                by_vmi
                    .state()
                    .into_iter()
                    .filter(|m| {
                        m.spec.vmi_name == vmi.name_any() && m.namespace() == vmi.namespace()
                    })
                    .map(|m| ObjectRef::from_obj(m.as_ref()))
                    .collect::<Vec<_>>()
            },
        )
        // Target Pods carry the migration's uid.
        .watches(
            Api::<Pod>::all(client.clone()),
            wc().labels(api::labels::MIGRATION_JOB),
            move |pod| {
                let uid = pod.labels().get(api::labels::MIGRATION_JOB).cloned();
                by_pod
                    .state()
                    .into_iter()
                    .filter(|m| m.uid() == uid)
                    .map(|m| ObjectRef::from_obj(m.as_ref()))
                    .collect::<Vec<_>>()
            },
        )
        .graceful_shutdown_on(stop(&tx))
        .run(
            crate::migration::reconcile,
            crate::migration::error_policy,
            ctx.clone(),
        )
        .for_each(|_| async {});

    // Only tainted nodes matter, but a taint cannot be selected on, so every node is watched
    // (node objects are few next to Pods and VMIs).
    let drain = Controller::new(Api::<Node>::all(client.clone()), wc())
        .graceful_shutdown_on(stop(&tx))
        .run(
            crate::evacuation::reconcile_node,
            crate::evacuation::node_error_policy,
            ctx.clone(),
        )
        .for_each(|_| async {});

    ctx.metrics.set_ready(true);
    let all = async {
        tokio::join!(vm, vmi, rs, pool, migration, drain);
    };
    tokio::select! {
        _ = all => {}
        _ = shutdown => {
            let _ = tx.send(());
        }
    }
    ctx.metrics.set_ready(false);
}

/// virt-controller: waits for the leader Lease (when configured), then reconciles until
/// `shutdown` resolves or leadership is lost. Returns Err when leadership was lost, so the
/// process exits and restarts as a follower (as client-go's leader election does).
pub async fn run(
    client: Client,
    config: ControllerConfig,
    lease: Option<LeaseConfig>,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), String> {
    let ctx = Context::new(client.clone(), config, metrics.clone());
    let Some(lease) = lease else {
        run_controllers(ctx, shutdown).await;
        return Ok(());
    };
    let elector = LeaderElector::new(client, lease);
    let mut shutdown = Box::pin(shutdown);
    tokio::select! {
        _ = elector.acquire() => {}
        _ = &mut shutdown => return Ok(()),
    }
    metrics.set_leading(true);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // Aborted if this future is dropped, so that a replica torn down mid-way stops acting.
    let mut controllers = AbortOnDrop(tokio::spawn(run_controllers(ctx, async {
        let _ = stop_rx.await;
    })));
    let outcome = tokio::select! {
        _ = elector.hold() => Err("lost the leader Lease".to_string()),
        _ = &mut shutdown => Ok(()),
    };
    let _ = stop_tx.send(());
    let _ = (&mut controllers.0).await;
    metrics.set_leading(false);
    if outcome.is_ok() {
        elector.release().await;
    }
    outcome
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
