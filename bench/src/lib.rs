//! What the benchmark binaries share: medians and the release launcher they measure.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Result};

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Builds `virt-launcher` in release mode and returns its path.
pub fn launcher_path() -> Result<PathBuf> {
    let status = Command::new(env!("CARGO"))
        .args(["build", "--release", "--quiet", "-p", "launcher"])
        .current_dir(tests::repo_root())
        .status()?;
    if !status.success() {
        bail!("building virt-launcher failed");
    }
    Ok(tests::repo_root().join("target/release/virt-launcher"))
}

/// The Firecracker anchor: $FIRECRACKER, or the one in `../shared/anchors/`.
pub fn firecracker_path() -> PathBuf {
    std::env::var_os("FIRECRACKER")
        .map(PathBuf::from)
        .unwrap_or_else(|| tests::repo_root().join("../shared/anchors/firecracker"))
}

pub fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn wait_for_path(p: &std::path::Path) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !p.exists() {
        if std::time::Instant::now() > deadline {
            bail!("{} never appeared", p.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    Ok(())
}

pub fn kill(mut c: std::process::Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// The Linux guest every VMM in a benchmark boots: the same kernel and command line.
pub struct Guest {
    pub kernel: PathBuf,
    pub cmdline: String,
}

/// The Linux guest built for this host (the emulated-KVM profile and its command-line flags
/// where KVM is software-emulated); also the profile's name and whether KVM is emulated.
pub fn linux_guest() -> Result<(Guest, &'static str, bool)> {
    let emulated = vmm::KvmContext::open()?.acceleration.is_software_emulated();
    let profile = if emulated {
        "emulated-kvm"
    } else {
        "production"
    };
    let kernel = tests::build_guest_image(&["linux", profile]).remove(0);
    let mut cmdline = "console=ttyS0 reboot=k panic=-1".to_string();
    if emulated {
        let extra = std::fs::read_to_string(
            tests::repo_root().join("guest-images/linux/profiles/emulated-kvm.cmdline"),
        )?;
        cmdline = format!("{cmdline} {}", extra.trim());
    }
    Ok((Guest { kernel, cmdline }, profile, emulated))
}
