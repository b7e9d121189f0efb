//! Daemon mode: one VM driven over the versioned control protocol (`api::protocol`) on a unix
//! socket, as virt-handler drives the launcher in a VM Pod. Plain threads: one per connection,
//! one watching the VM's end; the VMM's own threads do the work.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::protocol::*;
use api::validation::{default_vmi_spec, validate_vmi};
use api::VirtualMachineInstance;
use vmm::{SerialInput, SerialOutput, Vm, VmEnd};

mod connection;
mod lifecycle;

use crate::translate::{translate, Environment};
use crate::unix_socket::peer_uid;
use lifecycle::Lifecycle;

/// Console output fan-out to every attached client, with recent history for late attachers.
///
/// The guest's serial writes arrive on a vCPU thread, which must never wait for a client: each
/// write only appends to every client's bounded backlog and wakes the drain thread, which sends
/// what each socket takes without blocking (`MSG_DONTWAIT`). A client that reads too slowly
/// loses its oldest bytes and is told how many; a client that is gone is dropped.
///
/// Nothing on the vCPU's path allocates or frees: the history and every backlog are allocated
/// at their full size up front (on the control thread). A vCPU thread that grew and freed
/// buffers would have glibc's allocator trim its arena, which reads
/// /proc/sys/vm/overcommit_memory: an open(2) its seccomp filter rightly traps.
pub struct ConsoleHub {
    clients: Vec<ConsoleClient>,
    history: Vec<u8>,
    wake: Arc<std::sync::Condvar>,
    draining: bool,
    /// The drain thread sleeps until woken (every backlog was empty): the next write wakes it.
    /// Otherwise it looks again within 10 ms by itself, and writes do not wake it — the UART
    /// writes one byte at a time, and a wake-up per byte would cost the guest a context switch
    /// and lock hand-over each.
    drain_idle: bool,
}

const HISTORY: usize = 64 * 1024;
/// Console bytes held for one client that has not read them yet.
const CLIENT_BACKLOG: usize = 256 * 1024;
/// Room beyond the limits for one write (a UART writes a byte at a time).
const SLACK: usize = 4096;

impl Default for ConsoleHub {
    fn default() -> Self {
        ConsoleHub {
            clients: Vec::with_capacity(8),
            history: Vec::with_capacity(HISTORY + SLACK),
            wake: Arc::default(),
            draining: false,
            drain_idle: false,
        }
    }
}

struct ConsoleClient {
    stream: UnixStream,
    pending: VecDeque<u8>,
    dropped: u64,
}

impl ConsoleClient {
    /// Appends within the backlog's allocation: the oldest bytes make room first.
    fn queue(&mut self, bytes: &[u8]) {
        let bytes = &bytes[bytes.len().saturating_sub(CLIENT_BACKLOG)..];
        let over = (self.pending.len() + bytes.len()).saturating_sub(CLIENT_BACKLOG);
        if over > 0 {
            let cut = over.min(self.pending.len());
            self.pending.drain(..cut);
            self.dropped += over as u64;
        }
        self.pending.extend(bytes);
    }

