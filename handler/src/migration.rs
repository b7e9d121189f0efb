//! The migration legs. Target node: once virt-controller has handed a VMI over
//! (`status.migrationState` names this node and a target Pod, the VMI is labelled
//! `kubevirt.io/migrationTargetNodeName`), ask the target Pod's launcher to listen (PrepareMigrationTarget)
//! and publish `targetNodeAddress` (the Pod's IP and the port) → TargetReady. Source node: once
//! the address is there, set `startTimestamp` (→ Running) and have the source launcher
//! MigrateOut with the hand-off's migration configuration; set `completed` or `failed` with
//! the launcher's reason. A failed migration leaves the VM running on the source (the
//! launcher guarantees it); a hand-off marked failed meanwhile (the migration was deleted)
//! cancels the transfer.

use std::sync::Arc;
use std::time::Duration;

use api::launcher_pod::{MIGRATION_IN_SOCKET, MIGRATION_OUT_SOCKET};
use api::protocol::{Event, MigrationOptions, Request, Response};
use api::{MigrationState, VirtualMachineInstance};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};

use crate::context::{Context, Error};
use crate::launcher::{socket_path, LauncherClient};

/// The launcher's options from the hand-off's migration configuration (KubeVirt's fields),
/// with the page streams KubeVirt would give `vmi` (`api::protocol::page_streams_for`).
pub fn options(ms: &MigrationState, vmi: &VirtualMachineInstance) -> MigrationOptions {
    let c = ms.migration_configuration.clone().unwrap_or_default();
    MigrationOptions {
        bandwidth_bytes_per_second: c
            .bandwidth_per_migration
            .and_then(|q| api::quantity::parse_bytes(&q.0).ok())
            .filter(|b| *b > 0),
        completion_timeout_per_gib: c.completion_timeout_per_gi_b.map(|s| s.max(1) as u64),
        max_downtime_ms: c.max_downtime_ms.map(|m| m.max(1) as u64),
        progress_timeout_seconds: c.progress_timeout.map(|s| s.max(1) as u64),
        allow_auto_converge: c.allow_auto_converge.unwrap_or(false),
        page_streams: api::protocol::page_streams_for(vmi),
    }
}

/// Edits the VMI's migration state, re-reading on conflicts.
async fn edit_state(
    api: &Api<VirtualMachineInstance>,
    name: &str,
    muid: &str,
    f: impl Fn(&mut MigrationState),
) -> Result<(), kube::Error> {
    for _ in 0..20 {
        let mut v = api.get(name).await?;
        let Some(ms) = v.status.as_mut().and_then(|s| s.migration_state.as_mut()) else {
            return Ok(());
        };
        if ms.migration_uid.as_deref() != Some(muid) {
            return Ok(()); // another migration's hand-off by now
        }
        f(ms);
        match api.replace_status(name, &PostParams::default(), &v).await {
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            r => return r.map(|_| ()),
        }
    }
    Ok(())
}

/// Marks the target leg of migration `muid` failed with `reason` (the source keeps the VM).
async fn fail_target_leg(
    ctx: &Context,
    vmi: &VirtualMachineInstance,
    muid: &str,
    reason: String,
) -> Result<(), kube::Error> {
    let api = Api::namespaced(ctx.client.clone(), &vmi.namespace().unwrap_or_default());
    edit_state(&api, &vmi.name_any(), muid, |m| {
        m.failed = Some(true);
        m.failure_reason = Some(reason.clone());
    })
    .await
}

