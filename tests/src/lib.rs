//! Support for microvirt's integration tests: building and locating guest images, running a
//! VM in-process with its console captured, and reading the probe guest's result line.

pub mod admission;
pub mod apiserver;
pub mod cluster;
pub mod discovery;
pub mod kubectl;
pub mod peers;
pub mod rbac;
pub mod storage;
pub mod tls;
pub mod virt_api;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use vmm::{SerialInput, SerialOutput, Vm, VmConfig, VmEnd};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Builds `bin` of `package` (another package's binary, which Cargo does not build for this
/// one's tests) and returns its path.
pub fn build_bin(package: &str, bin: &str) -> PathBuf {
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p", package, "--bin", bin])
        .current_dir(repo_root())
        .status()
        .unwrap();
    assert!(status.success(), "cargo build -p {package} --bin {bin}");
    repo_root().join("target/debug").join(bin)
}

/// The user a launcher Pod's containers run as (`api::launcher_pod::LAUNCHER_UID`).
pub const POD_UID: u32 = api::launcher_pod::LAUNCHER_UID as u32;

/// `cmd` (program, arguments and environment; set its stdio afterwards) as a launcher Pod's
/// container runs it: as the Pod's non-root user without any capability, in a private mount
/// namespace whose `/dev/kvm` is a node owned by that user in `dir` — what the KVM device
/// plugin gives the container. What the process writes (its state directory, ...) must be
/// owned by [`POD_UID`]: see [`chown_to_pod_user`].
pub fn as_pod_user(cmd: &Command, dir: &Path) -> Command {
    let node = dir.join("kvm");
    if !node.exists() {
        let status = Command::new("mknod")
            .arg(&node)
            .args(["c", "10", "232"])
            .status()
            .expect("mknod runs");
        assert!(status.success(), "mknod {}", node.display());
        chown_to_pod_user(&node);
    }
    let script = format!(
        "mount --bind {} /dev/kvm && exec setpriv --reuid={POD_UID} --regid={POD_UID} --clear-groups --inh-caps=-all --bounding-set=-all \"$@\"",
        node.display()
    );
    let mut c = Command::new("unshare");
    c.args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
        "sh",
    ])
    .arg(cmd.get_program())
    .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c
}

/// The cgroup of the Pod with `pod_uid` as the kubelet lays it out (`.../kubepods/pod<UID>`,
/// the cgroupfs driver's layout), created if missing: on a cgroup v1 node in the `pids`
/// hierarchy (one is enough), else in the v2 tree. A process joins it by writing its PID to
/// `cgroup.procs` there; the directory can be removed once no process is left in it.
pub fn pod_cgroup(pod_uid: &str) -> PathBuf {
    let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup/pids"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.join("cgroup.procs").exists())
        .unwrap_or(Path::new("/sys/fs/cgroup"));
    let dir = root.join(format!("microvirt-tests/kubepods/pod{pod_uid}"));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("creating the Pod cgroup {}: {e}", dir.display()));
    dir
}

/// Makes `cmd`'s process start in a cgroup laid out as the kubelet lays out the Pod with
/// `pod_uid`'s (`.../kubepods/pod<UID>`, the cgroupfs driver's layout), so virt-handler's check
/// that a socket's listener belongs to its Pod sees what it sees on a node. The process joins
/// it before it runs (a `pre_exec` write to `cgroup.procs`), so everything it starts is in it.
pub fn in_pod_cgroup(cmd: &mut Command, pod_uid: &str) {
    use std::os::unix::process::CommandExt;
    let dir = pod_cgroup(pod_uid);
    let procs = std::ffi::CString::new(
        dir.join("cgroup.procs")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .unwrap();
    // SAFETY: the closure runs in the forked child before exec and makes only async-signal-safe
    // calls (open, write, close) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // "0" means the writing process itself.
            let r = libc::write(fd, b"0".as_ptr().cast(), 1);
            let e = std::io::Error::last_os_error();
            libc::close(fd);
            if r < 0 {
                return Err(e);
            }
            Ok(())
        });
    }
}

/// Gives `path` (created if missing, as a directory) to the launcher Pod's user.
pub fn chown_to_pod_user(path: &Path) {
    if !path.exists() {
        std::fs::create_dir_all(path).unwrap();
    }
    std::os::unix::fs::chown(path, Some(POD_UID), Some(POD_UID)).unwrap();
}

/// Tests that need KVM fail loudly without it; they never pass by skipping.
/// Asserts that a finished command exited 0 and returns its stdout. A failure panics with
/// `context`, the exit status and both streams, so the report shows what the command said.
pub fn expect_success(out: &std::process::Output, context: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{context} ({}): {stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        panic!("this test needs /dev/kvm and cannot open it: {e}");
    }
}

