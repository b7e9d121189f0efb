//! `virt-launcher run --socket`, `snapshot` and `restore` as a user runs them: snapshot a running
//! probe over the control socket, kill the launcher with SIGKILL, restore, and the guest
//! carries on; bad input is one line and exit code 2.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_virt-launcher"));
    c.env("RUST_LOG", "error");
    c
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mv-snapcli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn wait_for(path: &Path, needle: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in {}:\n{text}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_dirty(dir: &Path, socket: &Path, console: &Path) -> Child {
    tests::require_kvm();
    let child = bin()
        .arg("run")
        .arg("--kernel")
        .arg(tests::probe_path())
        .args([
            "--cmdline",
            "console=ttyS0 probe.test=dirty probe.passes=60",
        ])
        .args(["--vcpus", "2", "--memory", "192", "--no-console-input"])
        .arg("--socket")
        .arg(socket)
        .arg("--console-log")
        .arg(console)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .current_dir(dir)
        .spawn()
        .unwrap();
    tests::wait_for_path(socket, Duration::from_secs(10));
    child
}

fn snapshot(socket: &Path, to: &Path, extra: &[&str]) -> Output {
    bin()
        .arg("snapshot")
        .arg("--socket")
        .arg(socket)
        .arg("--to")
        .arg(to)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn snapshot_kill_restore_from_the_command_line() {
    let dir = scratch("kill");
    let socket = dir.join("launcher.sock");
    let console = dir.join("console.log");
    let mut child = run_dirty(&dir, &socket, &console);
    wait_for(
        &console,
        "PROBE PROGRESS dirty pass=5\n",
        Duration::from_secs(60),
    );
    let out = snapshot(&socket, &dir.join("snap"), &["--stop"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("memory 192 MiB") && stderr.contains("the VM stays paused"),
        "{stderr}"
    );
    let state_len = std::fs::metadata(dir.join("snap/state")).unwrap().len();
    assert!(
        state_len <= 64 << 10,
        "state file of {state_len} bytes for 2 vCPUs"
    );
    // Paused means paused: the console does not grow.
    let before = std::fs::read(&console).unwrap().len();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(std::fs::read(&console).unwrap().len(), before);
    child.kill().unwrap();
    child.wait().unwrap();

    let console2 = dir.join("console2.log");
    let out = bin()
        .arg("restore")
        .arg("--from")
        .arg(dir.join("snap"))
        .arg("--no-console-input")
        .arg("--console-log")
        .arg(&console2)
        .output()
        .unwrap();
    tests::expect_success(&out, "");
    let text = std::fs::read_to_string(&console2).unwrap();
    assert!(
        text.contains("PROBE RESULT dirty OK passes=60 cpus=2"),
        "{text}"
    );
    assert!(
        !text.contains("microvirt probe guest: hello"),
        "the guest booted again:\n{text}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn snapshot_and_restore_refuse_bad_input_in_one_line() {
    let dir = scratch("bad");
    let one_line = |out: Output, expect: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(expect), "expected {expect:?} in {stderr:?}");
    };
    one_line(
        snapshot(&dir.join("nosuch.sock"), &dir.join("s"), &[]),
        "nosuch.sock: No such file or directory",
    );
    let restore = |from: &Path, extra: &[&str]| {
        bin()
            .arg("restore")
            .arg("--from")
            .arg(from)
            .arg("--no-console-input")
            .args(extra)
            .output()
            .unwrap()
    };
    one_line(restore(&dir.join("nothing"), &[]), "nothing/state");
    // A real snapshot, asked for with the wrong size.
    let socket = dir.join("launcher.sock");
    let console = dir.join("console.log");
    let mut child = run_dirty(&dir, &socket, &console);
    wait_for(
        &console,
        "PROBE PROGRESS dirty pass=1\n",
        Duration::from_secs(60),
    );
    assert!(snapshot(&socket, &dir.join("snap"), &[]).status.success());
    child.kill().unwrap();
    child.wait().unwrap();
    one_line(
        restore(&dir.join("snap"), &["--vcpus", "1"]),
        "the snapshot has 2 vCPU(s), 1 were asked for",
    );
    one_line(
        restore(&dir.join("snap"), &["--memory", "256"]),
        "the snapshot has 192 MiB of memory, 256 MiB were asked for",
    );
    std::fs::write(dir.join("snap/state"), b"garbage").unwrap();
    one_line(
        restore(&dir.join("snap"), &[]),
        "not a microvirt state file",
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A VM with a vhost-user disk being written: snapshot over the socket, kill, and restore from
/// the command line, where the backend's socket (the host's, not in the snapshot) must be given;
/// the guest finishes its stream on a second qemu-storage-daemon serving the same image.
#[test]
fn a_vhost_user_disk_is_snapshotted_and_restored_from_the_command_line() {
    tests::require_kvm();
    let dir = scratch("vublk");
    let image = tests::blkstream_image(&dir);
    let (s1, s2) = (dir.join("first.sock"), dir.join("second.sock"));
    let first = tests::peers::storage_daemon_unlocked(&image, &s1);
    let socket = dir.join("launcher.sock");
    let console = dir.join("console.log");
    let mut child = bin()
        .arg("run")
        .arg("--kernel")
        .arg(tests::probe_path())
        .args([
            "--cmdline",
            "console=ttyS0 probe.test=blkstream probe.writes=512",
        ])
        .args(["--memory", "64", "--no-console-input"])
        .arg("--disk")
        .arg(format!("vhost-user={}", s1.display()))
        .arg("--socket")
        .arg(&socket)
        .arg("--console-log")
        .arg(&console)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .current_dir(&dir)
        .spawn()
        .unwrap();
    tests::wait_for_path(&socket, Duration::from_secs(10));
    wait_for(
        &console,
        "PROBE PROGRESS blkstream writes=64\n",
        Duration::from_secs(120),
    );
    let out = snapshot(&socket, &dir.join("snap"), &["--stop"]);
    tests::expect_success(&out, "");
    child.kill().unwrap();
    child.wait().unwrap();
    drop(first);

    let restore = |extra: &[String], console: &Path| {
        bin()
            .arg("restore")
            .arg("--from")
            .arg(dir.join("snap"))
            .args(extra)
            .arg("--no-console-input")
            .arg("--console-log")
            .arg(console)
            .output()
            .unwrap()
    };
    let out = restore(&[], &dir.join("refused.log"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("vda is served by a vhost-user backend")
            && stderr.contains("--disk vhost-user=SOCKET"),
        "{stderr}"
    );
    let _second = tests::peers::storage_daemon_unlocked(&image, &s2);
    let console2 = dir.join("console2.log");
    let out = restore(
        &["--disk".into(), format!("vhost-user={}", s2.display())],
        &console2,
    );
    let text = std::fs::read_to_string(&console2).unwrap_or_default();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("PROBE RESULT blkstream OK")
            && !text.contains("microvirt probe guest: hello"),
        "{text}"
    );
    tests::assert_blkstream_image(&image, 512);
    std::fs::remove_dir_all(dir).unwrap();
}
