//! vhost-user devices: the device's data path runs in another process (virtiofsd,
//! qemu-storage-daemon, a DPDK switch) that maps guest RAM itself. This VMM keeps the
//! virtio-mmio transport and hands the backend, over the rust-vmm `vhost` crate's frontend,
//! what the driver set up: the negotiated features, the memory table (guest RAM is a shared
//! memfd, see `GuestRam::shared`), each ring's addresses and position, the ioeventfd KVM
//! signals on a queue notification (so the guest's kicks reach the backend directly), and a
//! call eventfd the event thread turns into the virtio-mmio interrupt (the driver must see
//! the used-ring bit in InterruptStatus, so the backend cannot inject it alone).
//!
//! Every exchange with the backend happens on the event-manager thread, never on a vCPU: a
//! driver's status write only queues the work (`Pending`). The socket has a timeout, so a
//! backend that stops answering costs that thread seconds, not the VM; a backend that fails
//! makes the device ask for a reset (DEVICE_NEEDS_RESET), and the VM runs on. A NIC's
//! backend that disconnects (a switch restarting) is waited for instead: a thread reconnects
//! to the same socket for up to [`RECONNECT_WINDOW`] and the rings are handed to the new
//! backend from the used indexes in guest memory, as QEMU does; frames in flight may be sent
//! twice or lost, which networks tolerate. Disks and shares are not reconnected: a disk's
//! requests in flight (completed out of order) and virtiofsd's open files are not recoverable
//! from the rings alone.

pub mod blk;
mod event_handler;
pub mod fs;
pub mod log;
pub mod net;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use vhost::vhost_user::message::{
    VhostUserProtocolFeatures, VhostUserVirtioFeatures, VhostUserVringAddrFlags,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryBackend;
use vmm_sys_util::eventfd::EventFd;

use self::log::SharedDirtyLog;
use super::{ActivateError, DeviceBase, VirtioDevice, VirtioInterrupt};
use crate::memory::GuestMemory;

/// How long one request to the backend may take before the device gives up on it.
pub const BACKEND_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a NIC whose backend went away waits for a backend on the same socket.
pub const RECONNECT_WINDOW: Duration = Duration::from_secs(60);

/// The virtio feature bits a vhost-user device may offer the driver: the device type's own
/// (0-23), indirect descriptors, event index and VERSION_1. Anything else the backend offers
/// (packed rings, IOMMU platform access, its protocol-feature bit) is the transport's or
/// the frontend's business, not the driver's.
const DRIVER_VISIBLE_FEATURES: u64 = 0x00ff_ffff | 1 << 28 | 1 << 29 | super::VIRTIO_F_VERSION_1;

/// The protocol features this frontend uses when the backend has them.
fn wanted_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::LOG_SHMFD
}

#[derive(Debug, thiserror::Error)]
pub enum VhostUserError {
    #[error("vhost-user backend {socket}: cannot connect: {reason}")]
    Connect { socket: String, reason: String },
    #[error("vhost-user backend {socket}: {step}: {reason}")]
    Protocol {
        socket: String,
        step: &'static str,
        reason: String,
    },
    #[error("vhost-user backend {socket}: {reason}")]
    Unsuitable { socket: String, reason: String },
}

