//! vhost-user-blk on /dev/kvm against QEMU's qemu-storage-daemon export: the probe's virtio-blk
//! driver writes, flushes and reads back through the backend, and the host checks the image;
//! a read-only export refuses writes; a backend killed mid-I/O fails the guest's requests while
//! the VMM lives on.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tests::peers::{self, storage_daemon};
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
    let run = run_built(|console| config("blk", "", &socket, console), T);
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
    let run = run_built(|console| config("blk", "", &socket, console), T);
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

/// A VM whose guest streams 512 writes to the vhost-user disk at `socket`, past its 64th.
fn streaming(socket: &Path, console: &Console) -> Vm {
    let vm = Vm::build(&config("blkstream", " probe.writes=512", socket, console))
        .expect("building the VM");
    wait_progress(console, "blkstream", "writes=64", T);
    vm
}

/// Runs `vm` to its end: the stream finished and `image` holds every write.
fn finish_stream(vm: Vm, console: &Console, image: &Path) -> ProbeRun {
    let run = run_to_end(vm, console, T);
    assert_eq!(
        expect_probe_ok(&run, "blkstream").field("written"),
        Some("512"),
        "{}",
        run.console
    );
    assert_blkstream_image(image, 512);
    run
}

/// The guest streams writes to a vhost-user-blk disk while it migrates: the source's backend
/// logs the buffers and used-ring entries it writes (the shared dirty log), the rings are
/// taken back with their positions at stop-and-copy and handed to the target's own backend
/// there, and the guest finishes on the target with every sector of the image as written.
#[test]
fn a_vhost_user_disk_being_written_migrates_with_its_guest() {
    require_kvm();
    let dir = workdir("migrate");
    let image = blkstream_image(&dir);
    let (s1, s2) = (dir.join("source.sock"), dir.join("target.sock"));
    let source_daemon = peers::storage_daemon_unlocked(&image, &s1);
    let _target_daemon = peers::storage_daemon_unlocked(&image, &s2);
    let console = Console::default();
    let vm = streaming(&s1, &console);
    let (addr, receiver) =
        migration_target(config("blkstream", " probe.writes=512", &s2, &console));
    migrate_to(&vm, addr).expect("migration");
    let (target_vm, target_console) = receiver.join().unwrap().expect("target");
    assert_eq!(vm.end_signal().get(), Some(VmEnd::Migrated));
    drop(vm);
    drop(source_daemon);
    finish_stream(target_vm, &target_console, &image);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A target that cannot take the machine (it has no vhost-user disk) refuses it after the
/// source stopped its backend's rings: the source hands them back where they stopped and the
/// guest finishes there, nothing lost.
#[test]
fn a_failed_migration_gives_the_rings_back_to_the_source_backend() {
    require_kvm();
    let dir = workdir("rollback");
    let image = blkstream_image(&dir);
    let socket = dir.join("blk.sock");
    let _daemon = storage_daemon(&image, &socket, true);
    let console = Console::default();
    let vm = streaming(&socket, &console);
    let mut diskless = probe_config("blkstream", 1, 64, &console);
    diskless.cmdline.push_str(" probe.writes=512");
    let (addr, receiver) = migration_target(diskless);
    let e = migrate_to(&vm, addr).expect_err("a target without the disk refuses the machine");
    assert!(e.to_string().contains("vhost-user"), "{e}");
    assert!(receiver.join().unwrap().is_err());
    assert!(vm.end_signal().get().is_none() && !vm.is_paused());
    finish_stream(vm, &console, &image);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Snapshots of a VM whose guest streams writes to a vhost-user disk: the rings are taken back
/// from the backend for the save and handed back after it (the guest writes on), and the last
/// snapshot, restored on another daemon serving the same image (the memory file copied into
/// shared RAM the backend maps), finishes the stream with every sector as written.
#[test]
fn a_vhost_user_disk_being_written_survives_snapshots_and_a_restore() {
    require_kvm();
    let dir = workdir("snapshot");
    let image = blkstream_image(&dir);
    let (s1, s2) = (dir.join("first.sock"), dir.join("second.sock"));
    let first = peers::storage_daemon_unlocked(&image, &s1);
    let console = Console::default();
    let vm = streaming(&s1, &console);
    let snap = dir.join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    let paths = vmm::SnapshotPaths::in_dir(&snap);
    vm.snapshot(&paths, false).expect("a snapshot that resumes");
    assert!(!vm.is_paused());
    wait_progress(&console, "blkstream", "writes=128", T);
    vm.snapshot(&paths, true)
        .expect("a snapshot that stays paused");
    vm.stop();
    drop(vm);
    drop(first);
    let _second = peers::storage_daemon_unlocked(&image, &s2);
    let restored_console = Console::default();
    let restored = Vm::restore(
        &config("blkstream", " probe.writes=512", &s2, &restored_console),
        &paths,
    )
    .expect("restoring with a vhost-user disk");
    let run = finish_stream(restored, &restored_console, &image);
    assert!(
        !run.console.contains("PROBE PROGRESS blkstream writes=64\n"),
        "the restored guest started over:\n{}",
        run.console
    );
    let _ = std::fs::remove_dir_all(&dir);
}
