//! virt-handler's leg of a machine-state capture (the protocol is described at
//! [`api::snapshot::ANNOTATION_CAPTURE_STATE`]): when the VMI asks for its machine state to be
//! captured into a claim, the launcher saves the machine — and stays paused — into its own
//! sockets directory, and the files are moved into the claim as the attachment Pod's volume
//! shows it on this node. The guest resumes once the controller has cut the disks and taken
//! the request off.
//!
//! Both directories are the tenant's to arrange (the launcher's emptyDir, the claim's
//! contents): every file is opened below its directory with no symbolic link on the way
//! (`launcher::open_beneath`), so the root node agent reads and writes only what it names.

use std::fs::File;
use std::path::{Path, PathBuf};

use api::protocol::{Request, Response};
use api::snapshot::{
    capture_state, state_attachment_name, CONDITION_STATE_CAPTURED, LABEL_STATE_ATTACHMENT,
    LAUNCHER_STATE_FILES, MACHINE_STATE_FILES,
};
use api::{VirtualMachineInstance, VirtualMachineInstanceStatus};
use controller_runtime::{remove_condition, set_condition};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, ResourceExt};

use crate::context::{Context, Error};
use crate::launcher::{open_beneath, LauncherClient};

/// Where a capture stands for this VMI, from its annotation and condition.
#[derive(Debug, PartialEq)]
pub enum Capture<'a> {
    /// Nothing asked, nothing left to undo.
    None,
    /// Asked into this claim and not yet done here.
    Wanted(&'a str),
    /// Done (or failed) for the claim asked: the controller's move.
    Reported,
    /// The request is gone and the condition is left: resume the guest if it was captured,
    /// and drop the condition.
    Over { paused_by_capture: bool },
}

/// Pure, so the table is tested directly.
pub fn capture_of<'a>(
    vmi: &'a VirtualMachineInstance,
    status: &VirtualMachineInstanceStatus,
) -> Capture<'a> {
    let cond = status
        .conditions
        .iter()
        .find(|c| c.type_ == CONDITION_STATE_CAPTURED);
    match (capture_state(vmi.metadata.annotations.as_ref()), cond) {
        (None, None) => Capture::None,
        (None, Some(c)) => Capture::Over {
            paused_by_capture: c.status == "True",
        },
        (Some(claim), Some(c))
            if c.message
                .as_deref()
                .is_some_and(|m| api::snapshot::reports_on(m, claim)) =>
        {
            Capture::Reported
        }
        (Some(claim), _) => Capture::Wanted(claim),
    }
}

/// Carries out this node's part of a capture; the outcome goes into `status` (written by the
/// caller with the rest of the VMI's status).
pub async fn leg(
    ctx: &Context,
    vmi: &VirtualMachineInstance,
    launcher: &mut LauncherClient,
    pod_uid: &str,
    status: &mut VirtualMachineInstanceStatus,
) -> Result<(), Error> {
    match capture_of(vmi, status) {
        Capture::None | Capture::Reported => Ok(()),
        Capture::Over { paused_by_capture } => {
            if paused_by_capture {
                if let Response::Error { message } = launcher.call(&Request::Resume).await? {
                    tracing::warn!(vmi = %vmi.name_any(), "resuming after the capture: {message}");
                }
            }
            remove_condition(&mut status.conditions, CONDITION_STATE_CAPTURED);
            Ok(())
        }
        Capture::Wanted(claim) => {
            let Some(mount) = attachment_mount(ctx, vmi, claim).await? else {
                // The attachment Pod is not running here yet: looked at again on resync.
                return Ok(());
            };
            let outcome = save_into(ctx, vmi, launcher, pod_uid, &mount).await;
            let (ok, reason, message) = match outcome {
                Ok(bytes) => (
                    true,
                    "Captured",
                    api::snapshot::capture_report(
                        claim,
                        &format!(
                            "the machine state is saved ({} MiB of memory); the guest is paused \
                             until the disks are captured",
                            bytes >> 20
                        ),
                    ),
                ),
                Err(why) => (
                    false,
                    "CaptureFailed",
                    api::snapshot::capture_report(claim, &why),
                ),
            };
            let c = &mut status.conditions;
            set_condition(c, CONDITION_STATE_CAPTURED, ok, Some(reason), Some(message));
            Ok(())
        }
    }
}

