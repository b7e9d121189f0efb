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

/// The two Linux boots run one after the other: on a 2-core machine two emulated guests plus
/// their VMM threads starve each other.
static ONE_LINUX_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A console silent this long means the guest stalled.
const STALL: Duration = Duration::from_secs(240);
const LIMIT: Duration = Duration::from_secs(12 * 60);

/// Boots the VM `make` describes until `needle` is on its console. Software-emulated KVM hosts
/// can lose a guest mid-boot: its console stops for good, or the VM ends early. (The one cause
/// found so far: FWAIT, which that KVM does not emulate, in `fpu__drop` whenever a task exits or
/// execs — timing-dependent, so it hit some runs before `Run /init`; the emulated-kvm profile
/// now patches it out.) A lost attempt is reported with how it ended (and every vCPU's RIP when
/// it stalled) and the boot is tried once more; two lost attempts fail the test. `at_needle`
/// gets the VM, still running, once `needle` appeared. Returns whether `needle` appeared, the
/// console of the last attempt, and the reports of lost attempts.
fn boot_to(
    make: &dyn Fn(&Console) -> VmConfig,
    needle: &str,
    at_needle: &mut dyn FnMut(&Vm),
) -> (bool, String, Vec<String>) {
    let mut lost = Vec::new();
    for attempt in 0..2 {
        let console = Console::default();
        let vm = Vm::build(&make(&console)).expect("building the VM");
        let start = std::time::Instant::now();
        let (mut last_len, mut last_change) = (0, std::time::Instant::now());
        let reached = loop {
            if console.text().contains(needle) {
                break true;
            }
            if vm.end_signal().get().is_some() || start.elapsed() > LIMIT {
                break false;
            }
            let len = console.len();
            if len != last_len {
                (last_len, last_change) = (len, std::time::Instant::now());
            } else if last_change.elapsed() > STALL {
                break false;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        if reached {
            at_needle(&vm);
        }
        let ended = vm.end_signal().get();
        let stuck_at = if reached || ended.is_some() {
            vec![]
        } else {
            vm.vcpu_rips()
        };
        vm.stop();
        let _ = vm.wait();
        let mut log = console.text();
        let elapsed = start.elapsed();
        if reached {
            return (true, log, lost);
        }
        let why = match &ended {
            Some(end) => format!("the VM ended after {elapsed:.0?}: {end}"),
            None if elapsed > LIMIT => format!("the limit of {LIMIT:?} passed"),
            None => format!("no console output for {STALL:?}; vCPU RIPs {stuck_at:x?}"),
        };
        log.push_str(&format!("\n[test] attempt {} lost: {why}\n", attempt + 1));
        eprintln!("linux guest attempt {} lost: {why}", attempt + 1);
        lost.push(log);
    }
    let last = lost.last().cloned().unwrap_or_default();
    (false, last, lost)
}

/// The initramfs as a plain cpio archive. Inflating the 1 MiB gzip image is the longest silent
/// stretch of an emulated boot (over 200 s with no console line, against a 240 s stall limit);
/// the kernel unpacks a plain archive the same way minus the inflation, and the archive's
/// contents are the same.
fn uncompressed(gz: &std::path::Path) -> std::path::PathBuf {
    let out = std::env::temp_dir().join(format!("microvirt-initramfs-{}.cpio", std::process::id()));
    let file = std::fs::File::create(&out).unwrap();
    let status = std::process::Command::new("gzip")
        .arg("-dc")
        .arg(gz)
        .stdout(file)
        .status()
        .expect("running gzip");
    assert!(status.success(), "gzip -dc {}: {status}", gz.display());
    out
}

#[test]
fn linux_boots_to_init_with_our_e820_map() {
    require_kvm();
    let (profile, extra) = linux_profile();
    let images = build_guest_image(&["linux", profile]);
    let vmlinux = &images[0];
    let initramfs = uncompressed(&images[1]);
    let memory_mib = 256;
    let _one = ONE_LINUX_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let make = |console: &Console| {
        let mut cfg = VmConfig::new(vmlinux);
        cfg.initrd = Some(initramfs.clone());
        cfg.memory_mib = memory_mib;
        cfg.vcpus = 1;
        cfg.cmdline = format!("console=ttyS0 reboot=k panic=-1 {extra}");
        cfg.serial.output = console.output();
        // Entropy: without RDRAND (the emulated-kvm profile hides it) the guest's RNG would not
        // be ready by init, and a new generation reseeds only a ready one.
        cfg.rng = true;
        cfg
    };
    // At init, the guest is snapshotted; its restore below must tell it it is a copy.
    let snapshot = std::env::temp_dir().join(format!("mv-linux-genid-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&snapshot);
    std::fs::create_dir_all(&snapshot).unwrap();
    let paths = vmm::SnapshotPaths::in_dir(&snapshot);
    let (reached, log, lost) = boot_to(&make, "Run /init as init process", &mut |vm| {
        vm.snapshot(&paths, true).expect("snapshot at init");
    });
    let log_path = std::env::temp_dir().join("microvirt-linux-boot.log");
    std::fs::write(&log_path, &log).unwrap();
    assert!(
        reached,
        "no `Run /init` in {} attempts; console in {}:\n{}",
        lost.len(),
        log_path.display(),
        lost.join("\n----- next attempt -----\n")
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
    // ACPI: Linux found microvirt's tables and the VMGenID device's driver bound.
    for table in [
        "ACPI: RSDP 0x00000000000E0000",
        "ACPI: FACP",
        "ACPI: APIC",
        "ACPI: DSDT",
    ] {
        assert!(log.contains(table), "no `{table}` line:\n{log}");
    }
    assert_vmgenid_reseeds_after_restore(&make(&Console::default()), &paths, &log);
    std::fs::remove_dir_all(&snapshot).unwrap();
}

/// Restores the snapshot at `paths` and waits for the guest to say that, told of its new
/// generation through the GED, it reseeded its random number generator (Linux's vmgenid
/// driver). `booted` is the console before the snapshot.
fn assert_vmgenid_reseeds_after_restore(
    config: &VmConfig,
    paths: &vmm::SnapshotPaths,
    booted: &str,
) {
    const RESEEDED: &str = "crng reseeded due to virtual machine fork";
    assert!(!booted.contains(RESEEDED), "{booted}");
    assert!(
        booted.contains("random: crng init done"),
        "the guest's RNG was not ready when it was snapshotted, so a new generation would not reseed it:\n{booted}"
    );
    // As with the boot (`boot_to`), a restored Linux now and then dies on this machine's
    // software-emulated KVM before it gets there (an oops in a path the emulator gets wrong);
    // each attempt is a fresh restore of the same snapshot, and every one that was lost is
    // shown if none reseeds.
    let mut lost = Vec::new();
    for _ in 0..3 {
        let console = Console::default();
        let mut config = config.clone();
        config.serial.output = console.output();
        let vm = Vm::restore(&config, paths).expect("restore");
        let reseeded = console.wait_for(RESEEDED, Duration::from_secs(120));
        vm.stop();
        let _ = vm.wait();
        if reseeded {
            return;
        }
        lost.push(console.text());
    }
    panic!(
        "no `{RESEEDED}` after {} restores:\n{}",
        lost.len(),
        lost.join("\n----- next restore -----\n")
    );
}

/// Real-driver acceptance: Linux mounts its ext4 root from our virtio-blk disk and completes
/// DHCP over our virtio-net against dnsmasq in a network namespace, before running init.
#[test]
fn linux_mounts_root_from_virtio_blk_and_gets_dhcp_over_virtio_net() {
    require_kvm();
    let (profile, extra) = linux_profile();
    let images = build_guest_image(&["linux", profile]);
    let (vmlinux, rootfs) = (images[0].clone(), &images[2]);
    let dir = std::env::temp_dir().join(format!("mv-linux-net-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let root = dir.join("rootfs.ext4");

    let ns = NetNs::new("linux");
    ns.exec(&["ip", "tuntap", "add", "mvtap0", "mode", "tap", "vnet_hdr"]);
    ns.exec(&["ip", "addr", "add", "10.0.2.1/24", "dev", "mvtap0"]);
    ns.exec(&["ip", "link", "set", "mvtap0", "up"]);
    let dhcp_log = dir.join("dnsmasq.log");
    let mut dnsmasq = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.name,
            "dnsmasq",
            "--no-daemon",
            "--interface=mvtap0",
            "--bind-interfaces",
        ])
        .args([
            "--except-interface=lo",
            "--port=0",
            "--no-resolv",
            "--no-hosts",
            "--leasefile-ro",
            "--log-dhcp",
        ])
        .args(["--dhcp-range=10.0.2.15,10.0.2.15,255.255.255.0,1h"])
        .arg(format!("--log-facility={}", dhcp_log.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting dnsmasq (apt-get install dnsmasq-base)");

    let ns_name = ns.name.clone();
    let root2 = root.clone();
    let rootfs2 = rootfs.clone();
    let _one = ONE_LINUX_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let (reached, log) = std::thread::spawn(move || {
        let ns = NetNs { name: ns_name };
        ns.enter();
        std::mem::forget(ns);
        let make = |console: &Console| {
            // A fresh copy of the root image for every attempt.
            std::fs::copy(&rootfs2, &root2).unwrap();
            let mut cfg = VmConfig::new(&vmlinux);
            cfg.memory_mib = 256;
            cfg.cmdline =
                format!("console=ttyS0 reboot=k panic=-1 root=/dev/vda rw ip=dhcp {extra}");
            cfg.serial.output = console.output();
            cfg.disks = vec![vmm::config::DiskConfig::new(&root2)];
            cfg.nets = vec![vmm::config::NetConfig {
                tap: vmm::config::TapSource::Name("mvtap0".into()),
                mac: Some(vmm::config::MacAddr([0x52, 0x54, 0x00, 0x12, 0x34, 0x56])),
            }];
            cfg
        };
        let (reached, log, lost) = boot_to(&make, " as init process", &mut |_| {});
        (
            reached,
            if reached {
                log
            } else {
                lost.join("\n----- next attempt -----\n")
            },
        )
    })
    .join()
    .unwrap();
    let _ = dnsmasq.kill();
    let _ = dnsmasq.wait();
    let log_path = std::env::temp_dir().join("microvirt-linux-virtio.log");
    std::fs::write(&log_path, &log).unwrap();
    assert!(
        reached,
        "init not reached in 2 attempts; console in {}:\n{log}",
        log_path.display()
    );
    let init_at = log.find(" as init process").unwrap();
    for needle in [
        "virtio_blk virtio0: [vda]",
        "EXT4-fs (vda): mounted filesystem",
        "VFS: Mounted root (ext4 filesystem)",
        "IP-Config: Complete:",
        "hwaddr=52:54:00:12:34:56",
        "ipaddr=10.0.2.15",
    ] {
        let at = log.find(needle).unwrap_or_else(|| {
            panic!(
                "{needle:?} missing; console in {}:\n{log}",
                log_path.display()
            )
        });
        assert!(at < init_at, "{needle:?} only after init");
    }
    let dhcp = std::fs::read_to_string(&dhcp_log).unwrap_or_default();
    assert!(
        dhcp.contains("DHCPACK(mvtap0) 10.0.2.15 52:54:00:12:34:56"),
        "dnsmasq log:\n{dhcp}"
    );
    drop(ns);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Snapshots a Linux guest mid-boot, once it has probed its virtio-blk root disk, ends that VM
/// and restores the snapshot in a new one; once that one runs, live-migrates it to a third VM
/// over TCP, which must carry on to mount the root file system and run init. Like `boot_to`, a
/// lost attempt (the emulated host's problem) gets one more try.
#[test]
fn linux_snapshotted_then_migrated_mid_boot_reaches_init() {
    require_kvm();
    let (profile, extra) = linux_profile();
    let images = build_guest_image(&["linux", profile]);
    let (vmlinux, rootfs) = (images[0].clone(), images[2].clone());
    let dir = std::env::temp_dir().join(format!("mv-linux-snap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let root = dir.join("rootfs.ext4");
    let _one = ONE_LINUX_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let make = |console: &Console| {
        let mut cfg = VmConfig::new(&vmlinux);
        cfg.memory_mib = 256;
        cfg.cmdline = format!("console=ttyS0 reboot=k panic=-1 root=/dev/vda rw {extra}");
        cfg.serial.output = console.output();
        cfg.disks = vec![vmm::config::DiskConfig::new(&root)];
        cfg
    };
    let mut reports = Vec::new();
    for attempt in 1..=2 {
        std::fs::copy(&rootfs, &root).unwrap();
        let console = Console::default();
        let config = make(&console);
        let vm = Vm::build(&config).expect("building the VM");
        if !console.wait_for("virtio_blk virtio0: [vda]", LIMIT) || vm.end_signal().get().is_some()
        {
            reports.push(format!(
                "attempt {attempt}: no virtio-blk probe before the snapshot (end {:?}):\n{}",
                vm.end_signal().get(),
                console.text()
            ));
            vm.stop();
            continue;
        }
        let stats = vm
            .snapshot(&vmm::SnapshotPaths::in_dir(&dir), true)
            .expect("snapshot");
        vm.stop();
        drop(vm);
        let before = console.text();
        let console2 = Console::default();
        let mut config2 = config.clone();
        config2.serial.output = console2.output();
        let restored = Vm::restore(&config2, &vmm::SnapshotPaths::in_dir(&dir)).expect("restore");
        let start = std::time::Instant::now();
        while console2.is_empty() && start.elapsed() < LIMIT / 4 {
            std::thread::sleep(Duration::from_millis(100));
        }
        // The restored guest runs: move it.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let console3 = Console::default();
        let mut config3 = config.clone();
        config3.serial.output = console3.output();
        let receiver = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            Vm::migrate_in(&mut s, &config3)
        });
        let migrated = restored.migrate_out(
            &mut std::net::TcpStream::connect(addr).unwrap(),
            &vmm::migration::MigrationConfig::default(),
            &mut |_| {},
        );
        let vm = match (migrated, receiver.join().unwrap()) {
            (Ok(_), Ok(vm)) => vm,
            (a, b) => panic!(
                "migration mid-boot: source {:?}, target {:?}",
                a.err(),
                b.err()
            ),
        };
        drop(restored);
        let restored_console = console2;
        let console2 = console3;
        let (mut last_len, mut last_change) = (0, std::time::Instant::now());
        let reached = loop {
            if console2.text().contains(" as init process") {
                break true;
            }
            if vm.end_signal().get().is_some() || start.elapsed() > LIMIT {
                break false;
            }
            if console2.len() != last_len {
                (last_len, last_change) = (console2.len(), std::time::Instant::now());
            } else if last_change.elapsed() > STALL {
                break false;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        let end = vm.end_signal().get();
        vm.stop();
        let after = console2.text();
        if reached {
            let both = restored_console.text() + &after;
            assert!(
                both.contains("VFS: Mounted root (ext4 filesystem)"),
                "root not mounted after the restore:\n{both}"
            );
            assert!(
                !after.contains("Linux version"),
                "the restored or migrated guest booted again:\n{after}"
            );
            assert!(stats.memory_written_bytes < 256 << 20);
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        }
        reports.push(format!("attempt {attempt}: the migrated guest did not reach init (end {end:?}); before the snapshot:\n{before}\n--- on the migration target:\n{after}"));
    }
    panic!("{}", reports.join("\n----- next attempt -----\n"));
}

/// Real-driver acceptance for virtio-fs: Linux's virtio-fs driver (interrupt-driven, unlike
/// the probe's polling one) mounts its root filesystem from a directory virtiofsd serves
/// (`root=TAG rootfstype=virtiofs`, no initramfs) and runs init from it.
#[test]
fn linux_mounts_its_root_from_virtio_fs_and_runs_init_from_it() {
    require_kvm();
    let (profile, extra) = linux_profile();
    let images = build_guest_image(&["linux", profile]);
    let vmlinux = images[0].clone();
    let dir = std::env::temp_dir().join(format!("mv-linux-virtiofs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let root = dir.join("root");
    std::fs::create_dir_all(&root).unwrap();
    // The initramfs's files, unpacked, are the shared root.
    let status = std::process::Command::new("sh")
        .arg("-ec")
        .arg(format!(
            "gzip -dc {} | (cd {} && cpio -idm --quiet)",
            images[1].display(),
            root.display()
        ))
        .status()
        .unwrap();
    assert!(status.success(), "unpacking the initramfs: {status}");
    let socket = dir.join("fs.sock");
    let _one = ONE_LINUX_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let daemons = std::sync::Mutex::new(Vec::new());
    let make = |console: &Console| {
        daemons
            .lock()
            .unwrap()
            .push(tests::peers::virtiofsd(&root, &socket, false));
        let mut cfg = VmConfig::new(&vmlinux);
        cfg.memory_mib = 256;
        cfg.vcpus = 1;
        cfg.cmdline = format!(
            "console=ttyS0 reboot=k panic=-1 root=rootfs rootfstype=virtiofs rw init=/init {extra}"
        );
        cfg.filesystems = vec![vmm::config::FsConfig {
            tag: "rootfs".into(),
            socket: socket.clone(),
        }];
        cfg.serial.output = console.output();
        cfg
    };
    let (reached, log, lost) = boot_to(&make, "Run /init as init process", &mut |_| {});
    drop(daemons);
    let log_path = std::env::temp_dir().join("microvirt-linux-virtiofs.log");
    std::fs::write(&log_path, &log).unwrap();
    assert!(
        reached,
        "no `Run /init` in {} attempts; console in {}:\n{}",
        lost.len(),
        log_path.display(),
        lost.join("\n----- next attempt -----\n")
    );
    assert!(
        log.contains("VFS: Mounted root (virtiofs filesystem)"),
        "root not mounted from virtio-fs:\n{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
