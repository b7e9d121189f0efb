//! virt-handler: the per-node agent. It watches the VMIs scheduled to its node, finds each
//! launcher Pod's control socket in the kubelet's pods directory, Syncs the VMI into the
//! launcher and keeps the VMI's status true to what the launcher reports.
//! Before the first Sync it wires the VMI's Pod network in the launcher's network namespace
//! and hands the TAPs over (`network`).

pub mod context;
pub mod deviceplugin;
pub mod launcher;
pub mod legs;
pub mod machine_state;
pub mod metrics;
pub mod migration;
pub mod migration_proxy;
pub mod network;
pub mod node_certificate;
pub mod rest;
pub mod sync;

use futures::StreamExt;
use kube::runtime::{watcher, Controller};
use kube::{Api, Client};

pub use context::{Context, HandlerConfig};

/// Runs the reconcilers for this node until the process is told to stop: the VMIs that run
/// here, and the VMIs migrating here.
pub async fn run(
    client: Client,
    config: HandlerConfig,
    metrics_listener: Option<tokio::net::TcpListener>,
    console: Option<rest::Serving>,
) {
    let vmis: Api<api::VirtualMachineInstance> = Api::all(client.clone());
    let here = api::labels::selector(api::labels::NODE_NAME, &config.node);
    let incoming = api::labels::selector(api::labels::MIGRATION_TARGET_NODE, &config.node);
    tracing::info!(node = %config.node, pods_dir = %config.pods_dir.display(), "virt-handler running");
    let ctx = Context::new(client, config);
    if let Some(l) = metrics_listener {
        let m = ctx.metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = metrics::serve(l, m).await {
                tracing::error!("metrics endpoint: {e}");
            }
        });
    }
    if let Some(c) = console {
        tokio::spawn(c.serve(ctx.clone()));
    }
    let log = |r: Result<_, _>| async move {
        if let Err(e) = r {
            tracing::debug!("reconcile: {e}");
        }
    };
    let vmis_here = Controller::new(vmis.clone(), watcher::Config::default().labels(&here))
        .shutdown_on_signal()
        .run(sync::reconcile, sync::error_policy, ctx.clone())
        .for_each(log);
    let targets = Controller::new(vmis, watcher::Config::default().labels(&incoming))
        .shutdown_on_signal()
        .run(migration::reconcile_target, sync::error_policy, ctx)
        .for_each(log);
    futures::join!(vmis_here, targets);
}
