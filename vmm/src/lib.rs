//! microvirt's virtual machine monitor: KVM, guest memory, vCPUs, boot, legacy devices.
//!
//! One plain [`VmConfig`] goes in, [`Vm::build`] turns it into a running VM, and
//! [`Vm::wait`] reports how it ended as a [`VmEnd`].

pub mod arch;
pub mod boot;
pub mod builder;
pub mod bus;
pub mod config;
pub mod devices;
pub mod end;
pub mod kvm;
pub mod layout;
pub mod memory;
pub mod migration;
pub mod persist;
pub mod privileges;
pub mod seccomp;
pub mod vcpu;
pub mod vm;

pub use config::{ConfigError, SerialConfig, SerialInput, SerialOutput, VmConfig};
pub use kvm::{KvmAcceleration, KvmContext, KvmError};
pub use persist::SnapshotPaths;
pub use vm::{
    ShutdownRequest, SnapshotProgress, SnapshotStats, Vm, VmEnd, VmEndSignal, VmError, VmInfo,
};