/// Bounds every exchange with a backend. A socket timeout alone cannot: the vhost crate
/// retries a read that timed out (EAGAIN) forever. When an armed deadline passes, this
/// shuts the socket down, so the pending read sees end-of-file and the exchange fails.
struct Watchdog {
    shared: Arc<WatchShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct WatchShared {
    state: std::sync::Mutex<WatchState>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct WatchState {
    deadline: Option<std::time::Instant>,
    fired: bool,
    stop: bool,
}

impl Watchdog {
    fn start(fd: std::os::fd::RawFd) -> std::io::Result<Watchdog> {
        let shared = Arc::new(WatchShared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("vhost-user-watch".into())
            .spawn(move || {
                let mut g = s.state.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if g.stop {
                        return;
                    }
                    match g.deadline {
                        None => g = s.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                        Some(d) => {
                            let now = std::time::Instant::now();
                            if now >= d {
                                // SAFETY: the connection owning `fd` outlives this thread
                                // (its Drop stops and joins it first).
                                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                                g.fired = true;
                                g.deadline = None;
                            } else {
                                g =
                                    s.cv.wait_timeout(g, d - now)
                                        .unwrap_or_else(|p| p.into_inner())
                                        .0;
                            }
                        }
                    }
                }
            })?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    fn set(&self, deadline: Option<std::time::Instant>) {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .deadline = deadline;
        self.shared.cv.notify_all();
    }

    /// Arms the deadline for one exchange; disarmed when the guard drops.
    fn arm(&self) -> WatchGuard<'_> {
        self.set(Some(std::time::Instant::now() + BACKEND_TIMEOUT));
        WatchGuard(self)
    }

    fn fired(&self) -> bool {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .fired
    }

    /// Why an exchange failed: the deadline, if this shut the socket, else the error.
    fn explain(&self, e: vhost::Error) -> String {
        if self.fired() {
            timed_out()
        } else {
            reason(e)
        }
    }
}

struct WatchGuard<'a>(&'a Watchdog);

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        self.0.set(None);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stop = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An open, owned connection to a backend, with what it offered.
pub struct Connection {
    /// Declared before `frontend`: dropped (and joined) before the socket closes.
    watchdog: Watchdog,
    frontend: Frontend,
    socket: PathBuf,
    /// The backend's virtio features (VHOST_USER_GET_FEATURES).
    features: u64,
    /// Protocol features both sides use (empty when the backend lacks the protocol bit).
    protocol: VhostUserProtocolFeatures,
}

impl Connection {
    /// Connects, takes ownership and negotiates protocol features. Refuses, with the socket
    /// path and the reason, a path that is not a listening socket, a peer that does not speak
    /// vhost-user or stops answering, and a backend with fewer than `min_queues` queues.
    pub fn open(socket: &Path, min_queues: usize) -> Result<Connection, VhostUserError> {
        let name = socket.display().to_string();
        let connect_err = |reason: String| VhostUserError::Connect {
            socket: name.clone(),
            reason,
        };
        // A backend that just bound its socket may not listen yet: a few retries, as the vhost
        // crate's own `connect` does.
        let mut tries = 5;
        let stream = loop {
            match UnixStream::connect(socket) {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && tries > 0 => {
                    tries -= 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                r => break r.map_err(|e| connect_err(e.to_string()))?,
            }
        };
        let mut frontend = Frontend::from_stream(stream, min_queues as u64);
        let watchdog = Watchdog::start(std::os::fd::AsRawFd::as_raw_fd(&frontend))
            .map_err(|e| connect_err(e.to_string()))?;
        let guard = watchdog.arm();
        let step_err = |step: &'static str| {
            let socket = name.clone();
            let watchdog = &watchdog;
            move |e: vhost::Error| VhostUserError::Protocol {
                socket,
                step,
                reason: watchdog.explain(e),
            }
        };
        frontend.set_owner().map_err(step_err("SET_OWNER"))?;
        let features = frontend.get_features().map_err(step_err("GET_FEATURES"))?;
        let mut protocol = VhostUserProtocolFeatures::empty();
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            // The vhost crate wants the protocol-features bit acked before
            // GET_PROTOCOL_FEATURES, and libvhost-user refuses a feature set without
            // VERSION_1: ack what the device may use; activation acks the driver's choice.
            frontend
                .set_features(
                    features & DRIVER_VISIBLE_FEATURES
                        | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
                )
                .map_err(step_err("SET_FEATURES"))?;
            let offered = frontend
                .get_protocol_features()
                .map_err(step_err("GET_PROTOCOL_FEATURES"))?;
            protocol = offered & wanted_protocol_features();
            frontend
                .set_protocol_features(protocol)
                .map_err(step_err("SET_PROTOCOL_FEATURES"))?;
        }
        if protocol.contains(VhostUserProtocolFeatures::MQ) {
            let n = frontend
                .get_queue_num()
                .map_err(step_err("GET_QUEUE_NUM"))?;
            if (n as usize) < min_queues {
                return Err(VhostUserError::Unsuitable {
                    socket: name,
                    reason: format!("offers {n} queue(s); the device needs {min_queues}"),
                });
            }
        }
        if features & super::VIRTIO_F_VERSION_1 == 0 {
            return Err(VhostUserError::Unsuitable {
                socket: name,
                reason: "does not offer VIRTIO_F_VERSION_1 (a legacy-only backend)".into(),
            });
        }
        drop(guard);
        Ok(Connection {
            watchdog,
            frontend,
            socket: socket.to_path_buf(),
            features,
            protocol,
        })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The backend's config space, `len` bytes (VHOST_USER_GET_CONFIG): a device whose config
    /// only the backend knows (a disk's capacity) needs the CONFIG protocol feature.
    pub fn config(&mut self, len: usize) -> Result<Vec<u8>, VhostUserError> {
        let socket = self.socket.display().to_string();
        if !self.protocol.contains(VhostUserProtocolFeatures::CONFIG) {
            return Err(VhostUserError::Unsuitable {
                socket,
                reason: "does not offer its config space (protocol feature CONFIG)".into(),
            });
        }
        let _guard = self.watchdog.arm();
        let zeros = vec![0u8; len];
        let got = self.frontend.get_config(
            0,
            len as u32,
            vhost::vhost_user::message::VhostUserConfigFlags::empty(),
            &zeros,
        );
        match got {
            Ok((_, bytes)) => Ok(bytes),
            Err(e) => Err(VhostUserError::Protocol {
                socket,
                step: "GET_CONFIG",
                reason: self.watchdog.explain(e),
            }),
        }
    }

