//! `virt-launcher run` as a user runs it: exit codes and one-line errors for bad input.

use std::path::Path;
use std::process::{Command, Output};

fn launcher(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
        .arg("run")
        .args(args)
        .arg("--no-console-input")
        .env("RUST_LOG", "error")
        .output()
        .unwrap()
}

/// Bad input: exit code 2, exactly one line on stderr naming the option, nothing started.
fn assert_rejected(args: &[&str], expected: &str) {
    let out = launcher(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: stderr {stderr}");
    assert_eq!(stderr.lines().count(), 1, "args {args:?}: {stderr}");
    assert!(
        stderr.contains(expected),
        "args {args:?}: expected {expected:?} in {stderr:?}"
    );
    assert!(
        out.stdout.is_empty(),
        "the guest started: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

fn tmp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("mv-cli-{}-{name}", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn bad_input_is_a_one_line_error_with_exit_code_2() {
    let probe = tests::probe_path();
    let probe = probe.to_str().unwrap();
    assert_rejected(
        &["--kernel", "/nonexistent/vmlinux"],
        "--kernel /nonexistent/vmlinux: no such file",
    );
    assert_rejected(&["--kernel", "/tmp"], "--kernel /tmp: not a regular file");
    let junk = tmp("junk", b"this is not a kernel");
    assert_rejected(
        &["--kernel", junk.to_str().unwrap()],
        "neither an ELF vmlinux nor a bzImage",
    );
    assert_rejected(
        &["--kernel", probe, "--initrd", "/nonexistent/initrd"],
        "--initrd /nonexistent/initrd: no such file",
    );
    assert_rejected(
        &["--kernel", probe, "--vcpus", "0"],
        "--vcpus 0: must be between 1 and",
    );
    assert_rejected(
        &["--kernel", probe, "--vcpus", "300"],
        "--vcpus 300: must be between 1 and",
    );
    assert_rejected(
        &["--kernel", probe, "--memory", "2"],
        "--memory 2: must be between 8 and 1048576 MiB",
    );
    let long = "x".repeat(3000);
    assert_rejected(
        &["--kernel", probe, "--cmdline", &long],
        "--cmdline: 3000 bytes is too long, at most 2047",
    );
    // A 24 MiB initrd does not fit in a 16 MiB guest next to the probe.
    let big = tmp("initrd", &vec![0u8; 24 << 20]);
    assert_rejected(
        &[
            "--kernel",
            probe,
            "--initrd",
            big.to_str().unwrap(),
            "--memory",
            "16",
        ],
        "--memory 16: the kernel plus initrd needs",
    );
    for p in [junk, big] {
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn exit_code_reflects_how_the_guest_ended() {
    tests::require_kvm();
    let probe = tests::probe_path();
    let probe = probe.to_str().unwrap();
    let cases = [("boot", 0), ("triplefault", 11), ("reset", 10)];
    for (test, code) in cases {
        let cmdline = format!("console=ttyS0 probe.test={test}");
        let out = launcher(&["--kernel", probe, "--cmdline", &cmdline, "--memory", "64"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{test}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.starts_with("microvirt probe guest: hello"),
            "{stdout}"
        );
    }
    let out = launcher(&[
        "--kernel",
        probe,
        "--cmdline",
        "probe.test=boot",
        "--memory",
        "64",
    ]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("PROBE RESULT boot OK"));
    // `--rng` attaches the virtio-rng device the probe's rng test draws from (seccomp on).
    let rng = |extra: &[&str]| {
        let mut args = vec!["--kernel", probe, "--cmdline", "probe.test=rng"];
        args.extend_from_slice(extra);
        String::from_utf8_lossy(&launcher(&args).stdout).to_string()
    };
    let with = rng(&["--rng"]);
    assert!(with.contains("PROBE RESULT rng OK bytes="), "{with}");
    let without = rng(&[]);
    assert!(
        without.contains("PROBE RESULT rng FAIL no virtio-rng device"),
        "{without}"
    );
    let log = std::env::temp_dir().join(format!("mv-cli-{}-console.log", std::process::id()));
    let out = launcher(&[
        "--kernel",
        probe,
        "--cmdline",
        "probe.test=boot",
        "--console-log",
        log.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0));
    assert!(out.stdout.is_empty());
    assert!(std::fs::read_to_string(&log)
        .unwrap()
        .contains("PROBE RESULT boot OK"));
    std::fs::remove_file(&log).unwrap();
    assert!(Path::new(probe).exists());
}

/// `validate -f` (and `run --dry-run`) shows exactly what would boot, creating nothing; a
/// manifest with errors gets every one of them, exit code 2.
#[test]
fn validate_prints_the_plan_or_every_error() {
    let dir = std::env::temp_dir().join(format!("mv-cli-validate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("images/quay.io_containerdisks_fedora_40")).unwrap();
    std::fs::write(
        dir.join("images/quay.io_containerdisks_fedora_40/disk.img"),
        [0u8; 4096],
    )
    .unwrap();
    let good = dir.join("vm.yaml");
    std::fs::write(
        &good,
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: fedora}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        cpu: {cores: 2}
        memory: {guest: 1024M}
        clock: {utc: {}}
        devices: {}
      volumes:
      - {name: root, containerDisk: {image: "quay.io/containerdisks/fedora:40"}}
"#,
    )
    .unwrap();
    let state = dir.join("state");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
            .args(args)
            .arg("--image-dir")
            .arg(dir.join("images"))
            .arg("--state-dir")
            .arg(&state)
            .output()
            .unwrap()
    };
    for args in [
        vec!["validate", "-f", good.to_str().unwrap()],
        vec!["run", "--dry-run", "-f", good.to_str().unwrap()],
    ] {
        let out = run(&args);
        let plan = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(plan.contains("vcpus 2\nmemory_mib 977\n"), "{plan}");
        assert!(
            plan.contains("disk vda root "),
            "the volume without a disk is there: {plan}"
        );
        assert!(
            plan.contains("nic default binding=Masquerade mac="),
            "{plan}"
        );
        assert!(!state.join("fedora").exists(), "nothing is created");
        let warned = String::from_utf8_lossy(&out.stderr);
        assert!(
            warned
                .contains("warning: spec.template.spec.domain.clock: accepted, but has no effect"),
            "{warned}"
        );
    }
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: b}\nspec:\n  domain:\n    memory: {guest: 1GB}\n    cpu: {cores: 0}\n    devices: {}\n",
    )
    .unwrap();
    let out = run(&["validate", "-f", bad.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("spec.domain.memory.guest") && err.contains("accepted:"),
        "{err}"
    );
    assert!(err.contains("spec.domain.cpu.cores"), "every error: {err}");
    assert!(out.stdout.is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

/// A VM naming an instance type and a preference, defined in the same file or in
/// --instancetype-dir: `validate` shows the expanded plan; a missing one and a conflict are
/// refused with the kinds looked in and KubeVirt's message.
#[test]
fn instance_types_from_the_file_or_a_directory() {
    let dir = std::env::temp_dir().join(format!("mv-cli-it-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("lib")).unwrap();
    let vm = |instancetype: &str, domain: &str| {
        format!(
            r#"apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: sized}}
spec:
  runStrategy: Always
  instancetype: {{name: {instancetype}}}
  preference: {{kind: VirtualMachinePreference, name: cores}}
  template:
    spec:
      domain: {domain}
"#
        )
    };
    let pref = "apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachinePreference\nmetadata: {name: cores}\nspec: {cpu: {preferredCPUTopology: preferCores}}\n";
    let it = "apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachineClusterInstancetype\nmetadata: {name: u1.small}\nspec: {cpu: {guest: 2}, memory: {guest: 1Gi}}\n";
    let same_file = dir.join("same.yaml");
    std::fs::write(
        &same_file,
        format!("{}---\n{it}---\n{pref}", vm("u1.small", "{devices: {}}")),
    )
    .unwrap();
    std::fs::write(dir.join("lib/u1.yaml"), format!("{it}---\n{pref}")).unwrap();
    let alone = dir.join("alone.yaml");
    std::fs::write(&alone, vm("u1.small", "{devices: {}}")).unwrap();
    let validate = |f: &Path, lib: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_virt-launcher"));
        c.args(["validate", "-f"])
            .arg(f)
            .arg("--state-dir")
            .arg(dir.join("state"));
        if lib {
            c.arg("--instancetype-dir").arg(dir.join("lib"));
        }
        c.output().unwrap()
    };
    for (f, lib) in [(&same_file, false), (&alone, true)] {
        let out = validate(f, lib);
        let plan = String::from_utf8_lossy(&out.stdout);
        tests::expect_success(&out, "");
        assert!(plan.contains("vcpus 2\nmemory_mib 1024\n"), "{plan}");
    }
    let out = validate(&alone, false);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        err.contains("instance type \"u1.small\" not found (looked for VirtualMachineClusterInstancetype u1.small"),
        "{err}"
    );
    let conflict = dir.join("conflict.yaml");
    std::fs::write(
        &conflict,
        vm("u1.small", "{memory: {guest: 2Gi}, devices: {}}"),
    )
    .unwrap();
    let out = validate(&conflict, true);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        err.contains("VM field(s) spec.template.spec.domain.memory.guest conflicts with selected instance type"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `--fs tag=T,dir=DIR` starts virtiofsd for DIR; the probe guest reads and writes it. Bad
/// `--fs` specs and shares are one-line errors.
#[test]
fn fs_dir_shares_a_host_directory_through_virtiofsd() {
    let probe = tests::probe_path();
    let probe = probe.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("mv-cli-{}-fs", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("hello.txt"), "from the CLI\n").unwrap();
    let share = format!("tag=docs,dir={}", dir.display());
    let out = launcher(&[
        "--kernel",
        probe,
        "--memory",
        "64",
        "--cmdline",
        "console=ttyS0 probe.test=virtiofs probe.tag=docs",
        "--fs",
        &share,
    ]);
    let stdout = tests::expect_success(&out, "");
    assert!(
        stdout.contains("PROBE RESULT virtiofs OK") && stdout.contains("first-line=from the CLI"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("written.txt")).unwrap(),
        "probe wrote\n"
    );
    assert_rejected(
        &["--kernel", probe, "--fs", "tag=docs"],
        "--fs tag=docs: give exactly one of socket=PATH",
    );
    assert_rejected(
        &["--kernel", probe, "--fs", "tag=docs,dir=/nonexistent/dir"],
        "--fs tag=docs: dir=/nonexistent/dir: No such file",
    );
    assert_rejected(
        &[
            "--kernel",
            probe,
            "--disk",
            "vhost-user=/tmp/x.sock,readonly",
        ],
        "--disk vhost-user=/tmp/x.sock,readonly: vhost-user=SOCKET takes no other option",
    );
    assert_rejected(
        &["--kernel", probe, "--disk", "vhost-user=/nonexistent/blk.sock"],
        "--disk vhost-user=/nonexistent/blk.sock: vhost-user backend /nonexistent/blk.sock: cannot connect",
    );
    assert_rejected(
        &["--kernel", probe, "--fs", "tag=a b,socket=/tmp/x.sock"],
        "--fs a b: the tag must be 1 to 36 printable ASCII characters",
    );
    let _ = std::fs::remove_dir_all(&dir);
}
