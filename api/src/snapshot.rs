//! KubeVirt's `snapshot.kubevirt.io/v1beta1` VirtualMachineSnapshot, VirtualMachineSnapshotContent
//! and VirtualMachineRestore, with KubeVirt's field names, phases and conditions; the slice of
//! the CSI `snapshot.storage.k8s.io/v1` VolumeSnapshot they are made of; and the pure decisions
//! both virt-controller and the tests take from them: which volumes a snapshot captures, and
//! what each restored claim is named.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolumeClaimSpec, TypedLocalObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::types::{Condition, Extra, Volume};
use crate::{VirtualMachineSpec, VirtualMachineStatus};

/// The API group of the three kinds.
pub const GROUP: &str = "snapshot.kubevirt.io";
/// KubeVirt's default `failureDeadline` and restore grace period: five minutes.
pub const DEFAULT_DEADLINE_SECONDS: i64 = 300;

/// On every VolumeSnapshot a VirtualMachineSnapshot made: the VirtualMachineSnapshot's name.
pub const LABEL_SNAPSHOT: &str = "snapshot.kubevirt.io/source-vm-snapshot";
/// On a claim a restore made, and on the VM it restored: the VirtualMachineRestore's name.
pub const ANNOTATION_RESTORE_NAME: &str = "restore.kubevirt.io/name";
/// On a restored VM: the UID of the last VirtualMachineRestore applied to it (KubeVirt's).
pub const ANNOTATION_LAST_RESTORE: &str = "restore.kubevirt.io/lastRestoreUID";
/// KubeVirt's finalizers: a snapshot or restore being deleted first lets go of its VM.
pub const SNAPSHOT_FINALIZER: &str = "snapshot.kubevirt.io/vmsnapshot-protection";
pub const RESTORE_FINALIZER: &str = "snapshot.kubevirt.io/vmrestore-protection";
/// Annotations of the source VM not carried onto a VM a restore creates.
pub const NOT_CARRIED_ANNOTATIONS: &[&str] = &[
    "kubectl.kubernetes.io/last-applied-configuration",
    ANNOTATION_LAST_RESTORE,
    ANNOTATION_START_FROM_STATE,
    ANNOTATION_START_FROM_SNAPSHOT,
];

/// microvirt's extension to KubeVirt's snapshots, in one place: a VM's guest memory and machine
/// state, kept in a claim of its own (the cluster's `vmStateStorageClass`) as the launcher's
/// snapshot files ([`MACHINE_STATE_FILES`]).
///
/// On a VirtualMachineSnapshotContent, this annotation names that claim. An annotation, so a
/// KubeVirt client reading the content ignores it safely: KubeVirt's own restore boots the VM
/// from the captured disks, as it always does.
pub const ANNOTATION_STATE_CLAIM: &str = "snapshot.microvirt.io/machine-state-claim";
/// The one annotation a user writes to start VMs from a snapshot instead of booting them: the
/// name of a VirtualMachineSnapshot (in the same namespace) taken of a running VM, whose
/// machine state the VM resumes — memory mapped from the snapshot's one file, shared until
/// written, a new generation ID and the VM's own MACs announced to the guest.
/// - On a VirtualMachine (so also in a VirtualMachinePool's `spec.virtualMachineTemplate.metadata`):
///   taken once — the VM controller moves it onto the VMI it creates, since a later start
///   would resume memory older than the disks by then. A VirtualMachineRestore of a
///   running-state snapshot writes it onto the VM it restores (so do clones of a snapshot).
/// - On a VMI (so also in a VMI ReplicaSet's `spec.template.metadata`): that VMI resumes it.
///
/// virt-controller resolves it to the snapshot's machine-state claim
/// ([`ANNOTATION_START_FROM_STATE`] on the VMI) before the launcher Pod is made; a snapshot
/// that is missing, not ready or without a machine state leaves the VMI Pending with the
/// reason.
pub const ANNOTATION_START_FROM_SNAPSHOT: &str = "snapshot.microvirt.io/start-from-snapshot";
/// On a VMI: the claim holding the machine state it resumes (written by virt-controller from
/// [`ANNOTATION_START_FROM_SNAPSHOT`]); the launcher Pod mounts that claim read-only.
pub const ANNOTATION_START_FROM_STATE: &str = "snapshot.microvirt.io/start-from-state";
/// The two files of a machine state, as the launcher writes and reads them in its claim's
/// directory: the state (vCPUs, devices) and the guest's memory.
pub const MACHINE_STATE_FILES: [&str; 2] = ["state", "memory"];

