//! The control socket end to end with the probe: start, status, console, pause/resume, events,
//! graceful shutdown, kill, SIGTERM, and a client speaking another protocol version.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use api::protocol::*;

struct Launcher {
    child: Child,
    socket: PathBuf,
    dir: PathBuf,
}

impl Launcher {
    fn start(tag: &str) -> Launcher {
        Launcher::start_with_volumes(tag, None)
    }

    /// `start`, its claims (`--volume-dir`) in `volumes` (else in its own directory).
    fn start_with_volumes(tag: &str, volumes: Option<&Path>) -> Launcher {
        tests::require_kvm();
        let dir = tests::probe_workdir(&format!("mv-daemon-{tag}"));
        let socket = dir.join("launcher.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
            .args(["daemon", "--socket"])
            .arg(&socket)
            .arg("--image-dir")
            .arg(dir.join("images"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--volume-dir")
            .arg(volumes.map_or_else(|| dir.join("volumes"), Path::to_path_buf))
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        tests::wait_for_path(&socket, Duration::from_secs(10));
        Launcher { child, socket, dir }
    }

    fn client(&self) -> Client {
        let mut c = Client::connect(&self.socket, PROTOCOL_VERSION);
        match c.recv() {
            Response::Hello { version, .. } => assert_eq!(version, PROTOCOL_VERSION),
            other => panic!("{other:?}"),
        }
        c
    }

    /// Syncs `vmi` and waits for it to start: the control client, an event stream past
    /// `Started`, and a console stream.
    fn sync_watched(&self, vmi: api::VirtualMachineInstance) -> (Client, Client, Client) {
        let mut c = self.client();
        let mut events = self.client();
        events.call(Request::Events);
        let mut con = self.client();
        c.call(Request::Sync { vmi: Box::new(vmi) });
        assert_eq!(events.recv(), Response::Event(Event::Started));
        assert_eq!(con.call(Request::Console), Response::Ok);
        (c, events, con)
    }

    fn exit_code(mut self) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(Instant::now() < deadline, "launcher did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Client {
    out: UnixStream,
    inp: BufReader<UnixStream>,
}

impl Client {
    fn connect(socket: &Path, version: u32) -> Client {
        let s = UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut c = Client {
            out: s.try_clone().unwrap(),
            inp: BufReader::new(s),
        };
        c.send(&Request::Hello { version });
        c
    }
    fn send(&mut self, r: &Request) {
        let mut s = serde_json::to_string(r).unwrap();
        s.push('\n');
        self.out.write_all(s.as_bytes()).unwrap();
    }
    fn recv(&mut self) -> Response {
        let mut line = String::new();
        self.inp.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }
    fn call(&mut self, r: Request) -> Response {
        self.send(&r);
        self.recv()
    }
    fn status(&mut self) -> StatusReport {
        match self.call(Request::Status) {
            Response::Status(s) => *s,
            other => panic!("{other:?}"),
        }
    }
}

/// A VMI booting the probe with `test` (the test's name, then any `probe.*` parameters).
fn probe_vmi(test: &str, grace: i64) -> api::VirtualMachineInstance {
    let name = test.split(' ').next().unwrap_or(test);
    serde_yaml::from_str(&format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: probe-{name}}}
spec:
  terminationGracePeriodSeconds: {grace}
  domain:
    cpu: {{cores: 2}}
    memory: {{guest: 64Mi}}
    devices: {{autoattachPodInterface: false}}
    firmware:
      kernelBoot:
        container: {{image: "microvirt/probe:latest", kernelPath: /probe}}
        kernelArgs: "console=ttyS0 probe.test={test}"
"#
    ))
    .unwrap()
}

/// Reads a console stream until `needle` shows up.
fn read_until(console: &mut impl Read, seen: &mut String, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 512];
    while !seen.contains(needle) {
        assert!(
            Instant::now() < deadline,
            "no {needle:?} on the console; got:\n{seen}"
        );
        if let Ok(n) = console.read(&mut buf) {
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
}

/// Reads until the whole line that starts with `needle` is on the console, so a verdict's words
/// (OK or the failure) are there to check, whichever they are.
fn read_line_of(console: &mut impl Read, seen: &mut String, needle: &str) {
    read_until(console, seen, needle);
    let at = seen.find(needle).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 512];
    while !seen[at..].contains('\n') {
        assert!(
            Instant::now() < deadline,
            "{needle:?} never ended its line:\n{seen}"
        );
        if let Ok(n) = console.read(&mut buf) {
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
}

#[test]
fn control_socket_end_to_end() {
    let l = Launcher::start("e2e");
    let mut c = l.client();
    assert_eq!(c.call(Request::Ping), Response::Pong);
    assert_eq!(c.status().state, VmState::NoVm);
    assert!(
        matches!(c.call(Request::Pause), Response::Error { .. }),
        "pause without a VM is an error"
    );

    let mut events = l.client();
    assert_eq!(events.call(Request::Events), Response::Ok);
    assert_eq!(
        c.call(Request::Sync {
            vmi: Box::new(probe_vmi("console", 30))
        }),
        Response::Ok
    );
    assert_eq!(events.recv(), Response::Event(Event::Started));

    // Two console readers see the same output.
    let mut con = l.client();
    assert_eq!(con.call(Request::Console), Response::Ok);
    let mut con2 = l.client();
    assert_eq!(con2.call(Request::Console), Response::Ok);
    let (mut s1, mut s2) = (String::new(), String::new());
    // Console bytes may already sit in the client's line buffer: keep reading through it.
    con.out
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    con2.out
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let stream1 = &mut con.inp;
    let stream2 = &mut con2.inp;
    read_until(stream1, &mut s1, "tick 2");
    read_until(stream2, &mut s2, "tick 2");
    assert!(
        s1.contains("microvirt probe guest: hello") && s2.contains("microvirt probe guest: hello")
    );

    let st = c.status();
    assert_eq!(
        (
            st.state.clone(),
            st.vcpus,
            st.memory_mib,
            st.name.as_deref()
        ),
        (VmState::Running, 2, 64, Some("probe-console"))
    );
    assert!(st.uptime_seconds > 0.0);

    // Pause: the guest stops printing; resume: it goes on.
    assert_eq!(c.call(Request::Pause), Response::Ok);
    assert_eq!(events.recv(), Response::Event(Event::Paused));
    assert_eq!(c.status().state, VmState::Paused);
    let mut drained = String::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = stream1.read(&mut buf) {
        if n == 0 {
            break;
        }
        drained.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    std::thread::sleep(Duration::from_millis(1200));
    assert!(
        stream1.read(&mut buf).is_err(),
        "console output while paused"
    );
    assert_eq!(c.call(Request::Resume), Response::Ok);
    assert_eq!(events.recv(), Response::Event(Event::Resumed));
    let next = format!(
        "tick {}",
        s1.matches("tick ").count() + drained.matches("tick ").count() + 1
    );
    read_until(stream1, &mut s1, &next);

    // Console input reaches the guest, which then powers off.
    con.out.write_all(b"hi\n").unwrap();
    read_until(stream1, &mut s1, "PROBE RESULT console OK received=hi");
    match events.recv() {
        Response::Event(Event::ShutDown { reason }) => assert_eq!(reason, "guest powered off"),
        other => panic!("{other:?}"),
    }
    assert_eq!(c.status().state, VmState::ShutDown);
    assert_eq!(l.exit_code(), Some(0));
}

#[test]
fn kill_graceful_shutdown_and_sigterm() {
    // Kill.
    let l = Launcher::start("kill");
    let mut c = l.client();
    let mut events = l.client();
    events.call(Request::Events);
    assert_eq!(
        c.call(Request::Sync {
            vmi: Box::new(probe_vmi("console", 30))
        }),
        Response::Ok
    );
    assert_eq!(events.recv(), Response::Event(Event::Started));
    assert_eq!(c.call(Request::Kill), Response::Ok);
    assert_eq!(
        events.recv(),
        Response::Event(Event::ShutDown {
            reason: "stopped by the host".into()
        })
    );
    assert_eq!(l.exit_code(), Some(0));

    // Shutdown: the guest gets Ctrl-Alt-Del and powers off by itself, well within the grace period.
    let l = Launcher::start("graceful");
    let (mut c, mut events, mut con) = l.sync_watched(probe_vmi("keyboard", 60));
    let mut seen = String::new();
    read_until(&mut con.inp, &mut seen, "keyboard ready");
    let t = Instant::now();
    assert_eq!(
        c.call(Request::Shutdown {
            grace_period_seconds: None
        }),
        Response::Ok
    );
    assert_eq!(
        events.recv(),
        Response::Event(Event::ShutDown {
            reason: "guest powered off".into()
        })
    );
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "the guest did not see Ctrl-Alt-Del"
    );
    read_until(
        &mut con.inp,
        &mut seen,
        "PROBE RESULT keyboard OK ctrl-alt-del",
    );
    drop(l);

    // Shutdown with a grace period: a guest that ignores Ctrl-Alt-Del is stopped after it.
    let l = Launcher::start("grace");
    let (mut c, mut events, _con) = l.sync_watched(probe_vmi("console", 30));
    let t = Instant::now();
    assert_eq!(
        c.call(Request::Shutdown {
            grace_period_seconds: Some(1)
        }),
        Response::Ok
    );
    assert!(matches!(
        events.recv(),
        Response::Event(Event::ShutDown { .. })
    ));
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "stopped before the grace period"
    );
    drop(l);

    // SIGTERM: graceful shutdown with the VMI's terminationGracePeriodSeconds (0 here).
    let l = Launcher::start("term");
    let mut c = l.client();
    c.call(Request::Sync {
        vmi: Box::new(probe_vmi("console", 0)),
    });
    // SAFETY: signalling our child.
    unsafe { libc::kill(l.child.id() as i32, libc::SIGTERM) };
    assert_eq!(l.exit_code(), Some(0));
}

#[test]
fn other_protocol_versions_are_refused_and_the_vm_is_untouched() {
    let l = Launcher::start("version");
    let mut c = l.client();
    c.call(Request::Sync {
        vmi: Box::new(probe_vmi("console", 30)),
    });
    let mut newer = Client::connect(&l.socket, PROTOCOL_VERSION + 1);
    match newer.recv() {
        Response::Error { message } => assert!(
            message.contains(&format!(
                "not supported; this launcher speaks versions 1 to {PROTOCOL_VERSION}"
            )),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    // A version-1 client is answered in version 1, and the version-2 request is refused on
    // its connection without touching the VM.
    let mut v1 = Client::connect(&l.socket, 1);
    match v1.recv() {
        Response::Hello { version, .. } => assert_eq!(version, 1),
        other => panic!("{other:?}"),
    }
    assert_eq!(v1.status().state, VmState::Running);
    match v1.call(Request::Snapshot {
        memory_path: "/tmp/x/memory".into(),
        state_path: "/tmp/x/state".into(),
        stop: false,
    }) {
        Response::Error { message } => {
            assert!(
                message.contains("snapshot needs protocol version 2"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Garbage on a fresh connection is refused too.
    let mut raw = UnixStream::connect(&l.socket).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n").unwrap();
    let mut line = String::new();
    BufReader::new(raw).read_line(&mut line).unwrap();
    assert!(line.contains("expected hello"), "{line}");
    assert_eq!(c.status().state, VmState::Running);
    // A bad request on a good connection is an error, not a disconnect.
    c.out.write_all(b"{\"request\":\"reboot\"}\n").unwrap();
    assert!(matches!(c.recv(), Response::Error { .. }));
    assert_eq!(c.call(Request::Ping), Response::Pong);
}

#[test]
fn migrate_in_and_out_between_two_daemons() {
    let a = Launcher::start("mig-a");
    let b = Launcher::start("mig-b");
    let mut ca = a.client();
    let vmi = probe_vmi("dirty probe.passes=150", 30);
    assert_eq!(
        ca.call(Request::Sync {
            vmi: Box::new(vmi.clone())
        }),
        Response::Ok
    );
    let mut cb = b.client();
    // The pages travel on 3 page streams beside the conversation.
    let address = match cb.call(Request::PrepareMigrationTarget {
        vmi: Box::new(vmi),
        listen: "127.0.0.1:0".into(),
        tls: None,
        page_streams: 3,
    }) {
        Response::MigrationListening { address } => address,
        other => panic!("{other:?}"),
    };
    assert_eq!(cb.status().state, VmState::WaitingForMigration);
    // A second PrepareMigrationTarget while one waits is refused.
    assert!(matches!(
        b.client().call(Request::PrepareMigrationTarget {
            vmi: Box::new(probe_vmi("dirty", 30)),
            listen: "127.0.0.1:0".into(),
            tls: None,
            page_streams: 0,
        }),
        Response::Error { .. }
    ));
    std::thread::sleep(Duration::from_millis(500));
    ca.send(&Request::MigrateOut {
        target: address,
        options: MigrationOptions {
            page_streams: 3,
            ..Default::default()
        },
        tls: None,
    });
    let mut rounds = 0;
    let report = loop {
        match ca.recv() {
            Response::Event(Event::MigrationProgress { .. }) => rounds += 1,
            Response::Migration(r) => break r,
            other => panic!("{other:?}"),
        }
    };
    assert!(rounds >= 1 && report.bytes_sent > 0, "{report:?}");
    wait_running(&b);
    let console = UnixStream::connect(&b.socket).unwrap();
    console
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut c = Client {
        out: console.try_clone().unwrap(),
        inp: BufReader::new(console.try_clone().unwrap()),
    };
    c.send(&Request::Hello {
        version: PROTOCOL_VERSION,
    });
    c.recv();
    assert_eq!(c.call(Request::Console), Response::Ok);
    let mut seen = String::new();
    read_until(&mut c.inp, &mut seen, "PROBE RESULT dirty OK passes=150");
    assert_eq!(
        a.exit_code(),
        Some(0),
        "the source launcher ends once its VM left"
    );
}

/// The target resumes the guest right after the source's Go: wait for it to say so.
fn wait_running(l: &Launcher) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = l.client().status().state;
        if state == VmState::Running {
            return;
        }
        assert!(Instant::now() < deadline, "the target is {state:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Certificates for `MIGRATION_TLS_NAME` signed by a fresh CA (`tests::tls`), as the
/// standalone `--tls-dir` holds them.
fn migration_tls(dir: &Path) -> MigrationTls {
    let d = tests::tls::write_dirs(dir, &[MIGRATION_TLS_NAME]).remove(0);
    MigrationTls::from_dir(&d).unwrap()
}

#[test]
fn migration_over_mutual_tls_and_a_stranger_refused() {
    let a = Launcher::start("tls-a");
    let b = Launcher::start("tls-b");
    let vmi = probe_vmi("dirty probe.passes=100000", 30);
    let mut ca = a.client();
    assert_eq!(
        ca.call(Request::Sync {
            vmi: Box::new(vmi.clone())
        }),
        Response::Ok
    );
    let ours = migration_tls(&a.dir.join("ours"));
    let prepare = |tls: MigrationTls| match b.client().call(Request::PrepareMigrationTarget {
        vmi: Box::new(vmi.clone()),
        listen: "127.0.0.1:0".into(),
        tls: Some(tls),
        // Every page stream is a TLS link of its own, authenticated like the conversation.
        page_streams: 2,
    }) {
        Response::MigrationListening { address } => address,
        other => panic!("{other:?}"),
    };
    let migrate = |ca: &mut Client, address: String, tls: MigrationTls| {
        ca.send(&Request::MigrateOut {
            target: address,
            options: MigrationOptions {
                page_streams: 2,
                ..Default::default()
            },
            tls: Some(tls),
        });
        loop {
            match ca.recv() {
                Response::Event(_) => continue,
                other => return other,
            }
        }
    };
    // A source whose certificate another CA signed is turned away; the VM stays home.
    let address = prepare(ours.clone());
    let stranger = migration_tls(&a.dir.join("stranger"));
    match migrate(&mut ca, address, stranger) {
        Response::Error { message } => assert!(!message.is_empty()),
        other => panic!("a stranger migrated: {other:?}"),
    }
    assert_eq!(ca.status().state, VmState::Running);
    std::thread::sleep(Duration::from_millis(300));
    // With the shared CA it goes through.
    let address = prepare(ours.clone());
    match migrate(&mut ca, address, ours) {
        Response::Migration(r) => assert!(r.bytes_sent > 0),
        other => panic!("{other:?}"),
    }
    wait_running(&b);
    assert_eq!(a.exit_code(), Some(0));
}

/// `/proc/<pid>/task/*/status` field values of every thread.
fn thread_fields(pid: u32, field: &str) -> Vec<(String, String)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        // A thread may end between the listing and the read (a finished client connection).
        .filter_map(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let value = status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .map(|v| v.trim().to_string())?;
            Some((comm.trim().to_string(), value))
        })
        .collect()
}

#[test]
fn the_daemon_holds_no_capability_and_no_inherited_descriptor() {
    // A descriptor the launcher's parent leaks to it (no close-on-exec).
    let leaked_path = std::env::temp_dir().join(format!("mv-leak-{}", std::process::id()));
    let leaked = std::fs::File::create(&leaked_path).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: clears FD_CLOEXEC on a descriptor this test owns.
    unsafe { libc::fcntl(leaked.as_raw_fd(), libc::F_SETFD, 0) };
    let l = Launcher::start("privileges");
    drop(leaked);
    let mut c = l.client();
    assert_eq!(
        c.call(Request::Sync {
            vmi: Box::new(probe_vmi("keyboard", 5))
        }),
        Response::Ok
    );
    wait_running(&l);
    let pid = l.child.id();
    // Started as root, yet no thread — control socket, vCPUs, devices — holds a capability,
    // and none can gain one.
    for field in ["CapEff:", "CapPrm:", "CapInh:", "CapBnd:", "CapAmb:"] {
        for (comm, v) in thread_fields(pid, field) {
            assert_eq!(v, "0000000000000000", "{comm} {field} {v}");
        }
    }
    for (comm, v) in thread_fields(pid, "NoNewPrivs:") {
        assert_eq!(v, "1", "{comm} NoNewPrivs");
    }
    // Every thread is filtered: the control filter, inherited, and the vCPU and device
    // threads' own on top.
    for (comm, v) in thread_fields(pid, "Seccomp:") {
        assert_eq!(v, "2", "{comm} Seccomp");
    }
    let open: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .collect();
    assert!(
        !open.contains(&leaked_path),
        "the inherited descriptor is still open: {open:?}"
    );
    assert!(
        open.iter().any(|p| p == Path::new("anon_inode:kvm-vm")),
        "the VM is the daemon's: {open:?}"
    );
    let _ = std::fs::remove_file(leaked_path);
}

fn hello_line() -> Vec<u8> {
    let hello = Request::Hello {
        version: PROTOCOL_VERSION,
    };
    let mut line = serde_json::to_vec(&hello).unwrap();
    line.push(b'\n');
    line
}

fn vm_hwm_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// True once the daemon has closed `s` (a read sees the end, or the connection was reset).
fn closed_by_daemon(s: &mut UnixStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue, // a greeting or an error answer before the close
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn hostile_control_clients_are_dropped_and_the_guest_goes_on() {
    use sendfd::SendWithFd;
    use std::os::fd::AsRawFd;
    let l = Launcher::start("hostile");
    let mut c = l.client();
    let sync = Request::Sync {
        vmi: Box::new(probe_vmi("console", 30)),
    };
    assert_eq!(c.call(sync), Response::Ok);
    let mut con = l.client();
    assert_eq!(con.call(Request::Console), Response::Ok);
    con.out
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut seen = String::new();
    read_until(&mut con.inp, &mut seen, "tick 1");
    let pid = l.child.id();
    let before = vm_hwm_kib(pid);

    // A trickler: a greeting, then a byte a second and never a newline. The deadline is per
    // line, so it is dropped after LINE_DEADLINE however regularly it sends.
    let socket = l.socket.clone();
    let trickler = std::thread::spawn(move || {
        let mut t = UnixStream::connect(&socket).unwrap();
        t.write_all(&hello_line()).unwrap();
        let started = Instant::now();
        let mut r = BufReader::new(t.try_clone().unwrap());
        let mut hello = String::new();
        r.read_line(&mut hello).unwrap();
        while t.write_all(b" ").is_ok() && started.elapsed() < LINE_DEADLINE * 2 {
            std::thread::sleep(Duration::from_secs(1));
        }
        started.elapsed()
    });

    // 64 MiB without a newline: refused after the 1 MiB cap, the connection dropped.
    let mut flood = UnixStream::connect(&l.socket).unwrap();
    let chunk = vec![b'x'; 1 << 20];
    let mut sent = 0usize;
    for _ in 0..64 {
        if flood.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len();
    }
    assert!(
        sent < 64 << 20 || closed_by_daemon(&mut flood, Duration::from_secs(5)),
        "a 64 MiB line was taken whole"
    );
    assert!(sent <= 8 << 20, "the daemon read {sent} bytes of one line");

    // Descriptors that no request uses: at most MAX_HELD_FDS are kept, then the connection goes.
    let mut fds = UnixStream::connect(&l.socket).unwrap();
    fds.write_all(&hello_line()).unwrap();
    let null = std::fs::File::open("/dev/null").unwrap();
    let many = vec![null.as_raw_fd(); 40];
    for _ in 0..3 {
        if fds.send_with_fd(b" ", &many).is_err() {
            break;
        }
    }
    assert!(
        closed_by_daemon(&mut fds, Duration::from_secs(5)),
        "120 unused descriptors were kept"
    );

    let lasted = trickler.join().unwrap();
    assert!(
        lasted >= LINE_DEADLINE && lasted < LINE_DEADLINE + Duration::from_secs(10),
        "the trickler was dropped after {lasted:?}"
    );
    // The guest went on, the daemon still answers, and its memory did not follow the flood.
    let ticks = seen.matches("tick ").count();
    read_until(&mut con.inp, &mut seen, &format!("tick {}", ticks + 1));
    // A fresh client: `c` has been idle as long as the trickler, and an idle connection
    // owes a line within LINE_DEADLINE too, so whether it is still open is a race.
    drop(c);
    assert_eq!(l.client().status().state, VmState::Running);
    let after = vm_hwm_kib(pid);
    assert!(
        after < before + 16 * 1024,
        "peak RSS grew from {before} KiB to {after} KiB"
    );
}

/// A console client that attaches and never reads: the guest prints far more than the
/// socket holds, finishes, and a snapshot taken meanwhile succeeds (no vCPU waits for a
/// console client). A client that does read sees the whole run.
#[test]
fn a_console_client_that_never_reads_stops_nothing() {
    let l = Launcher::start("stuckcon");
    let mut c = l.client();
    let vmi = probe_vmi("flood probe.bytes=786432", 30);
    let mut stuck = l.client();
    assert_eq!(c.call(Request::Sync { vmi: Box::new(vmi) }), Response::Ok);
    assert_eq!(stuck.call(Request::Console), Response::Ok);
    // The reader attaches later: it gets the history, then everything else.
    let mut reader = l.client();
    assert_eq!(reader.call(Request::Console), Response::Ok);
    reader
        .out
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut seen = String::new();
    read_until(&mut reader.inp, &mut seen, "flood 0000002000");
    let dir = l.dir.join("snap");
    std::fs::create_dir_all(&dir).unwrap();
    let mut answer = c.call(Request::Snapshot {
        memory_path: dir.join("memory").display().to_string(),
        state_path: dir.join("state").display().to_string(),
        stop: false,
    });
    // Progress events come first; the report follows.
    let snap = loop {
        match answer {
            Response::Event(_) => answer = c.recv(),
            Response::Snapshot(r) => break r,
            other => panic!("snapshot while flooding: {other:?}"),
        }
    };
    assert!(snap.memory_bytes > 0, "{snap:?}");
    // The whole result line: output arrives in batches, which may end mid-line.
    read_until(&mut reader.inp, &mut seen, "PROBE RESULT flood");
    let at = seen.find("PROBE RESULT flood").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen[at..].contains('\n') {
        assert!(
            Instant::now() < deadline,
            "the result line never ended: {}",
            &seen[at..]
        );
        let mut buf = [0u8; 512];
        if let Ok(n) = reader.inp.read(&mut buf) {
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
    let line = seen[at..].lines().next().unwrap_or_default();
    assert_eq!(
        line.trim_end(),
        "PROBE RESULT flood OK lines=12288 bytes=786432"
    );
    assert_eq!(l.exit_code(), Some(0));
}

/// SoftReboot: the guest gets Ctrl-Alt-Del, reboots (a reset through the keyboard controller),
/// and its reset restarts it in the same launcher — status Running throughout, the console
/// attached across the reboot, its input reaching the new guest. Refused while paused; once a
/// shutdown was asked for, the reset ends the VM.
#[test]
fn a_soft_reboot_restarts_the_guest_in_the_same_launcher() {
    let l = Launcher::start("softreboot");
    let (mut c, mut events, mut con) = l.sync_watched(probe_vmi("console probe.cad=reboot", 30));
    let mut seen = String::new();
    read_until(&mut con.inp, &mut seen, "tick 1\n");

    assert_eq!(c.call(Request::Pause), Response::Ok);
    assert_eq!(
        c.call(Request::SoftReboot),
        Response::Error {
            message: "VMI is paused".into()
        }
    );
    assert_eq!(c.call(Request::Resume), Response::Ok);
    assert_eq!(events.recv(), Response::Event(Event::Paused));
    assert_eq!(events.recv(), Response::Event(Event::Resumed));

    assert_eq!(c.call(Request::SoftReboot), Response::Ok);
    read_until(&mut con.inp, &mut seen, "probe: ctrl-alt-del, rebooting");
    assert_eq!(events.recv(), Response::Event(Event::Started));
    let after = seen
        .split("rebooting")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    let mut again = after.clone();
    read_until(&mut con.inp, &mut again, "tick 1\n");
    assert!(again.contains("microvirt probe guest: hello"), "{again}");
    let s = c.status();
    assert_eq!((s.state, s.reboots), (VmState::Running, 1));
    assert!(s.end.is_none());

    // The new guest reads the same console input; a power-off still ends the VM.
    con.out.write_all(b"ok\n").unwrap();
    read_until(
        &mut con.inp,
        &mut again,
        "PROBE RESULT console OK received=ok",
    );
    assert_eq!(
        events.recv(),
        Response::Event(Event::ShutDown {
            reason: "guest powered off".into()
        })
    );
    drop(l);

    // A shutdown asked for: the guest's reboot on Ctrl-Alt-Del ends the VM, not a loop.
    let l = Launcher::start("softreboot-stop");
    let (mut c, mut events, _con) = l.sync_watched(probe_vmi("console probe.cad=reboot", 30));
    assert_eq!(
        c.call(Request::Shutdown {
            grace_period_seconds: None
        }),
        Response::Ok
    );
    assert_eq!(
        events.recv(),
        Response::Event(Event::ShutDown {
            reason: "guest requested a reset".into()
        })
    );
    assert_eq!(c.status().reboots, 0);
    assert!(matches!(
        c.call(Request::SoftReboot),
        Response::Error { message } if message.starts_with("the VM has ended")
    ));
}

/// The extension KubeVirt's snapshots get from microvirt, at the launcher: a VMI annotated
/// `snapshot.microvirt.io/start-from-state: CLAIM` resumes the machine state in that claim's
/// directory instead of booting — two launchers from one state, each its own machine (its own
/// generation ID), the guest going on where it was; a claim without a state, or one whose
/// state does not fit the VMI, fails the Sync with the annotation named and starts nothing.
#[test]
fn a_vmi_annotated_with_a_machine_state_resumes_it_instead_of_booting() {
    let source = Launcher::start("state-source");
    let volumes = tests::probe_workdir("mv-daemon-state-claims");
    let claim = volumes.join("vmstate-1");
    std::fs::create_dir_all(&claim).unwrap();
    let (mut c, _events, mut con) = source.sync_watched(probe_vmi("dirty probe.passes=30", 30));
    let mut seen = String::new();
    read_until(&mut con.inp, &mut seen, "PROBE PROGRESS dirty pass=3");
    let answer = loop {
        match c.call(Request::Snapshot {
            memory_path: claim.join("memory").display().to_string(),
            state_path: claim.join("state").display().to_string(),
            stop: true,
        }) {
            Response::Event(_) => continue,
            other => break other,
        }
    };
    let Response::Snapshot(report) = answer else {
        panic!("snapshot: {answer:?}")
    };
    assert!(report.memory_bytes >= 64 << 20, "{report:?}");
    let first_id = seen
        .lines()
        .find_map(|l| l.strip_prefix("PROBE GENID "))
        .expect("the probe announces its generation ID")
        .to_string();
    drop(source);

    let annotated = |claim: &str| {
        let mut vmi = probe_vmi("dirty probe.passes=30", 30);
        vmi.metadata.annotations = Some(
            [(
                api::snapshot::ANNOTATION_START_FROM_STATE.to_string(),
                claim.to_string(),
            )]
            .into(),
        );
        vmi
    };
    let mut ids = Vec::new();
    let mut launchers = Vec::new();
    for i in 0..2 {
        let l = Launcher::start_with_volumes(&format!("state-copy-{i}"), Some(&volumes));
        let (_c, _e, mut con) = l.sync_watched(annotated("vmstate-1"));
        let mut seen = String::new();
        read_line_of(&mut con.inp, &mut seen, "PROBE RESULT dirty");
        assert!(
            !seen.contains("microvirt probe guest: hello"),
            "the guest booted instead of resuming:\n{seen}"
        );
        assert!(seen.contains("PROBE RESULT dirty OK"), "{seen}");
        let id = seen
            .lines()
            .find_map(|l| l.strip_prefix("PROBE GENID "))
            .unwrap_or_else(|| panic!("no new generation announced:\n{seen}"))
            .to_string();
        ids.push(id);
        launchers.push(l);
    }
    assert_ne!(ids[0], first_id);
    assert_ne!(ids[1], first_id);
    assert_ne!(ids[0], ids[1]);

    // No state in the claim; a state that does not fit the VMI (another vCPU count).
    let l = Launcher::start_with_volumes("state-bad", Some(&volumes));
    let mut c = l.client();
    std::fs::create_dir_all(volumes.join("empty")).unwrap();
    let Response::Error { message } = c.call(Request::Sync {
        vmi: Box::new(annotated("empty")),
    }) else {
        panic!("a claim without a state was taken")
    };
    assert!(
        message.contains("snapshot.microvirt.io/start-from-state")
            && message.contains("holds no machine state"),
        "{message}"
    );
    let mut other = annotated("vmstate-1");
    other.spec.domain.cpu.as_mut().unwrap().cores = Some(1);
    let Response::Error { message } = c.call(Request::Sync {
        vmi: Box::new(other),
    }) else {
        panic!("a state of another shape was taken")
    };
    assert!(
        message.contains("cannot start from the machine state in claim \"vmstate-1\""),
        "{message}"
    );
    assert_eq!(c.status().state, VmState::NoVm);
    drop(launchers);
    let _ = std::fs::remove_dir_all(volumes);
}
