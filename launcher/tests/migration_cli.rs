//! Live migration between two launcher processes in two network namespaces standing in for two
//! nodes (joined by a veth pair): `run --socket` on node A, `run --incoming` on node B,
//! `virt-launcher migrate` between them. The guest (the probe's `dirty` test) finishes on B.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tests::NetNs;

struct Nodes {
    a: NetNs,
    b: NetNs,
}

/// Two namespaces joined by veth: A is 10.77.0.1, B is 10.77.0.2.
fn nodes(tag: &str) -> Nodes {
    let a = NetNs::new(&format!("{tag}a"));
    let b = NetNs::new(&format!("{tag}b"));
    a.exec(&[
        "ip", "link", "add", "mva", "type", "veth", "peer", "name", "mvb",
    ]);
    a.exec(&["ip", "link", "set", "mvb", "netns", &b.name]);
    a.exec(&["ip", "addr", "add", "10.77.0.1/24", "dev", "mva"]);
    a.exec(&["ip", "link", "set", "mva", "up"]);
    b.exec(&["ip", "addr", "add", "10.77.0.2/24", "dev", "mvb"]);
    b.exec(&["ip", "link", "set", "mvb", "up"]);
    Nodes { a, b }
}

fn in_ns(ns: &NetNs, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args([
        "netns",
        "exec",
        &ns.name,
        env!("CARGO_BIN_EXE_virt-launcher"),
    ]);
    c.args(args);
    c.env("RUST_LOG", "error");
    c
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mv-migcli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn wait_for(path: &Path, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
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

/// The whole console line that starts with `prefix`, once its newline is written (the console
/// file grows byte by byte).
fn wait_for_line(path: &Path, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if let Some(at) = text.find(prefix) {
            if let Some(len) = text[at..].find('\n') {
                return text[at..at + len].to_string();
            }
        }
        assert!(
            Instant::now() < deadline,
            "no {prefix:?} line in {}:\n{text}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn vm_args<'a>(probe: &'a str, console: &'a str) -> Vec<&'a str> {
    vec![
        "--kernel",
        probe,
        "--cmdline",
        "console=ttyS0 probe.test=dirty probe.passes=150",
        "--vcpus",
        "2",
        "--memory",
        "256",
        "--no-console-input",
        "--console-log",
        console,
    ]
}

#[test]
fn migrate_between_two_node_namespaces() {
    tests::require_kvm();
    let n = nodes("mig");
    let dir = scratch("nodes");
    let probe = tests::probe_path().display().to_string();
    let (ca, cb) = (dir.join("a.log"), dir.join("b.log"));
    let (ca_s, cb_s) = (ca.display().to_string(), cb.display().to_string());
    let socket = dir.join("a.sock");
    // Between two machines plain TCP is refused: both ends take the certificates.
    let tls = tests::tls::write_dirs(&dir, &[api::protocol::MIGRATION_TLS_NAME]).remove(0);
    let tls_arg = format!("--tls-dir={}", tls.display());
    let plain = in_ns(&n.b, &["run", "--incoming", "tcp:10.77.0.2:7301"])
        .args(vm_args(&probe, &cb_s))
        .output()
        .unwrap();
    assert_eq!(plain.status.code(), Some(2));
    let said = String::from_utf8_lossy(&plain.stderr);
    assert!(
        said.contains("plain TCP is accepted on loopback only"),
        "{said}"
    );
    // The pages travel on 4 page streams, each a TLS link of its own between the nodes.
    let mut target = in_ns(
        &n.b,
        &[
            "run",
            "--incoming",
            "tcp:10.77.0.2:7301",
            &tls_arg,
            "--page-streams=4",
        ],
    )
    .args(vm_args(&probe, &cb_s))
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut source = in_ns(&n.a, &["run", "--socket", &socket.display().to_string()])
        .args(vm_args(&probe, &ca_s))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tests::wait_for_path(&socket, Duration::from_secs(10));
    wait_for(&ca, "PROBE PROGRESS dirty pass=5\n");
    let out: Output = in_ns(
        &n.a,
        &["migrate", "--socket", &socket.display().to_string()],
    )
    .args(["--to", "10.77.0.2:7301", &tls_arg, "--page-streams=4"])
    .output()
    .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("migrated to 10.77.0.2:7301"), "{said}");
    let s = source.wait().unwrap();
    let mut serr = String::new();
    std::io::Read::read_to_string(source.stderr.as_mut().unwrap(), &mut serr).unwrap();
    assert_eq!(s.code(), Some(0), "{serr}");
    assert!(serr.contains("the VM migrated to 10.77.0.2:7301"), "{serr}");
    let result = wait_for_line(&cb, "PROBE RESULT dirty");
    assert!(
        result.starts_with("PROBE RESULT dirty OK passes=150 cpus=2"),
        "{result}"
    );
    let text = std::fs::read_to_string(&cb).unwrap();
    assert!(
        !text.contains("probe guest: hello"),
        "the target booted afresh:\n{text}"
    );
    let t = target.wait().unwrap();
    assert_eq!(t.code(), Some(0));
    // The source's console stopped where the target's began.
    let a_text = std::fs::read_to_string(&ca).unwrap();
    assert!(!a_text.contains("PROBE RESULT"), "{a_text}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_refused_migration_keeps_the_vm_on_its_node() {
    tests::require_kvm();
    let n = nodes("mgr");
    let dir = scratch("refused");
    let probe = tests::probe_path().display().to_string();
    let (ca, cb) = (dir.join("a.log"), dir.join("b.log"));
    let (ca_s, cb_s) = (ca.display().to_string(), cb.display().to_string());
    let socket = dir.join("a.sock");
    // The target was prepared for a different machine (1 vCPU).
    let mut args_b = vm_args(&probe, &cb_s);
    args_b[5] = "1";
    let tls = tests::tls::write_dirs(&dir, &[api::protocol::MIGRATION_TLS_NAME]).remove(0);
    let tls_arg = format!("--tls-dir={}", tls.display());
    let mut target = in_ns(&n.b, &["run", "--incoming", "10.77.0.2:7302", &tls_arg])
        .args(args_b)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut source = in_ns(&n.a, &["run", "--socket", &socket.display().to_string()])
        .args(vm_args(&probe, &ca_s))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    tests::wait_for_path(&socket, Duration::from_secs(10));
    wait_for(&ca, "PROBE PROGRESS dirty pass=2\n");
    let out = in_ns(
        &n.a,
        &["migrate", "--socket", &socket.display().to_string()],
    )
    .args(["--to", "10.77.0.2:7302", &tls_arg])
    .output()
    .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("refused by the target") && said.contains("keeps running here"),
        "{said}"
    );
    assert_eq!(target.wait().unwrap().code(), Some(1));
    let mut terr = String::new();
    std::io::Read::read_to_string(target.stderr.as_mut().unwrap(), &mut terr).unwrap();
    assert!(terr.contains("prepared for 1 and 256"), "{terr}");
    // The guest carries on at home and finishes there.
    let result = wait_for_line(&ca, "PROBE RESULT dirty");
    assert!(result.starts_with("PROBE RESULT dirty OK"), "{result}");
    assert_eq!(source.wait().unwrap().code(), Some(0));
    std::fs::remove_dir_all(dir).unwrap();
}

fn launcher() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_virt-launcher"));
    c.env("RUST_LOG", "error");
    c
}

/// On one host over a unix socket, with the options a user tunes; and each bad input to
/// `migrate` named in one line with nothing changed: the VM keeps running throughout.
#[test]
fn migrate_over_a_unix_socket_and_refuse_bad_options() {
    tests::require_kvm();
    let dir = scratch("unix");
    let probe = tests::probe_path().display().to_string();
    let (ca, cb) = (dir.join("a.log"), dir.join("b.log"));
    let (ca_s, cb_s) = (ca.display().to_string(), cb.display().to_string());
    let socket = dir.join("a.sock").display().to_string();
    let incoming = dir.join("in.sock");
    let mut source = launcher()
        .args(["run", "--socket", &socket])
        .args(vm_args(&probe, &ca_s))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tests::wait_for_path(Path::new(&socket), Duration::from_secs(10));
    wait_for(&ca, "PROBE PROGRESS dirty pass=3\n");
    let migrate = |extra: &[&str]| -> Output {
        launcher()
            .args(["migrate", "--socket", &socket])
            .args(extra)
            .output()
            .unwrap()
    };
    let to = format!("unix:{}", incoming.display());
    for (args, code, says) in [
        (
            vec!["--to", "nowhere"],
            2,
            "tcp:HOST:PORT, HOST:PORT or unix:PATH",
        ),
        (vec!["--to", &to, "--bandwidth=-5Mi"], 2, "--bandwidth"),
        (vec!["--to", &to, "--bandwidth", "0"], 2, "bandwidth: 0"),
        (
            vec!["--to", &to, "--progress-timeout", "0"],
            2,
            "progressTimeout",
        ),
        (
            vec!["--to", &to, "--page-streams", "33"],
            2,
            "pageStreams: 33 is more than the 32",
        ),
        (vec!["--to", &to], 1, "is it waiting?"),
    ] {
        let out = migrate(&args);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {said}");
        assert!(said.contains(says), "{args:?}: {said}");
        assert_eq!(said.trim().lines().count(), 1, "one line: {said}");
    }
    let mut target = launcher()
        .args(["run", "--incoming", &to])
        .args(vm_args(&probe, &cb_s))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tests::wait_for_path(&incoming, Duration::from_secs(10));
    let out = migrate(&[
        "--to",
        &to,
        "--max-downtime-ms",
        "50",
        "--bandwidth",
        "1Gi",
        "--completion-timeout-per-gib",
        "60",
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    // Not a terminal: one progress line per pass, then the summary.
    assert!(said.contains("pre-copy pass 0:"), "{said}");
    assert!(said.contains(&format!("migrated to {to} in ")), "{said}");
    assert!(said.contains(" passes, "), "{said}");
    assert_eq!(source.wait().unwrap().code(), Some(0));
    let mut serr = String::new();
    std::io::Read::read_to_string(source.stderr.as_mut().unwrap(), &mut serr).unwrap();
    assert!(serr.contains(&format!("the VM migrated to {to}")), "{serr}");
    let result = wait_for_line(&cb, "PROBE RESULT dirty");
    assert!(result.starts_with("PROBE RESULT dirty OK"), "{result}");
    assert_eq!(target.wait().unwrap().code(), Some(0));
    assert!(!incoming.exists(), "the listener's socket file is removed");
    std::fs::remove_dir_all(dir).unwrap();
}