/// The claim a snapshot's machine state is kept in.
pub fn state_claim_name(snapshot_uid: &str) -> String {
    format!("vmstate-{snapshot_uid}")
}

/// How a running VM's machine state gets into its claim, between virt-controller and
/// virt-handler (the way KubeVirt's memory dump reaches a claim):
/// 1. the controller makes the claim and an attachment Pod on the VMI's node that mounts it
///    (labelled [`LABEL_STATE_ATTACHMENT`]), and annotates the VMI
///    [`ANNOTATION_CAPTURE_STATE`] with the claim's name;
/// 2. virt-handler has the launcher save the machine, paused, into its sockets directory,
///    copies the files into the claim as the attachment Pod's volume shows it on the node, and
///    sets the VMI's [`CONDITION_STATE_CAPTURED`] (True, or False with the reason);
/// 3. the controller cuts the disks' VolumeSnapshots while the guest is still paused — so
///    disks and memory are of one instant — then takes the annotation off;
/// 4. virt-handler resumes the guest and drops the condition.
pub const ANNOTATION_CAPTURE_STATE: &str = "snapshot.microvirt.io/capture-machine-state";
/// On the content, once the machine state is in its claim: the capture is not asked again
/// (the guest resumed after the disks were cut, so a second one would not match them).
pub const ANNOTATION_STATE_CAPTURED: &str = "snapshot.microvirt.io/machine-state-captured";
/// The VMI condition virt-handler reports a capture with; its reason names the claim.
pub const CONDITION_STATE_CAPTURED: &str = "MachineStateCaptured";
/// On the attachment Pod that mounts a machine-state claim on the VMI's node: the claim.
pub const LABEL_STATE_ATTACHMENT: &str = "snapshot.microvirt.io/machine-state-claim";
/// The files the launcher saves a machine into, in its own sockets directory, before
/// virt-handler moves them into the claim ([`MACHINE_STATE_FILES`] there, in that order).
pub const LAUNCHER_STATE_FILES: [&str; 2] = ["machine-state.state", "machine-state.memory"];

/// A [`CONDITION_STATE_CAPTURED`] message: the claim it reports on, then `detail`.
pub fn capture_report(claim: &str, detail: &str) -> String {
    format!("claim {claim:?}: {detail}")
}

/// Whether a [`CONDITION_STATE_CAPTURED`] message reports on `claim` (not on an earlier
/// capture's claim).
pub fn reports_on(message: &str, claim: &str) -> bool {
    message.starts_with(&format!("claim {claim:?}:"))
}

/// The attachment Pod of machine-state claim `claim`.
pub fn state_attachment_name(claim: &str) -> String {
    format!("{claim}-attach")
}

/// The claim the VMI is asked to capture its machine state into, if any.
pub fn capture_state(annotations: Option<&BTreeMap<String, String>>) -> Option<&str> {
    annotations?
        .get(ANNOTATION_CAPTURE_STATE)
        .map(String::as_str)
}

/// The snapshot `annotations` say the VM or VMI starts from, if any.
pub fn start_from_snapshot(annotations: Option<&BTreeMap<String, String>>) -> Option<&str> {
    annotations?
        .get(ANNOTATION_START_FROM_SNAPSHOT)
        .map(String::as_str)
}

/// The claim `annotations` say the VMI starts from, if any.
pub fn start_from_state(annotations: Option<&BTreeMap<String, String>>) -> Option<&str> {
    annotations?
        .get(ANNOTATION_START_FROM_STATE)
        .map(String::as_str)
}

