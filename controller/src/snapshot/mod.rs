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
