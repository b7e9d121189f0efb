//! The device manager: owns the port and MMIO buses, every device by id, where each virtio
//! device sits (MMIO window and GSI) and the event-manager thread that runs device I/O. Pausing
//! it parks that thread, so a paused machine neither writes guest memory nor interrupts.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use kvm_ioctls::{IoEventAddress, VmFd};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::bus::Bus;
use crate::config::{
    DiskConfig, FsConfig, MacAddr, NetConfig, SerialConfig, SerialInput, TapSource,
    VhostUserNetConfig,
};
use crate::devices::ged::Ged;
use crate::devices::i8042::persist::I8042Args;
use crate::devices::i8042::I8042;
use crate::devices::power::PowerPort;
use crate::devices::serial::persist::SerialArgs;
use crate::devices::serial::{open_output, SerialDevice, SerialInputHandler};
use crate::devices::virtio::block::persist::BlockArgs;
use crate::devices::virtio::block::{Block, Disk};
use crate::devices::virtio::mmio::{MmioTransport, QUEUE_NOTIFY_OFFSET};
use crate::devices::virtio::net::persist::NetArgs;
use crate::devices::virtio::net::{Net, Tap};
use crate::devices::virtio::persist::TransportArgs;
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::vhost_user::{blk, fs, net, Connection, VhostUserDevice};
use crate::devices::virtio::{VirtioDevice, VirtioInterrupt, TYPE_BLOCK, TYPE_NET};
use crate::devices::EventFdTrigger;
use crate::end::{VmEnd, VmEndSignal};
use crate::layout::*;
use crate::memory::GuestMemory;
use crate::persist::{
    DevicesState, DiskRecord, Persist, SlotState, VirtioDeviceState, VirtioKindState,
};

/// First legacy IRQ for virtio devices (0-4 are the PIT, keyboard, cascade and COM ports).
pub const VIRTIO_FIRST_IRQ: u32 = 5;

/// Where a virtio-mmio device lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioSlot {
    pub base: u64,
    pub irq: u32,
}

impl VirtioSlot {
    /// The i-th slot of the virtio window: the one allocation rule, used for a fresh boot (a
    /// restore takes the slots its state recorded).
    pub fn at(i: usize) -> VirtioSlot {
        VirtioSlot {
            base: VIRTIO_MMIO_START + i as u64 * VIRTIO_MMIO_SIZE,
            irq: VIRTIO_FIRST_IRQ + i as u32,
        }
    }

    /// ` virtio_mmio.device=4K@0xd0000000:5`
    pub fn cmdline_entry(&self) -> String {
        format!(" virtio_mmio.device=4K@{:#x}:{}", self.base, self.irq)
    }

    /// A slot read from a state file must be one this VMM could have allocated.
    fn check(s: SlotState) -> Result<VirtioSlot, String> {
        let max = crate::config::MAX_VIRTIO_DEVICES as u64;
        let i = s.base.wrapping_sub(VIRTIO_MMIO_START) / VIRTIO_MMIO_SIZE;
        if s.base < VIRTIO_MMIO_START || i >= max || !s.base.is_multiple_of(VIRTIO_MMIO_SIZE) {
            return Err(format!(
                "virtio slot at {:#x} is outside the virtio window",
                s.base
            ));
        }
        if !(VIRTIO_FIRST_IRQ..VIRTIO_FIRST_IRQ + max as u32).contains(&s.irq) {
            return Err(format!("virtio IRQ {} is not one the IOAPIC routes", s.irq));
        }
        Ok(VirtioSlot {
            base: s.base,
            irq: s.irq,
        })
    }
}

