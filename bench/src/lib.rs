//! What the benchmark binaries share: medians and the release launcher they measure.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Result};

pub mod firecracker;

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

/// The probe guest, which `guest-images/build probe` makes.
pub fn probe_guest() -> Result<PathBuf> {
    let probe = tests::probe_path();
    if !probe.exists() {
        bail!(
            "{} is missing: run `guest-images/build probe`",
            probe.display()
        );
    }
    Ok(probe)
}

/// `virt-launcher snapshot --socket SOCK --to DIR --stop`: snapshots a running launcher and
/// stops its VM. Returns the command's stderr, where the launcher reports the pause time.
pub fn microvirt_snapshot(
    launcher: &std::path::Path,
    sock: &std::path::Path,
    to: &std::path::Path,
) -> Result<String> {
    let out = Command::new(launcher)
        .arg("snapshot")
        .arg("--socket")
        .arg(sock)
        .arg("--to")
        .arg(to)
        .arg("--stop")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("microvirt snapshot failed: {stderr}");
    }
    Ok(stderr)
}

/// What one line of `virt-launcher restore --boot-timer`'s stderr reports.
pub enum BootTimerLine {
    /// The host's memory-slot registration, nanoseconds.
    MemorySlots(u128),
    /// The first KVM_RUN, Unix nanoseconds.
    FirstRun(u128),
    Other,
}

pub fn boot_timer_line(line: &str) -> BootTimerLine {
    let number = |after: &str| line.split(after).nth(1).and_then(|n| n.trim().parse().ok());
    if let Some(ns) = number("memory slots ns=") {
        BootTimerLine::MemorySlots(ns)
    } else if let Some(ns) = number("first KVM_RUN unix_ns=") {
        BootTimerLine::FirstRun(ns)
    } else {
        BootTimerLine::Other
    }
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