/// Runs `guest-images/build ARGS` and returns the paths on its last output line.
pub fn build_guest_image(args: &[&str]) -> Vec<PathBuf> {
    let out = Command::new(repo_root().join("guest-images/build"))
        .args(args)
        .output()
        .expect("running guest-images/build");
    assert!(
        out.status.success(),
        "guest-images/build {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let last = stdout
        .lines()
        .last()
        .expect("guest-images/build printed nothing");
    last.split_whitespace().map(PathBuf::from).collect()
}

pub fn probe_path() -> PathBuf {
    static PROBE: OnceLock<PathBuf> = OnceLock::new();
    PROBE
        .get_or_init(|| build_guest_image(&["probe"]).remove(0))
        .clone()
}

/// A fresh scratch directory `<tmp>/<tag>-<pid>` whose `images/` holds the probe guest the way
/// `virt-launcher --image-dir` expects the `microvirt/probe:latest` kernelBoot image.
pub fn probe_workdir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let img = dir.join("images/microvirt_probe_latest");
    std::fs::create_dir_all(&img).unwrap();
    std::fs::copy(probe_path(), img.join("probe")).unwrap();
    dir
}

/// Waits until `path` exists (a socket a child process creates); panics after `timeout`.
pub fn wait_for_path(path: &Path, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A console sink shared with the test.
#[derive(Clone, Default)]
pub struct Console(Arc<Mutex<Vec<u8>>>);

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Console({} bytes)", self.len())
    }
}

impl Console {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn output(&self) -> SerialOutput {
        SerialOutput::Writer(self.0.clone() as Arc<Mutex<dyn Write + Send>>)
    }
    /// Waits until the console contains `needle`.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.text().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

/// The probe's `PROBE RESULT <test> OK|FAIL <details>` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResult {
    pub test: String,
    pub ok: bool,
    pub details: String,
}

impl ProbeResult {
    pub fn parse(console: &str) -> Option<ProbeResult> {
        let line = console
            .lines()
            .find_map(|l| l.strip_prefix("PROBE RESULT "))?;
        let mut it = line.splitn(3, ' ');
        let test = it.next()?.to_string();
        let ok = match it.next()? {
            "OK" => true,
            "FAIL" => false,
            _ => return None,
        };
        Some(ProbeResult {
            test,
            ok,
            details: it.next().unwrap_or("").trim_end().to_string(),
        })
    }

    /// The value of `key=value` in the details.
    pub fn field(&self, key: &str) -> Option<&str> {
        self.details
            .split(' ')
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
    }
}

pub struct ProbeRun {
    pub console: String,
    pub end: VmEnd,
    pub result: Option<ProbeResult>,
}

pub fn probe_config(test: &str, vcpus: u8, memory_mib: u64, console: &Console) -> VmConfig {
    let mut c = VmConfig::new(probe_path());
    c.vcpus = vcpus;
    c.memory_mib = memory_mib;
    c.cmdline = format!("console=ttyS0 probe.test={test}");
    c.serial.output = console.output();
    c.serial.input = SerialInput::None;
    c
}

/// The probe's `dirty` test: `passes` passes over its working set on `vcpus` vCPUs.
pub fn dirty_config(vcpus: u8, memory_mib: u64, passes: u32, console: &Console) -> VmConfig {
    let mut c = probe_config("dirty", vcpus, memory_mib, console);
    c.cmdline.push_str(&format!(" probe.passes={passes}"));
    c
}

/// The probe's `blkstream` test writing `writes` 4 KiB requests to a fresh 8 MiB image in `dir`;
/// returns the config and the image's path.
pub fn blkstream_config(dir: &Path, writes: u64, console: &Console) -> (VmConfig, PathBuf) {
    let image = blkstream_image(dir);
    let mut config = probe_config("blkstream", 1, 64, console);
    config.cmdline.push_str(&format!(" probe.writes={writes}"));
    config.disks = vec![vmm::config::DiskConfig::new(&image)];
    (config, image)
}

