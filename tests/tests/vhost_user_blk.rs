//! vhost-user-blk on /dev/kvm against QEMU's qemu-storage-daemon export: the probe's virtio-blk
//! driver writes, flushes and reads back through the backend, and the host checks the image;
//! a read-only export refuses writes; a backend killed mid-I/O fails the guest's requests while
//! the VMM lives on.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tests::peers::storage_daemon;
use tests::*;
use vmm::config::VhostUserDiskConfig;
use vmm::{Vm, VmEnd};

const T: Duration = Duration::from_secs(180);

fn workdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mv-vublk-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(test: &str, extra: &str, socket: &Path, console: &Console) -> vmm::VmConfig {
    let mut cfg = probe_config(test, 1, 64, console);
    cfg.cmdline.push_str(extra);
    cfg.vhost_user_disks = vec![VhostUserDiskConfig {
        socket: socket.to_path_buf(),
    }];
    cfg
}

#[test]
fn the_probe_writes_flushes_and_reads_back_through_qemu_storage_daemon() {
    require_kvm();
    let dir = workdir("rw");
    let image = dir.join("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let socket = dir.join("blk.sock");
    let daemon = storage_daemon(&image, &socket, true);
    let console = Console::default();
    let vm = Vm::build(&config("blk", "", &socket, &console)).expect("building the VM");
    let run = run_to_end(vm, &console, T);
    let r = expect_probe_ok(&run, "blk");
    assert_eq!(r.field("disks"), Some("1"));
    assert_eq!(r.field("d0.sectors"), Some("8192"));
    assert_eq!(r.field("d0.mode"), Some("rw"));
    assert_eq!(r.field("d0.verified"), Some("16"));
    drop(daemon);
    // What the probe wrote is in the image, byte for byte (guest-images/probe/src/blk.rs).
    let data = std::fs::read(&image).unwrap();
    let sectors = data.len() as u64 / 512;
    let mut written: Vec<u64> = (0..16u64).map(|k| k * (sectors - 2) / 15).collect();
    written.push(written[15] + 1);
    let mut expect = [0u8; 512];
    for s in written {
        pattern(s, &mut expect);
        let at = (s * 512) as usize;
        assert_eq!(&data[at..at + 512], &expect[..], "sector {s}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The probe's sector pattern (guest-images/probe/src/blk.rs `pattern`).
fn pattern(sector: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (sector as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
    let tag = format!("MVPROBE sector {sector}");
    buf[..tag.len()].copy_from_slice(tag.as_bytes());
}

#[test]
fn a_read_only_export_refuses_the_guests_writes_and_the_image_is_unchanged() {
    require_kvm();
    let dir = workdir("ro");
    let image = dir.join("disk.img");
    let content: Vec<u8> = (0..1 << 20).map(|i| (i % 253) as u8).collect();
    std::fs::write(&image, &content).unwrap();
    let socket = dir.join("blk.sock");
    let _daemon = storage_daemon(&image, &socket, false);
    let console = Console::default();
    let vm = Vm::build(&config("blk", "", &socket, &console)).expect("building the VM");
    let run = run_to_end(vm, &console, T);
    let r = expect_probe_ok(&run, "blk");
    assert_eq!(r.field("d0.mode"), Some("ro"));
    assert_eq!(r.field("d0.write_rejected"), Some("1"));
    assert_eq!(std::fs::read(&image).unwrap(), content);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_backend_killed_mid_io_fails_the_guests_requests_and_the_vm_lives_on() {
    require_kvm();
    let dir = workdir("kill");
    let image = dir.join("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let socket = dir.join("blk.sock");
    let mut daemon = storage_daemon(&image, &socket, true);
    let console = Console::default();
    let vm = Vm::build(&config(
        "blkstream",
        " probe.writes=8000",
        &socket,
        &console,
    ))
    .expect("building the VM");
    wait_progress(&console, "blkstream", "writes=32", T);
    daemon.kill();
    let run = run_to_end(vm, &console, T);
    let r = run
        .result
        .clone()
        .unwrap_or_else(|| panic!("no result:\n{}", run.console));
    assert!(!r.ok, "{}", run.console);
    assert!(r.details.contains("device needs reset"), "{}", r.details);
    assert_eq!(run.end, VmEnd::PoweredOff, "{}", run.console);
    let _ = std::fs::remove_dir_all(&dir);
}
