//! The builder that turns a `VmConfig` into a running VM, and the handle to control it.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::SystemTime;

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{IoEventAddress, VmFd};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::boot::{self, BootSpec};
use crate::bus::Bus;
use crate::config::{disk_name, ConfigError, MacAddr, SerialInput, TapSource, VmConfig};
use crate::devices::i8042::I8042;
use crate::devices::power::PowerPort;
use crate::devices::serial::{open_output, SerialDevice, SerialInputHandler};
use crate::devices::virtio::block::{Block, Disk, DiskError};
use crate::devices::virtio::mmio::{MmioTransport, QUEUE_NOTIFY_OFFSET};
use crate::devices::virtio::net::{Net, Tap, TapError};
use crate::devices::virtio::{VirtioDevice, VirtioInterrupt};
use crate::devices::EventFdTrigger;
use crate::kvm::{KvmAcceleration, KvmContext, KvmError};
use crate::layout::*;
use crate::vcpu::{self, RunState, Vcpu, VcpuContext, VcpuControl};
use std::os::fd::FromRawFd;

/// Guest RAM. The dirty bitmap tracks writes the VMM itself makes (device DMA), which KVM's
/// dirty log cannot see; migration ORs both.
pub type GuestMemory = vm_memory::GuestMemoryMmap<AtomicBitmap>;

/// How a VM ended. Always a value: a guest can never make the VMM hang or panic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmEnd {
    /// The guest powered off (shutdown port or KVM system event).
    PoweredOff,
    /// The guest asked for a reset (i8042 0xFE, shutdown port or KVM system event).
    Reset,
    /// A vCPU triple-faulted (KVM_EXIT_SHUTDOWN).
    TripleFault { vcpu: u8 },
    /// KVM could not emulate something; `insn` holds the bytes at `rip` when readable.
    InternalError {
        vcpu: u8,
        suberror: u32,
        rip: u64,
        insn: Vec<u8>,
    },
    /// KVM could not enter the guest.
    EntryFailure { vcpu: u8, reason: u64, cpu: u32 },
    /// A vCPU halted with interrupts it can never receive.
    Halted { vcpu: u8 },
    /// The host stopped the VM.
    Stopped,
    /// The VMM hit an error running a vCPU.
    VcpuError { vcpu: u8, message: String },
}

impl fmt::Display for VmEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmEnd::PoweredOff => write!(f, "guest powered off"),
            VmEnd::Reset => write!(f, "guest requested a reset"),
            VmEnd::TripleFault { vcpu } => write!(f, "vCPU {vcpu} triple-faulted"),
            VmEnd::InternalError {
                vcpu,
                suberror,
                rip,
                insn,
            } => {
                write!(f, "KVM internal error on vCPU {vcpu} (suberror {suberror}")?;
                if *suberror == kvm_bindings::KVM_INTERNAL_ERROR_EMULATION {
                    write!(f, ": emulation failure")?;
                }
                write!(f, ") at rip {rip:#x}, instruction bytes [")?;
                for (i, b) in insn.iter().enumerate() {
                    write!(f, "{}{b:02x}", if i > 0 { " " } else { "" })?;
                }
                write!(f, "]")
            }
            VmEnd::EntryFailure { vcpu, reason, cpu } => {
                write!(f, "KVM failed to enter vCPU {vcpu} on host CPU {cpu} (hardware reason {reason:#x})")
            }
            VmEnd::Halted { vcpu } => write!(f, "vCPU {vcpu} halted for good"),
            VmEnd::Stopped => write!(f, "stopped by the host"),
            VmEnd::VcpuError { vcpu, message } => write!(f, "vCPU {vcpu} failed: {message}"),
        }
    }
}

impl VmEnd {
    /// The launcher's exit status for this end (documented in the README).
    pub fn exit_code(&self) -> i32 {
        match self {
            VmEnd::PoweredOff | VmEnd::Stopped => 0,
            VmEnd::Reset => 10,
            VmEnd::TripleFault { .. } => 11,
            VmEnd::InternalError { .. } => 12,
            VmEnd::EntryFailure { .. } | VmEnd::VcpuError { .. } => 13,
            VmEnd::Halted { .. } => 14,
        }
    }
}

/// The first end reported wins; later ones (other vCPUs winding down) are ignored.
#[derive(Clone, Default)]
pub struct VmEndSignal(Arc<(Mutex<Option<VmEnd>>, Condvar)>);