/// `dir/disk.img`: an 8 MiB blank image, room for the 512 writes `blkstream` makes by default.
pub fn blkstream_image(dir: &Path) -> PathBuf {
    let image = dir.join("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    image
}

/// Whether sector `s` of `image` (the whole file's bytes) holds what `blkstream` writes there.
pub fn blkstream_sector_ok(image: &[u8], s: u64) -> bool {
    let sector = &image[s as usize * 512..(s as usize + 1) * 512];
    let tag = format!("MVPROBE sector {s}");
    sector[..tag.len()] == *tag.as_bytes()
        && sector
            .iter()
            .enumerate()
            .skip(tag.len() + 20)
            .all(|(i, &b)| b == (s as u8).wrapping_mul(31).wrapping_add(i as u8))
}

/// The image holds exactly what `blkstream` wrote: each sector's tag and pattern for the first
/// `writes * 8` sectors, zeroes after them.
pub fn assert_blkstream_image(image: &Path, writes: u64) {
    let bytes = std::fs::read(image).unwrap();
    let sectors = writes * 8;
    for s in 0..sectors {
        assert!(blkstream_sector_ok(&bytes, s), "sector {s}");
    }
    assert!(
        bytes[sectors as usize * 512..].iter().all(|&b| b == 0),
        "written beyond what the guest wrote"
    );
}

/// Waits for the probe's `PROBE PROGRESS <test> <what>` line; fails the test after `timeout`.
pub fn wait_progress(console: &Console, test: &str, what: &str, timeout: Duration) {
    let needle = format!("PROBE PROGRESS {test} {what}\n");
    assert!(
        console.wait_for(&needle, timeout),
        "no {needle:?} within {timeout:?}; console:\n{}",
        console.text()
    );
}

/// The run's result line, which must be `test` OK, and a powered-off end.
pub fn expect_probe_ok(run: &ProbeRun, test: &str) -> ProbeResult {
    let r = run
        .result
        .clone()
        .unwrap_or_else(|| panic!("no result; end={:?}; console:\n{}", run.end, run.console));
    assert_eq!(r.test, test);
    assert!(r.ok, "probe failed: {}\n{}", r.details, run.console);
    assert_eq!(run.end, VmEnd::PoweredOff, "{}", run.console);
    r
}

/// Boots the probe with `probe.test=<test>` and waits for the VM to end.
pub fn run_probe(test: &str, vcpus: u8, memory_mib: u64, timeout: Duration) -> ProbeRun {
    require_kvm();
    run_built(
        |console| probe_config(test, vcpus, memory_mib, console),
        timeout,
    )
}

/// Builds the VM `config` describes around a fresh console and runs it to its end.
pub fn run_built(config: impl FnOnce(&Console) -> VmConfig, timeout: Duration) -> ProbeRun {
    let console = Console::default();
    let vm = Vm::build(&config(&console)).expect("building the VM");
    run_to_end(vm, &console, timeout)
}

/// A migration target's thread: the VM it received, with its console.
pub type Received =
    std::thread::JoinHandle<Result<(Vm, Console), vmm::migration::MigrationFailure>>;

/// A target on loopback receiving the VM with `config` (its console its own).
pub fn migration_target(config: VmConfig) -> (std::net::SocketAddr, Received) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let console = Console::default();
        let mut c = config;
        c.serial.output = console.output();
        Vm::migrate_in(&mut s, &c).map(|vm| (vm, console))
    });
    (addr, t)
}

/// Migrates `vm` to the target listening at `addr`.
pub fn migrate_to(
    vm: &Vm,
    addr: std::net::SocketAddr,
) -> Result<(), vmm::migration::MigrationFailure> {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    vm.migrate_out(&mut s, &Default::default(), &mut |_| {})
        .map(|_| ())
}

/// Waits for `vm` to end; a VM still running after `timeout` fails the test.
pub fn run_to_end(vm: Vm, console: &Console, timeout: Duration) -> ProbeRun {
    let ended = vm.end_signal().wait_timeout(timeout);
    if ended.is_none() {
        vm.stop();
        let _ = vm.wait();
        panic!(
            "VM still running after {timeout:?}; console:\n{}",
            console.text()
        );
    }
    let end = vm.wait();
    let text = console.text();
    ProbeRun {
        result: ProbeResult::parse(&text),
        console: text,
        end,
    }
}