/// A locally administered unicast MAC (52:54:00 like QEMU/KubeVirt) derived from `seed`: the
/// same seed gives the same MAC in every process, so a NIC keeps its address across restarts,
/// snapshots and migrations. FNV-1a: no cryptographic need, only spread.
pub fn derived_mac(seed: &str) -> MacAddr {
    let mut h: u32 = 0x811c_9dc5;
    for b in seed.bytes() {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    MacAddr([0x52, 0x54, 0x00, (h >> 16) as u8, (h >> 8) as u8, h as u8])
}

pub type Subscribers = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LoopState {
    Running,
    PauseRequested,
    Paused,
    Stopping,
}

type LoopShared = Arc<(Mutex<LoopState>, Condvar)>;

/// The event-manager thread and the switch that parks it between event batches.
pub struct EventLoop {
    shared: LoopShared,
    wake: EventFd,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Watches the reset and wake eventfds on the event-manager thread.
struct Lifecycle {
    reset: EventFd,
    wake: EventFd,
    end: VmEndSignal,
}

impl MutEventSubscriber for Lifecycle {
    fn init(&mut self, ops: &mut EventOps) {
        for fd in [&self.reset, &self.wake] {
            if let Err(e) = ops.add(Events::new(fd, EventSet::IN)) {
                tracing::error!("event loop: {e:?}");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() == self.reset.as_raw_fd() {
            let _ = self.reset.read();
            self.end.signal(VmEnd::Reset);
        } else if events.fd() == self.wake.as_raw_fd() {
            // Only wakes the loop; its state says what to do.
            let _ = self.wake.read();
        }
    }
}

impl EventLoop {
    /// Starts the thread; with `paused` it parks before handling any event.
    pub fn start(
        mut em: Subscribers,
        wake: EventFd,
        paused: bool,
        seccomp: bool,
    ) -> std::io::Result<EventLoop> {
        let initial = if paused {
            LoopState::PauseRequested
        } else {
            LoopState::Running
        };
        let shared: LoopShared = Arc::new((Mutex::new(initial), Condvar::new()));
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("vmm-events".into())
            .spawn(move || {
                if let Err(e) = crate::privileges::drop_capabilities() {
                    tracing::error!("device thread: {e}");
                    return;
                }
                if seccomp {
                    if let Err(e) = crate::seccomp::install(crate::seccomp::ThreadKind::Devices) {
                        tracing::error!("device thread: {e}");
                        return;
                    }
                }
                loop {
                    {
                        let (lock, cv) = &*s;
                        let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
                        if *g == LoopState::PauseRequested {
                            *g = LoopState::Paused;
                            cv.notify_all();
                            while *g == LoopState::Paused {
                                g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
                            }
                        }
                        if *g == LoopState::Stopping {
                            return;
                        }
                    }
                    if let Err(e) = em.run() {
                        tracing::error!("event loop: {e:?}");
                        return;
                    }
                }
            })?;
        Ok(EventLoop {
            shared,
            wake,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Returns once the thread is parked: every event handler has returned, so no device
    /// request is in flight and none starts until `resume`.
    /// Parks the event loop between events; false if it did not park before `deadline` (a
    /// device busy in a request that does not return, e.g. a disk on a hung file server).
    pub fn pause(&self, deadline: std::time::Instant) -> bool {
        let (lock, cv) = &*self.shared;
        let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
        if *g == LoopState::Running {
            *g = LoopState::PauseRequested;
            let _ = self.wake.write(1);
        }
        let alive = || {
            self.thread
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .is_some_and(|t| !t.is_finished())
        };
        while *g == LoopState::PauseRequested && alive() {
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            let wait = (deadline - now).min(std::time::Duration::from_millis(100));
            let (ng, _) = cv.wait_timeout(g, wait).unwrap_or_else(|p| p.into_inner());
            g = ng;
        }
        true
    }

    pub fn resume(&self) {
        let (lock, cv) = &*self.shared;
        let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*g, LoopState::Paused | LoopState::PauseRequested) {
            *g = LoopState::Running;
            cv.notify_all();
        }
    }

    pub fn is_paused(&self) -> bool {
        *self.shared.0.lock().unwrap_or_else(|p| p.into_inner()) == LoopState::Paused
    }

    /// Stops and joins the thread. Idempotent.
    pub fn stop(&self) {
        {
            let (lock, cv) = &*self.shared;
            *lock.lock().unwrap_or_else(|p| p.into_inner()) = LoopState::Stopping;
            cv.notify_all();
        }
        let _ = self.wake.write(1);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A virtio device with its place on the bus.
pub struct VirtioEntry {
    pub id: String,
    pub slot: VirtioSlot,
    pub transport: Arc<Mutex<MmioTransport>>,
    pub kind: VirtioKind,
    /// Restored with a config space other than the snapshot's (a clone's new MAC): the guest
    /// is to be told once the machine is whole (`Vm::announce_config_changes`).
    pub config_changed: bool,
}

pub enum VirtioKind {
    Block {
        device: Arc<Mutex<Block>>,
        record: DiskRecord,
    },
    Net {
        device: Arc<Mutex<Net>>,
        tap: Option<String>,
    },
    /// A device a vhost-user backend serves (virtio-fs).
    VhostUser {
        device: Arc<Mutex<VhostUserDevice>>,
    },
    Rng {
        device: Arc<Mutex<Rng>>,
    },
}

/// The host side of the devices, opened before anything is created (a missing disk or busy
/// TAP is the user's to fix, before a VM exists).
pub struct Backends {
    pub disks: Vec<(Disk, DiskConfig)>,
    pub taps: Vec<(Tap, NetConfig)>,
    /// vhost-user-blk disks, connected, with the config space their backend announced.
    pub vhost_user_disks: Vec<(Connection, Vec<u8>)>,
    /// vhost-user-net NICs, connected.
    pub vhost_user_nets: Vec<(Connection, VhostUserNetConfig)>,
    /// virtio-fs shares, connected to their backends.
    pub filesystems: Vec<(Connection, FsConfig)>,
    /// Whether the VM has a virtio-rng device (it needs nothing opened on the host).
    pub rng: bool,
}

pub struct DeviceManager {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub serial: Arc<Mutex<SerialDevice>>,
    pub i8042: Arc<Mutex<I8042>>,
    pub ged: Arc<Mutex<Ged>>,
    pub virtio: Vec<VirtioEntry>,
    /// The command-line entries that announce the virtio devices to the guest.
    pub cmdline_entries: String,
}

fn dev_err(what: &'static str) -> impl Fn(std::io::Error) -> String {
    move |e| format!("{what}: {e}")
}

fn irqfd(vm_fd: &VmFd, gsi: u32, what: &str) -> Result<EventFd, String> {
    let fd = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
    vm_fd
        .register_irqfd(&fd, gsi)
        .map_err(|e| format!("KVM_IRQFD {what}: {e}"))?;
    Ok(fd)
}

/// The recorded virtio devices of a snapshot or migration, split by kind in bus order and
/// checked against the configuration's devices.
#[derive(Default)]
struct Recorded<'a> {
    blocks: Vec<&'a VirtioDeviceState>,
    nets: Vec<&'a VirtioDeviceState>,
    vhost_user_disks: Vec<&'a VirtioDeviceState>,
    vhost_user_nets: Vec<&'a VirtioDeviceState>,
    rng: Option<&'a VirtioDeviceState>,
}

fn recorded_virtio<'a>(
    state: Option<&'a DevicesState>,
    backends: &Backends,
) -> Result<Recorded<'a>, String> {
    let mut r = Recorded::default();
    let Some(s) = state else {
        return Ok(r);
    };
    for d in &s.virtio {
        match &d.kind {
            VirtioKindState::Block { .. } => r.blocks.push(d),
            VirtioKindState::Net { .. } => r.nets.push(d),
            VirtioKindState::Rng { .. } if r.rng.is_none() => r.rng = Some(d),
            VirtioKindState::Rng { .. } => {
                return Err(format!("{}: a second virtio-rng device", d.id))
            }
            VirtioKindState::VhostUser { device_type, .. } => match *device_type {
                TYPE_BLOCK => r.vhost_user_disks.push(d),
                TYPE_NET => r.vhost_user_nets.push(d),
                t => {
                    return Err(format!(
                        "{}: a vhost-user device of type {t} cannot be restored",
                        d.id
                    ))
                }
            },
        }
    }
    if r.blocks.len() != backends.disks.len() || r.nets.len() != backends.taps.len() {
        return Err(format!(
            "the snapshot has {} disk(s) and {} NIC(s), the configuration {} and {}",
            r.blocks.len(),
            r.nets.len(),
            backends.disks.len(),
            backends.taps.len()
        ));
    }
    if r.vhost_user_disks.len() != backends.vhost_user_disks.len()
        || r.vhost_user_nets.len() != backends.vhost_user_nets.len()
        || !backends.filesystems.is_empty()
    {
        return Err(format!(
            "the state has {} vhost-user disk(s), {} vhost-user NIC(s) and no virtio-fs share; the configuration {}, {} and {}",
            r.vhost_user_disks.len(),
            r.vhost_user_nets.len(),
            backends.vhost_user_disks.len(),
            backends.vhost_user_nets.len(),
            backends.filesystems.len()
        ));
    }
    if r.rng.is_some() != backends.rng {
        return Err(format!(
            "the state has {} virtio-rng device, the configuration {}",
            if r.rng.is_some() { "a" } else { "no" },
            if backends.rng { "has one" } else { "none" }
        ));
    }
    Ok(r)
}

/// Where the serial console's input comes from.
fn serial_input(
    cfg: &SerialConfig,
) -> Result<Option<Box<dyn crate::devices::serial::InputSource>>, String> {
    Ok(match &cfg.input {
        SerialInput::None => None,
        SerialInput::Stdin => Some(Box::new(std::io::stdin())),
        SerialInput::UnixSocket(p) => Some(Box::new(
            std::os::unix::net::UnixStream::connect(p).map_err(dev_err("serial input socket"))?,
        )),
        // SAFETY: the config hands the descriptor's ownership to the VM.
        SerialInput::Fd(fd) => Some(Box::new(std::fs::File::from(unsafe {
            <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(*fd)
        }))),
    })
}

/// The legacy devices on the port bus (COM1, i8042, the power port), the event handlers of
/// their host side, and the eventfd that wakes the event loop.
struct Legacy {
    serial: Arc<Mutex<SerialDevice>>,
    i8042: Arc<Mutex<I8042>>,
    ged: Arc<Mutex<Ged>>,
    wake: EventFd,
}

impl Legacy {
    fn build(
        vm_fd: &VmFd,
        serial_cfg: &SerialConfig,
        end: &VmEndSignal,
        state: Option<&DevicesState>,
        pio: &mut Bus,
        em: &mut Subscribers,
    ) -> Result<Legacy, String> {
        let serial_irq = EventFdTrigger(irqfd(vm_fd, SERIAL_COM1_IRQ, "serial")?);
        let drained = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
        let out = open_output(&serial_cfg.output).map_err(dev_err("serial output"))?;
        let drained2 = drained.try_clone().map_err(dev_err("eventfd"))?;
        let serial = match state {
            None => SerialDevice::new(serial_irq, drained2, out),
            Some(s) => SerialDevice::restore(
                SerialArgs {
                    irq: serial_irq,
                    drained: drained2,
                    out,
                },
                &s.serial,
            )?,
        };
        let serial = Arc::new(Mutex::new(serial));
        pio.insert(SERIAL_COM1_PORT as u64, 8, serial.clone())
            .map_err(|e| e.to_string())?;

        let reset = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
        let args = I8042Args {
            reset_evt: EventFdTrigger(reset.try_clone().map_err(dev_err("eventfd"))?),
            irq: EventFdTrigger(irqfd(vm_fd, KEYBOARD_IRQ, "i8042")?),
        };
        let i8042 = match state {
            None => I8042::new(args.reset_evt, args.irq),
            Some(s) => I8042::restore(args, &s.i8042)?,
        };
        let i8042 = Arc::new(Mutex::new(i8042));
        pio.insert(I8042_PORT as u64, 5, i8042.clone())
            .map_err(|e| e.to_string())?;
        pio.insert(
            POWER_PORT as u64,
            1,
            Arc::new(Mutex::new(PowerPort::new(end.clone()))),
        )
        .map_err(|e| e.to_string())?;
        let ged = Arc::new(Mutex::new(Ged::new(EventFdTrigger(irqfd(
            vm_fd, GED_IRQ, "GED",
        )?))));
        pio.insert(GED_PORT as u64, 1, ged.clone())
            .map_err(|e| e.to_string())?;

        let wake = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
        em.add_subscriber(Arc::new(Mutex::new(Lifecycle {
            reset,
            wake: wake.try_clone().map_err(dev_err("eventfd"))?,
            end: end.clone(),
        })));
        if let Some(input) = serial_input(serial_cfg)? {
            em.add_subscriber(Arc::new(Mutex::new(SerialInputHandler::new(
                serial.clone(),
                input,
                drained,
            ))));
        }
        Ok(Legacy {
            serial,
            i8042,
            ged,
            wake,
        })
    }
}

impl DeviceManager {
    /// Creates every device, fresh (`state` None) or as `state` recorded them, and the event
    /// manager that will run them; returns both plus the eventfd that wakes the event loop.
    pub fn build(
        vm_fd: &VmFd,
        memory: &GuestMemory,
        serial_cfg: &SerialConfig,
        end: &VmEndSignal,
        backends: Backends,
        state: Option<&DevicesState>,
    ) -> Result<(DeviceManager, Subscribers, EventFd), String> {
        let mut pio = Bus::new();
        let mut mmio = Bus::new();
        let mut em: Subscribers =
            EventManager::new().map_err(|e| format!("event manager: {e:?}"))?;
        let legacy = Legacy::build(vm_fd, serial_cfg, end, state, &mut pio, &mut em)?;
        let mut dm = DeviceManager {
            pio: Arc::new(Bus::new()),
            mmio: Arc::new(Bus::new()),
            serial: legacy.serial,
            i8042: legacy.i8042,
            ged: legacy.ged,
            virtio: Vec::new(),
            cmdline_entries: String::new(),
        };
        let recorded = recorded_virtio(state, &backends)?;
        let mut place = VirtioPlacer {
            vm_fd,
            memory,
            mmio: &mut mmio,
            em: &mut em,
        };
        let file_disks = backends.disks.len();
        for (i, (disk, dcfg)) in backends.disks.into_iter().enumerate() {
            place.attach_disk(&mut dm, i, disk, dcfg, recorded.blocks.get(i).copied())?;
        }
        for (i, (conn, config)) in backends.vhost_user_disks.into_iter().enumerate() {
            let saved = recorded.vhost_user_disks.get(i).copied();
            place.attach_vhost_user_disk(&mut dm, file_disks + i, conn, config, saved)?;
        }
        let tap_nics = backends.taps.len();
        for (i, (tap, ncfg)) in backends.taps.into_iter().enumerate() {
            place.attach_nic(&mut dm, i, tap, ncfg, recorded.nets.get(i).copied())?;
        }
        for (i, (conn, ncfg)) in backends.vhost_user_nets.into_iter().enumerate() {
            let saved = recorded.vhost_user_nets.get(i).copied();
            place.attach_vhost_user_nic(&mut dm, tap_nics + i, conn, ncfg, saved)?;
        }
        for (conn, fcfg) in backends.filesystems {
            place.attach_fs(&mut dm, conn, fcfg)?;
        }
        if backends.rng {
            place.attach_rng(&mut dm, recorded.rng)?;
        }
        dm.pio = Arc::new(pio);
        dm.mmio = Arc::new(mmio);
        Ok((dm, em, legacy.wake))
    }

    pub fn blocks(&self) -> Vec<Arc<Mutex<Block>>> {
        self.virtio
            .iter()
            .filter_map(|v| match &v.kind {
                VirtioKind::Block { device, .. } => Some(device.clone()),
                _ => None,
            })
            .collect()
    }

    pub fn nets(&self) -> Vec<Arc<Mutex<Net>>> {
        self.virtio
            .iter()
            .filter_map(|v| match &v.kind {
                VirtioKind::Net { device, .. } => Some(device.clone()),
                _ => None,
            })
            .collect()
    }

    /// The devices vhost-user backends serve.
    pub fn vhost_user(&self) -> Vec<Arc<Mutex<VhostUserDevice>>> {
        self.virtio
            .iter()
            .filter_map(|v| match &v.kind {
                VirtioKind::VhostUser { device } => Some(device.clone()),
                _ => None,
            })
            .collect()
    }

    /// Why each device a snapshot (or with `migration`, a live migration) cannot carry
    /// cannot, naming it and its socket.
    pub fn persist_blockers(&self, migration: bool) -> Vec<String> {
        self.vhost_user()
            .iter()
            .filter_map(|d| {
                let d = d.lock().unwrap_or_else(|p| p.into_inner());
                let why = d.persist_blocker(migration)?;
                Some(format!("{} ({}): {why}", d.id(), d.socket().display()))
            })
            .collect()
    }

    /// Every device's state. The caller has paused the vCPUs and the event loop, and taken
    /// the rings back from vhost-user backends (`VhostUserDevice::quiesce`).
    pub fn save(&self) -> DevicesState {
        let lock =
            |m: &Arc<Mutex<MmioTransport>>| m.lock().unwrap_or_else(|p| p.into_inner()).save();
        DevicesState {
            serial: self.serial.lock().unwrap_or_else(|p| p.into_inner()).save(),
            i8042: self.i8042.lock().unwrap_or_else(|p| p.into_inner()).save(),
            virtio: self
                .virtio
                .iter()
                .map(|v| VirtioDeviceState {
                    id: v.id.clone(),
                    slot: SlotState {
                        base: v.slot.base,
                        irq: v.slot.irq,
                    },
                    transport: lock(&v.transport),
                    kind: match &v.kind {
                        VirtioKind::Block { device, record } => VirtioKindState::Block {
                            disk: record.clone(),
                            state: device.lock().unwrap_or_else(|p| p.into_inner()).save(),
                        },
                        VirtioKind::Net { device, tap } => {
                            let d = device.lock().unwrap_or_else(|p| p.into_inner());
                            VirtioKindState::Net {
                                tap: tap.clone(),
                                mac: d.mac(),
                                state: d.save(),
                            }
                        }
                        VirtioKind::VhostUser { device } => {
                            let d = device.lock().unwrap_or_else(|p| p.into_inner());
                            VirtioKindState::VhostUser {
                                device_type: d.device_type(),
                                mac: d.mac(),
                            }
                        }
                        VirtioKind::Rng { device } => VirtioKindState::Rng {
                            state: device.lock().unwrap_or_else(|p| p.into_inner()).save(),
                        },
                    },
                })
                .collect(),
        }
    }
}

/// Places virtio devices: virtio-mmio devices get one 4 KiB window and one legacy IRQ each
/// (the next free slot, or the one a snapshot recorded), announced on the kernel command line
/// the way a guest without ACPI finds them.
struct VirtioPlacer<'a> {
    vm_fd: &'a VmFd,
    memory: &'a GuestMemory,
    mmio: &'a mut Bus,
    em: &'a mut Subscribers,
}

impl VirtioPlacer<'_> {
    fn attach<D>(
        &mut self,
        dm: &mut DeviceManager,
        id: String,
        device: D,
        saved: Option<&VirtioDeviceState>,
        kind: impl FnOnce(Arc<Mutex<D>>) -> VirtioKind,
    ) -> Result<(), String>
    where
        D: VirtioDevice + MutEventSubscriber + Send + 'static,
    {
        let device = Arc::new(Mutex::new(device));
        let slot = match saved {
            Some(d) => VirtioSlot::check(d.slot)?,
            None => VirtioSlot::at(dm.virtio.len()),
        };
        let transport = attach_virtio(
            self.vm_fd,
            self.memory,
            self.mmio,
            self.em,
            slot,
            device.clone(),
            device.clone(),
            saved,
        )
        .map_err(|e| format!("{id}: {e}"))?;
        dm.cmdline_entries.push_str(&slot.cmdline_entry());
        dm.virtio.push(VirtioEntry {
            id,
            slot,
            transport,
            kind: kind(device),
            config_changed: false,
        });
        Ok(())
    }
}

impl VirtioPlacer<'_> {
    /// The virtio-rng device, fresh or as `saved` recorded it.
    fn attach_rng(
        &mut self,
        dm: &mut DeviceManager,
        saved: Option<&VirtioDeviceState>,
    ) -> Result<(), String> {
        let id = "rng0".to_string();
        let rng = match saved.map(|d| &d.kind) {
            Some(VirtioKindState::Rng { state }) => Rng::restore(id.clone(), state)?,
            _ => Rng::new(id.clone()).map_err(dev_err("virtio-rng"))?,
        };
        self.attach(dm, id, rng, saved, |device| VirtioKind::Rng { device })
    }

    /// The `i`th disk, fresh or as `saved` recorded it.
    fn attach_disk(
        &mut self,
        dm: &mut DeviceManager,
        i: usize,
        disk: Disk,
        dcfg: DiskConfig,
        saved: Option<&VirtioDeviceState>,
    ) -> Result<(), String> {
        let id = crate::config::disk_name(i);
        let record = DiskRecord {
            path: dcfg.path.clone(),
            read_only: dcfg.read_only,
            serial: dcfg.serial.clone(),
            cache: dcfg.cache,
        };
        let args = BlockArgs {
            id: id.clone(),
            disk,
            serial: dcfg.serial.clone(),
        };
        let block = match saved.map(|d| &d.kind) {
            Some(VirtioKindState::Block { state, .. }) => Block::restore(args, state)?,
            _ => Block::new(args.id, args.disk, args.serial.as_deref())
                .map_err(dev_err("virtio-blk"))?,
        };
        self.attach(dm, id, block, saved, |device| VirtioKind::Block {
            device,
            record,
        })
    }

    /// The `i`th NIC, fresh or as `saved` recorded it (its MAC included).
    fn attach_nic(
        &mut self,
        dm: &mut DeviceManager,
        i: usize,
        tap: Tap,
        ncfg: NetConfig,
        saved: Option<&VirtioDeviceState>,
    ) -> Result<(), String> {
        let id = format!("eth{i}");
        let tap_name = match &ncfg.tap {
            TapSource::Name(n) => Some(n.clone()),
            TapSource::Fd(_) => None,
        };
        // Restored, the NIC keeps the snapshot's MAC unless the configuration names another:
        // a clone's own identity, announced to the guest as a config change.
        let (mac, changed) = match (saved.map(|d| &d.kind), ncfg.mac) {
            (Some(VirtioKindState::Net { mac, .. }), Some(new)) if new != *mac => (new, true),
            (Some(VirtioKindState::Net { mac, .. }), _) => (*mac, false),
            (_, given) => (
                given.unwrap_or_else(|| derived_mac(&format!("{}/{id}", tap.name))),
                false,
            ),
        };
        let args = NetArgs {
            id: id.clone(),
            tap,
            mac,
        };
        let net = match saved.map(|d| &d.kind) {
            Some(VirtioKindState::Net { state, .. }) => Net::restore(args, state)?,
            _ => Net::new(args.id, args.tap, args.mac).map_err(dev_err("virtio-net"))?,
        };
        self.attach(dm, id, net, saved, |device| VirtioKind::Net {
            device,
            tap: tap_name,
        })?;
        if let Some(entry) = dm.virtio.last_mut() {
            entry.config_changed = changed;
        }
        Ok(())
    }
}

impl VirtioPlacer<'_> {
    /// The `i`th disk (vda, vdb, ... after the file-backed ones), served by a vhost-user-blk
    /// backend whose config space is `config`.
    fn attach_vhost_user_disk(
        &mut self,
        dm: &mut DeviceManager,
        i: usize,
        conn: Connection,
        config: Vec<u8>,
        saved: Option<&VirtioDeviceState>,
    ) -> Result<(), String> {
        let id = crate::config::disk_name(i);
        let device = VhostUserDevice::new(id.clone(), blk::shape(config), conn)
            .map_err(dev_err("vhost-user-blk"))?;
        self.attach(dm, id, device, saved, |device| VirtioKind::VhostUser {
            device,
        })
    }

    /// The `i`th NIC (eth0, eth1, ... after the TAP ones), served by a vhost-user-net backend.
    fn attach_vhost_user_nic(
        &mut self,
        dm: &mut DeviceManager,
        i: usize,
        conn: Connection,
        ncfg: VhostUserNetConfig,
        saved: Option<&VirtioDeviceState>,
    ) -> Result<(), String> {
        let id = format!("eth{i}");
        // A migrated NIC keeps the MAC the guest knows, whatever the target's socket.
        let mac = match saved.map(|d| &d.kind) {
            Some(VirtioKindState::VhostUser { mac: Some(mac), .. }) => *mac,
            _ => ncfg
                .mac
                .unwrap_or_else(|| derived_mac(&format!("{}/{id}", ncfg.socket.display()))),
        };
        let device = VhostUserDevice::new(id.clone(), net::shape(mac), conn)
            .map_err(dev_err("vhost-user-net"))?;
        self.attach(dm, id, device, saved, |device| VirtioKind::VhostUser {
            device,
        })
    }

    /// A virtio-fs share over its backend's connection.
    fn attach_fs(
        &mut self,
        dm: &mut DeviceManager,
        conn: Connection,
        fcfg: FsConfig,
    ) -> Result<(), String> {
        let id = format!("fs-{}", fcfg.tag);
        let device = VhostUserDevice::new(id.clone(), fs::shape(&fcfg.tag), conn)
            .map_err(dev_err("virtio-fs"))?;
        self.attach(dm, id, device, None, |device| VirtioKind::VhostUser {
            device,
        })
    }
}

/// Puts a virtio device on the MMIO bus with its irqfd and queue ioeventfds, and gives it to the
/// event manager; with `saved`, the transport (and the device's activation) is restored.
#[allow(clippy::too_many_arguments)]
fn attach_virtio(
    vm_fd: &VmFd,
    memory: &GuestMemory,
    mmio: &mut Bus,
    em: &mut Subscribers,
    slot: VirtioSlot,
    device: Arc<Mutex<dyn VirtioDevice>>,
    subscriber: Arc<Mutex<dyn MutEventSubscriber + Send>>,
    saved: Option<&VirtioDeviceState>,
) -> Result<Arc<Mutex<MmioTransport>>, String> {
    let irq = irqfd(vm_fd, slot.irq, "virtio")?;
    {
        let d = device.lock().unwrap_or_else(|p| p.into_inner());
        for (q, evt) in d.queue_events().iter().enumerate() {
            let addr = IoEventAddress::Mmio(slot.base + QUEUE_NOTIFY_OFFSET);
            vm_fd
                .register_ioevent(evt, &addr, q as u32)
                .map_err(|e| format!("KVM_IOEVENTFD virtio: {e}"))?;
        }
    }
    let interrupt = VirtioInterrupt::new(irq);
    let transport = match saved {
        None => MmioTransport::new(device, memory.clone(), interrupt),
        Some(s) => MmioTransport::restore(
            TransportArgs {
                device,
                mem: memory.clone(),
                interrupt,
            },
            &s.transport,
        )?,
    };
    let transport = Arc::new(Mutex::new(transport));
    mmio.insert(slot.base, VIRTIO_MMIO_SIZE, transport.clone())
        .map_err(|e| e.to_string())?;
    em.add_subscriber(subscriber);
    Ok(transport)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_macs_are_stable_local_unicast_and_spread() {
        let a = derived_mac("default/vm1/default");
        assert_eq!(a, derived_mac("default/vm1/default"));
        assert_ne!(a, derived_mac("default/vm2/default"));
        assert_eq!(a.0[..3], [0x52, 0x54, 0x00]);
    }

    #[test]
    fn recorded_slots_are_checked() {
        assert!(VirtioSlot::check(SlotState {
            base: VIRTIO_MMIO_START,
            irq: 5
        })
        .is_ok());
        assert!(VirtioSlot::check(SlotState {
            base: 0x1000,
            irq: 5
        })
        .is_err());
        assert!(VirtioSlot::check(SlotState {
            base: VIRTIO_MMIO_START,
            irq: 24
        })
        .is_err());
    }
}
