//! Wiring: the kube-runtime `Controller`s (VMs, VMIs, ReplicaSets, Migrations, the node
//! drain taint, DataVolumes, VM snapshots, restores and clones), behind leader election.

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

/// Resolves when the controllers are told to stop.
type Stop = std::pin::Pin<Box<dyn Future<Output = ()> + Send + Sync>>;

fn launcher_pods() -> watcher::Config {
    watcher::Config::default().labels(&api::labels::selector(
        api::labels::APP,
        api::labels::APP_LAUNCHER,
    ))
}

/// Runs the VM, VMI, ReplicaSet, pool, Migration and drain-taint controllers until
/// `shutdown` resolves.
pub async fn run_controllers(
    ctx: Arc<Context>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let (tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let stop = || -> Stop {
        let mut rx = tx.subscribe();
        Box::pin(async move {
            let _ = rx.recv().await;
        })
    };
    let feeds = ctx.caches.start(
        all::<Pod>(&ctx),
        launcher_pods(),
        all::<VirtualMachineInstance>(&ctx),
    );
    let all = futures::future::join_all([
        vms(&ctx, feeds.vmis, stop()),
        vmis(&ctx, feeds.launcher_pods, stop()),
        replica_owners::<VirtualMachineInstanceReplicaSet>(&ctx, stop()),
        replica_owners::<VirtualMachinePool>(&ctx, stop()),
        migrations(&ctx, stop()),
        drains(&ctx, stop()),
        datavolumes(&ctx, stop()),
        snapshots(&ctx, stop()),
        restores(&ctx, stop()),
        clones(&ctx, stop()),
    ]);
    ctx.metrics.set_ready(true);
    tokio::select! {
        _ = all => {}
        _ = shutdown => {
            let _ = tx.send(());
        }
    }
    ctx.metrics.set_ready(false);
    ctx.caches.stop();
}

type Running = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

fn all<K>(ctx: &Context) -> Api<K>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    Api::all(ctx.client.clone())
}

/// VMs, woken by their VMIs through the watch that fills the VMI cache they read.
fn vms(
    ctx: &Arc<Context>,
    vmis: crate::caches::Feed<VirtualMachineInstance>,
    stop: Stop,
) -> Running {
    Box::pin(
        Controller::new(all::<VirtualMachine>(ctx), watcher::Config::default())
            .owns_stream(vmis)
            .graceful_shutdown_on(stop)
            .run(crate::vm::reconcile, crate::vm::error_policy, ctx.clone())
            .for_each(|_| async {}),
    )
}

/// VMIs, woken by their launcher Pods through the watch that fills the Pod cache they read.
fn vmis(ctx: &Arc<Context>, launcher_pods: crate::caches::Feed<Pod>, stop: Stop) -> Running {
    let wc = watcher::Config::default;
    let controller = Controller::new(all::<VirtualMachineInstance>(ctx), wc())
        .owns_stream(launcher_pods)
        // A failed evacuation migration is retried by its VMI (after a pause).
        .watches(all::<VirtualMachineInstanceMigration>(ctx), wc(), |m| {
            m.annotations()
                .contains_key(api::labels::ANNOTATION_EVACUATION)
                .then(|| {
                    ObjectRef::<VirtualMachineInstance>::new(&m.spec.vmi_name)
                        .within(&m.namespace().unwrap_or_default())
                })
        });
    ctx.metrics
        .watch_vmis(controller.store(), ctx.settings.clone());
    Box::pin(
        controller
            .graceful_shutdown_on(stop)
            .run(crate::vmi::reconcile, crate::vmi::error_policy, ctx.clone())
            .for_each(|_| async {}),
    )
}

/// The controller of a kind that keeps replicas (VMI ReplicaSets, VM pools), woken by its own
/// objects and by changes to the members it controls.
fn replica_owners<K: crate::replicas::ReplicaOwner>(ctx: &Arc<Context>, stop: Stop) -> Running {
    let wc = watcher::Config::default;
    Box::pin(
        Controller::new(all::<K>(ctx), wc())
            .owns(all::<K::Member>(ctx), wc())
            .graceful_shutdown_on(stop)
            .run(
                crate::replicas::reconcile::<K>,
                crate::replicas::error_policy::<K>,
                ctx.clone(),
            )
            .for_each(|_| async {}),
    )
}