/// Every entry of `spec.patches` a JSON patch.
pub fn check_patches(patches: &[String]) -> Result<(), String> {
    for (i, p) in patches.iter().enumerate() {
        parse_json_patch(p)
            .map_err(|e| format!("spec.patches[{i}]: not a JSON patch (RFC 6902): {e}"))?;
    }
    Ok(())
}

/// What a VirtualMachineSnapshot's spec says that can be judged alone (the admission webhook's
/// check): a VM as its source, a readable `failureDeadline`.
pub fn validate_snapshot(spec: &VirtualMachineSnapshotSpec) -> Result<(), String> {
    check_vm_reference(&spec.source, "spec.source")?;
    if let Some(d) = &spec.failure_deadline {
        if crate::duration::parse_duration(d).is_none() {
            return Err(format!(
                "spec.failureDeadline: {d:?} is not a duration (e.g. 5m, 1h30m)"
            ));
        }
    }
    Ok(())
}

/// What a VirtualMachineRestore's spec says that can be judged alone: a VM as its target, a
/// snapshot named, JSON patches, one override per volume.
pub fn validate_restore(spec: &VirtualMachineRestoreSpec) -> Result<(), String> {
    check_vm_reference(&spec.target, "spec.target")?;
    if spec.virtual_machine_snapshot_name.is_empty() {
        return Err("spec.virtualMachineSnapshotName: is required".into());
    }
    check_patches(&spec.patches)?;
    let mut seen = std::collections::BTreeSet::new();
    for (i, o) in spec.volume_restore_overrides.iter().enumerate() {
        if !seen.insert(o.volume_name.as_str()) {
            return Err(format!(
                "spec.volumeRestoreOverrides[{i}].volumeName: volume {:?} has another override",
                o.volume_name
            ));
        }
    }
    Ok(())
}

/// One entry of a restore's (or clone's) `patches`: a JSON patch (RFC 6902), either a list of
/// operations or, as KubeVirt's examples write it, one operation alone.
pub fn parse_json_patch(p: &str) -> Result<json_patch::Patch, serde_json::Error> {
    serde_json::from_str(p).or_else(|_| serde_json::from_str(&format!("[{p}]")))
}

// ---------------------------------------------------------------------------------------------
// VirtualMachineSnapshot

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "snapshot.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachineSnapshot",
    namespaced,
    shortname = "vmsnapshot",
    shortname = "vmsnapshots",
    status = "VirtualMachineSnapshotStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"SourceKind","type":"string","jsonPath":".spec.source.kind"}"#,
    printcolumn = r#"{"name":"SourceName","type":"string","jsonPath":".spec.source.name"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"ReadyToUse","type":"boolean","jsonPath":".status.readyToUse"}"#,
    printcolumn = r#"{"name":"CreationTime","type":"date","jsonPath":".status.creationTime"}"#,
    printcolumn = r#"{"name":"Error","type":"string","jsonPath":".status.error.message"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
/// A point-in-time copy of a VirtualMachine: its spec and its claims (as CSI VolumeSnapshots),
/// kept in a VirtualMachineSnapshotContent.
pub struct VirtualMachineSnapshotSpec {
    /// The VM (`apiGroup: kubevirt.io`, `kind: VirtualMachine`).
    pub source: TypedLocalObjectReference,
    /// `Delete` (default): the content goes with the snapshot; `Retain`: it stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_policy: Option<DeletionPolicy>,
    /// How long the snapshot may take (a duration such as `5m`, the default) before it fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_deadline: Option<String>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum DeletionPolicy {
    #[default]
    Delete,
    Retain,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum SnapshotPhase {
    InProgress,
    Succeeded,
    Failed,
    Deleting,
    Unknown,
}

/// What the snapshot knows of the VM's state when it was taken (KubeVirt's indications).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Indication {
    Online,
    NoGuestAgent,
    GuestAgent,
    QuiesceTimeout,
    Paused,
    PartialSnapshot,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct SourceIndication {
    pub indication: Indication,
    pub message: String,
}

/// The last error of a snapshot or restore.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotError {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotVolumesLists {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub included_volumes: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded_volumes: Vec<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineSnapshotStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_snapshot_content_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<SnapshotPhase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Deprecated in KubeVirt in favour of `sourceIndications`; still written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub indications: Vec<Indication>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_indications: Vec<SourceIndication>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_volumes: Option<SnapshotVolumesLists>,
}

