//! Opening /dev/kvm and checking that it can run our VMs.

use std::path::Path;

use kvm_ioctls::{Cap, Kvm};

/// The KVM API version every kernel since 2.6.22 reports; anything else is not a KVM we know.
pub const KVM_API_VERSION: i32 = 12;

/// Capabilities the VMM relies on, with why, so a missing one can be explained.
pub const REQUIRED_CAPS: &[(Cap, &str)] = &[
    (Cap::Irqchip, "in-kernel IOAPIC/PIC/LAPIC"),
    (Cap::UserMemory, "guest memory from user space"),
    (Cap::SetTssAddr, "real-mode TSS placement"),
    (Cap::SetIdentityMapAddr, "EPT identity map placement"),
    (Cap::Pit2, "in-kernel PIT"),
    (Cap::PitState2, "PIT state save/restore"),
    (Cap::Irqfd, "interrupts from device eventfds"),
    (Cap::Ioeventfd, "device notifications without vCPU exits"),
    (Cap::ExtCpuid, "KVM_GET_SUPPORTED_CPUID"),
    (Cap::ImmediateExit, "pausing vCPUs without races"),
    (Cap::AdjustClock, "guest clock across pause and migration"),
];

#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    #[error("/dev/kvm does not exist: this host has no KVM (load kvm_intel or kvm_amd, or run on a node with virtualization enabled)")]
    NoDevice,
    #[error("/dev/kvm: permission denied (run as root or add this user to the kvm group)")]
    PermissionDenied,
    #[error("/dev/kvm: cannot open: {0}")]
    Open(std::io::Error),
    #[error("/dev/kvm reports API version {0}, only version {KVM_API_VERSION} is supported")]
    ApiVersion(i32),
    #[error("/dev/kvm lacks capability {cap:?} ({why})")]
    MissingCap { cap: Cap, why: &'static str },
}

/// How the host's KVM executes guest code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvmAcceleration {
    /// VT-x or AMD-V backs KVM: guest code runs at native speed.
    Hardware,
    /// KVM is present but the host CPU has neither vmx nor svm (e.g. a paravirtual or nested
    /// backend such as kvm_pvm): guest code runs orders of magnitude slower.
    SoftwareEmulated { backend: String },
}

impl KvmAcceleration {
    pub fn is_software_emulated(&self) -> bool {
        matches!(self, KvmAcceleration::SoftwareEmulated { .. })
    }
}

pub struct KvmContext {
    pub kvm: Kvm,
    pub max_vcpus: usize,
    pub acceleration: KvmAcceleration,
}

impl KvmContext {
    pub fn open() -> Result<Self, KvmError> {
        let kvm = Kvm::new().map_err(|e| match e.errno() {
            libc::ENOENT => KvmError::NoDevice,
            libc::EACCES | libc::EPERM => KvmError::PermissionDenied,
            _ => KvmError::Open(std::io::Error::from_raw_os_error(e.errno())),
        })?;
        let version = kvm.get_api_version();
        if version != KVM_API_VERSION {
            return Err(KvmError::ApiVersion(version));
        }
        for (cap, why) in REQUIRED_CAPS {
            if !kvm.check_extension(*cap) {
                return Err(KvmError::MissingCap { cap: *cap, why });
            }
        }
        let max_vcpus = kvm.get_max_vcpus();
        let acceleration = detect_acceleration(
            &std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default(),
            Path::new("/sys/module"),
        );
        if let KvmAcceleration::SoftwareEmulated { backend } = &acceleration {
            tracing::warn!(
                backend = %backend,
                "KVM is software-emulated on this host (no vmx/svm): guests run ~1000x slower than on hardware KVM"
            );
        }
        Ok(KvmContext {
            kvm,
            max_vcpus,
            acceleration,
        })
    }
}

/// Decides how KVM is backed from the host CPU flags and the loaded modules. Hardware KVM needs
/// the vmx (Intel) or svm (AMD) flag on the host CPU; a kernel that offers /dev/kvm without
/// them emulates guest execution.
pub fn detect_acceleration(cpuinfo: &str, sys_module: &Path) -> KvmAcceleration {
    let has_hw_flag = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    if has_hw_flag {
        return KvmAcceleration::Hardware;
    }
    let backend = ["kvm_intel", "kvm_amd", "kvm_pvm"]
        .iter()
        .find(|m| sys_module.join(m).exists())
        .map_or_else(|| "unknown".to_string(), |m| m.to_string());
    KvmAcceleration::SoftwareEmulated { backend }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmx_flag_means_hardware() {
        let info = "processor: 0\nflags\t\t: fpu vme vmx sse\n";
        assert_eq!(
            detect_acceleration(info, Path::new("/nonexistent")),
            KvmAcceleration::Hardware
        );
        let info = "flags\t\t: fpu svm\n";
        assert_eq!(
            detect_acceleration(info, Path::new("/nonexistent")),
            KvmAcceleration::Hardware
        );
    }

    #[test]
    fn no_flag_means_software_emulated() {
        let info = "flags\t\t: fpu vme sse hypervisor\n";
        let dir = std::env::temp_dir().join(format!("mv-kvm-detect-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("kvm_pvm")).unwrap();
        assert_eq!(
            detect_acceleration(info, &dir),
            KvmAcceleration::SoftwareEmulated {
                backend: "kvm_pvm".into()
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
