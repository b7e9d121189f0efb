//! virtio-fs on /dev/kvm against the real virtiofsd: the probe's FUSE client reads a file the
//! host put in a shared directory and writes one the host then reads; a read-only share
//! refuses the write; backends that are missing, mute, garbled or killed mid-I/O are refused
//! at start or become a device error in the guest, never a hung VMM.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tests::peers::virtiofsd;
use tests::*;
use vmm::config::FsConfig;
use vmm::{Vm, VmEnd};

const T: Duration = Duration::from_secs(180);

fn workdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mv-fs-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("share")).unwrap();
    d
}

fn fs_config(test_args: &str, socket: &Path, console: &Console) -> vmm::VmConfig {
    let mut cfg = probe_config("virtiofs", 1, 64, console);
    cfg.cmdline
        .push_str(&format!(" probe.tag=share {test_args}"));
    cfg.filesystems = vec![FsConfig {
        tag: "share".into(),
        socket: socket.to_path_buf(),
    }];
    cfg
}

#[test]
fn the_probe_reads_and_writes_a_shared_directory_through_virtiofsd() {
    require_kvm();
    let dir = workdir("rw");
    let share = dir.join("share");
    std::fs::write(share.join("hello.txt"), "a line from the host\nmore\n").unwrap();
    let socket = dir.join("fs.sock");
    let _daemon = virtiofsd(&share, &socket, false);
    let run = run_built(|console| fs_config("", &socket, console), T);
    let r = expect_probe_ok(&run, "virtiofs");
    assert!(
        r.details.ends_with("first-line=a line from the host"),
        "{}",
        r.details
    );
    assert_eq!(r.field("hello.size"), Some("26"));
    assert_eq!(r.field("wrote"), Some("12"));
    assert_eq!(r.field("written.size"), Some("12"));
    assert_eq!(
        std::fs::read_to_string(share.join("written.txt")).unwrap(),
        "probe wrote\n"
    );
    assert_eq!(run.end, VmEnd::PoweredOff);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_read_only_share_refuses_the_guests_write_and_the_directory_stays_as_it_was() {
    require_kvm();
    let dir = workdir("ro");
    let share = dir.join("share");
    std::fs::write(share.join("hello.txt"), "config map data\n").unwrap();
    let socket = dir.join("fs.sock");
    let _daemon = virtiofsd(&share, &socket, true);
    let run = run_built(|console| fs_config("", &socket, console), T);
    let r = run
        .result
        .clone()
        .unwrap_or_else(|| panic!("no result:\n{}", run.console));
    assert!(!r.ok, "{}", run.console);
    // EROFS (30) from CREATE, after the read succeeded.
    assert!(
        r.details.contains("CREATE written.txt failed: errno 30"),
        "{}",
        r.details
    );
    assert!(!share.join("written.txt").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

fn build_error(socket: &Path) -> String {
    let console = Console::default();
    match Vm::build(&fs_config("", socket, &console)) {
        Ok(vm) => {
            vm.stop();
            let _ = vm.wait();
            panic!("a VM was built on {}", socket.display())
        }
        Err(e) => {
            assert!(e.is_config_error(), "{e}");
            e.to_string()
        }
    }
}

#[test]
fn sockets_that_are_not_working_backends_are_refused_at_start_with_the_reason() {
    require_kvm();
    let dir = workdir("bad");
    // No socket at all.
    let e = build_error(&dir.join("missing.sock"));
    assert!(
        e.contains("--fs share") && e.contains("missing.sock") && e.contains("cannot connect"),
        "{e}"
    );
    // A listener that never answers: refused after the backend timeout, not a hang.
    let mute = dir.join("mute.sock");
    let _mute = UnixListener::bind(&mute).unwrap();
    let started = Instant::now();
    let e = build_error(&mute);
    assert!(e.contains("no answer within 5 s"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(30));
    // A peer that answers with a malformed reply.
    let garbled = dir.join("garbled.sock");
    let l = UnixListener::bind(&garbled).unwrap();
    let peer = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut c, _) = l.accept().unwrap();
        let mut buf = [0u8; 64];
        let _ = c.read(&mut buf);
        // A reply header for request 5 (not GET_FEATURES) with a bogus size.
        let _ = c.write_all(&[5, 0, 0, 0, 5, 0, 0, 0, 8, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
        std::thread::sleep(Duration::from_secs(2));
    });
    let e = build_error(&garbled);
    assert!(
        e.contains("garbled.sock") && e.contains("GET_FEATURES"),
        "{e}"
    );
    peer.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_backend_killed_mid_io_is_a_device_error_in_the_guest_and_the_vm_lives_on() {
    require_kvm();
    let dir = workdir("kill");
    let share = dir.join("share");
    std::fs::write(share.join("hello.txt"), "x\n").unwrap();
    let socket = dir.join("fs.sock");
    let mut daemon = virtiofsd(&share, &socket, false);
    let console = Console::default();
    let vm =
        Vm::build(&fs_config("probe.reads=100000", &socket, &console)).expect("building the VM");
    wait_progress(&console, "virtiofs", "reads=8", T);
    // A snapshot or migration would lose the backend's state: refused, and the VM runs on.
    let snap = dir.join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    let e = vm
        .snapshot(&vmm::SnapshotPaths::in_dir(&snap), false)
        .expect_err("a snapshot of a VM with a virtio-fs share");
    assert!(e.to_string().contains("fs-share"), "{e}");
    assert!(!vm.is_paused());
    let mut link = std::io::Cursor::new(Vec::new());
    let e = vm
        .migrate_out(&mut link, &Default::default(), &mut |_| {})
        .expect_err("a migration of a VM with a virtio-fs share");
    assert!(
        e.to_string().contains("fs-share") && e.to_string().contains("virtiofsd"),
        "{e}"
    );
    assert!(!vm.is_paused());
    daemon.kill();
    let run = run_to_end(vm, &console, T);
    let r = run
        .result
        .clone()
        .unwrap_or_else(|| panic!("no result:\n{}", run.console));
    assert!(!r.ok, "{}", run.console);
    assert!(
        r.details.contains("READ hello.txt again failed: errno 5"),
        "{}",
        r.details
    );
    assert_eq!(run.end, VmEnd::PoweredOff, "{}", run.console);
    let _ = std::fs::remove_dir_all(&dir);
}