    /// The features the driver may be offered.
    pub fn driver_features(&self) -> u64 {
        self.features & DRIVER_VISIBLE_FEATURES
    }

    /// Whether the backend logs the guest memory it writes into a shared log (VHOST_F_LOG_ALL
    /// with the LOG_SHMFD protocol feature), which a live migration needs.
    pub fn logs_dirty_pages(&self) -> bool {
        self.features & VhostUserVirtioFeatures::LOG_ALL.bits() != 0
            && self.protocol.contains(VhostUserProtocolFeatures::LOG_SHMFD)
    }
}

fn timed_out() -> String {
    format!(
        "no answer within {} s (is it a vhost-user backend, and alive?)",
        BACKEND_TIMEOUT.as_secs()
    )
}

/// A hand-written exchange's error, or the deadline if the watchdog cut it short.
fn watchdog_or(watchdog: &Watchdog, e: String) -> String {
    if watchdog.fired() {
        format!("SET_LOG_BASE: {}", timed_out())
    } else {
        format!("SET_LOG_BASE: {e}")
    }
}

/// The backend's errors in words a user can act on.
fn reason(e: vhost::Error) -> String {
    match e {
        vhost::Error::VhostUserProtocol(
            vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
        ) => "the backend closed the connection".into(),
        vhost::Error::VhostUserProtocol(vhost::vhost_user::Error::InvalidMessage) => {
            "the backend sent a malformed reply".into()
        }
        other => other.to_string(),
    }
}

/// Work a driver's status write asked for, done in order on the event thread.
enum Pending {
    Activate {
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    },
    Reset,
}

/// Where the device stands with its backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendState {
    /// Connected; the rings are not handed over.
    Idle,
    /// The backend runs the rings.
    Running,
    /// The rings were taken back with their positions while the vCPUs are paused (a
    /// migration's stop-and-copy): what `queue_states` reports is exact until `restart`.
    Stopped,
    /// The backend went away; a thread waits for one on the same socket ([`Reconnector`]).
    Reconnecting,
    /// The backend failed or went away: the device needs a reset and does nothing more.
    Failed,
}

