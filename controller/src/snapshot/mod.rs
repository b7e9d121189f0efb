//! KubeVirt's VM snapshots and restores (`snapshot.kubevirt.io/v1beta1`), as KubeVirt's snapshot
//! controller carries them out:
//! - `capture`: a VirtualMachineSnapshot becomes a VirtualMachineSnapshotContent holding the VM
//!   as it was and one CSI VolumeSnapshot (`snapshot.storage.k8s.io/v1`) per claim; it is
//!   ready when the storage's snapshotter has made every VolumeSnapshot ready.
//! - `restore`: a VirtualMachineRestore makes a claim from each VolumeSnapshot and points the
//!   target VM (the snapshot's own, or a new one) at them.
//! - `clone`: a VirtualMachineClone (`clone.kubevirt.io/v1beta1`) is a snapshot of its source VM
//!   (or a given snapshot) restored into a new VM with its own identity.
//!
//! Bad input ends the object `Failed` (snapshot) or with a `Failure` condition (restore), the
//! reason on its conditions; neither ever changes the source VM or its claims when it fails:
//! every check runs before the first write.

pub mod capture;
pub mod clone;
pub mod restore;

use api::snapshot::SnapshotError;
use api::{Condition, VirtualMachine};
use controller_runtime::set_condition;
use kube::api::{Api, ApiResource, GroupVersionKind, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;

use crate::context::Result;

/// The machine-state claim `content` names, if any; it must be the one its snapshot's capture
/// makes, so an edited content cannot point a VM at another claim.
pub fn named_state_claim(
    snapshot: &api::snapshot::VirtualMachineSnapshot,
    content: &api::snapshot::VirtualMachineSnapshotContent,
) -> std::result::Result<Option<String>, String> {
    let Some(named) = content
        .annotations()
        .get(api::snapshot::ANNOTATION_STATE_CLAIM)
    else {
        return Ok(None);
    };
    let expected = api::snapshot::state_claim_name(&snapshot.uid().unwrap_or_default());
    if *named != expected {
        return Err(format!(
            "VirtualMachineSnapshotContent {:?}: metadata.annotations[{}] names claim {named:?}, \
             not its snapshot's machine-state claim {expected:?}",
            content.name_any(),
            api::snapshot::ANNOTATION_STATE_CLAIM
        ));
    }
    Ok(Some(expected))
}

/// Whether claim `name` in `ns` exists and is bound.
pub async fn claim_bound(client: &kube::Client, ns: &str, name: &str) -> Result<bool> {
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(client.clone(), ns);
    let claim = claims.get_opt(name).await?;
    Ok(claim
        .and_then(|c| c.status)
        .and_then(|s| s.phase)
        .is_some_and(|p| p == "Bound"))
}

/// Whether a snapshot is a clone's own (the temporary one a clone of a VM takes, deleted when
/// the clone is done): nothing may start from it later.
pub fn is_clone_temporary(snapshot: &api::snapshot::VirtualMachineSnapshot) -> bool {
    snapshot
        .owner_references()
        .iter()
        .any(|o| o.kind == "VirtualMachineClone")
}

/// The machine-state claim of VirtualMachineSnapshot `name` in `ns`, or why a VM cannot start
/// from it (missing, not ready, holding disks only, its claim gone).
pub async fn state_claim_of(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<std::result::Result<String, String>> {
    use api::snapshot::{VirtualMachineSnapshot, VirtualMachineSnapshotContent};
    let field = format!(
        "metadata.annotations[{}]",
        api::snapshot::ANNOTATION_START_FROM_SNAPSHOT
    );
    let snapshots: Api<VirtualMachineSnapshot> = Api::namespaced(client.clone(), ns);
    let Some(snapshot) = snapshots.get_opt(name).await? else {
        return Ok(Err(format!(
            "{field}: VirtualMachineSnapshot {name:?} does not exist (remove the annotation to \
             boot instead)"
        )));
    };
    let status = snapshot.status.clone().unwrap_or_default();
    if status.ready_to_use != Some(true) {
        return Ok(Err(format!(
            "{field}: VirtualMachineSnapshot {name:?} is not ready to use yet"
        )));
    }
    let contents: Api<VirtualMachineSnapshotContent> = Api::namespaced(client.clone(), ns);
    let content_name = status
        .virtual_machine_snapshot_content_name
        .unwrap_or_default();
    let Some(content) = contents.get_opt(&content_name).await? else {
        return Ok(Err(format!(
            "{field}: the content {content_name:?} of VirtualMachineSnapshot {name:?} does not \
             exist"
        )));
    };
    let claim = match named_state_claim(&snapshot, &content) {
        Ok(Some(c)) => c,
        Ok(None) => {
            return Ok(Err(format!(
                "{field}: VirtualMachineSnapshot {name:?} holds no machine state (it was taken \
                 of a stopped VM, or without the cluster's vmStateStorageClass); only disks can \
                 be restored from it"
            )))
        }
        Err(why) => return Ok(Err(format!("{field}: {why}"))),
    };
    if !claim_bound(client, ns, &claim).await? {
        return Ok(Err(format!(
            "{field}: the machine-state claim {claim:?} of VirtualMachineSnapshot {name:?} is \
             missing or not bound"
        )));
    }
    Ok(Ok(claim))
}

/// KubeVirt's locks on a VM while a snapshot reads it or a restore writes it (its
/// `status.snapshotInProgress` / `status.restoreInProgress`, naming the holder). The VM
/// controller starts no VMI while either is held.
#[derive(Clone, Copy, Debug)]
pub enum Lock {
    Snapshot,
    Restore,
}

impl Lock {
    fn field(self) -> &'static str {
        match self {
            Lock::Snapshot => "snapshotInProgress",
            Lock::Restore => "restoreInProgress",
        }
    }

    /// Who holds this lock on `vm`, if anyone.
    pub fn holder(self, vm: &VirtualMachine) -> Option<&str> {
        let s = vm.status.as_ref()?;
        match self {
            Lock::Snapshot => s.snapshot_in_progress.as_deref(),
            Lock::Restore => s.restore_in_progress.as_deref(),
        }
    }

    /// Takes the lock on `vm` for `holder`.
    pub async fn take(self, vms: &Api<VirtualMachine>, vm: &str, holder: &str) -> Result<()> {
        let p = json!({"status": {self.field(): holder}});
        vms.patch_status(vm, &PatchParams::default(), &Patch::Merge(&p))
            .await?;
        Ok(())
    }

    /// Lets go of the lock on `vm` if `holder` has it (a VM that is gone holds nothing).
    pub async fn release(self, vms: &Api<VirtualMachine>, vm: &str, holder: &str) -> Result<()> {
        let Some(current) = vms.get_opt(vm).await? else {
            return Ok(());
        };
        if self.holder(&current) != Some(holder) {
            return Ok(());
        }
        let p = json!({"status": {self.field(): null}});
        match vms
            .patch_status(vm, &PatchParams::default(), &Patch::Merge(&p))
            .await
        {
            Err(e) if !controller_runtime::is_not_found(&e) => Err(e.into()),
            _ => Ok(()),
        }
    }
}

/// Adds (`present`) or removes `finalizer` on `obj`, if it is not so already; true if it wrote
/// (the pass then ends: the write wakes the next one).
pub async fn protect<K>(api: &Api<K>, obj: &K, finalizer: &str, present: bool) -> Result<bool>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if controller_runtime::has_finalizer(obj, finalizer) == present {
        return Ok(false);
    }
    let p = controller_runtime::finalizer_patch(obj, finalizer, present);
    match api
        .patch(&obj.name_any(), &PatchParams::default(), &Patch::Merge(&p))
        .await
    {
        Err(e) if !controller_runtime::is_not_found(&e) => Err(e.into()),
        _ => Ok(true),
    }
}

