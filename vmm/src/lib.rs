//! microvirt's virtual machine monitor: KVM, guest memory, vCPUs, boot, legacy devices.
//!
//! One plain [`VmConfig`] goes in, [`Vm::build`] turns it into a running VM, and
//! [`Vm::wait`] reports how it ended as a [`VmEnd`].

pub mod arch;
pub mod boot;
pub mod bus;
pub mod config;
pub mod devices;
pub mod kvm;
pub mod layout;
pub mod vcpu;
pub mod vm;

pub use config::{ConfigError, SerialConfig, SerialInput, SerialOutput, VmConfig};
pub use kvm::{KvmAcceleration, KvmContext, KvmError};
pub use vm::{Vm, VmEnd, VmEndSignal, VmError, VmInfo};
