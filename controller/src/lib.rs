//! virt-controller: reconciles VirtualMachines, VMIs, ReplicaSets and Migrations into launcher
//! Pods, with kube-runtime `Controller`s (one pure-ish `reconcile` + `error_policy` per kind),
//! leader election through a Lease, an admission webhook and Prometheus metrics.

pub mod caches;
pub mod cdi;
pub mod context;
pub mod crds;
pub mod datavolume;
pub mod disruption;
pub mod evacuation;
pub mod instancetype;
pub mod leader;
pub mod metrics;
pub mod migration;
pub mod pod;
pub mod pool;
pub mod replicas;
pub mod replicaset;
pub mod run;
pub mod snapshot;
pub mod vm;
pub mod vmi;
pub mod webhook;
