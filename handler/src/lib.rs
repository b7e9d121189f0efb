//! virt-handler: the per-node agent. It watches the VMIs scheduled to its node, finds each
//! launcher Pod's control socket in the kubelet's pods directory, Syncs the VMI into the
//! launcher and keeps the VMI's status true to what the launcher reports.
//!
//! Still to come (the handler issue): pod network wiring with TAP hand-over, device plugins,
//! the migration legs, per-VMI metrics.

pub mod launcher;
pub mod sync;

use futures::StreamExt;
use kube::runtime::{watcher, Controller};
use kube::{Api, Client};

pub use sync::{Context, HandlerConfig};

/// Runs the VMI reconciler for this node until the process is told to stop.
pub async fn run(client: Client, config: HandlerConfig) {
    let vmis: Api<api::VirtualMachineInstance> = Api::all(client.clone());
    let selector = format!("kubevirt.io/nodeName={}", config.node);
    tracing::info!(node = %config.node, pods_dir = %config.pods_dir.display(), "virt-handler running");
    let ctx = Context::new(client, config);
    Controller::new(vmis, watcher::Config::default().labels(&selector))
        .shutdown_on_signal()
        .run(sync::reconcile, sync::error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!("reconcile: {e}");
            }
        })
        .await;
}