/// The claim's directory as the attachment Pod on this node mounts it, once that Pod runs:
/// `<pods>/<Pod UID>/volumes/kubernetes.io~csi/<volume>/mount`, as the kubelet lays a CSI
/// volume out (KubeVirt's hotplug finds its volumes the same way).
async fn attachment_mount(
    ctx: &Context,
    vmi: &VirtualMachineInstance,
    claim: &str,
) -> Result<Option<PathBuf>, Error> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &vmi.namespace().unwrap_or_default());
    let Some(pod) = pods.get_opt(&state_attachment_name(claim)).await? else {
        return Ok(None);
    };
    let labelled = pod.labels().get(LABEL_STATE_ATTACHMENT).map(String::as_str) == Some(claim);
    let here = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&ctx.config.node);
    let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
    let Some(uid) = pod.uid().filter(|_| labelled && here && running) else {
        return Ok(None);
    };
    if crate::launcher::check_pod_uid(&uid).is_err() {
        return Ok(None);
    }
    let csi = ctx
        .config
        .pods_dir
        .join(&uid)
        .join("volumes/kubernetes.io~csi");
    let volumes: Vec<PathBuf> = match std::fs::read_dir(&csi) {
        Ok(entries) => entries.filter_map(|e| Some(e.ok()?.path())).collect(),
        Err(_) => return Ok(None),
    };
    Ok(match volumes.as_slice() {
        [one] => Some(one.join("mount")),
        _ => None,
    })
}

