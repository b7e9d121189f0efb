//! virt-controller: reconciles VirtualMachines, VMIs, ReplicaSets and Migrations into launcher
//! Pods. This first part generates the CustomResourceDefinitions from the `api` types.

pub mod crds;
pub mod pod;
pub mod vm;