    /// Sends what the socket takes now; an error when the client is gone.
    fn drain(&mut self) -> std::io::Result<()> {
        if self.dropped > 0 {
            let notice = format!(
                "\r\n[microvirt: {} bytes of console output were dropped: this client read too slowly]\r\n",
                self.dropped
            );
            for b in notice.bytes().rev() {
                self.pending.push_front(b);
            }
            self.dropped = 0;
        }
        while !self.pending.is_empty() {
            let (front, _) = self.pending.as_slices();
            // SAFETY: send reads at most `front.len()` bytes from `front`.
            let n = unsafe {
                libc::send(
                    self.stream.as_raw_fd(),
                    front.as_ptr().cast(),
                    front.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                return match e.kind() {
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(()),
                    _ => Err(e),
                };
            }
            self.pending.drain(..n as usize);
        }
        Ok(())
    }
}

impl ConsoleHub {
    /// Adds a client (it first gets the history) and starts the drain thread once.
    pub fn attach(hub: &Arc<Mutex<ConsoleHub>>, stream: UnixStream) {
        let mut h = hub.lock().unwrap();
        let mut c = ConsoleClient {
            stream,
            pending: VecDeque::with_capacity(CLIENT_BACKLOG + SLACK),
            dropped: 0,
        };
        c.queue(&h.history);
        h.clients.push(c);
        h.wake.notify_one();
        if !h.draining {
            h.draining = true;
            let hub = hub.clone();
            std::thread::spawn(move || drain_console(&hub));
        }
    }
}

fn drain_console(hub: &Mutex<ConsoleHub>) {
    let mut h = hub.lock().unwrap();
    loop {
        h.clients.retain_mut(|c| c.drain().is_ok());
        let wake = h.wake.clone();
        // A client that could not take everything is retried shortly; otherwise sleep until
        // the guest writes again.
        h = if h.clients.iter().any(|c| !c.pending.is_empty()) {
            wake.wait_timeout(h, Duration::from_millis(10)).unwrap().0
        } else {
            h.drain_idle = true;
            let mut h = wake.wait(h).unwrap();
            h.drain_idle = false;
            h
        };
    }
}

impl Write for ConsoleHub {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Room first, so the history never outgrows its allocation.
        let buf_tail = &buf[buf.len().saturating_sub(HISTORY)..];
        let over = (self.history.len() + buf_tail.len()).saturating_sub(HISTORY);
        self.history.drain(..over.min(self.history.len()));
        self.history.extend_from_slice(buf_tail);
        for c in &mut self.clients {
            c.queue(buf);
        }
        if self.drain_idle && !self.clients.is_empty() {
            self.drain_idle = false;
            self.wake.notify_one();
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Default)]
struct Inner {
    life: Lifecycle<Arc<Vm>>,
    name: Option<String>,
    started: Option<Instant>,
    vcpus: u32,
    memory_mib: u64,
    software_emulated: bool,
    grace_seconds: u64,
    console_input: Option<std::fs::File>,
    ephemeral: Vec<PathBuf>,
    /// The VMI the VM was built from (Sync or an arrived migration): a guest reboot builds the
    /// next VM from it. None for a VM adopted from `run`/`restore`, whose reset ends it.
    vmi: Option<VirtualMachineInstance>,
    /// In-place reboots so far.
    reboots: u32,
    /// Set to abort the MigrateOut in progress.
    migration_abort: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The Pod network virt-handler wired (AttachNetwork), by VMI interface name.
    network: Vec<AttachedNic>,
    /// What the status reports per NIC, in the VM's NIC order.
    nic_info: Vec<NicInfo>,
}

impl Inner {
    /// Records what the daemon keeps about the VM it now runs.
    fn keep(&mut self, vm: &Vm, origin: VmOrigin) {
        self.name = Some(origin.name);
        self.started = Some(Instant::now());
        self.vcpus = vm.info.vcpus as u32;
        self.memory_mib = vm.info.memory_mib;
        self.software_emulated = vm.info.acceleration.is_software_emulated();
        self.grace_seconds = origin.grace;
        self.console_input = origin.input;
        self.ephemeral = origin.ephemeral;
        self.vmi = origin.vmi;
    }
}

/// A NIC handed over by virt-handler: its TAP (kept, so a failed start can be retried), and
/// its DHCP server's socket until the server starts.
struct AttachedNic {
    nic: HandedNic,
    tap: OwnedFd,
    dhcp: Option<OwnedFd>,
}

#[derive(Clone, Default)]
struct NicInfo {
    mac: Option<String>,
    ip_addresses: Vec<String>,
    pod_interface: Option<String>,
}

/// The control connection's reading side: every read is a recvmsg, so descriptors sent along
/// with a message (SCM_RIGHTS) are collected in arrival order instead of being dropped by a
/// plain read.
///
/// Everything on this socket comes from a peer that may be hostile (anyone who can exec into
/// the Pod as its user): the descriptors it may leave here are capped, and while a request line
/// is owed it must arrive before a deadline (`deadline`), however slowly it trickles.
struct FdReader {
    stream: UnixStream,
    fds: VecDeque<OwnedFd>,
    /// When the line being read must be complete; `None` while the peer owes nothing (console
    /// input, which may stay idle as long as its user likes).
    deadline: Option<Instant>,
}

/// At most this many descriptors per read (a VMI has at most 2 per NIC).
const MAX_FDS_PER_READ: usize = 64;

impl Read for FdReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use sendfd::RecvWithFd;
        let timeout = match self.deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no whole request line within {:?}",
                            api::protocol::LINE_DEADLINE
                        ),
                    ));
                }
                Some(left)
            }
            None => None,
        };
        self.stream.set_read_timeout(timeout)?;
        let mut fds = [-1; MAX_FDS_PER_READ];
        let (n, nfds) = self.stream.recv_with_fd(buf, &mut fds).map_err(|e| {
            if e.kind() == std::io::ErrorKind::WouldBlock {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no whole request line in time",
                )
            } else {
                e
            }
        })?;
        let mut overflow = false;
        for &fd in &fds[..nfds] {
            // SAFETY: the kernel just installed this descriptor for us; nobody else owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            if self.fds.len() >= api::protocol::MAX_HELD_FDS {
                overflow = true;
                continue; // closed here
            }
            // SAFETY: F_SETFD on a descriptor we own.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
            self.fds.push_back(fd);
        }
        if overflow {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the peer sent more than {} descriptors that no request used",
                    api::protocol::MAX_HELD_FDS
                ),
            ));
        }
        Ok(n)
    }
}

/// Reads one request line into `line`: at most `MAX_LINE_BYTES`, complete within
/// `LINE_DEADLINE`. `Ok(false)` when the peer closed the connection; an error (the connection
/// is then dropped) for a longer line, a late one, or too many descriptors.
fn read_request(reader: &mut BufReader<FdReader>, line: &mut String) -> std::io::Result<bool> {
    line.clear();
    reader.get_mut().deadline = Some(Instant::now() + api::protocol::LINE_DEADLINE);
    let n = reader
        .by_ref()
        .take(api::protocol::MAX_LINE_BYTES as u64)
        .read_line(line);
    reader.get_mut().deadline = None;
    let n = n?;
    if n >= api::protocol::MAX_LINE_BYTES && !line.ends_with('\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "a request line longer than {} bytes",
                api::protocol::MAX_LINE_BYTES
            ),
        ));
    }
    Ok(n > 0)
}

/// A duplicate of `fd` for the VM, which takes ownership of what it is given.
fn dup_for_vm(fd: &OwnedFd) -> Result<i32, String> {
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor we then own (or -1).
    let d = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if d < 0 {
        return Err(format!("dup: {}", std::io::Error::last_os_error()));
    }
    Ok(d)
}