/// The CSI VolumeSnapshotClasses (cluster-scoped; their `driver` is a provisioner's name).
pub fn volume_snapshot_classes() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", "VolumeSnapshotClass"),
        "volumesnapshotclasses",
    )
}

/// An error now, with its message.
fn error(message: &str) -> SnapshotError {
    SnapshotError {
        time: Some(controller_runtime::time::now_rfc3339()),
        message: Some(message.to_string()),
    }
}

/// KubeVirt's condition pair while work goes on (or waits, `progressing` false, for `reason`).
fn set_progress(conditions: &mut Vec<Condition>, progressing: bool, reason: &str, message: &str) {
    set_condition(
        conditions,
        "Progressing",
        progressing,
        Some(reason),
        Some(message.into()),
    );
    set_condition(
        conditions,
        "Ready",
        false,
        Some(reason),
        Some(message.into()),
    );
}

/// KubeVirt's conditions once the work is done.
fn set_done(conditions: &mut Vec<Condition>) {
    let m = "Operation complete";
    set_condition(conditions, "Progressing", false, Some(m), Some(m.into()));
    set_condition(conditions, "Ready", true, Some(m), Some(m.into()));
}

/// KubeVirt's conditions after a failure: `Failure` true with the reason.
fn set_failed(conditions: &mut Vec<Condition>, message: &str) {
    set_condition(
        conditions,
        "Progressing",
        false,
        Some("Failed"),
        Some(message.into()),
    );
    set_condition(
        conditions,
        "Ready",
        false,
        Some("Failed"),
        Some(message.into()),
    );
    set_condition(
        conditions,
        "Failure",
        true,
        Some("Failed"),
        Some(message.into()),
    );
}
