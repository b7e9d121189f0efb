//! The VMM's per-thread hardening, for real: seccomp filters installed on every vCPU and the
//! device thread (the kernel reports filter mode 2 for them, not for the others) and biting — a
//! debug-build hook makes a filtered thread call socket(2), or the daemon's control thread
//! unshare(2), and the process ends with the documented line and exit status 31; those threads hold no capability even in a launcher run
//! as root; and a launcher run as an unprivileged user, with only its KVM device node made
//! accessible (as the device plugin does in a Pod), boots the guest.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn manifest(dir: &std::path::Path, test: &str, vcpus: u32) -> std::path::PathBuf {
    let m = dir.join(format!("{test}.yaml"));
    std::fs::write(
        &m,
        format!(
            r#"apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: filtered}}
spec:
  domain:
    cpu: {{sockets: {vcpus}}}
    memory: {{guest: 64Mi}}
    devices: {{autoattachPodInterface: false}}
    firmware:
      kernelBoot:
        container: {{image: "microvirt/probe:latest", kernelPath: /probe}}
        kernelArgs: "console=ttyS0 probe.test={test}"
"#
        ),
    )
    .unwrap();
    m
}

fn launcher(dir: &std::path::Path, m: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_virt-launcher"));
    c.args(["run", "--no-console-input", "--network", "none", "-f"])
        .arg(m)
        .arg("--image-dir")
        .arg(dir.join("images"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("RUST_LOG", "error");
    c
}

#[test]
fn every_thread_of_a_standalone_run_is_filtered() {
    tests::require_kvm();
    let dir = tests::probe_workdir("mv-seccomp-on");
    // The keyboard test waits for Ctrl-Alt-Del: the VM stays up while we look.
    let m = manifest(&dir, "keyboard", 2);
    let mut child = launcher(&dir, &m).stdout(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    let mut caps = Vec::new();
    while Instant::now() < deadline {
        seen.clear();
        caps.clear();
        for t in std::fs::read_dir(format!("/proc/{}/task", child.id()))
            .unwrap()
            .flatten()
        {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
            let mode = status
                .lines()
                .find_map(|l| l.strip_prefix("Seccomp:"))
                .map(|v| v.trim().to_string())
                .unwrap_or_default();
            let field = |f: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(f))
                    .map(|v| v.trim().to_string())
                    .unwrap_or_default()
            };
            caps.push((
                comm.trim().to_string(),
                [
                    field("CapEff:"),
                    field("CapPrm:"),
                    field("CapBnd:"),
                    field("CapAmb:"),
                ],
            ));
            seen.push((comm.trim().to_string(), mode));
        }
        if seen.iter().filter(|(c, _)| c.starts_with("vcpu")).count() == 2
            && seen.iter().any(|(c, _)| c == "vmm-events")
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    // Every thread: the standalone `run` installs the control filter before it builds the VM
    // (its own threads), the vCPUs and the device thread stack their own on it (and KVM's
    // worker, forked from a vCPU thread, inherits it).
    for (comm, mode) in &seen {
        assert_eq!(mode, "2", "{comm}: Seccomp {mode} ({seen:?})");
    }
    assert!(seen.iter().any(|(c, _)| c == "vcpu1"), "{seen:?}");
    // The launcher runs as root here; the threads the guest drives dropped every capability.
    for (comm, sets) in &caps {
        if comm.starts_with("vcpu") || comm == "vmm-events" {
            assert!(
                sets.iter().all(|s| s == "0000000000000000"),
                "{comm} holds capabilities (CapEff, CapPrm, CapBnd, CapAmb): {sets:?}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_unprivileged_launcher_boots_the_guest() {
    tests::require_kvm();
    let dir = tests::probe_workdir("mv-unprivileged");
    let m = manifest(&dir, "smp", 2);
    // As the launcher Pod's user, with only its state directory and its KVM node its own.
    tests::chown_to_pod_user(&dir);
    tests::chown_to_pod_user(&dir.join("state"));
    let mut c = tests::as_pod_user(&launcher(&dir, &m), &dir);
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("PROBE RESULT smp OK"),
        "exit {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `cmd` ends with status 31 and the line naming `thread` and syscall `nr`.
fn assert_trapped(cmd: &mut Command, thread: &str, nr: i64) {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(31), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "microvirt: seccomp: the {thread} thread made syscall {nr}, which its seccomp filter does not allow; the VMM stops"
        )),
        "{stderr}"
    );
}

#[test]
fn a_denied_syscall_ends_the_vmm_with_the_thread_and_the_number() {
    tests::require_kvm();
    let dir = tests::probe_workdir("mv-seccomp-bite");
    let m = manifest(&dir, "boot", 1);
    for (thread, name) in [("vcpu", "vcpu0"), ("devices", "vmm-events")] {
        assert_trapped(
            launcher(&dir, &m).env("MICROVIRT_SECCOMP_TEST_DENIED", thread),
            name,
            libc::SYS_socket,
        );
    }
    // A vCPU thread may run KVM_RUN, but not change the guest's memory map: the same ioctl
    // type, refused by its number.
    assert_trapped(
        launcher(&dir, &m).env("MICROVIRT_SECCOMP_TEST_DENIED", "vcpu-memory"),
        "vcpu0",
        libc::SYS_ioctl,
    );
    // A vCPU thread that grows and frees a lot of heap is not trapped by its allocator
    // (glibc's arena trim would read /proc/sys/vm/overcommit_memory the first time).
    let out = launcher(&dir, &m)
        .env("MICROVIRT_SECCOMP_TEST_DENIED", "vcpu-heap")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("grew and freed 32 MiB of heap"),
        "{:?}: {stderr}",
        out.status
    );
    // TIOCSTI has TUN's ioctl type ('T'); only TUN's own request numbers pass.
    assert_trapped(
        launcher(&dir, &m).env("MICROVIRT_SECCOMP_TEST_DENIED", "tiocsti"),
        "vcpu0",
        libc::SYS_ioctl,
    );
    let daemon = || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_virt-launcher"));
        c.args(["daemon", "--socket"])
            .arg(dir.join("control.sock"))
            .arg("--state-dir")
            .arg(dir.join("state"));
        c
    };
    // clone makes threads only: one that asks for a mount namespace is trapped by its flags.
    assert_trapped(
        daemon().env("MICROVIRT_SECCOMP_TEST_DENIED", "clone-namespace"),
        "virt-launcher (control)",
        libc::SYS_clone,
    );
    // clone3, whose flags seccomp cannot read, is answered ENOSYS; the daemon goes on (and
    // its threads, made through clone, work: it serves its socket).
    let mut child = daemon()
        .env("MICROVIRT_SECCOMP_TEST_DENIED", "clone3")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    tests::wait_for_path(
        &dir.join("control.sock"),
        std::time::Duration::from_secs(10),
    );
    let s = std::os::unix::net::UnixStream::connect(dir.join("control.sock")).unwrap();
    let mut w = s.try_clone().unwrap();
    std::io::Write::write_all(&mut w, b"{\"request\":\"ping\"}\n").unwrap();
    let mut answer = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(s), &mut answer).unwrap();
    assert!(
        !answer.is_empty(),
        "the daemon answers after clone3 was refused"
    );
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("clone3 returned -1 (Function not implemented"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(dir.join("control.sock"));
    // The daemon's own threads: their filter traps what no launcher thread may do.
    assert_trapped(
        Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
            .args(["daemon", "--socket"])
            .arg(dir.join("control.sock"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .env("MICROVIRT_SECCOMP_TEST_DENIED", "control"),
        "virt-launcher (control)",
        libc::SYS_unshare,
    );
    // Without filters the same call goes through and the guest runs to its end.
    let out = launcher(&dir, &m)
        .args(["--seccomp", "off"])
        .env("MICROVIRT_SECCOMP_TEST_DENIED", "vcpu")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("--seccomp off"), "the warning: {stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("PROBE RESULT boot OK"));
    let _ = std::fs::remove_dir_all(dir);
}
