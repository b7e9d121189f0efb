//! How a VM ends: a closed value, so a guest can never make the VMM hang or panic, and the
//! one-shot signal every thread reports an end through.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};

/// How a VM ended. Always a value: a guest can never make the VMM hang or panic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmEnd {
    /// The guest powered off (shutdown port or KVM system event).
    PoweredOff,
    /// The guest asked for a reset (i8042 0xFE, shutdown port or KVM system event).
    Reset,
    /// A vCPU triple-faulted (KVM_EXIT_SHUTDOWN).
    TripleFault { vcpu: u8 },
    /// KVM could not emulate something; `insn` holds the bytes at `rip` when readable.
    InternalError {
        vcpu: u8,
        suberror: u32,
        rip: u64,
        insn: Vec<u8>,
    },
    /// KVM could not enter the guest.
    EntryFailure { vcpu: u8, reason: u64, cpu: u32 },
    /// A vCPU halted with interrupts it can never receive.
    Halted { vcpu: u8 },
    /// The host stopped the VM.
    Stopped,
    /// The VM moved to another host (live migration completed); it runs there now.
    Migrated,
    /// The VMM hit an error running a vCPU.
    VcpuError { vcpu: u8, message: String },
}

impl fmt::Display for VmEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmEnd::PoweredOff => write!(f, "guest powered off"),
            VmEnd::Reset => write!(f, "guest requested a reset"),
            VmEnd::TripleFault { vcpu } => write!(f, "vCPU {vcpu} triple-faulted"),
            VmEnd::InternalError {
                vcpu,
                suberror,
                rip,
                insn,
            } => {
                write!(f, "KVM internal error on vCPU {vcpu} (suberror {suberror}")?;
                if *suberror == kvm_bindings::KVM_INTERNAL_ERROR_EMULATION {
                    write!(f, ": emulation failure")?;
                }
                write!(f, ") at rip {rip:#x}, instruction bytes [")?;
                for (i, b) in insn.iter().enumerate() {
                    write!(f, "{}{b:02x}", if i > 0 { " " } else { "" })?;
                }
                write!(f, "]")
            }
            VmEnd::EntryFailure { vcpu, reason, cpu } => {
                write!(f, "KVM failed to enter vCPU {vcpu} on host CPU {cpu} (hardware reason {reason:#x})")
            }
            VmEnd::Halted { vcpu } => write!(f, "vCPU {vcpu} halted for good"),
            VmEnd::Stopped => write!(f, "stopped by the host"),
            VmEnd::Migrated => write!(f, "migrated to another host"),
            VmEnd::VcpuError { vcpu, message } => write!(f, "vCPU {vcpu} failed: {message}"),
        }
    }
}

impl VmEnd {
    /// The launcher's exit status for this end (documented in the README).
    pub fn exit_code(&self) -> i32 {
        match self {
            VmEnd::PoweredOff | VmEnd::Stopped | VmEnd::Migrated => 0,
            VmEnd::Reset => 10,
            VmEnd::TripleFault { .. } => 11,
            VmEnd::InternalError { .. } => 12,
            VmEnd::EntryFailure { .. } | VmEnd::VcpuError { .. } => 13,
            VmEnd::Halted { .. } => 14,
        }
    }
}

/// The first end reported wins; later ones (other vCPUs winding down) are ignored.
#[derive(Clone, Default)]
pub struct VmEndSignal(Arc<(Mutex<Option<VmEnd>>, Condvar)>);

impl VmEndSignal {
    pub fn signal(&self, end: VmEnd) {
        let mut g = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            tracing::info!(%end, "VM ended");
            *g = Some(end);
            self.0 .1.notify_all();
        }
    }

    pub fn get(&self) -> Option<VmEnd> {
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn wait(&self) -> VmEnd {
        let mut g = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(e) = g.as_ref() {
                return e.clone();
            }
            g = self.0 .1.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub fn wait_timeout(&self, t: std::time::Duration) -> Option<VmEnd> {
        let g = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .0
             .1
            .wait_timeout_while(g, t, |e| e.is_none())
            .unwrap_or_else(|p| p.into_inner());
        g.clone()
    }
}