impl VmEndSignal {
    pub fn signal(&self, end: VmEnd) {
        let mut g = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            tracing::info!(%end, "VM ended");
            *g = Some(end);
            self.0 .1.notify_all();
        }
    }

    pub fn get(&self) -> Option<VmEnd> {
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn wait(&self) -> VmEnd {
        let mut g = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(e) = g.as_ref() {
                return e.clone();
            }
            g = self.0 .1.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub fn wait_timeout(&self, t: std::time::Duration) -> Option<VmEnd> {
        let g = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .0
             .1
            .wait_timeout_while(g, t, |e| e.is_none())
            .unwrap_or_else(|p| p.into_inner());
        g.clone()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Kvm(#[from] KvmError),
    #[error("KVM: {0}")]
    KvmSetup(String),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error("vCPU setup: {0}")]
    Vcpu(String),
    #[error("devices: {0}")]
    Device(String),
}

impl VmError {
    /// True for errors in what the user asked for (exit code 2), as opposed to host failures.
    pub fn is_config_error(&self) -> bool {
        matches!(self, VmError::Config(_))
    }
}

/// Facts about the running VM for front ends.
#[derive(Clone, Debug)]
pub struct VmInfo {
    pub vcpus: u8,
    pub memory_mib: u64,
    pub acceleration: KvmAcceleration,
}

pub struct Vm {
    pub info: VmInfo,
    vm_fd: Arc<VmFd>,
    memory: GuestMemory,
    control: Arc<VcpuControl>,
    end: VmEndSignal,
    vcpu_threads: Mutex<Vec<JoinHandle<()>>>,
    event_thread: Mutex<Option<JoinHandle<()>>>,
    event_stop: EventFd,
    first_run: Arc<OnceLock<SystemTime>>,
    blocks: Vec<Arc<Mutex<Block>>>,
    nets: Vec<Arc<Mutex<Net>>>,
    i8042: Arc<Mutex<I8042>>,
}

fn tap_reason(e: TapError) -> String {
    match e {
        TapError::NotFound { name } => format!(
            "no TAP device named {name} (create it first, e.g. `ip tuntap add {name} mode tap`)"
        ),
        TapError::Busy { .. } => "busy (another process has it open)".into(),
        TapError::Other { reason, .. } => reason,
    }
}

/// A locally administered unicast MAC (52:54:00 like QEMU/KubeVirt) unique per process and NIC.
fn generated_mac(index: usize) -> MacAddr {
    let mut r = [0u8; 3];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut r))
        .is_err()
    {
        let x = std::process::id() as usize ^ index.wrapping_mul(0x9e37_79b9);
        r = [(x >> 16) as u8, (x >> 8) as u8, x as u8];
    }
    MacAddr([0x52, 0x54, 0x00, r[0], r[1], r[2]])
}

/// Where the i-th virtio-mmio device lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioSlot {
    pub base: u64,
    pub irq: u32,
}

/// First legacy IRQ for virtio devices (0-4 are the PIT, keyboard, cascade and COM ports).
pub const VIRTIO_FIRST_IRQ: u32 = 5;

impl VirtioSlot {
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
}

type Subscribers = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

/// Puts a virtio device on the MMIO bus with its irqfd and queue ioeventfds, and gives it to the
/// event manager.
fn attach_virtio(
    vm_fd: &VmFd,
    memory: &GuestMemory,
    mmio: &mut Bus,
    em: &mut Subscribers,
    slot: VirtioSlot,
    device: Arc<Mutex<dyn VirtioDevice>>,
    subscriber: Arc<Mutex<dyn MutEventSubscriber + Send>>,
) -> Result<(), VmError> {
    let irqfd =
        EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VmError::Device(format!("eventfd: {e}")))?;
    vm_fd
        .register_irqfd(&irqfd, slot.irq)
        .map_err(kvm_err("KVM_IRQFD virtio"))?;
    {
        let d = device.lock().unwrap();
        for (q, evt) in d.queue_events().iter().enumerate() {
            let addr = IoEventAddress::Mmio(slot.base + QUEUE_NOTIFY_OFFSET);
            vm_fd
                .register_ioevent(evt, &addr, q as u32)
                .map_err(kvm_err("KVM_IOEVENTFD virtio"))?;
        }
    }
    let transport = MmioTransport::new(device, memory.clone(), VirtioInterrupt::new(irqfd));
    mmio.insert(slot.base, VIRTIO_MMIO_SIZE, Arc::new(Mutex::new(transport)))
        .map_err(|e| VmError::Device(e.to_string()))?;
    em.add_subscriber(subscriber);
    Ok(())
}

/// Watches the reset and stop eventfds on the event-manager thread.
struct Lifecycle {
    reset: EventFd,
    stop: EventFd,
    end: VmEndSignal,
    stopping: Arc<std::sync::atomic::AtomicBool>,
}