/// A VMI ready to become a VM here: its config, and what the daemon keeps while it runs.
struct PreparedVmi {
    config: vmm::VmConfig,
    origin: VmOrigin,
}

/// What the daemon keeps about the VM it runs besides the VM itself.
struct VmOrigin {
    name: String,
    grace: u64,
    /// The write end of the guest's console input.
    input: Option<std::fs::File>,
    /// Files made for this VM alone (cloud-init disks), removed when it ends.
    ephemeral: Vec<PathBuf>,
    /// See `Inner::vmi`.
    vmi: Option<VirtualMachineInstance>,
}

impl PreparedVmi {
    /// It will never run: its files go.
    fn discard(self) {
        for f in self.origin.ephemeral {
            let _ = std::fs::remove_file(f);
        }
    }
}

pub struct Daemon {
    env: Environment,
    /// Requests being answered: the process waits for them before it exits with its VM, so a
    /// client (e.g. `migrate`, whose success ends the VM) still gets its answer.
    in_flight: std::sync::atomic::AtomicUsize,
    inner: Mutex<Inner>,
    events: Mutex<Vec<Sender<Event>>>,
    console: Arc<Mutex<ConsoleHub>>,
    /// The directory of the control socket (`listen`): in a Pod, its own sockets volume,
    /// where the migration endpoints a node agent proxies are made.
    socket_dir: std::sync::OnceLock<PathBuf>,
}

impl Daemon {
    pub fn new(env: Environment) -> Arc<Daemon> {
        Arc::new(Daemon {
            env,
            in_flight: Default::default(),
            inner: Mutex::default(),
            events: Mutex::default(),
            console: Arc::default(),
            socket_dir: Default::default(),
        })
    }

    /// A migration endpoint in this launcher's own sockets directory: `unix:NAME`, NAME a
    /// plain file name. Returns the socket's path, or None for any other address.
    fn pod_endpoint(&self, address: &str) -> Option<Result<PathBuf, String>> {
        let name = address.strip_prefix("unix:")?;
        if name.contains('/') {
            return None;
        }
        Some(self.in_socket_dir(name, address, "socket name"))
    }

    /// Plain file `name` (given as `given`) in this launcher's own sockets directory.
    fn in_socket_dir(&self, name: &str, given: &str, what: &str) -> Result<PathBuf, String> {
        if name.is_empty() || name == "." || name == ".." {
            return Err(format!("{given:?}: not a {what}"));
        }
        self.socket_dir
            .get()
            .map(|d| d.join(name))
            .ok_or_else(|| format!("{given:?}: this launcher has no control socket directory"))
    }

    /// Where a snapshot file goes: a plain file name is in this launcher's own sockets
    /// directory — the one directory of the Pod virt-handler sees on the node, so it can move
    /// a machine state on from there — any other path is taken as it is.
    fn snapshot_file(&self, path: &str) -> Result<PathBuf, String> {
        if path.contains('/') {
            return Ok(PathBuf::from(path));
        }
        self.in_socket_dir(path, path, "file name")
    }

    /// Waits (at most `timeout`) until no request is being answered.
    pub fn wait_idle(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.in_flight.load(std::sync::atomic::Ordering::SeqCst) > 0
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The console fan-out that `Console` clients attach to.
    pub fn console(&self) -> Arc<Mutex<ConsoleHub>> {
        self.console.clone()
    }

    fn emit(&self, e: Event) {
        self.events
            .lock()
            .unwrap()
            .retain(|s| s.send(e.clone()).is_ok());
    }

    fn vm(&self) -> Result<Arc<Vm>, String> {
        self.inner.lock().unwrap().life.vm()
    }

    /// A VMI turned into a VM config with the console wired to this daemon.
    fn prepare(&self, vmi: VirtualMachineInstance) -> Result<PreparedVmi, String> {
        let source = vmi.clone();
        let mut vmi = vmi;
        default_vmi_spec(&mut vmi.spec);
        validate_vmi(&vmi).map_err(|e| e.to_string())?;
        let name = vmi.metadata.name.clone().unwrap_or_else(|| "vm".into());
        let mut plan = translate(&name, &vmi.spec, &self.env).map_err(|e| e.to_string())?;
        let nic_info = self.attach_nics(&mut plan)?;
        let ephemeral = plan.prepare().map_err(|e| e.to_string())?;
        self.inner.lock().unwrap().nic_info = nic_info;
        let mut config = plan.config;
        config.filesystems = self.virtiofs_sockets(&plan.filesystems)?;
        config.serial.output = SerialOutput::Writer(self.console.clone());
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 fills two descriptors we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(format!("pipe: {}", std::io::Error::last_os_error()));
        }
        config.serial.input = SerialInput::Fd(fds[0]);
        Ok(PreparedVmi {
            config,
            origin: VmOrigin {
                name,
                grace: vmi
                    .spec
                    .termination_grace_period_seconds
                    .unwrap_or(30)
                    .max(0) as u64,
                // SAFETY: we own the write end.
                input: Some(unsafe { std::fs::File::from_raw_fd(fds[1]) }),
                ephemeral,
                vmi: Some(source),
            },
        })
    }

