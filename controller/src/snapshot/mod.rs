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
use api::Condition;
use controller_runtime::set_condition;
use kube::api::{ApiResource, GroupVersionKind};

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
