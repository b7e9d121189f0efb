//! The KubeVirt API as microvirt serves it: `kubevirt.io/v1` VirtualMachine,
//! VirtualMachineInstance, VirtualMachineInstanceReplicaSet, VirtualMachineInstanceMigration and
//! `migrations.kubevirt.io/v1alpha1` MigrationPolicy and `instancetype.kubevirt.io/v1beta1`
//! instance types and preferences, with KubeVirt's field names and meanings;
//! validation and defaulting (shared by the admission webhook and the launcher); quantities;
//! and the launcher's control protocol.
//!
//! Fields microvirt does not model are kept: the structs that users write carry a flattened
//! `extra` map, so a read-modify-write never drops what another tool put there.

pub mod cdi;
pub mod clone;
pub mod closed;
pub mod conditions;
pub mod duration;
pub mod fields;
pub mod instancetype;
pub mod kubevirt;
pub mod labels;
pub mod launcher_pod;
pub mod limits;
pub mod mac;
pub mod migratability;
pub mod ownership;
pub mod protocol;
pub mod quantity;
pub mod snapshot;
pub mod types;
pub mod validation;

pub use types::*;