// ---------------------------------------------------------------------------------------------
// VirtualMachineSnapshotContent

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "snapshot.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachineSnapshotContent",
    namespaced,
    shortname = "vmsnapshotcontent",
    shortname = "vmsnapshotcontents",
    status = "VirtualMachineSnapshotContentStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"ReadyToUse","type":"boolean","jsonPath":".status.readyToUse"}"#,
    printcolumn = r#"{"name":"CreationTime","type":"date","jsonPath":".status.creationTime"}"#,
    printcolumn = r#"{"name":"Error","type":"string","jsonPath":".status.error.message"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
/// What a snapshot holds: the VM as it was, and one backup per captured volume.
pub struct VirtualMachineSnapshotContentSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_snapshot_name: Option<String>,
    pub source: SnapshotSource,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_backups: Vec<VolumeBackup>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine: Option<SnapshottedVm>,
}

/// The VM as it was when the snapshot was taken.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshottedVm {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: VirtualMachineSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VirtualMachineStatus>,
}

/// A captured claim: the claim as it was (to make its copy from) and its VolumeSnapshot.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeBackup {
    pub volume_name: String,
    pub persistent_volume_claim: BackedUpClaim,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_name: Option<String>,
    /// microvirt's, where the claim's storage has no VolumeSnapshotClass: the DataVolume (and
    /// claim, of the same name) holding a full copy of the volume made while the VM was
    /// stopped. `volumeSnapshotName` is then empty, so KubeVirt's own restore refuses the
    /// backup instead of misreading it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_claim_name: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BackedUpClaim {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PersistentVolumeClaimSpec,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineSnapshotContentStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_snapshot_status: Vec<VolumeSnapshotStatus>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotStatus {
    pub volume_snapshot_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
}

// ---------------------------------------------------------------------------------------------
// VirtualMachineRestore

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "snapshot.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachineRestore",
    namespaced,
    shortname = "vmrestore",
    shortname = "vmrestores",
    status = "VirtualMachineRestoreStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"TargetKind","type":"string","jsonPath":".spec.target.kind"}"#,
    printcolumn = r#"{"name":"TargetName","type":"string","jsonPath":".spec.target.name"}"#,
    printcolumn = r#"{"name":"Complete","type":"boolean","jsonPath":".status.complete"}"#,
    printcolumn = r#"{"name":"RestoreTime","type":"date","jsonPath":".status.restoreTime"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