/// Has the launcher save its machine (staying paused) and moves the files into `mount`.
/// Returns the memory's size, or why not (the guest then runs on).
async fn save_into(
    ctx: &Context,
    vmi: &VirtualMachineInstance,
    launcher: &mut LauncherClient,
    pod_uid: &str,
    mount: &Path,
) -> Result<u64, String> {
    let [state, memory] = LAUNCHER_STATE_FILES;
    let sent = launcher
        .send(&Request::Snapshot {
            memory_path: memory.into(),
            state_path: state.into(),
            stop: true,
        })
        .await;
    sent.map_err(|e| format!("asking the launcher to save the machine: {e}"))?;
    let report = loop {
        match launcher.next_answer().await {
            Ok(Response::Event(_)) => continue,
            Ok(Response::Snapshot(r)) => break r,
            Ok(Response::Error { message }) => return Err(format!("the launcher: {message}")),
            Ok(other) => return Err(format!("the launcher answered {other:?}")),
            Err(e) => return Err(format!("the launcher: {e}")),
        }
    };
    let pods = ctx.config.pods_dir.clone();
    let sockets = crate::launcher::socket_path(&pods, pod_uid)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let mount = mount.to_path_buf();
    // The files are the tenant's to fill: no more is moved than the machine can need — its
    // memory (plus the seal) and a state far larger than any machine's.
    let guest = api::validation::guest_memory(&vmi.spec)
        .and_then(Result::ok)
        .unwrap_or(0);
    let limits = [MAX_STATE_BYTES, guest + (1 << 20)];
    let moved = tokio::task::spawn_blocking(move || {
        let files = LAUNCHER_STATE_FILES.iter().zip(MACHINE_STATE_FILES);
        for ((from, to), limit) in files.zip(limits) {
            move_file(&pods, &sockets.join(from), &mount, &mount.join(to), limit)?;
        }
        Ok::<_, String>(())
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r);
    if let Err(why) = moved {
        // Not captured: the guest goes on.
        let _ = launcher.call(&Request::Resume).await;
        return Err(why);
    }
    Ok(report.memory_bytes)
}

/// The most a machine's state file (vCPUs and devices, without memory) is taken to be.
const MAX_STATE_BYTES: u64 = 64 << 20;

/// Copies `from` (below `from_root`, at most `limit` bytes) to `to` (below `to_root`), then
/// removes `from`. Both must be regular files: a FIFO the tenant left there would block the
/// node agent (opened non-blocking, then refused).
fn move_file(
    from_root: &Path,
    from: &Path,
    to_root: &Path,
    to: &Path,
    limit: u64,
) -> Result<(), String> {
    let open = |root: &Path, p: &Path, flags: i32| {
        let f = open_beneath(root, p, flags | libc::O_NONBLOCK, 0o644)
            .map(File::from)
            .map_err(|e| format!("{}: {e}", p.display()))?;
        let meta = f.metadata().map_err(|e| format!("{}: {e}", p.display()))?;
        if !meta.file_type().is_file() {
            return Err(format!("{}: not a regular file; refused", p.display()));
        }
        Ok(f)
    };
    let src = open(from_root, from, libc::O_RDONLY | libc::O_NOFOLLOW)?;
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_NOFOLLOW;
    let mut dst = open(to_root, to, flags)?;
    use std::io::Read;
    let copied = std::io::copy(&mut src.take(limit + 1), &mut dst)
        .map_err(|e| format!("copying into {}: {e}", to.display()))?;
    if copied > limit {
        return Err(format!(
            "{}: larger than the {limit} bytes this machine's state can take; refused",
            from.display()
        ));
    }
    dst.sync_all()
        .map_err(|e| format!("{}: {e}", to.display()))?;
    let _ = std::fs::remove_file(from);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::snapshot::ANNOTATION_CAPTURE_STATE;

    fn vmi(asked: Option<&str>) -> VirtualMachineInstance {
        let mut v = VirtualMachineInstance::new("vm", Default::default());
        if let Some(claim) = asked {
            v.metadata.annotations =
                Some([(ANNOTATION_CAPTURE_STATE.to_string(), claim.to_string())].into());
        }
        v
    }

    fn reported(claim: &str, ok: bool) -> VirtualMachineInstanceStatus {
        let mut s = VirtualMachineInstanceStatus::default();
        let m = api::snapshot::capture_report(claim, "done");
        set_condition(
            &mut s.conditions,
            CONDITION_STATE_CAPTURED,
            ok,
            None,
            Some(m),
        );
        s
    }

    /// What the tenant can leave in its directories — a link, a FIFO, an oversized file — is
    /// refused before the node agent follows, blocks on or copies it; a plain file moves.
    #[test]
    fn only_plain_files_within_their_limit_are_moved() {
        let root = std::env::temp_dir().join(format!("mv-move-file-{}", std::process::id()));
        let (pod, claim) = (root.join("pod"), root.join("claim"));
        std::fs::create_dir_all(&pod).unwrap();
        std::fs::create_dir_all(&claim).unwrap();
        let moved = |name: &str, limit: u64| {
            move_file(&pod, &pod.join(name), &claim, &claim.join("out"), limit)
        };
        std::fs::write(pod.join("plain"), b"state").unwrap();
        moved("plain", 5).unwrap();
        assert_eq!(std::fs::read(claim.join("out")).unwrap(), b"state");
        assert!(!pod.join("plain").exists(), "moved, not copied");

        std::fs::write(pod.join("big"), b"too big").unwrap();
        let e = moved("big", 3).unwrap_err();
        assert!(e.contains("larger than the 3 bytes"), "{e}");

        std::os::unix::fs::symlink("/etc/hostname", pod.join("link")).unwrap();
        let e = moved("link", 1 << 20).unwrap_err();
        assert!(e.contains("refused"), "{e}");

        let fifo = std::ffi::CString::new(pod.join("fifo").to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = moved("fifo", 1 << 20).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");

        // A link planted where the file goes in the claim is not written through.
        std::fs::write(pod.join("plain"), b"state").unwrap();
        let victim = root.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::fs::remove_file(claim.join("out")).unwrap();
        std::os::unix::fs::symlink(&victim, claim.join("out")).unwrap();
        assert!(moved("plain", 5).is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_capture_is_done_once_per_claim_and_undone_when_the_request_goes() {
        let none = VirtualMachineInstanceStatus::default();
        assert_eq!(capture_of(&vmi(None), &none), Capture::None);
        assert_eq!(capture_of(&vmi(Some("a")), &none), Capture::Wanted("a"));
        assert_eq!(
            capture_of(&vmi(Some("a")), &reported("a", true)),
            Capture::Reported
        );
        assert_eq!(
            capture_of(&vmi(Some("a")), &reported("a", false)),
            Capture::Reported
        );
        // A condition left from another claim's capture does not count for this one.
        assert_eq!(
            capture_of(&vmi(Some("ab")), &reported("a", true)),
            Capture::Wanted("ab")
        );
        assert_eq!(
            capture_of(&vmi(None), &reported("a", true)),
            Capture::Over {
                paused_by_capture: true
            }
        );
        assert_eq!(
            capture_of(&vmi(None), &reported("a", false)),
            Capture::Over {
                paused_by_capture: false
            }
        );
    }
}
