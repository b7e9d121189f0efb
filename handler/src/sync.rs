//! The VMI reconciler of virt-handler: for each VMI scheduled to this node, find its launcher
//! Pod's control socket, Sync the VMI into it, and keep the VMI's status true to what the
//! launcher reports (phase, reason, conditions, launcher version).

use std::sync::Arc;
use std::time::Duration;

use api::protocol::{StatusReport, VmState};
use api::{VirtualMachineInstance, VirtualMachineInstanceStatus, VmiPhase};
use controller_runtime::{is_conflict, remove_condition, set_condition, write_status};
use kube::runtime::controller::Action;
use kube::{Api, ResourceExt};

use crate::context::{Context, Error};
use crate::launcher::{socket_path, LauncherClient, LauncherError};

/// The launcher Pod of `status` on `node` (from `status.activePods`: Pod UID → node).
pub fn launcher_pod<'a>(status: &'a VirtualMachineInstanceStatus, node: &str) -> Option<&'a str> {
    status
        .active_pods
        .as_ref()?
        .iter()
        .find(|(_, n)| n.as_str() == node)
        .map(|(uid, _)| uid.as_str())
}

/// The status a launcher's report means for the VMI. Pure, so the table is tested directly.
pub fn observed_status(
    old: &VirtualMachineInstanceStatus,
    report: &StatusReport,
    node: &str,
    launcher_version: &str,
) -> VirtualMachineInstanceStatus {
    let mut s = old.clone();
    let (phase, reason) = match report.state {
        VmState::Running | VmState::Paused => (Some(VmiPhase::Running), None),
        VmState::ShutDown => (Some(VmiPhase::Succeeded), report.end.clone()),
        VmState::Crashed => (Some(VmiPhase::Failed), report.end.clone()),
        // Nothing runs (yet), or the VM left by migration: the phase is not the launcher's to
        // say.
        VmState::NoVm | VmState::WaitingForMigration | VmState::Migrated => {
            (old.phase, old.reason.clone())
        }
    };
    s.phase = phase;
    s.reason = reason;
    s.node_name = Some(node.to_string());
    if report.memory_mib > 0 {
        let got = Some(format!("{}Mi", report.memory_mib));
        let m = s.memory.get_or_insert_with(Default::default);
        m.guest_at_boot = got.clone();
        m.guest_current = got;
    }
    s.launcher_container_image_version = Some(launcher_version.to_string());
    let running = report.state == VmState::Running;
    let paused = report.state == VmState::Paused;
    set_condition(
        &mut s.conditions,
        api::conditions::READY,
        running,
        (!running).then_some(match report.state {
            VmState::Paused => "Paused",
            VmState::ShutDown | VmState::Crashed => "GuestNotRunning",
            _ => "GuestNotRunning",
        }),
        None,
    );
    if paused {
        set_condition(
            &mut s.conditions,
            api::conditions::PAUSED,
            true,
            Some("PausedByUser"),
            Some("the VMI was paused".into()),
        );
    } else {
        remove_condition(&mut s.conditions, api::conditions::PAUSED);
    }
    set_condition(
        &mut s.conditions,
        api::conditions::SYNCHRONIZED,
        true,
        None,
        None,
    );
    if report.software_emulated_kvm {
        set_condition(
            &mut s.conditions,
            api::conditions::SOFTWARE_EMULATION,
            true,
            Some("SoftwareEmulatedKVM"),
            Some("this node's KVM has no hardware virtualization (no vmx/svm): the guest runs ~1000x slower".into()),
        );
    } else {
        remove_condition(&mut s.conditions, api::conditions::SOFTWARE_EMULATION);
    }
    s
}

fn is_finished(phase: Option<VmiPhase>) -> bool {
    matches!(phase, Some(VmiPhase::Succeeded | VmiPhase::Failed))
}