/// The target leg, for VMIs labelled `kubevirt.io/migrationTargetNodeName=<this node>`.
pub async fn reconcile_target(
    vmi: Arc<VirtualMachineInstance>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let node = ctx.config.node.as_str();
    let Some(ms) = vmi.status.as_ref().and_then(|s| s.migration_state.clone()) else {
        return Ok(Action::await_change());
    };
    let Some(muid) = ms.migration_uid.clone() else {
        return Ok(Action::await_change());
    };
    if ms.target_node.as_deref() != Some(node)
        || ms.completed == Some(true)
        || ms.failed == Some(true)
        || ms.target_node_address.is_some()
    {
        return Ok(Action::await_change());
    }
    let ns = vmi.namespace().unwrap_or_default();
    let Some(pod_name) = ms.target_pod.clone() else {
        return Ok(Action::await_change());
    };
    let pod = Api::<Pod>::namespaced(ctx.client.clone(), &ns)
        .get(&pod_name)
        .await?;
    let (Some(uid), Some(_ip)) = (
        pod.metadata.uid.clone(),
        pod.status.as_ref().and_then(|s| s.pod_ip.clone()),
    ) else {
        return Ok(Action::requeue(Duration::from_millis(500)));
    };
    if !api::ownership::controlled_by_vmi(&pod.metadata, &vmi.uid().unwrap_or_default()) {
        // A Pod the controller did not make for this VMI gets neither the VM nor a stream.
        let why =
            api::ownership::stranger_note(&pod_name, &vmi.name_any(), "the migration's targetPod");
        tracing::warn!(vmi = %vmi.name_any(), "{why}");
        fail_target_leg(&ctx, &vmi, &muid, why).await?;
        return Ok(Action::await_change());
    }
    let socket = socket_path(&ctx.config.pods_dir, &uid);
    if !socket.exists() {
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    let known = ctx.legs.incoming.lock().unwrap().get(&muid).cloned();
    let address = match known {
        Some(a) => a,
        None => match prepare_target(&ctx, &vmi, &ms, &uid, &socket).await? {
            Ok(a) => {
                let mut incoming = ctx.legs.incoming.lock().unwrap();
                incoming.insert(muid.clone(), a.clone());
                a
            }
            Err(why) => {
                fail_target_leg(&ctx, &vmi, &muid, why).await?;
                return Ok(Action::await_change());
            }
        },
    };
    let api = Api::namespaced(ctx.client.clone(), &ns);
    edit_state(&api, &vmi.name_any(), &muid, |m| {
        m.target_node_address = Some(address.clone())
    })
    .await?;
    tracing::info!(vmi = %vmi.name_any(), %address, "migration target ready");
    Ok(Action::await_change())
}

/// Readies the target Pod (uid `pod_uid`, control socket `socket`): its network wired, its
/// launcher receiving on its own Pod's socket, and this handler listening on the node for the
/// source node's handler, to carry the stream in. The inner result is the address the source
/// connects to, or why the target leg fails.
async fn prepare_target(
    ctx: &Context,
    vmi: &Arc<VirtualMachineInstance>,
    ms: &MigrationState,
    pod_uid: &str,
    socket: &std::path::Path,
) -> Result<Result<String, String>, Error> {
    let mut l =
        LauncherClient::connect_pod(&ctx.config.pods_dir, pod_uid, ctx.config.launcher_timeout)
            .await?;
    // The target Pod's network is wired like any other before the VM arrives: the
    // same MAC and guest address on a new node.
    if !l.status().await?.network_attached {
        if let Err(e) = crate::network::attach(&mut l, vmi).await {
            let message = e.to_string();
            if let crate::network::NetworkError::Launcher(e) = e {
                return Err(e.into());
            }
            return Ok(Err(format!(
                "the target Pod's network cannot be wired: {message}"
            )));
        }
    }
    // The launcher receives on a socket in its own Pod; this handler listens on the
    // node for the source node's handler and carries the stream to it.
    let page_streams = api::protocol::page_streams_for(vmi);
    let listening = l
        .call(&Request::PrepareMigrationTarget {
            vmi: Box::new((**vmi).clone()),
            listen: format!("unix:{MIGRATION_IN_SOCKET}"),
            tls: None,
            page_streams,
        })
        .await?;
    match listening {
        Response::MigrationListening { .. } => {}
        Response::Error { message } => {
            return Ok(Err(format!(
                "the target launcher cannot receive: {message}"
            )))
        }
        other => return Err(crate::launcher::LauncherError::Garbage(format!("{other:?}")).into()),
    };
    let source_node = ms.source_node.clone().unwrap_or_default();
    let vmi_name = vmi.name_any();
    let served = crate::migration_proxy::serve_target(
        ctx.config.migration_ip,
        ctx.node_tls()
            .map_err(crate::launcher::LauncherError::Refused)?,
        source_node,
        1 + page_streams as usize,
        ctx.config.pods_dir.clone(),
        socket.with_file_name(MIGRATION_IN_SOCKET),
        TARGET_WAIT,
        move |outcome| match outcome {
            Ok((sent, received)) => {
                tracing::info!(vmi = %vmi_name, sent, received, "migration stream carried in")
            }
            Err(e) => tracing::warn!(vmi = %vmi_name, "incoming migration stream: {e}"),
        },
    )
    .await
    .map_err(crate::launcher::LauncherError::Refused)?;
    Ok(Ok(served.to_string()))
}

/// The source leg, from the VMI reconciler of this node: starts MigrateOut once the target is
/// ready, cancels it when the hand-off is marked failed. Returns whether a migration is in
/// progress (the caller then leaves the status to the migration).
pub async fn source_leg(
    vmi: &VirtualMachineInstance,
    ctx: &Arc<Context>,
    socket: &std::path::Path,
) -> Result<bool, Error> {
    let node = ctx.config.node.as_str();
    let Some(ms) = vmi.status.as_ref().and_then(|s| s.migration_state.clone()) else {
        return Ok(false);
    };
    let Some(muid) = ms.migration_uid.clone() else {
        return Ok(false);
    };
    if ms.source_node.as_deref() != Some(node) || ms.completed == Some(true) {
        return Ok(false);
    }
    let started_here = ctx.legs.outgoing.lock().unwrap().contains(&muid);
    let running_here = started_here && !ctx.legs.finished.lock().unwrap().contains(&muid);
    if ms.failed == Some(true) {
        if running_here {
            // The migration was deleted or failed elsewhere: stop sending; the VM stays.
            let pods = &ctx.config.pods_dir;
            if let Ok(mut l) =
                LauncherClient::connect_beneath(pods, socket, ctx.config.launcher_timeout).await
            {
                let _ = l.call(&Request::CancelMigration).await;
            }
        }
        return Ok(false);
    }
    let Some(address) = ms.target_node_address.clone() else {
        return Ok(false);
    };
    if started_here {
        return Ok(running_here);
    }
    ctx.legs.outgoing.lock().unwrap().insert(muid.clone());
    let api: Api<VirtualMachineInstance> =
        Api::namespaced(ctx.client.clone(), &vmi.namespace().unwrap_or_default());
    let name = vmi.name_any();
    edit_state(&api, &name, &muid, |m| {
        m.start_timestamp
            .get_or_insert_with(controller_runtime::time::now_rfc3339);
    })
    .await?;
    let socket = socket.to_path_buf();
    let opts = options(&ms, vmi);
    let target_node = ms.target_node.clone().unwrap_or_default();
    let ctx = ctx.clone();
    let ns = vmi.namespace().unwrap_or_default();
    tokio::spawn(async move {
        let metrics = ctx.metrics.clone();
        let outcome = migrate_out(&ctx, &socket, &address, &target_node, opts, &mut |p| {
            metrics.record_migration(&ns, &name, Some(p))
        })
        .await;
        match &outcome {
            // The VMI lives on the target node now: its figures are that handler's.
            Ok(()) => ctx.metrics.forget(&ns, &name),
            Err(_) => ctx.metrics.record_migration(&ns, &name, None),
        }
        let r = edit_state(&api, &name, &muid, |m| {
            if m.completed == Some(true) || m.failed == Some(true) {
                return; // decided already
            }
            m.end_timestamp = Some(controller_runtime::time::now_rfc3339());
            match &outcome {
                Ok(()) => m.completed = Some(true),
                Err(reason) => {
                    m.failed = Some(true);
                    m.failure_reason = Some(reason.clone());
                }
            }
        })
        .await;
        if let Err(e) = r {
            tracing::warn!(vmi = %name, "recording the migration's end: {e}");
        }
        match outcome {
            Ok(()) => tracing::info!(vmi = %name, %address, "migrated"),
            Err(reason) => tracing::warn!(vmi = %name, %reason, "migration failed"),
        }
        ctx.legs.finished.lock().unwrap().insert(muid);
    });
    Ok(true)
}

/// How long a target handler waits for the source node's handler to connect.
const TARGET_WAIT: Duration = Duration::from_secs(600);

/// Runs MigrateOut on the source launcher to its end: the launcher offers its stream on its
/// own Pod's socket, and this handler carries it to the target node's (`migration_proxy`).
async fn migrate_out(
    ctx: &Arc<Context>,
    socket: &std::path::Path,
    address: &str,
    target_node: &str,
    options: MigrationOptions,
    progress: &mut (dyn FnMut(crate::metrics::MigrationSample) + Send),
) -> Result<(), String> {
    let pods_dir = ctx.config.pods_dir.clone();
    let tls = ctx.node_tls()?;
    let links = 1 + options.page_streams as usize;
    // Rounds can take long on large guests: the launcher's own completion timeout bounds it.
    let mut l = LauncherClient::connect_beneath(&pods_dir, socket, Duration::from_secs(3600))
        .await
        .map_err(|e| e.to_string())?;
    l.send(&Request::MigrateOut {
        target: format!("listen:unix:{MIGRATION_OUT_SOCKET}"),
        options,
        tls: None,
    })
    .await
    .map_err(|e| e.to_string())?;
    let out_socket = socket.with_file_name(MIGRATION_OUT_SOCKET);
    let (address, target_node) = (address.to_string(), target_node.to_string());
    let carrier = tokio::spawn(async move {
        crate::migration_proxy::carry_source(
            tls,
            &address,
            &target_node,
            links,
            &pods_dir,
            &out_socket,
            crate::migration_proxy::HANDSHAKE_DEADLINE * 6,
        )
        .await
    });
    let answered = follow_migrate_out(&mut l, progress).await;
    let carried = carrier.await.map_err(|e| e.to_string())?;
    match (answered, carried) {
        (Ok(()), _) => Ok(()),
        // The launcher's own reason first; the carrier's when the launcher only saw the
        // stream end.
        (Err(e), Err(c)) => Err(format!("{e} (carrying the stream: {c})")),
        (Err(e), Ok(_)) => Err(e),
    }
}

/// Reads MigrateOut's progress events and its final answer.
async fn follow_migrate_out(
    l: &mut LauncherClient,
    progress: &mut (dyn FnMut(crate::metrics::MigrationSample) + Send),
) -> Result<(), String> {
    let first = l.next_answer().await.map_err(|e| e.to_string())?;
    let mut answer = first;
    loop {
        match answer {
            Response::Event(Event::MigrationProgress {
                phase,
                pass,
                data_processed_bytes,
                data_remaining_bytes,
                dirty_memory_rate_bytes,
                memory_transfer_rate_bytes,
                ..
            }) => {
                tracing::debug!(
                    %phase,
                    pass,
                    data_processed_bytes,
                    data_remaining_bytes,
                    "migration progress"
                );
                progress(crate::metrics::MigrationSample {
                    data_processed_bytes,
                    data_remaining_bytes,
                    dirty_memory_rate_bytes,
                    memory_transfer_rate_bytes,
                });
            }
            Response::Event(_) => {}
            Response::Migration(r) => {
                tracing::info!(?r, "migration report");
                return Ok(());
            }
            Response::Error { message } => return Err(message),
            other => return Err(format!("unexpected answer {other:?}")),
        }
        answer = l.next_answer().await.map_err(|e| e.to_string())?;
    }
}
