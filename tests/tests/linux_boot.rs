//! The real Linux kernel on our VMM: one bounded boot to `Run /init as init process`, with the
//! e820 map it prints checked against the configuration.
//!
//! On a software-emulated KVM host this takes ~5 minutes and uses the `emulated-kvm` kernel
//! profile plus its command line (ENVIRONMENT.md); on hardware KVM the production kernel.

use std::time::Duration;

use tests::*;
use vmm::layout::{e820_map, E820Kind, MIB};
use vmm::{Vm, VmConfig};

fn linux_profile() -> (&'static str, String) {
    let kvm = vmm::KvmContext::open().expect("opening /dev/kvm");
    if kvm.acceleration.is_software_emulated() {
        let extra = std::fs::read_to_string(
            repo_root().join("guest-images/linux/profiles/emulated-kvm.cmdline"),
        )
        .unwrap();
        ("emulated-kvm", extra.trim().to_string())
    } else {
        ("production", String::new())
    }
}

/// The line Linux prints for each e820 entry it was given.
fn e820_line(addr: u64, size: u64, kind: E820Kind) -> String {
    let t = match kind {
        E820Kind::Ram => "usable",
        E820Kind::Reserved => "reserved",
    };
    format!(
        "BIOS-e820: [mem {:#018x}-{:#018x}] {t}",
        addr,
        addr + size - 1
    )
}

#[test]
fn linux_boots_to_init_with_our_e820_map() {
    require_kvm();
    let (profile, extra) = linux_profile();
    let images = build_guest_image(&["linux", profile]);
    let (vmlinux, initramfs) = (&images[0], &images[1]);
    let memory_mib = 256;
    let console = Console::default();
    let mut cfg = VmConfig::new(vmlinux);
    cfg.initrd = Some(initramfs.clone());
    cfg.memory_mib = memory_mib;
    cfg.vcpus = 1;
    cfg.cmdline = format!("console=ttyS0 reboot=k panic=-1 {extra}");
    cfg.serial.output = console.output();
    let vm = Vm::build(&cfg).expect("building the VM");
    let reached = console.wait_for("Run /init as init process", Duration::from_secs(12 * 60));
    let ended = vm.end_signal().get();
    vm.stop();
    let _ = vm.wait();
    let log = console.text();
    let log_path = std::env::temp_dir().join("microvirt-linux-boot.log");
    std::fs::write(&log_path, &log).unwrap();
    assert!(
        reached,
        "no `Run /init` within 12 minutes (VM end: {ended:?}); console in {}:\n{log}",
        log_path.display()
    );
    assert!(log.contains("Linux version 6.1"), "{log}");
    let printed: Vec<&str> = log
        .lines()
        .filter_map(|l| l.find("BIOS-e820: ").map(|i| l[i..].trim_end()))
        .collect();
    let expected: Vec<String> = e820_map(memory_mib * MIB)
        .iter()
        .map(|e| e820_line(e.addr, e.size, e.kind))
        .collect();
    assert_eq!(
        printed, expected,
        "e820 map printed by Linux differs from the configured one"
    );
    assert!(
        log.contains("Unpacking initramfs") || log.contains("Trying to unpack rootfs"),
        "initramfs not seen:\n{log}"
    );
}