    /// The sockets of the Pod's virtiofsd containers (one per filesystem, beside the control
    /// socket), once each listens: they start with the launcher, so allow them a moment.
    fn virtiofs_sockets(
        &self,
        shares: &[crate::translate::FsPlan],
    ) -> Result<Vec<vmm::config::FsConfig>, String> {
        let mut out = Vec::new();
        for f in shares {
            let dir = self.socket_dir.get().ok_or_else(|| {
                format!(
                    "filesystem {}: this launcher has no sockets directory for its virtiofsd",
                    f.tag
                )
            })?;
            let socket = dir.join(api::launcher_pod::virtiofs_socket(&f.tag));
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !socket.exists() {
                if std::time::Instant::now() > deadline {
                    return Err(format!(
                        "filesystem {}: virtiofsd did not create {} within 60 s",
                        f.tag,
                        socket.display()
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            out.push(vmm::config::FsConfig {
                tag: f.tag.clone(),
                socket,
            });
        }
        Ok(out)
    }

    /// The plan's NICs on the TAPs virt-handler handed over, with their DHCP servers started,
    /// and its vhostuser NICs on the sockets Multus reports in the Pod's network-status.
    /// Without a hand-over (a launcher driven by hand) the VM runs without TAP NICs rather
    /// than not at all.
    fn attach_nics(&self, plan: &mut crate::translate::Plan) -> Result<Vec<NicInfo>, String> {
        use crate::translate::Binding;
        if plan.nics.is_empty() {
            return Ok(Vec::new());
        }
        let vhost_user: Vec<_> = (plan.nics.iter())
            .filter(|n| n.binding == Binding::VhostUser)
            .cloned()
            .collect();
        if !vhost_user.is_empty() {
            let status = std::path::Path::new(api::launcher_pod::NETWORK_INFO)
                .join(api::launcher_pod::NETWORK_STATUS_FILE);
            plan.config.vhost_user_nets = crate::network::vhost_user_nets(
                &vhost_user,
                &status,
                std::time::Duration::from_secs(120),
            )?;
        }
        let mut g = self.inner.lock().unwrap();
        let taps: Vec<_> = (plan.nics.iter())
            .filter(|n| n.binding != Binding::VhostUser)
            .collect();
        if g.network.is_empty() && !taps.is_empty() {
            let names: Vec<&str> = taps.iter().map(|n| n.interface.as_str()).collect();
            tracing::warn!(interfaces = ?names, "no TAP devices handed over; interfaces not attached");
            return Ok(Vec::new());
        }
        let mut configs = Vec::new();
        let mut info = Vec::new();
        for nic in &plan.nics {
            if nic.binding == Binding::VhostUser {
                info.push(NicInfo {
                    mac: nic.mac.map(|m| m.to_string()),
                    ip_addresses: Vec::new(),
                    pod_interface: nic.pod_interface.clone(),
                });
                continue;
            }
            let a = g
                .network
                .iter_mut()
                .find(|a| a.nic.interface == nic.interface)
                .ok_or_else(|| {
                    format!(
                        "interface {}: virt-handler handed over no TAP for it",
                        nic.interface
                    )
                })?;
            let mac = match &a.nic.mac {
                Some(m) => Some(m.parse::<vmm::config::MacAddr>().map_err(|e| {
                    format!("interface {}: handed-over MAC {m:?}: {e}", nic.interface)
                })?),
                None => nic.mac,
            };
            configs.push(vmm::config::NetConfig {
                tap: vmm::config::TapSource::Fd(dup_for_vm(&a.tap)?),
                mac,
            });
            if let (Some(fd), Some(lease), Some(m)) = (a.dhcp.take(), a.nic.dhcp.clone(), mac) {
                let socket = std::net::UdpSocket::from(fd);
                std::thread::Builder::new()
                    .name(format!("dhcp-{}", nic.interface))
                    .spawn(move || podnet::dhcp::serve(socket, m.0, lease))
                    .map_err(|e| format!("DHCP server thread: {e}"))?;
            }
            info.push(NicInfo {
                mac: mac.map(|m| m.to_string()),
                ip_addresses: a.nic.ip_addresses.clone(),
                pod_interface: a.nic.pod_interface.clone(),
            });
        }
        plan.config.nets = configs;
        Ok(info)
    }

    /// Takes the NICs virt-handler wired, with the descriptors that came with the message.
    fn attach_network(
        &self,
        nics: Vec<HandedNic>,
        count: usize,
        fds: &mut VecDeque<OwnedFd>,
    ) -> Result<(), String> {
        if fds.len() < count {
            return Err(format!(
                "attachNetwork announced {count} descriptors but {} arrived (send them with the message, SCM_RIGHTS)",
                fds.len()
            ));
        }
        let mut got: Vec<Option<OwnedFd>> = fds.drain(..count).map(Some).collect();
        let mut g = self.inner.lock().unwrap();
        if !g.life.is_empty() {
            return Err("the VM already exists: its network cannot be changed".into());
        }
        let mut attached = Vec::new();
        for nic in nics {
            let mut take = |i: usize, what: &str| {
                got.get_mut(i).and_then(Option::take).ok_or_else(|| {
                    format!(
                        "interface {}: {what} descriptor {i} is not one of the {count} sent (or is used twice)",
                        nic.interface
                    )
                })
            };
            let tap = take(nic.tap_fd, "TAP")?;
            let dhcp = match nic.dhcp_fd {
                Some(i) => Some(take(i, "DHCP socket")?),
                None => None,
            };
            if nic.dhcp.is_some() != dhcp.is_some() {
                return Err(format!(
                    "interface {}: a DHCP lease needs its socket and a socket its lease",
                    nic.interface
                ));
            }
            attached.push(AttachedNic { nic, tap, dhcp });
        }
        g.network = attached;
        Ok(())
    }

    fn sync(self: &Arc<Self>, vmi: VirtualMachineInstance) -> Result<(), String> {
        match self.inner.lock().unwrap().life {
            Lifecycle::Empty => {}
            Lifecycle::AwaitingMigration => {
                return Err("this launcher awaits an incoming migration of its VM".into())
            }
            // Sync is idempotent: the VM exists (or existed).
            _ => return Ok(()),
        }
        let state = self.machine_state_of(&vmi)?;
        let p = self.prepare(vmi)?;
        let built = match &state {
            None => Vm::build(&p.config),
            Some((_, paths)) => Vm::restore(&p.config, paths),
        };
        match built {
            Ok(vm) => {
                self.install(Arc::new(vm), p.origin);
                Ok(())
            }
            Err(e) => {
                p.discard();
                Err(match state {
                    None => e.to_string(),
                    Some((claim, _)) => format!(
                        "metadata.annotations[{}]: cannot start from the machine state in claim {claim:?}: {e}",
                        api::snapshot::ANNOTATION_START_FROM_STATE
                    ),
                })
            }
        }
    }

    /// The snapshot files a VMI starts from (`snapshot.microvirt.io/start-from-state`): in
    /// the named claim's directory, which the Pod mounts where the launcher finds claims, and
    /// which must not lead out of it.
    fn machine_state_of(
        &self,
        vmi: &VirtualMachineInstance,
    ) -> Result<Option<(String, vmm::SnapshotPaths)>, String> {
        let Some(claim) = api::snapshot::start_from_state(vmi.metadata.annotations.as_ref()) else {
            return Ok(None);
        };
        let field = format!(
            "metadata.annotations[{}]",
            api::snapshot::ANNOTATION_START_FROM_STATE
        );
        if claim.is_empty() || claim.contains('/') || claim == "." || claim == ".." {
            return Err(format!("{field}: {claim:?} is not a claim's name"));
        }
        let root = &self.env.volume_dir;
        let dir = crate::beneath::resolve(root, &root.join(claim), "volume directory")
            .map_err(|e| format!("{field}: the claim's directory: {e}"))?;
        let [state, memory] = api::snapshot::MACHINE_STATE_FILES.map(|f| {
            crate::beneath::resolve(root, &dir.join(f), "volume directory")
                .map_err(|e| format!("{field}: claim {claim:?} holds no machine state: {e}"))
        });
        Ok(Some((
            claim.to_string(),
            vmm::SnapshotPaths {
                state: state?,
                memory: memory?,
            },
        )))
    }

    /// The target side of a live migration: listens on `listen` for one source and, once the
    /// VM has arrived, runs it as if it had been Synced here.
    ///
    /// `listen` as `unix:NAME` is a socket in this launcher's sockets directory (a node agent
    /// proxies the stream to it): only the requester's user may connect to it. The source
    /// connects `1 + page_streams` times: the conversation, then its page streams.
    fn migrate_in(
        self: &Arc<Self>,
        vmi: VirtualMachineInstance,
        listen: &str,
        tls: Option<MigrationTls>,
        page_streams: u8,
        requester: Option<u32>,
    ) -> Result<String, String> {
        api::protocol::validate_page_streams(page_streams)?;
        if !self.inner.lock().unwrap().life.is_empty() {
            return Err("this launcher already has a VM (or awaits one)".into());
        }
        let (listen, only_uid) = match self.pod_endpoint(listen) {
            Some(path) => (format!("unix:{}", path?.display()), requester),
            None => (listen.to_string(), None),
        };
        let p = self.prepare(vmi)?;
        let listener = match crate::migration_link::MigrationListener::bind(&listen, tls.is_some())
        {
            Ok(l) => l,
            Err(e) => {
                p.discard();
                return Err(e);
            }
        };
        let address = listener.address();
        if let Err(e) = self.inner.lock().unwrap().life.await_migration() {
            p.discard();
            return Err(e);
        }
        let me = self.clone();
        std::thread::spawn(move || {
            // The source opens its page streams right after the conversation.
            let arrived = (0..=page_streams)
                .map(|i| match i {
                    0 => listener.accept_from(tls.as_ref(), only_uid),
                    _ => listener.accept_within(
                        tls.as_ref(),
                        only_uid,
                        crate::migration_link::LINK_TIMEOUT,
                    ),
                })
                .collect::<Result<Vec<_>, _>>()
                .and_then(|mut links| {
                    let mut conversation = links.remove(0);
                    Vm::migrate_in_streams(&mut conversation, &mut links, &p.config)
                        .map_err(|e| e.to_string())
                });
            drop(listener);
            match arrived {
                Ok(vm) => {
                    me.install(Arc::new(vm), p.origin);
                    me.emit(Event::MigratedIn);
                }
                Err(reason) => {
                    me.inner.lock().unwrap().life.migration_failed();
                    p.discard();
                    tracing::warn!("incoming migration failed: {reason}");
                    me.emit(Event::MigrationFailed { reason });
                }
            }
        });
        Ok(address)
    }

    /// The source side: streams progress to `progress` and event listeners; the VM ends as
    /// migrated on success and keeps running on failure.
    ///
    /// `address` as `listen:unix:NAME`: the stream is offered on a socket in this launcher's
    /// sockets directory, for the node agent (the requester's user only) to take within
    /// `LINK_TIMEOUT` and carry to the target; the launcher itself reaches no network.
    /// `options.page_streams` more links are opened (or offered) after the conversation's,
    /// one after the other, so every hop sees them in the same order.
    fn migrate_out(
        &self,
        address: &str,
        options: &MigrationOptions,
        tls: Option<&MigrationTls>,
        requester: Option<u32>,
        progress: &mut dyn FnMut(Event),
    ) -> Result<MigrationReport, String> {
        options.validate()?;
        let vm = self.vm()?;
        let config = migration_config(options, vm.info.memory_mib);
        {
            let mut g = self.inner.lock().unwrap();
            if g.migration_abort.is_some() {
                return Err("a migration of this VM is already in progress".into());
            }
            g.migration_abort = Some(config.abort.clone());
        }
        let mut paused_on_source = false;
        let result = (|| {
            let listener = match address.strip_prefix("listen:") {
                Some(_) if tls.is_some() => {
                    return Err("listen: hands the stream to the node agent, which holds the migration keys: tls is not taken with it".into())
                }
                Some(endpoint) => {
                    let path = self
                        .pod_endpoint(endpoint)
                        .unwrap_or_else(|| Err(format!("{address:?}: listen: takes unix:NAME")))?;
                    Some(crate::migration_link::MigrationListener::bind(
                        &format!("unix:{}", path.display()),
                        false,
                    )?)
                }
                None => None,
            };
            let mut links = (0..=options.page_streams)
                .map(|_| match &listener {
                    Some(l) => {
                        l.accept_within(None, requester, crate::migration_link::LINK_TIMEOUT)
                    }
                    None => crate::migration_link::connect(address, tls),
                })
                .collect::<Result<Vec<_>, _>>()?;
            drop(listener);
            let mut stream = links.remove(0);
            vm.migrate_out_streams(&mut stream, &mut links, &config, &mut |p| {
                let e = Event::MigrationProgress {
                    phase: p.phase.to_string(),
                    pass: p.pass,
                    data_processed_bytes: p.data_processed_bytes,
                    data_remaining_bytes: p.data_remaining_bytes,
                    dirty_memory_rate_bytes: p.dirty_rate_bytes_per_s as u64,
                    memory_transfer_rate_bytes: p.transfer_rate_bytes_per_s as u64,
                    expected_downtime_ms: p.expected_downtime.as_millis() as u64,
                    throttle_percent: p.throttle_percent,
                };
                self.emit(e.clone());
                progress(e);
            })
            .map_err(|e| {
                paused_on_source = !e.vm_stays_on_source();
                e.to_string()
            })
        })();
        if paused_on_source {
            self.inner.lock().unwrap().life.set_paused(true);
        }
        self.inner.lock().unwrap().migration_abort = None;
        match result {
            Ok(s) => Ok({
                self.inner
                    .lock()
                    .unwrap()
                    .life
                    .handed_over(address.to_string());
                MigrationReport {
                    passes: s.passes,
                    bytes_sent: s.bytes_sent,
                    total_ms: s.total_time.as_millis() as u64,
                    downtime_ms: s.downtime.as_millis() as u64,
                    max_throttle_percent: s.max_throttle_percent,
                }
            }),
            Err(reason) => {
                self.emit(Event::MigrationFailed {
                    reason: reason.clone(),
                });
                Err(reason)
            }
        }
    }

    /// Takes charge of a VM built elsewhere (`virt-launcher run --socket` and `restore
    /// --socket`): the control protocol then drives it as if a client had Synced it.
    pub fn adopt(self: &Arc<Self>, vm: Arc<Vm>, name: String, grace_seconds: u64) {
        let origin = VmOrigin {
            name,
            grace: grace_seconds,
            input: None,
            ephemeral: Vec::new(),
            vmi: None,
        };
        self.install(vm, origin);
    }

    fn install(self: &Arc<Self>, vm: Arc<Vm>, origin: VmOrigin) {
        {
            let mut g = self.inner.lock().unwrap();
            g.keep(&vm, origin);
            if let Err(e) = g.life.start(vm.clone()) {
                // Only one VM per launcher: callers check first, so this is a race lost.
                tracing::error!("{e}; the new VM is stopped");
                drop(g);
                vm.stop();
                return;
            }
        }
        self.emit(Event::Started);
        let me = self.clone();
        std::thread::spawn(move || me.watch(vm));
    }

    /// Snapshot into the two paths, streaming progress to `progress` and to event listeners.
    fn snapshot(
        &self,
        memory_path: &str,
        state_path: &str,
        stop: bool,
        progress: &mut dyn FnMut(Event),
    ) -> Result<SnapshotReport, String> {
        let vm = self.vm()?;
        let paths = vmm::SnapshotPaths {
            state: self.snapshot_file(state_path)?,
            memory: self.snapshot_file(memory_path)?,
        };
        let mut last = 0;
        let stats = vm
            .snapshot_with_progress(&paths, stop, &mut |p| {
                if let vmm::SnapshotProgress::Memory { done, total } = p {
                    // At most one event per 1/16 of memory (and the last one).
                    if done == total || done - last >= total / 16 {
                        last = done;
                        let e = Event::SnapshotProgress { done, total };
                        self.emit(e.clone());
                        progress(e);
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        if stop {
            self.inner.lock().unwrap().life.set_paused(true);
            self.emit(Event::Paused);
        }
        Ok(SnapshotReport {
            state_bytes: stats.state_bytes,
            memory_bytes: stats.memory_bytes,
            memory_written_bytes: stats.memory_written_bytes,
            paused_ms: stats.paused_for.as_millis() as u64,
        })
    }

    /// Waits for the VM's end, then records it, cleans up and tells event listeners — or, for
    /// a guest that reset without being asked to stop, reboots it in place.
    fn watch(self: &Arc<Self>, vm: Arc<Vm>) {
        let end = vm.end_signal().wait();
        let (ephemeral, reboot) = {
            let mut g = self.inner.lock().unwrap();
            let reboot = match g.vmi.clone() {
                Some(vmi) => g.life.end_or_reboot(end.clone()).then_some(vmi),
                None => {
                    g.life.finish(end.clone());
                    None
                }
            };
            g.console_input = None;
            (std::mem::take(&mut g.ephemeral), reboot)
        };
        // Stop and join the VM's threads (the last Arc drops the Vm).
        vm.stop();
        drop(vm);
        for f in ephemeral {
            let _ = std::fs::remove_file(f);
        }
        if let Some(vmi) = reboot {
            match self.reboot(vmi) {
                Ok(()) => return,
                Err(why) => {
                    self.inner.lock().unwrap().life.finish(end);
                    let reason = format!("the guest reset and could not be restarted: {why}");
                    tracing::error!("{reason}");
                    self.emit(Event::Crashed { reason });
                    return;
                }
            }
        }
        let reason = end.to_string();
        self.emit(match end {
            VmEnd::Migrated => Event::MigratedOut,
            VmEnd::PoweredOff | VmEnd::Reset | VmEnd::Stopped => Event::ShutDown { reason },
            _ => Event::Crashed { reason },
        });
    }

    /// The guest reset: a new VM from the same VMI (the same TAPs, disks and console; guest
    /// memory starts afresh as on a real reset), in this launcher, so the VMI and its Pod stay.
    /// The rebuild in the same process is how Cloud Hypervisor reboots too.
    fn reboot(self: &Arc<Self>, vmi: VirtualMachineInstance) -> Result<(), String> {
        let p = self.prepare(vmi)?;
        let vm = match Vm::build(&p.config) {
            Ok(vm) => Arc::new(vm),
            Err(e) => {
                p.discard();
                return Err(e.to_string());
            }
        };
        {
            let mut g = self.inner.lock().unwrap();
            g.keep(&vm, p.origin);
            g.reboots += 1;
            g.life.rebooted(vm.clone());
            tracing::info!(reboots = g.reboots, "the guest rebooted in place");
        }
        self.emit(Event::Started);
        let me = self.clone();
        std::thread::spawn(move || me.watch(vm));
        Ok(())
    }

    /// SoftReboot: Ctrl-Alt-Del, which Linux's init (busybox and systemd alike) turns into a
    /// clean reboot; the reset that ends it restarts the VM here (see `watch`). KubeVirt asks
    /// through its guest agent; ACPI has no reboot button, and this is the signal every
    /// guest here has.
    fn soft_reboot(&self) -> Result<(), String> {
        let g = self.inner.lock().unwrap();
        let vm = g.life.vm_to_reboot()?;
        if g.vmi.is_none() {
            return Err(
                "this VM was not started from a VMI (run/restore --socket): a reset ends it".into(),
            );
        }
        drop(g);
        vm.ctrl_alt_del();
        Ok(())
    }

    fn status(&self) -> StatusReport {
        let g = self.inner.lock().unwrap();
        let state = g.life.state();
        let (disks, nics) = match g.life.any_vm() {
            Some(vm) => (
                vm.blocks()
                    .iter()
                    .map(|b| {
                        let b = b.lock().unwrap();
                        let c = b.counters;
                        DiskCounters {
                            name: b.id.clone(),
                            requests: c.requests,
                            reads: c.reads,
                            writes: c.writes,
                            read_bytes: c.read_bytes,
                            write_bytes: c.write_bytes,
                            flushes: c.flushes,
                            errors: c.errors,
                        }
                    })
                    .collect(),
                vm.nets()
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        let n = n.lock().unwrap();
                        let c = n.counters;
                        let info = g.nic_info.get(i).cloned().unwrap_or_default();
                        NicCounters {
                            name: n.id.clone(),
                            mac: Some(info.mac.unwrap_or_else(|| n.mac().to_string())),
                            ip_addresses: info.ip_addresses,
                            pod_interface: info.pod_interface,
                            rx_frames: c.rx_frames,
                            rx_bytes: c.rx_bytes,
                            tx_frames: c.tx_frames,
                            tx_bytes: c.tx_bytes,
                            rx_errors: c.rx_errors,
                            tx_errors: c.tx_errors,
                        }
                    })
                    .collect(),
            ),
            None => (vec![], vec![]),
        };
        StatusReport {
            state,
            name: g.name.clone(),
            vcpus: g.vcpus,
            memory_mib: g.memory_mib,
            uptime_seconds: g.started.map_or(0.0, |s| s.elapsed().as_secs_f64()),
            software_emulated_kvm: g.software_emulated,
            end: g.life.end().map(|e| e.to_string()),
            disks,
            nics,
            network_attached: !g.network.is_empty(),
            reboots: g.reboots,
        }
    }

    /// Graceful shutdown: the guest gets the ACPI power button (Ctrl-Alt-Del when it does not
    /// listen to ACPI events) and `grace` seconds to end, then it is killed.
    pub fn shutdown(&self, grace: Option<u64>) -> Result<(), String> {
        let vm = {
            let mut g = self.inner.lock().unwrap();
            let vm = g.life.vm()?;
            g.life.set_stopping();
            vm
        };
        let asked = vm.request_shutdown();
        tracing::info!(?asked, "asked the guest to shut down");
        let grace = grace.unwrap_or_else(|| self.inner.lock().unwrap().grace_seconds);
        std::thread::spawn(move || {
            if vm
                .end_signal()
                .wait_timeout(Duration::from_secs(grace))
                .is_none()
            {
                vm.stop();
            }
        });
        Ok(())
    }

    /// Answers one request from a peer running as `requester` (SO_PEERCRED).
    fn handle(self: &Arc<Self>, req: Request, requester: Option<u32>) -> Response {
        let ok = |r: Result<(), String>| {
            r.map_or_else(|message| Response::Error { message }, |_| Response::Ok)
        };
        match req {
            Request::Hello { .. } => Response::Error {
                message: "already greeted".into(),
            },
            Request::Ping => Response::Pong,
            Request::Status => Response::Status(Box::new(self.status())),
            Request::Sync { vmi } => ok(self.sync(*vmi)),
            Request::Pause => ok(self.vm().and_then(|vm| {
                vm.pause().map_err(|e| e.to_string())?;
                self.inner.lock().unwrap().life.set_paused(true);
                self.emit(Event::Paused);
                Ok(())
            })),
            Request::Resume => ok(self.vm().map(|vm| {
                vm.resume();
                self.inner.lock().unwrap().life.set_paused(false);
                self.emit(Event::Resumed);
            })),
            Request::Kill => ok(self.vm().map(|vm| vm.stop())),
            Request::SoftReboot => ok(self.soft_reboot()),
            Request::Shutdown {
                grace_period_seconds,
            } => ok(self.shutdown(grace_period_seconds)),
            Request::PrepareMigrationTarget {
                vmi,
                listen,
                tls,
                page_streams,
            } => match self.migrate_in(*vmi, &listen, tls, page_streams, requester) {
                Ok(address) => Response::MigrationListening { address },
                Err(message) => Response::Error { message },
            },
            Request::CancelMigration => {
                let abort = self.inner.lock().unwrap().migration_abort.clone();
                match abort {
                    Some(a) => {
                        a.store(true, std::sync::atomic::Ordering::SeqCst);
                        Response::Ok
                    }
                    None => Response::Error {
                        message: "no migration in progress".into(),
                    },
                }
            }
            Request::Console
            | Request::Events
            | Request::Snapshot { .. }
            | Request::MigrateOut { .. }
            | Request::AttachNetwork { .. } => Response::Error {
                message: "handled by the connection".into(),
            },
        }
    }

    /// The target the VM migrated to, once it has.
    pub fn migrated_to(&self) -> Option<String> {
        let g = self.inner.lock().unwrap();
        g.life.migrated_to().map(str::to_string)
    }

    /// The VM's end, once it has ended.
    pub fn ended(&self) -> Option<VmEnd> {
        self.inner.lock().unwrap().life.end().cloned()
    }
}

/// Counts a request as being answered for as long as it lives.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> InFlight<'a> {
    fn enter(n: &'a std::sync::atomic::AtomicUsize) -> Self {
        n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Accepts connections on `socket` until the process exits.
pub fn listen(daemon: Arc<Daemon>, socket: &Path) -> std::io::Result<()> {
    let _ = std::fs::remove_file(socket);
    let listener = crate::unix_socket::bind_unix(socket)?;
    if let Some(parent) = socket.parent() {
        let _ = daemon.socket_dir.set(parent.to_path_buf());
    }
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            // Only the launcher's own user and root (virt-handler) may drive it.
            match peer_uid(&stream) {
                // SAFETY: geteuid cannot fail.
                Ok(uid) if uid == 0 || uid == unsafe { libc::geteuid() } => {}
                Ok(uid) => {
                    tracing::warn!(uid, "control connection from another user refused");
                    continue;
                }
                Err(e) => {
                    tracing::warn!("control connection: SO_PEERCRED: {e}");
                    continue;
                }
            }
            let d = daemon.clone();
            std::thread::spawn(move || {
                if let Err(e) = d.serve_connection(stream) {
                    tracing::debug!("control connection: {e}");
                }
            });
        }
    });
    Ok(())
}

/// The VMM's migration settings from the protocol's options, KubeVirt's defaults for the rest.
pub fn migration_config(
    options: &MigrationOptions,
    memory_mib: u64,
) -> vmm::migration::MigrationConfig {
    let mut config = vmm::migration::MigrationConfig::default();
    if let Some(ms) = options.max_downtime_ms {
        config.max_downtime = Duration::from_millis(ms);
    }
    if let Some(s) = options.progress_timeout_seconds {
        config.progress_timeout = Duration::from_secs(s);
    }
    config.bandwidth_limit = options.bandwidth_bytes_per_second.filter(|b| *b > 0);
    config.auto_converge = options.allow_auto_converge;
    config.with_timeout_per_gib(
        options.completion_timeout_per_gib.unwrap_or(150),
        memory_mib,
    )
}
