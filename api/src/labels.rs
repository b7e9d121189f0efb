//! The label, annotation, finalizer and taint keys KubeVirt's components agree on. Every crate
//! that writes or selects on one of them takes it from here, so virt-controller, virt-handler
//! and the webhook cannot drift apart on a spelling.

/// On every launcher Pod: `kubevirt.io=virt-launcher` (what `kubectl get pods -l` selects on).
pub const APP: &str = "kubevirt.io";
/// The value of [`APP`] on launcher Pods.
pub const APP_LAUNCHER: &str = "virt-launcher";
/// On a launcher Pod and a VMI's PodDisruptionBudget: the UID of the VMI it serves.
pub const CREATED_BY: &str = "kubevirt.io/created-by";
/// On a VMI's launcher Pod: the name of the VM it came from.
pub const VM_NAME: &str = "vm.kubevirt.io/name";
/// On a migration's target Pod: the migration's UID.
pub const MIGRATION_JOB: &str = "kubevirt.io/migrationJobUID";
/// On a VMI: the node it runs on (virt-handler selects the VMIs of its node with it).
pub const NODE_NAME: &str = "kubevirt.io/nodeName";
/// On a VMI being migrated: the node it is migrating to.
pub const MIGRATION_TARGET_NODE: &str = "kubevirt.io/migrationTargetNodeName";

/// On a launcher Pod: the VMI's name (KubeVirt's `kubevirt.io/domain`).
pub const ANNOTATION_DOMAIN: &str = "kubevirt.io/domain";
/// On a migration the evacuation made: the node being drained.
pub const ANNOTATION_EVACUATION: &str = "kubevirt.io/evacuationMigration";

/// Held on a VM until its VMI is gone.
pub const VM_FINALIZER: &str = "kubevirt.io/virtualMachineControllerFinalize";
/// Held on a VMI until its Pods are gone.
pub const VMI_FINALIZER: &str = "kubevirt.io/foregroundDeleteVirtualMachine";
/// Held on a migration until it is final.
pub const MIGRATION_FINALIZER: &str = "kubevirt.io/migrationJobFinalize";

/// KubeVirt's default `migrations.nodeDrainTaintKey`: nodes with this taint are drained.
pub const DEFAULT_DRAIN_TAINT: &str = "kubevirt.io/drain";

/// `key=value`, the label selector matching one value of one label.
pub fn selector(key: &str, value: &str) -> String {
    format!("{key}={value}")
}