impl MutEventSubscriber for Lifecycle {
    fn init(&mut self, ops: &mut EventOps) {
        for fd in [&self.reset, &self.stop] {
            if let Err(e) = ops.add(Events::new(fd, EventSet::IN)) {
                tracing::error!("event loop: {e:?}");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        use std::os::fd::AsRawFd;
        if events.fd() == self.reset.as_raw_fd() {
            let _ = self.reset.read();
            self.end.signal(VmEnd::Reset);
        } else if events.fd() == self.stop.as_raw_fd() {
            let _ = self.stop.read();
            self.stopping
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

fn kvm_err(what: &str) -> impl Fn(kvm_ioctls::Error) -> VmError + '_ {
    move |e| VmError::KvmSetup(format!("{what}: {e}"))
}

impl Vm {
    /// Validates `config`, builds the VM and starts its vCPUs.
    pub fn build(config: &VmConfig) -> Result<Vm, VmError> {
        let kvm = KvmContext::open()?;
        config.validate(Some(kvm.max_vcpus))?;
        boot::check_fits(config.memory_mib, &config.kernel, config.initrd.as_deref())?;
        let mem_size = config.memory_mib * MIB;
        // Disks first: a missing or locked image is the user's to fix, before anything starts.
        let mut disks = Vec::with_capacity(config.disks.len());
        for d in &config.disks {
            let disk = Disk::open(&d.path, d.read_only, d.cache).map_err(|e| {
                let reason = match e {
                    DiskError::Open { reason, .. } => reason,
                    DiskError::Locked { .. } => {
                        "locked by another VM (advisory lock held)".to_string()
                    }
                };
                ConfigError::Disk {
                    path: d.path.display().to_string(),
                    reason,
                }
            })?;
            disks.push(disk);
        }
        let mut taps = Vec::with_capacity(config.nets.len());
        for n in &config.nets {
            let tap = match &n.tap {
                TapSource::Name(name) => Tap::open(name),
                // SAFETY: the config hands the descriptor's ownership to the VM.
                TapSource::Fd(fd) => {
                    Tap::from_fd(unsafe { std::os::fd::OwnedFd::from_raw_fd(*fd) })
                }
            }
            .map_err(|e| ConfigError::Net {
                tap: n.tap.to_string(),
                reason: tap_reason(e),
            })?;
            taps.push(tap);
        }
        if !taps.is_empty() {
            if std::path::Path::new("/dev/vhost-net").exists() {
                tracing::info!("virtio-net: /dev/vhost-net present, but this build runs the in-process virtio-net device");
            } else {
                tracing::info!(
                    "virtio-net: no /dev/vhost-net; using the in-process virtio-net device"
                );
            }
        }

        let vm_fd = kvm.kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        vm_fd
            .set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
        vm_fd
            .set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS)
            .map_err(kvm_err("KVM_SET_IDENTITY_MAP_ADDR"))?;
        vm_fd
            .create_irq_chip()
            .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm_fd.create_pit2(pit).map_err(kvm_err("KVM_CREATE_PIT2"))?;

        let memory = GuestMemory::from_ranges(&ram_regions(mem_size))
            .map_err(|e| VmError::Memory(e.to_string()))?;
        let memslots_started = std::time::Instant::now();
        for (slot, region) in memory.iter().enumerate() {
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|e| VmError::Memory(e.to_string()))?;
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: the mapping lives in `memory`, which outlives the VM fd's use of it (the
            // Vm owns both and joins the vCPU threads before dropping memory).
            unsafe { vm_fd.set_user_memory_region(r) }
                .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
        }
        if config.boot_timer {
            // On some hosts (software-emulated KVM) registering memory costs milliseconds that
            // are the host's, not the VMM's; the benchmark reports them apart.
            eprintln!(
                "microvirt boot-timer: memory slots ns={}",
                memslots_started.elapsed().as_nanos()
            );
        }

        let end = VmEndSignal::default();
        let dev_err =
            |what: &'static str| move |e: std::io::Error| VmError::Device(format!("{what}: {e}"));
        let mut pio = Bus::new();
        let mut mmio = Bus::new();

        let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
        vm_fd
            .register_irqfd(&serial_irq, SERIAL_COM1_IRQ)
            .map_err(kvm_err("KVM_IRQFD serial"))?;
        let drained = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
        let out = open_output(&config.serial.output).map_err(dev_err("serial output"))?;
        let serial = Arc::new(Mutex::new(SerialDevice::new(
            EventFdTrigger(serial_irq),
            drained.try_clone().map_err(dev_err("eventfd"))?,
            out,
        )));
        pio.insert(SERIAL_COM1_PORT as u64, 8, serial.clone())
            .map_err(|e| VmError::Device(e.to_string()))?;

        let reset = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
        let kbd_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
        vm_fd
            .register_irqfd(&kbd_irq, KEYBOARD_IRQ)
            .map_err(kvm_err("KVM_IRQFD i8042"))?;
        let i8042 = Arc::new(Mutex::new(I8042::new(
            EventFdTrigger(reset.try_clone().map_err(dev_err("eventfd"))?),
            EventFdTrigger(kbd_irq),
        )));
        pio.insert(I8042_PORT as u64, 5, i8042.clone())
            .map_err(|e| VmError::Device(e.to_string()))?;
        pio.insert(
            POWER_PORT as u64,
            1,
            Arc::new(Mutex::new(PowerPort::new(end.clone()))),
        )
        .map_err(|e| VmError::Device(e.to_string()))?;

        let mut em: Subscribers =
            EventManager::new().map_err(|e| VmError::Device(format!("event manager: {e:?}")))?;
        let event_stop = EventFd::new(libc::EFD_NONBLOCK).map_err(dev_err("eventfd"))?;
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        em.add_subscriber(Arc::new(Mutex::new(Lifecycle {
            reset,
            stop: event_stop.try_clone().map_err(dev_err("eventfd"))?,
            end: end.clone(),
            stopping: stopping.clone(),
        })));
        let input: Option<Box<dyn crate::devices::serial::InputSource>> = match &config.serial.input
        {
            SerialInput::None => None,
            SerialInput::Stdin => Some(Box::new(std::io::stdin())),
            SerialInput::UnixSocket(p) => Some(Box::new(
                std::os::unix::net::UnixStream::connect(p)
                    .map_err(dev_err("serial input socket"))?,
            )),
            // SAFETY: the config hands the descriptor's ownership to the VM.
            SerialInput::Fd(fd) => Some(Box::new(std::fs::File::from(unsafe {
                std::os::fd::OwnedFd::from_raw_fd(*fd)
            }))),
        };
        if let Some(input) = input {
            em.add_subscriber(Arc::new(Mutex::new(SerialInputHandler::new(
                serial, input, drained,
            ))));
        }

        // virtio-mmio devices: one 4 KiB window and one legacy IRQ each, announced on the
        // kernel command line the way a guest without ACPI finds them.
        let mut cmdline = config.cmdline.clone();
        let mut blocks = Vec::new();
        for (i, (disk, dcfg)) in disks.into_iter().zip(&config.disks).enumerate() {
            let block = Block::new(disk_name(i), disk, dcfg.serial.as_deref())
                .map_err(dev_err("virtio-blk"))?;
            let block = Arc::new(Mutex::new(block));
            let slot = VirtioSlot::at(blocks.len());
            attach_virtio(
                &vm_fd,
                &memory,
                &mut mmio,
                &mut em,
                slot,
                block.clone(),
                block.clone(),
            )?;
            cmdline.push_str(&slot.cmdline_entry());
            blocks.push(block);
        }
        let mut nets = Vec::new();
        for (i, (tap, ncfg)) in taps.into_iter().zip(&config.nets).enumerate() {
            let mac = ncfg.mac.unwrap_or_else(|| generated_mac(i));
            let net = Arc::new(Mutex::new(
                Net::new(format!("eth{i}"), tap, mac).map_err(dev_err("virtio-net"))?,
            ));
            let slot = VirtioSlot::at(blocks.len() + nets.len());
            attach_virtio(
                &vm_fd,
                &memory,
                &mut mmio,
                &mut em,
                slot,
                net.clone(),
                net.clone(),
            )?;
            cmdline.push_str(&slot.cmdline_entry());
            nets.push(net);
        }
        if cmdline.len() >= CMDLINE_MAX_SIZE {
            return Err(ConfigError::CmdlineTooLong {
                len: cmdline.len(),
                max: CMDLINE_MAX_SIZE - 1,
            }
            .into());
        }

        let boot = boot::load(
            &memory,
            &BootSpec {
                mem_size,
                vcpus: config.vcpus,
                kernel: &config.kernel,
                initrd: config.initrd.as_deref(),
                cmdline: &cmdline,
            },
        )?;

        let mut vcpus = Vec::with_capacity(config.vcpus as usize);
        for id in 0..config.vcpus {
            let v = Vcpu::new(&vm_fd, id)
                .map_err(|e| VmError::Vcpu(format!("KVM_CREATE_VCPU {id}: {e}")))?;
            v.configure(&kvm.kvm, config.vcpus, &boot)
                .map_err(|e| VmError::Vcpu(format!("vCPU {id}: {e}")))?;
            vcpus.push(v);
        }
        vcpu::register_kick_handler().map_err(VmError::Vcpu)?;

        let event_thread = std::thread::Builder::new()
            .name("vmm-events".into())
            .spawn(move || {
                while !stopping.load(std::sync::atomic::Ordering::SeqCst) {
                    if let Err(e) = em.run() {
                        tracing::error!("event loop: {e:?}");
                        break;
                    }
                }
            })
            .map_err(dev_err("event thread"))?;

        let control = VcpuControl::new();
        let first_run = Arc::new(OnceLock::new());
        let pio = Arc::new(pio);
        let mmio = Arc::new(mmio);
        let mut vcpu_threads = Vec::new();
        for v in vcpus {
            let ctx = VcpuContext {
                pio: pio.clone(),
                mmio: mmio.clone(),
                memory: memory.clone(),
                control: control.clone(),
                end: end.clone(),
                first_run: first_run.clone(),
                boot_timer: config.boot_timer,
            };
            vcpu_threads
                .push(vcpu::spawn(v, ctx).map_err(|e| VmError::Vcpu(format!("thread: {e}")))?);
        }

        Ok(Vm {
            info: VmInfo {
                vcpus: config.vcpus,
                memory_mib: config.memory_mib,
                acceleration: kvm.acceleration,
            },
            vm_fd: Arc::new(vm_fd),
            memory,
            control,
            end,
            vcpu_threads: Mutex::new(vcpu_threads),
            event_thread: Mutex::new(Some(event_thread)),
            event_stop,
            first_run,
            blocks,
            nets,
            i8042,
        })
    }

    /// The VM's virtio-net devices, in guest order.
    pub fn nets(&self) -> &[Arc<Mutex<Net>>] {
        &self.nets
    }

    /// The VM's virtio-blk devices, in guest order.
    pub fn blocks(&self) -> &[Arc<Mutex<Block>>] {
        &self.blocks
    }

    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    pub fn vm_fd(&self) -> &Arc<VmFd> {
        &self.vm_fd
    }

    /// When the first vCPU first entered KVM_RUN.
    pub fn first_run(&self) -> Option<SystemTime> {
        self.first_run.get().copied()
    }

    pub fn end_signal(&self) -> VmEndSignal {
        self.end.clone()
    }

    /// Stops every vCPU outside guest mode; returns once all are parked.
    pub fn pause(&self) {
        self.control.set(RunState::Paused);
        let live = {
            let threads = self.vcpu_threads.lock().unwrap();
            threads.iter().for_each(vcpu::kick);
            threads.iter().filter(|t| !t.is_finished()).count()
        };
        self.control.wait_parked(live);
    }

    pub fn resume(&self) {
        self.control.set(RunState::Running);
    }

    /// Where each vCPU is executing (vCPU id, RIP): pauses the VM for a moment. For diagnosing
    /// a guest that stopped making progress.
    pub fn vcpu_rips(&self) -> Vec<(u8, u64)> {
        self.pause();
        let rips = self.control.parked_at();
        self.resume();
        rips
    }

    pub fn state(&self) -> RunState {
        self.control.state()
    }

    /// Presses Ctrl-Alt-Del on the guest's keyboard: how a guest without ACPI is asked to shut
    /// down (Linux reboots on it, which `reboot=k` turns into a reset the VMM reports).
    pub fn ctrl_alt_del(&self) {
        self.i8042
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ctrl_alt_del();
    }

    /// Ends the VM from the host side and waits until its threads are gone.
    pub fn stop(&self) {
        self.end.signal(VmEnd::Stopped);
        self.shutdown();
    }

    /// Blocks until the VM ends, then tears down its threads and returns how it ended.
    pub fn wait(self) -> VmEnd {
        let end = self.end.wait();
        self.shutdown();
        end
    }

    /// Stops and joins every vCPU and the event thread. Idempotent.
    pub fn shutdown(&self) {
        self.control.set(RunState::Stopping);
        let threads: Vec<_> = {
            let mut t = self.vcpu_threads.lock().unwrap();
            t.iter().for_each(vcpu::kick);
            t.drain(..).collect()
        };
        for t in threads {
            let _ = t.join();
        }
        let _ = self.event_stop.write(1);
        if let Some(t) = self.event_thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.end.signal(VmEnd::Stopped);
        self.shutdown();
    }
}