/// Puts a snapshot back: onto the VM it was taken of, or into a new VM (created if absent).
pub struct VirtualMachineRestoreSpec {
    /// The VM to restore (`apiGroup: kubevirt.io`, `kind: VirtualMachine`).
    pub target: TypedLocalObjectReference,
    pub virtual_machine_snapshot_name: String,
    /// What to do while the target runs (default `WaitGracePeriod`: five minutes, then fail).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_readiness_policy: Option<TargetReadinessPolicy>,
    /// How restored claims are named (default `RandomizeNames`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_restore_policy: Option<VolumeRestorePolicy>,
    /// Who owns the restored claims (default `Vm`: they go with the target VM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_ownership_policy: Option<VolumeOwnershipPolicy>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_restore_overrides: Vec<VolumeRestoreOverride>,
    /// JSON patches (RFC 6902, one per string) applied to a target VM the restore creates.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patches: Vec<String>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum TargetReadinessPolicy {
    StopTarget,
    #[default]
    WaitGracePeriod,
    FailImmediate,
    WaitEventually,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum VolumeRestorePolicy {
    #[default]
    RandomizeNames,
    InPlace,
    PrefixTargetName,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum VolumeOwnershipPolicy {
    #[default]
    Vm,
    None,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRestoreOverride {
    #[serde(default)]
    pub volume_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub restore_name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineRestoreStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restores: Vec<VolumeRestore>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_time: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deleted_data_volumes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub complete: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRestore {
    pub volume_name: String,
    #[serde(rename = "persistentVolumeClaim")]
    pub persistent_volume_claim_name: String,
    pub volume_snapshot_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_volume_name: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// CSI VolumeSnapshot (snapshot.storage.k8s.io/v1): the fields KubeVirt's snapshots use. Its CRD
// is the external-snapshotter's, not microvirt's (see `crds`).

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "snapshot.storage.k8s.io",
    version = "v1",
    kind = "VolumeSnapshot",
    namespaced,
    status = "CsiVolumeSnapshotStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSpec {
    pub source: VolumeSnapshotSource,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_class_name: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSnapshotSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot_content_name: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CsiVolumeSnapshotStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_volume_snapshot_content_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_to_use: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_size: Option<k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<SnapshotError>,
}

// ---------------------------------------------------------------------------------------------
// Decisions

/// What a snapshot does with one of the VM's volumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeCapture {
    /// A claim (a `persistentVolumeClaim` or `dataVolume` volume): captured as a VolumeSnapshot.
    Claim(String),
    /// Made anew from the VM's spec on every start (container disks, cloud-init, ConfigMaps,
    /// Secrets, empty disks, …): nothing to capture.
    FromSpec,
    /// Holds data the snapshot cannot capture: why.
    Uncapturable(String),
}

/// How a snapshot treats `v`.
pub fn capture_of(v: &Volume) -> VolumeCapture {
    if let Some(p) = &v.persistent_volume_claim {
        VolumeCapture::Claim(p.claim_name.clone())
    } else if let Some(d) = &v.data_volume {
        VolumeCapture::Claim(d.name.clone())
    } else if v.host_disk.is_some() {
        VolumeCapture::Uncapturable(
            "a hostDisk is a file on one node's filesystem, outside any claim, and no \
             VolumeSnapshot can be taken of it; move it to a PersistentVolumeClaim"
                .into(),
        )
    } else {
        VolumeCapture::FromSpec
    }
}

/// The VolumeSnapshot of volume `volume` made for snapshot `snapshot_uid` (KubeVirt's naming).
pub fn volume_snapshot_name(snapshot_uid: &str, volume: &str) -> String {
    format!("vmsnapshot-{snapshot_uid}-volume-{volume}")
}

/// The content of snapshot `snapshot_uid` (KubeVirt's naming).
pub fn content_name(snapshot_uid: &str) -> String {
    format!("vmsnapshot-content-{snapshot_uid}")
}

/// The name of the claim restoring `volume` into VM `target` (the override's name, else as
/// the policy says; `original` is the claim the snapshot was taken of).
pub fn restored_claim_name(
    policy: VolumeRestorePolicy,
    restore_uid: &str,
    target: &str,
    volume: &str,
    original: &str,
    overrides: &[VolumeRestoreOverride],
) -> String {
    if let Some(o) = overrides
        .iter()
        .find(|o| o.volume_name == volume && !o.restore_name.is_empty())
    {
        return o.restore_name.clone();
    }
    match policy {
        VolumeRestorePolicy::RandomizeNames => format!("restore-{restore_uid}-{volume}"),
        VolumeRestorePolicy::PrefixTargetName => format!("{target}-{volume}"),
        VolumeRestorePolicy::InPlace => original.to_string(),
    }
}

/// Checks that `r` names a VirtualMachine: the field and why, if not.
pub fn check_vm_reference(r: &TypedLocalObjectReference, path: &str) -> Result<(), String> {
    if r.api_group.as_deref() != Some("kubevirt.io") {
        return Err(format!(
            "{path}.apiGroup: must be kubevirt.io (got {:?}); only VirtualMachines are snapshotted \
             and restored",
            r.api_group.as_deref().unwrap_or("")
        ));
    }
    if r.kind != "VirtualMachine" {
        return Err(format!(
            "{path}.kind: must be VirtualMachine (got {:?})",
            r.kind
        ));
    }
    if r.name.is_empty() {
        return Err(format!("{path}.name: is required"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volumes_are_captured_by_their_source() {
        let v: Volume = serde_json::from_value(
            serde_json::json!({"name": "d", "persistentVolumeClaim": {"claimName": "c"}}),
        )
        .unwrap();
        assert_eq!(capture_of(&v), VolumeCapture::Claim("c".into()));
        let v: Volume =
            serde_json::from_value(serde_json::json!({"name": "d", "dataVolume": {"name": "dv"}}))
                .unwrap();
        assert_eq!(capture_of(&v), VolumeCapture::Claim("dv".into()));
        let v: Volume = serde_json::from_value(
            serde_json::json!({"name": "d", "containerDisk": {"image": "x"}}),
        )
        .unwrap();
        assert_eq!(capture_of(&v), VolumeCapture::FromSpec);
        let v: Volume = serde_json::from_value(
            serde_json::json!({"name": "d", "hostDisk": {"path": "/x", "type": "Disk"}}),
        )
        .unwrap();
        assert!(matches!(capture_of(&v), VolumeCapture::Uncapturable(m) if m.contains("hostDisk")));
    }

    #[test]
    fn restored_claims_are_named_as_the_policy_says() {
        use VolumeRestorePolicy::*;
        let none: &[VolumeRestoreOverride] = &[];
        assert_eq!(
            restored_claim_name(RandomizeNames, "u1", "vm", "root", "orig", none),
            "restore-u1-root"
        );
        assert_eq!(
            restored_claim_name(PrefixTargetName, "u1", "vm", "root", "orig", none),
            "vm-root"
        );
        assert_eq!(
            restored_claim_name(InPlace, "u1", "vm", "root", "orig", none),
            "orig"
        );
        let o = [VolumeRestoreOverride {
            volume_name: "root".into(),
            restore_name: "mine".into(),
            ..Default::default()
        }];
        assert_eq!(
            restored_claim_name(RandomizeNames, "u1", "vm", "root", "orig", &o),
            "mine"
        );
    }

    #[test]
    fn references_must_name_a_virtual_machine() {
        let mut r = TypedLocalObjectReference {
            api_group: Some("kubevirt.io".into()),
            kind: "VirtualMachine".into(),
            name: "vm".into(),
        };
        assert!(check_vm_reference(&r, "spec.source").is_ok());
        r.kind = "Pod".into();
        let e = check_vm_reference(&r, "spec.source").unwrap_err();
        assert!(e.starts_with("spec.source.kind"), "{e}");
        r.kind = "VirtualMachine".into();
        r.api_group = None;
        assert!(check_vm_reference(&r, "spec.target")
            .unwrap_err()
            .starts_with("spec.target.apiGroup"));
    }

    #[test]
    fn kubevirt_objects_round_trip() {
        let restore: VirtualMachineRestore = serde_json::from_value(serde_json::json!({
            "apiVersion": "snapshot.kubevirt.io/v1beta1",
            "kind": "VirtualMachineRestore",
            "metadata": {"name": "r"},
            "spec": {
                "target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm"},
                "virtualMachineSnapshotName": "s",
                "volumeRestorePolicy": "InPlace",
                "somethingNewer": 1
            },
            "status": {"restores": [{"volumeName": "root", "persistentVolumeClaim": "c",
                                     "volumeSnapshotName": "vs"}]}
        }))
        .unwrap();
        assert_eq!(
            restore.spec.volume_restore_policy,
            Some(VolumeRestorePolicy::InPlace)
        );
        let back = serde_json::to_value(&restore).unwrap();
        assert_eq!(back["spec"]["somethingNewer"], 1);
        assert_eq!(back["status"]["restores"][0]["persistentVolumeClaim"], "c");
    }
}
