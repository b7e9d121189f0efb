//! virt-controller: reconciles VirtualMachines, VMIs, ReplicaSets and migrations into launcher
//! Pods (filled by the controller issue).