fn migrations(ctx: &Arc<Context>, stop: Stop) -> Running {
    let wc = watcher::Config::default;
    let controller = Controller::new(all::<VirtualMachineInstanceMigration>(ctx), wc());
    let store = controller.store();
    ctx.metrics.watch_migrations(store.clone());
    let by_vmi = store.clone();
    let by_pod = store;
    Box::pin(
        controller
            // A VMI's hand-off progress (set by virt-handler) drives its migrations.
            .watches(all::<VirtualMachineInstance>(ctx), wc(), move |vmi| {
                by_vmi
                    .state()
                    .into_iter()
                    .filter(|m| {
                        m.spec.vmi_name == vmi.name_any() && m.namespace() == vmi.namespace()
                    })
                    .map(|m| ObjectRef::from_obj(m.as_ref()))
                    .collect::<Vec<_>>()
            })
            // Target Pods carry the migration's uid.
            .watches(
                all::<Pod>(ctx),
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
            .graceful_shutdown_on(stop)
            .run(
                crate::migration::reconcile,
                crate::migration::error_policy,
                ctx.clone(),
            )
            .for_each(|_| async {}),
    )
}

/// DataVolumes, woken by their importer Pods and claims (see `cdi`). Off entirely with
/// `--datavolume-import never`, so a cluster without the DataVolume kind sees no watch of it.
fn datavolumes(ctx: &Arc<Context>, stop: Stop) -> Running {
    use api::cdi::DataVolume;
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    if ctx.config.datavolume_import == crate::cdi::DataVolumeImport::Never {
        return stop;
    }
    let importers = || {
        watcher::Config::default().labels(&api::labels::selector("app", api::cdi::importer::APP))
    };
    Box::pin(
        Controller::new(all::<DataVolume>(ctx), watcher::Config::default())
            .owns(all::<Pod>(ctx), importers())
            .owns(all::<PersistentVolumeClaim>(ctx), importers())
            .graceful_shutdown_on(stop)
            .run(crate::cdi::reconcile, crate::cdi::error_policy, ctx.clone())
            .for_each(|_| async {}),
    )
}

/// VirtualMachineSnapshots, woken by their contents. The CSI VolumeSnapshots they wait for are
/// not watched (a cluster without the CSI snapshot CRDs could not serve the watch): a snapshot
/// in progress is looked at again every few seconds instead.
fn snapshots(ctx: &Arc<Context>, stop: Stop) -> Running {
    use crate::snapshot::capture;
    use api::snapshot::{VirtualMachineSnapshot, VirtualMachineSnapshotContent};
    let wc = watcher::Config::default;
    Box::pin(
        Controller::new(all::<VirtualMachineSnapshot>(ctx), wc())
            .owns(all::<VirtualMachineSnapshotContent>(ctx), wc())
            .graceful_shutdown_on(stop)
            .run(capture::reconcile, capture::error_policy, ctx.clone())
            .for_each(|_| async {}),
    )
}

/// VirtualMachineRestores (each polled while it waits on its target or its claims).
fn restores(ctx: &Arc<Context>, stop: Stop) -> Running {
    use crate::snapshot::restore;
    Box::pin(
        Controller::new(
            all::<api::snapshot::VirtualMachineRestore>(ctx),
            watcher::Config::default(),
        )
        .graceful_shutdown_on(stop)
        .run(restore::reconcile, restore::error_policy, ctx.clone())
        .for_each(|_| async {}),
    )
}

/// VirtualMachineClones, woken by the snapshots and restores they make.
fn clones(ctx: &Arc<Context>, stop: Stop) -> Running {
    use crate::snapshot::clone;
    use api::snapshot::{VirtualMachineRestore, VirtualMachineSnapshot};
    let wc = watcher::Config::default;
    Box::pin(
        Controller::new(all::<api::clone::VirtualMachineClone>(ctx), wc())
            .owns(all::<VirtualMachineSnapshot>(ctx), wc())
            .owns(all::<VirtualMachineRestore>(ctx), wc())
            .graceful_shutdown_on(stop)
            .run(clone::reconcile, clone::error_policy, ctx.clone())
            .for_each(|_| async {}),
    )
}

/// Only tainted nodes matter, but a taint cannot be selected on, so every node is watched
/// (node objects are few next to Pods and VMIs).
fn drains(ctx: &Arc<Context>, stop: Stop) -> Running {
    Box::pin(
        Controller::new(
            Api::<Node>::all(ctx.client.clone()),
            watcher::Config::default(),
        )
        .graceful_shutdown_on(stop)
        .run(
            crate::evacuation::reconcile_node,
            crate::evacuation::node_error_policy,
            ctx.clone(),
        )
        .for_each(|_| async {}),
    )
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