pub async fn reconcile(
    vmi: Arc<VirtualMachineInstance>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let node = ctx.config.node.as_str();
    let status = vmi.status.clone().unwrap_or_default();
    // Deletion is the controller's (it deletes the Pod; the launcher shuts the guest down on
    // SIGTERM); a finished VMI is history.
    if vmi.metadata.deletion_timestamp.is_some() || is_finished(status.phase) {
        ctx.metrics
            .forget(&vmi.namespace().unwrap_or_default(), &vmi.name_any());
        return Ok(Action::await_change());
    }
    if !matches!(status.phase, Some(VmiPhase::Scheduled | VmiPhase::Running))
        || status.node_name.as_deref().is_some_and(|n| n != node)
    {
        return Ok(Action::await_change());
    }
    let Some(pod_uid) = launcher_pod(&status, node).map(str::to_string) else {
        return Ok(Action::requeue(ctx.config.resync));
    };
    let pod_uid = pod_uid.as_str();
    let socket = socket_path(&ctx.config.pods_dir, pod_uid);
    if !socket.exists() {
        // The launcher container has not created its socket yet.
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    let api: Api<VirtualMachineInstance> =
        Api::namespaced(ctx.client.clone(), &vmi.namespace().unwrap_or_default());
    let connected =
        LauncherClient::connect_pod(&ctx.config.pods_dir, pod_uid, ctx.config.launcher_timeout);
    let mut launcher = match connected.await {
        Ok(l) => l,
        Err(e) => {
            let mut s = status.clone();
            set_condition(
                &mut s.conditions,
                api::conditions::SYNCHRONIZED,
                false,
                Some("LauncherUnreachable"),
                Some(e.to_string()),
            );
            write_status(&api, &vmi, s).await?;
            return Err(e.into());
        }
    };
    let mut report = launcher.status().await?;
    let migrating = crate::migration::source_leg(&vmi, &ctx, &socket).await?;
    if report.state == VmState::NoVm && !migrating {
        match start(&ctx, &vmi, &mut launcher, report.network_attached).await? {
            Ok(()) => report = launcher.status().await?,
            Err((reason, message)) => {
                // The VMI cannot run here, and stays failed with the reason.
                let mut s = status.clone();
                s.phase = Some(VmiPhase::Failed);
                s.reason = Some(format!("{reason}: {message}"));
                let c = &mut s.conditions;
                let synced = api::conditions::SYNCHRONIZED;
                set_condition(c, synced, false, Some(reason), Some(message.clone()));
                write_status(&api, &vmi, s).await?;
                ctx.event(&vmi, true, reason, message).await;
                return Ok(Action::await_change());
            }
        }
    }
    let mut status = status;
    if !migrating && matches!(report.state, VmState::Running | VmState::Paused) {
        crate::machine_state::leg(&ctx, &vmi, &mut launcher, pod_uid, &mut status).await?;
        report = launcher.status().await?;
    }
    publish(&ctx, &vmi, &api, &status, report, &launcher).await
}

/// Wires the Pod network (once) and Syncs the VMI into its launcher. The inner Err is why
/// the VMI cannot run here at all (a Failed reason and its message); nothing of the
/// network's wiring is left behind then.
async fn start(
    ctx: &Context,
    vmi: &VirtualMachineInstance,
    launcher: &mut LauncherClient,
    network_attached: bool,
) -> Result<Result<(), (&'static str, String)>, Error> {
    if !network_attached {
        match crate::network::attach(launcher, vmi).await {
            Ok(()) => {}
            Err(crate::network::NetworkError::Unwirable(message)) => {
                return Ok(Err(("NetworkSetupFailed", message)))
            }
            Err(crate::network::NetworkError::Launcher(e)) => return Err(e.into()),
        }
    }
    match launcher.sync(vmi).await {
        Ok(()) => {
            let note = format!("VMI started on {}", ctx.config.node);
            ctx.event(vmi, false, "Started", note).await;
            Ok(Ok(()))
        }
        // The launcher cannot run this VMI (bad input, a missing disk).
        Err(LauncherError::Refused(message)) => Ok(Err(("SyncFailed", message))),
        Err(e) => Err(e.into()),
    }
}

/// What the launcher reports, into the node's metrics and the VMI's status.
async fn publish(
    ctx: &Context,
    vmi: &VirtualMachineInstance,
    api: &Api<VirtualMachineInstance>,
    status: &VirtualMachineInstanceStatus,
    report: StatusReport,
    launcher: &LauncherClient,
) -> Result<Action, Error> {
    let node = ctx.config.node.as_str();
    let ns = vmi.namespace().unwrap_or_default();
    ctx.metrics.record(&ns, &vmi.name_any(), report.clone());
    if let Some(pid) = launcher.pid.filter(|_| report.network_attached) {
        match crate::network::spoofed(pid).await {
            Ok(counts) => ctx.metrics.record_spoofed(&ns, &vmi.name_any(), counts),
            Err(e) => {
                tracing::debug!(vmi = %vmi.name_any(), "reading the source guard counters: {e}")
            }
        }
    }
    let mut new = observed_status(status, &report, node, &launcher.launcher_version);
    if let Some(m) = new.memory.as_mut() {
        m.guest_requested = vmi
            .spec
            .domain
            .memory
            .as_ref()
            .and_then(|m| m.guest.as_ref())
            .map(|q| q.0.clone());
    }
    if !report.nics.is_empty() {
        new.interfaces = crate::network::interface_status(vmi, &report);
    }
    write_status(api, vmi, new.clone()).await?;
    if status.phase != new.phase {
        if let Some(p) = new.phase {
            let note = new
                .reason
                .clone()
                .unwrap_or_else(|| format!("the VMI is {p:?} on {node}"));
            ctx.event(vmi, p == VmiPhase::Failed, &format!("{p:?}"), note)
                .await;
        }
    }
    ctx.backoff.reset(&key(vmi));
    Ok(if is_finished(new.phase) {
        Action::await_change()
    } else {
        Action::requeue(ctx.config.resync)
    })
}

fn key(vmi: &VirtualMachineInstance) -> String {
    format!("{}/{}", vmi.namespace().unwrap_or_default(), vmi.name_any())
}

/// Retry with per-VMI exponential backoff: an unreachable launcher is asked again, never in a
/// tight loop.
pub fn error_policy(vmi: Arc<VirtualMachineInstance>, err: &Error, ctx: Arc<Context>) -> Action {
    let conflict = match err {
        Error::Kube(e) => is_conflict(e),
        _ => false,
    };
    let delay = ctx.backoff.after_failure(
        &key(&vmi),
        conflict,
        ctx.config.retry_base,
        ctx.config.retry_max,
    );
    if conflict {
        // The controller wrote the VMI meanwhile: expected, retried with a fresh read.
        tracing::debug!(vmi = %key(&vmi), retry_in = ?delay, "conflict, retrying");
    } else {
        tracing::warn!(vmi = %key(&vmi), rv = ?vmi.metadata.resource_version, error = %err, retry_in = ?delay, "sync failed");
    }
    Action::requeue(delay)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(state: VmState) -> StatusReport {
        StatusReport {
            state,
            name: Some("vm".into()),
            vcpus: 1,
            memory_mib: 64,
            uptime_seconds: 1.0,
            software_emulated_kvm: true,
            end: Some("guest powered off".into()),
            disks: vec![],
            nics: vec![],
            network_attached: false,
            reboots: 0,
        }
    }

    fn cond<'a>(s: &'a VirtualMachineInstanceStatus, t: &str) -> Option<&'a str> {
        s.conditions
            .iter()
            .find(|c| c.type_ == t)
            .map(|c| c.status.as_str())
    }

    #[test]
    fn launcher_states_map_to_kubevirt_phases_and_conditions() {
        let old = VirtualMachineInstanceStatus {
            phase: Some(VmiPhase::Scheduled),
            ..Default::default()
        };
        let s = observed_status(&old, &report(VmState::Running), "n1", "0.1.0");
        assert_eq!(s.phase, Some(VmiPhase::Running));
        assert_eq!(cond(&s, "Ready"), Some("True"));
        assert_eq!(cond(&s, "Paused"), None);
        assert_eq!(cond(&s, "SoftwareEmulation"), Some("True"));
        assert_eq!(s.node_name.as_deref(), Some("n1"));
        assert_eq!(s.launcher_container_image_version.as_deref(), Some("0.1.0"));
        assert_eq!(
            s.memory.as_ref().and_then(|m| m.guest_at_boot.as_deref()),
            Some("64Mi")
        );
        let p = observed_status(&s, &report(VmState::Paused), "n1", "0.1.0");
        assert_eq!(p.phase, Some(VmiPhase::Running));
        assert_eq!(
            (cond(&p, "Ready"), cond(&p, "Paused")),
            (Some("False"), Some("True"))
        );
        let r = observed_status(&p, &report(VmState::Running), "n1", "0.1.0");
        assert_eq!(cond(&r, "Paused"), None, "unpaused");
        let done = observed_status(&r, &report(VmState::ShutDown), "n1", "0.1.0");
        assert_eq!(done.phase, Some(VmiPhase::Succeeded));
        let crashed = observed_status(&r, &report(VmState::Crashed), "n1", "0.1.0");
        assert_eq!(crashed.phase, Some(VmiPhase::Failed));
        assert_eq!(crashed.reason.as_deref(), Some("guest powered off"));
        let waiting = observed_status(&old, &report(VmState::NoVm), "n1", "0.1.0");
        assert_eq!(waiting.phase, Some(VmiPhase::Scheduled));
    }
}