/// A thread that connects to a departed backend's socket again when asked, every 250 ms for
/// up to [`RECONNECT_WINDOW`]. It is started with the device, on the thread that builds the
/// VM: the device thread's seccomp filter allows neither sockets nor new threads (a
/// connection starts its watchdog thread), and a refused connect is retried for a while,
/// which the event thread must not wait for. `ready` is written when `result` holds the new
/// connection or why there is none.
struct Reconnector {
    ask: Option<std::sync::mpsc::Sender<()>>,
    ready: EventFd,
    result: Arc<std::sync::Mutex<Option<Result<Connection, String>>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Reconnector {
    fn start(socket: PathBuf, queues: usize) -> std::io::Result<Reconnector> {
        let ready = EventFd::new(libc::EFD_NONBLOCK)?;
        let signal = ready.try_clone()?;
        let result = Arc::new(std::sync::Mutex::new(None));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ask, asked) = std::sync::mpsc::channel::<()>();
        let (r, st) = (result.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("vhost-user-reconnect".into())
            .spawn(move || {
                while asked.recv().is_ok() {
                    let deadline = std::time::Instant::now() + RECONNECT_WINDOW;
                    let got = loop {
                        if st.load(std::sync::atomic::Ordering::Relaxed) {
                            return;
                        }
                        match Connection::open(&socket, queues) {
                            Ok(c) => break Ok(c),
                            Err(e) if std::time::Instant::now() >= deadline => {
                                break Err(format!(
                                    "no backend came back within {} s (last: {e})",
                                    RECONNECT_WINDOW.as_secs()
                                ))
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(250)),
                        }
                    };
                    *r.lock().unwrap_or_else(|p| p.into_inner()) = Some(got);
                    let _ = signal.write(1);
                }
            })?;
        Ok(Reconnector {
            ask: Some(ask),
            ready,
            result,
            stop,
            thread: Some(thread),
        })
    }

    /// Starts looking for the backend; false when the thread is gone.
    fn ask(&self) -> bool {
        self.ask.as_ref().is_some_and(|a| a.send(()).is_ok())
    }

    fn take(&self) -> Option<Result<Connection, String>> {
        let _ = self.ready.read();
        self.result.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl Drop for Reconnector {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.ask.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a device type adds to the generic frontend.
pub struct DeviceShape {
    pub device_type: u32,
    pub queue_sizes: Vec<u16>,
    /// The config space the driver reads (the frontend's, e.g. virtio-fs's tag, or the
    /// backend's, fetched with `Connection::config`).
    pub config: Vec<u8>,
    /// Features the frontend itself provides (config-space fields such as a NIC's MAC): offered
    /// to the driver whether or not the backend has them, never passed on to it.
    pub local_features: u64,
    /// Backend features the driver must not see (they need queues or handling this frontend
    /// does not have, such as a control queue).
    pub hidden_features: u64,
}

/// A virtio device whose queues a vhost-user backend serves.
pub struct VhostUserDevice {
    id: String,
    /// Its queue eventfds (KVM's ioeventfds) are handed to the backend as kick fds.
    base: DeviceBase,
    conn: Connection,
    /// The backend signals these when it used buffers; one per queue.
    call_evts: Vec<EventFd>,
    pending: std::collections::VecDeque<Pending>,
    /// The interrupt of the live activation.
    interrupt: Option<Arc<VirtioInterrupt>>,
    /// The live activation's guest memory and rings (their positions are exact only while
    /// the backend does not run them: see `quiesce`).
    mem: Option<GuestMemory>,
    rings: Vec<Queue>,
    /// The dirty log the backend writes to while a migration runs.
    dirty_log: Option<Arc<SharedDirtyLog>>,
    state: BackendState,
    /// A NIC's: the thread that finds the backend again when it went away.
    reconnector: Option<Reconnector>,
    /// Whether the rings ran when the backend left: the one that comes back gets them.
    resume_rings: bool,
    /// Requested activation seen by the transport (true from `activate` until `reset`).
    activated: bool,
}

impl VhostUserDevice {
    /// A device of `shape` over `conn`.
    pub fn new(
        id: String,
        shape: DeviceShape,
        conn: Connection,
    ) -> std::io::Result<VhostUserDevice> {
        let offered = conn.driver_features() & !shape.hidden_features | shape.local_features;
        let base = DeviceBase::new(shape.device_type, &shape.queue_sizes, offered, shape.config)?;
        let reconnector = if shape.device_type == super::TYPE_NET {
            Some(Reconnector::start(
                conn.socket.clone(),
                shape.queue_sizes.len(),
            )?)
        } else {
            None
        };
        let call_evts = (0..shape.queue_sizes.len())
            .map(|_| EventFd::new(libc::EFD_NONBLOCK))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(VhostUserDevice {
            id,
            base,
            conn,
            call_evts,
            pending: Default::default(),
            interrupt: None,
            mem: None,
            rings: Vec::new(),
            dirty_log: None,
            state: BackendState::Idle,
            reconnector,
            resume_rings: false,
            activated: false,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn socket(&self) -> &Path {
        self.conn.socket()
    }

    /// A NIC's MAC (the first six bytes of its config space, which this frontend provides).
    pub fn mac(&self) -> Option<crate::config::MacAddr> {
        if self.base.device_type != super::TYPE_NET {
            return None;
        }
        let b: [u8; 6] = self.base.config.get(..6)?.try_into().ok()?;
        Some(crate::config::MacAddr(b))
    }

    pub fn backend_state(&self) -> BackendState {
        self.state
    }

    /// Does the queued work (on the event thread); while the backend is away it waits.
    fn run_pending(&mut self) {
        if self.state == BackendState::Reconnecting {
            return;
        }
        while let Some(p) = self.pending.pop_front() {
            let r = match p {
                Pending::Activate {
                    mem,
                    queues,
                    interrupt,
                } => {
                    self.interrupt = Some(interrupt);
                    self.mem = Some(mem);
                    self.rings = queues;
                    self.hand_over()
                }
                Pending::Reset => self.take_back(),
            };
            if let Err(e) = r {
                self.fail(&e);
            }
        }
    }

    /// The backend closed its socket. A NIC waits for a backend on the same socket (a switch
    /// restarting keeps its sockets' paths); anything else fails.
    fn backend_gone(&mut self) {
        if self.state == BackendState::Failed {
            return;
        }
        if !self.reconnector.as_ref().is_some_and(Reconnector::ask) {
            self.fail("the backend closed its socket");
            return;
        }
        tracing::warn!(device = %self.id, socket = %self.conn.socket.display(), "vhost-user: the backend closed its socket; waiting up to {} s for it to come back", RECONNECT_WINDOW.as_secs());
        self.resume_rings = self.state == BackendState::Running;
        self.state = BackendState::Reconnecting;
    }

    /// The reconnection thread finished: on a new backend that offers every feature the
    /// driver acked, the rings are handed over from the used indexes in guest memory (what
    /// the old backend completed; what it took but had not completed is offered again).
    /// Returns the new socket to watch for a hang-up.
    fn reconnected(&mut self) -> Option<std::os::fd::RawFd> {
        let got = self.reconnector.as_ref()?.take()?;
        if self.state != BackendState::Reconnecting {
            return None;
        }
        self.state = BackendState::Idle;
        let conn = match got {
            Ok(c) => c,
            Err(why) => {
                self.fail(&why);
                return None;
            }
        };
        let needed = self.base.acked_features & self.conn.features;
        if conn.features & needed != needed {
            self.fail(&format!(
                "the backend that came back lacks features the driver uses ({:#x})",
                needed & !conn.features
            ));
            return None;
        }
        self.conn = conn;
        if std::mem::take(&mut self.resume_rings) {
            if let Err(e) = self.rewind_to_used().and_then(|()| self.hand_over()) {
                self.fail(&e);
                return None;
            }
        }
        tracing::info!(device = %self.id, socket = %self.conn.socket.display(), "vhost-user: the backend is back");
        self.run_pending();
        Some(self.conn.frontend.as_raw_fd())
    }

    /// Every ready ring resumes at its used index: the state a backend that died leaves.
    fn rewind_to_used(&mut self) -> Result<(), String> {
        let mem = self.mem.clone().ok_or("no guest memory")?;
        for (i, q) in self.rings.iter_mut().enumerate().filter(|(_, q)| q.ready()) {
            let at = vm_memory::GuestAddress(q.used_ring() + 2);
            let used: u16 = vm_memory::Bytes::read_obj(&mem, at)
                .map_err(|e| format!("queue {i}: reading the used index: {e}"))?;
            q.set_next_avail(used);
            q.set_next_used(used);
        }
        Ok(())
    }

    /// The backend is gone or broke the protocol: the driver is told the device needs a reset.
    fn fail(&mut self, why: &str) {
        if self.state == BackendState::Failed {
            return;
        }
        tracing::error!(device = %self.id, socket = %self.conn.socket.display(), "vhost-user: {why}; the device needs a reset");
        self.state = BackendState::Failed;
        if let Some(i) = &self.interrupt {
            i.device_needs_reset();
        }
    }

    /// The features to set on the backend: the driver's, as far as the backend offered them
    /// (the frontend's own stay here), with the protocol bit and, while a migration logs,
    /// LOG_ALL.
    fn backend_features(&self) -> u64 {
        let mut features = self.base.acked_features & self.conn.features;
        if self.conn.features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            features |= VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        }
        if self.dirty_log.is_some() {
            features |= VhostUserVirtioFeatures::LOG_ALL.bits();
        }
        features
    }

    /// Ring `i`'s addresses as the backend maps them; with a dirty log, its used-ring writes
    /// are logged too (by guest-physical address).
    fn ring_addresses(&self, i: usize) -> Result<VringConfigData, String> {
        let q = &self.rings[i];
        let mem = self.mem.as_ref().ok_or("no guest memory")?;
        let addr = |gpa: u64| -> Result<u64, String> {
            mem.get_host_address(vm_memory::GuestAddress(gpa))
                .map(|h| h as u64)
                .map_err(|_| format!("queue {i}: ring at {gpa:#x} is outside guest RAM"))
        };
        let logging = self.dirty_log.is_some();
        Ok(VringConfigData {
            queue_max_size: self.base.queue_sizes[i],
            queue_size: q.size(),
            flags: if logging {
                VhostUserVringAddrFlags::VHOST_VRING_F_LOG.bits()
            } else {
                0
            },
            desc_table_addr: addr(q.desc_table())?,
            used_ring_addr: addr(q.used_ring())?,
            avail_ring_addr: addr(q.avail_ring())?,
            log_addr: logging.then(|| q.used_ring()),
        })
    }

    /// Hands the driver's rings to the backend (VHOST_USER_SET_MEM_TABLE, then per ready queue
    /// NUM, BASE, ADDR, CALL, KICK and ENABLE, QEMU's order, which backends are tested
    /// against), from the positions `rings` hold: zero on a fresh activation, where the guest
    /// was on a restore or after `quiesce`. Then every ring is kicked and the driver
    /// interrupted once: the guest's last notification may have gone to another backend (the
    /// migration source's) or completions may have landed while no call eventfd was set, and
    /// a spurious kick or interrupt costs a look at an index.
    fn hand_over(&mut self) -> Result<(), String> {
        if self.state == BackendState::Failed {
            return Err("the backend failed before".into());
        }
        let features = self.backend_features();
        let addresses = (0..self.rings.len())
            .filter(|&i| self.rings[i].ready())
            .map(|i| self.ring_addresses(i).map(|a| (i, a)))
            .collect::<Result<Vec<_>, _>>()?;
        let mem = self.mem.as_ref().ok_or("no guest memory")?;
        let _guard = self.conn.watchdog.arm();
        let watchdog = &self.conn.watchdog;
        let f = &mut self.conn.frontend;
        let step = |s: &'static str| move |e: vhost::Error| format!("{s}: {}", watchdog.explain(e));
        f.set_features(features).map_err(step("SET_FEATURES"))?;
        let regions = mem
            .iter()
            .map(VhostUserMemoryRegionInfo::from_guest_region)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("guest RAM is not shareable: {e}"))?;
        f.set_mem_table(&regions).map_err(step("SET_MEM_TABLE"))?;
        if let Some(log) = &self.dirty_log {
            log::set_log_base(f.as_raw_fd(), log).map_err(|e| watchdog_or(watchdog, e))?;
        }
        let enable = !self.conn.protocol.is_empty()
            || self.conn.features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        for (i, config) in &addresses {
            let (i, q) = (*i, &self.rings[*i]);
            f.set_vring_num(i, q.size())
                .map_err(step("SET_VRING_NUM"))?;
            f.set_vring_base(i, q.next_avail())
                .map_err(step("SET_VRING_BASE"))?;
            f.set_vring_addr(i, config)
                .map_err(step("SET_VRING_ADDR"))?;
            f.set_vring_call(i, &self.call_evts[i])
                .map_err(step("SET_VRING_CALL"))?;
            f.set_vring_kick(i, &self.base.queue_evts[i])
                .map_err(step("SET_VRING_KICK"))?;
            if enable {
                f.set_vring_enable(i, true)
                    .map_err(step("SET_VRING_ENABLE"))?;
            }
        }
        self.state = BackendState::Running;
        for (i, _) in &addresses {
            let _ = self.base.queue_evts[*i].write(1);
        }
        if let Some(irq) = &self.interrupt {
            irq.signal(super::INT_USED_RING);
        }
        tracing::info!(device = %self.id, socket = %self.conn.socket.display(), "vhost-user: rings handed to the backend");
        Ok(())
    }

    /// Stops the backend's rings (VHOST_USER_GET_VRING_BASE stops a ring) after a driver reset.
    fn take_back(&mut self) -> Result<(), String> {
        if !matches!(self.state, BackendState::Running | BackendState::Stopped) {
            return Ok(());
        }
        let was = std::mem::replace(&mut self.state, BackendState::Idle);
        self.rings.clear();
        if was == BackendState::Stopped {
            return Ok(());
        }
        let _guard = self.conn.watchdog.arm();
        for i in 0..self.base.queue_sizes.len() {
            if let Err(e) = self.conn.frontend.get_vring_base(i) {
                return Err(format!("GET_VRING_BASE: {}", self.conn.watchdog.explain(e)));
            }
        }
        Ok(())
    }

    /// Why a snapshot (or with `migration`, a live migration) cannot carry this device, if
    /// it cannot.
    pub fn persist_blocker(&self, migration: bool) -> Option<String> {
        if self.state == BackendState::Reconnecting {
            return Some("its backend went away and is being waited for".into());
        }
        if self.base.device_type == fs::TYPE_FS {
            return Some(
                "virtiofsd keeps the guest's open files and FUSE state, which this VMM does not transfer (VHOST_USER_SET_DEVICE_STATE_FD is not implemented)".into(),
            );
        }
        if migration && !self.conn.logs_dirty_pages() {
            return Some(
                "the backend cannot log the guest memory it writes (it lacks VHOST_F_LOG_ALL or the LOG_SHMFD protocol feature), so pages it fills during the copy would be lost".into(),
            );
        }
        None
    }

    /// From now on the backend logs the guest memory it writes into `log` (a migration's
    /// pre-copy); rings handed over later log too.
    pub fn start_logging(&mut self, log: Arc<SharedDirtyLog>) -> Result<(), String> {
        self.run_pending();
        self.dirty_log = Some(log);
        self.relog().inspect_err(|e| self.fail(e))
    }

    /// The backend stops logging.
    pub fn stop_logging(&mut self) -> Result<(), String> {
        if self.dirty_log.take().is_none() {
            return Ok(());
        }
        self.relog().inspect_err(|e| self.fail(e))
    }

    /// Tells a running backend the log, the features and the ring flags that go with
    /// `dirty_log`.
    fn relog(&mut self) -> Result<(), String> {
        if self.state != BackendState::Running {
            return Ok(());
        }
        let features = self.backend_features();
        let addresses = (0..self.rings.len())
            .filter(|&i| self.rings[i].ready())
            .map(|i| self.ring_addresses(i).map(|a| (i, a)))
            .collect::<Result<Vec<_>, _>>()?;
        let _guard = self.conn.watchdog.arm();
        let watchdog = &self.conn.watchdog;
        let f = &mut self.conn.frontend;
        let step = |s: &'static str| move |e: vhost::Error| format!("{s}: {}", watchdog.explain(e));
        if let Some(log) = &self.dirty_log {
            log::set_log_base(f.as_raw_fd(), log).map_err(|e| watchdog_or(watchdog, e))?;
        }
        f.set_features(features).map_err(step("SET_FEATURES"))?;
        for (i, config) in &addresses {
            f.set_vring_addr(*i, config)
                .map_err(step("SET_VRING_ADDR"))?;
        }
        Ok(())
    }

    /// Takes the rings back from the backend with their positions, the vCPUs being paused:
    /// GET_VRING_BASE stops a ring and says how far the backend took from it; then the
    /// requests it took and has not completed yet (a disk write in flight) are waited for,
    /// so no buffer is half-done and every completion is in guest memory (and, with a
    /// migration's log on, in the log) before the machine state is saved.
    pub fn quiesce(&mut self) -> Result<(), String> {
        self.run_pending();
        match self.state {
            BackendState::Running => {}
            BackendState::Failed => return Err("the backend failed".into()),
            BackendState::Reconnecting => {
                return Err("the backend went away and is being waited for".into())
            }
            BackendState::Idle | BackendState::Stopped => return Ok(()),
        }
        let ready: Vec<usize> = (0..self.rings.len())
            .filter(|&i| self.rings[i].ready())
            .collect();
        let bases = {
            let _guard = self.conn.watchdog.arm();
            ready
                .iter()
                .map(|&i| match self.conn.frontend.get_vring_base(i) {
                    Ok(b) => Ok(b as u16),
                    Err(e) => Err(format!("GET_VRING_BASE: {}", self.conn.watchdog.explain(e))),
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let bases = bases.inspect_err(|why| self.fail(why))?;
        self.state = BackendState::Stopped;
        let mem = self.mem.clone().ok_or("no guest memory")?;
        // Where each ring stopped is recorded before any wait, so `restart` resumes there even
        // when a backend is too slow and the wait gives up.
        for (&i, &base) in ready.iter().zip(&bases) {
            self.rings[i].set_next_avail(base);
        }
        let deadline = std::time::Instant::now() + BACKEND_TIMEOUT;
        let mut late = None;
        for (&i, &base) in ready.iter().zip(&bases) {
            let used_idx = vm_memory::GuestAddress(self.rings[i].used_ring() + 2);
            loop {
                let used: u16 = vm_memory::Bytes::read_obj(&mem, used_idx)
                    .map_err(|e| format!("queue {i}: reading the used index: {e}"))?;
                self.rings[i].set_next_used(used);
                if used == base {
                    break;
                }
                if std::time::Instant::now() >= deadline {
                    late.get_or_insert(format!(
                        "queue {i}: the backend took requests up to {base} but completed only up to {used} within {} s",
                        BACKEND_TIMEOUT.as_secs()
                    ));
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        late.map_or(Ok(()), Err)
    }

    /// Hands stopped rings back to the backend where they stopped (a migration that failed).
    pub fn restart(&mut self) -> Result<(), String> {
        if self.state != BackendState::Stopped {
            return Ok(());
        }
        self.hand_over().inspect_err(|e| self.fail(e))
    }

    /// The backend used buffers on queue `i`: tell the driver.
    fn used(&self, i: usize) {
        let _ = self.call_evts[i].read();
        if let Some(irq) = &self.interrupt {
            irq.signal(super::INT_USED_RING);
        }
    }
}

impl VirtioDevice for VhostUserDevice {
    fn base(&self) -> &DeviceBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut DeviceBase {
        &mut self.base
    }
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<(), ActivateError> {
        if self.state == BackendState::Failed {
            return Err(ActivateError::Backend(format!(
                "vhost-user backend {} failed",
                self.conn.socket.display()
            )));
        }
        self.activated = true;
        self.pending.push_back(Pending::Activate {
            mem,
            queues,
            interrupt,
        });
        self.base.announce_activation();
        Ok(())
    }
    fn reset(&mut self) {
        if self.activated {
            self.activated = false;
            self.pending.push_back(Pending::Reset);
            self.base.announce_activation();
        }
    }
    fn is_activated(&self) -> bool {
        self.activated
    }
    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        // The backend, not this process, advances the rings: their positions are known only
        // once `quiesce` took them back (the machine state is saved after it).
        self.rings.iter().map(|q| q.state()).collect()
    }
}