/// A network namespace the test creates and removes, for real TAP/bridge/veth tests.
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new(tag: &str) -> NetNs {
        let name = format!("mv-{}-{tag}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run_ok("ip", &["netns", "add", &name]);
        let ns = NetNs { name };
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    /// Runs a command inside the namespace; panics if it fails.
    pub fn exec(&self, cmd: &[&str]) {
        let mut args = vec!["netns", "exec", &self.name];
        args.extend_from_slice(cmd);
        run_ok("ip", &args);
    }

    /// Moves the calling thread into the namespace (only this thread: setns(CLONE_NEWNET)).
    pub fn enter(&self) {
        let f = std::fs::File::open(format!("/var/run/netns/{}", self.name)).expect("netns file");
        use std::os::fd::AsRawFd;
        // SAFETY: setns on a namespace fd we hold open.
        let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

fn run_ok(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two "node" namespaces joined by a veth pair: the first is 10.78.0.1/24 (on `hv1`), the
/// second 10.78.0.2/24 (on `hv2`).
pub fn two_nodes(tag1: &str, tag2: &str) -> (NetNs, NetNs) {
    let n1 = NetNs::new(tag1);
    let n2 = NetNs::new(tag2);
    n1.exec(&[
        "ip", "link", "add", "hv1", "type", "veth", "peer", "name", "hv2",
    ]);
    n1.exec(&["ip", "link", "set", "hv2", "netns", &n2.name]);
    n1.exec(&["ip", "addr", "add", "10.78.0.1/24", "dev", "hv1"]);
    n1.exec(&["ip", "link", "set", "hv1", "up"]);
    n2.exec(&["ip", "addr", "add", "10.78.0.2/24", "dev", "hv2"]);
    n2.exec(&["ip", "link", "set", "hv2", "up"]);
    (n1, n2)
}

/// A VirtualMachineInstance booting the probe guest (64 MiB) with `probe_args` (e.g.
/// `probe.test=dhcp probe.peer=...`) and the given interfaces and networks (YAML flow lists).
pub fn probe_vmi_yaml(name: &str, probe_args: &str, interfaces: &str, networks: &str) -> String {
    format!(
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}}}
spec:
  domain:
    memory: {{guest: 64Mi}}
    devices:
      interfaces: {interfaces}
    firmware:
      kernelBoot:
        container: {{image: "microvirt/probe:latest", kernelPath: /probe}}
        kernelArgs: "console=ttyS0 {probe_args}"
  networks: {networks}
"#
    )
}

/// A Pod's network namespace as a CNI plugin leaves it: `eth0` with `pod_ip`/24, the other end
/// of the veth in a "node" namespace with `gateway`/24, the default route through it. Returns
/// (node, pod).
pub fn pod_namespace(tag: &str, pod_ip: &str, gateway: &str) -> (NetNs, NetNs) {
    let node = NetNs::new(&format!("{tag}n"));
    let pod = pod_namespace_on(&node, tag, pod_ip, gateway);
    (node, pod)
}

/// `pod_namespace` on an existing node namespace (its veth end is `v<tag>`).
pub fn pod_namespace_on(node: &NetNs, tag: &str, pod_ip: &str, gateway: &str) -> NetNs {
    let pod = NetNs::new(&format!("{tag}p"));
    let veth = format!("v{tag}");
    node.exec(&[
        "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0",
    ]);
    node.exec(&["ip", "link", "set", "eth0", "netns", &pod.name]);
    node.exec(&["ip", "addr", "add", &format!("{gateway}/24"), "dev", &veth]);
    node.exec(&["ip", "link", "set", &veth, "up"]);
    pod.exec(&["ip", "addr", "add", &format!("{pod_ip}/24"), "dev", "eth0"]);
    pod.exec(&["ip", "link", "set", "eth0", "up"]);
    pod.exec(&["ip", "route", "add", "default", "via", gateway]);
    pod
}

/// A UDP echo server in a namespace: echoes every datagram (until 4 minutes of silence) and
/// records who sent it.
/// Each datagram an echo server got: its sender and its bytes.
type Datagrams = Arc<Mutex<Vec<(std::net::SocketAddr, Vec<u8>)>>>;

pub struct UdpEcho {
    seen: Datagrams,
}

impl UdpEcho {
    /// Serves on `port` in `ns`; bound before this returns.
    pub fn start(ns: &NetNs, port: u16) -> UdpEcho {
        let name = ns.name.clone();
        let seen: Datagrams = Arc::default();
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let log = seen.clone();
        std::thread::spawn(move || {
            let ns = NetNs { name };
            ns.enter();
            std::mem::forget(ns);
            let s = std::net::UdpSocket::bind(("0.0.0.0", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(240))).unwrap();
            ready_tx.send(()).unwrap();
            let mut buf = [0u8; 1500];
            while let Ok((n, src)) = s.recv_from(&mut buf) {
                let _ = s.send_to(&buf[..n], src);
                log.lock().unwrap().push((src, buf[..n].to_vec()));
            }
        });
        ready.recv().unwrap();
        UdpEcho { seen }
    }

    /// The senders so far, one per datagram.
    pub fn seen(&self) -> Vec<std::net::SocketAddr> {
        self.seen.lock().unwrap().iter().map(|(a, _)| *a).collect()
    }

    /// The datagrams so far, in order.
    pub fn payloads(&self) -> Vec<Vec<u8>> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// Waits until a datagram from `ip` has been echoed.
    pub fn wait_from(&self, ip: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.seen().iter().any(|a| a.ip().to_string() == ip) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

/// An AF_PACKET socket on one interface: sees every frame the interface receives and sends
/// frames out of it, like a host on the other end of the wire.
pub struct PacketSocket {
    fd: std::os::fd::OwnedFd,
    ifindex: i32,
}

impl PacketSocket {
    pub fn bind(ifname: &str) -> PacketSocket {
        use std::os::fd::{AsRawFd, FromRawFd};
        let proto = (libc::ETH_P_ALL as u16).to_be() as i32;
        // SAFETY: plain socket(2).
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto) };
        assert!(
            raw >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: we own the new fd.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        let name = std::ffi::CString::new(ifname).unwrap();
        // SAFETY: NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
        assert!(ifindex > 0, "no interface {ifname}");
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto as u16;
        sll.sll_ifindex = ifindex;
        // SAFETY: bind with a sockaddr_ll of the right size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 200_000,
        };
        // SAFETY: SO_RCVTIMEO with a timeval.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        PacketSocket { fd, ifindex }
    }

    pub fn send(&self, frame: &[u8]) {
        use std::os::fd::AsRawFd;
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_ifindex = self.ifindex;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: sending from a buffer we own.
        let r = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr() as *const libc::c_void,
                frame.len(),
                0,
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(
            r,
            frame.len() as isize,
            "sendto: {}",
            std::io::Error::last_os_error()
        );
    }

    /// The next frame received on the interface (not the ones we sent) within `timeout`.
    pub fn recv_matching(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&[u8]) -> bool,
    ) -> Option<Vec<u8>> {
        use std::os::fd::AsRawFd;
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 65536];
        while Instant::now() < deadline {
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: receiving into buffers we own.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                    &mut sll as *mut _ as *mut libc::sockaddr,
                    &mut len,
                )
            };
            if n <= 0 || sll.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            let f = &buf[..n as usize];
            if pred(f) {
                return Some(f.to_vec());
            }
        }
        None
    }
}

/// The peer of the probe's `net` test on a wire: reads its greeting frames, sends `PING i` to
/// the guest's MAC and waits for `PONG i`, ends the test with `DONE`.
pub struct ProbeNetPeer<'a> {
    pub wire: &'a PacketSocket,
    pub guest: [u8; 6],
    pub me: [u8; 6],
}

impl ProbeNetPeer<'_> {
    pub const ETHERTYPE: [u8; 2] = [0x88, 0xb5];

    fn frame(&self, payload: &[u8], len: usize) -> Vec<u8> {
        let mut f = self.guest.to_vec();
        f.extend_from_slice(&self.me);
        f.extend_from_slice(&Self::ETHERTYPE);
        f.extend_from_slice(payload);
        f.resize(len, 0x11);
        f
    }

    /// The three frames the probe sends when it starts.
    pub fn greetings(&self, timeout: Duration) {
        for _ in 0..3 {
            self.wire
                .recv_matching(timeout, |f| f.len() > 14 && f[12..14] == Self::ETHERTYPE)
                .expect("greeting");
        }
    }

    /// Sends `PING i` and returns the guest's `PONG i`.
    pub fn ping(&self, i: usize, timeout: Duration) -> Vec<u8> {
        self.wire
            .send(&self.frame(format!("PING {i}").as_bytes(), 100));
        let want = format!("PONG {i}");
        self.wire
            .recv_matching(timeout, |f| {
                f.len() >= 14 + want.len()
                    && f[12..14] == Self::ETHERTYPE
                    && f[14..14 + want.len()] == *want.as_bytes()
            })
            .unwrap_or_else(|| panic!("no {want}"))
    }

    pub fn done(&self) {
        self.wire.send(&self.frame(b"DONE", 60));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_result_lines() {
        let r = ProbeResult::parse("hello\nPROBE RESULT smp OK cpus=2 mask=0x3\n").unwrap();
        assert_eq!((r.test.as_str(), r.ok), ("smp", true));
        assert_eq!(r.field("cpus"), Some("2"));
        assert_eq!(r.field("nope"), None);
        assert!(
            !ProbeResult::parse("PROBE RESULT boot FAIL e820: empty")
                .unwrap()
                .ok
        );
        assert_eq!(ProbeResult::parse("PROBE RESULT boot MAYBE"), None);
        assert_eq!(ProbeResult::parse("no result"), None);
    }
}
