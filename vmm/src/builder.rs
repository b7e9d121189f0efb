//! Turning a `VmConfig` into a running VM, as named steps that a fresh boot and a restore from
//! a snapshot share: open the backends, create the KVM VM, map and register RAM, build the
//! devices, create the vCPUs, start the threads. Boot adds loading the kernel and the vCPUs'
//! boot registers; restore adds injecting the recorded state instead.

use std::os::fd::FromRawFd;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use kvm_bindings::{kvm_pit_config, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::VmFd;

use crate::boot;
use crate::config::{ConfigError, TapSource, VmConfig};
use crate::devices::manager::{Backends, DeviceManager, EventLoop};
use crate::devices::virtio::block::{Disk, DiskError};
use crate::devices::virtio::net::{Tap, TapError};
use crate::end::VmEndSignal;
use crate::kvm::KvmContext;
use crate::layout::*;
use crate::memory::{file_layout, GuestRam};
use crate::persist::vcpu::VcpuStateSupport;
use crate::persist::{read_state_file, MachineState, SnapshotPaths, VirtioKindState};
use crate::vcpu::{self, RunState, Vcpu, VcpuContext, VcpuControl, VcpuRequest};
use crate::vm::{kvm_err, Vm, VmError, VmInfo};

fn tap_reason(e: TapError) -> String {
    match e {
        TapError::NotFound { name } => format!(
            "no TAP device named {name} (create it first, e.g. `ip tuntap add {name} mode tap`)"
        ),
        TapError::Busy { .. } => "busy (another process has it open)".into(),
        TapError::Other { reason, .. } => reason,
    }
}

/// Step 1: disks and TAPs. A missing or locked image is the user's to fix, before anything
/// starts.
fn open_backends(config: &VmConfig, lock_disks: bool) -> Result<Backends, VmError> {
    let mut disks = Vec::with_capacity(config.disks.len());
    for d in &config.disks {
        let disk = Disk::open_with(&d.path, d.read_only, d.cache, lock_disks).map_err(|e| {
            let reason = match e {
                DiskError::Open { reason, .. } => reason,
                DiskError::Locked { .. } => "locked by another VM (advisory lock held)".to_string(),
            };
            ConfigError::Disk {
                path: d.path.display().to_string(),
                reason,
            }
        })?;
        disks.push((disk, d.clone()));
    }
    let mut taps = Vec::with_capacity(config.nets.len());
    for n in &config.nets {
        let tap = match &n.tap {
            TapSource::Name(name) => Tap::open(name),
            // SAFETY: the config hands the descriptor's ownership to the VM.
            TapSource::Fd(fd) => Tap::from_fd(unsafe { std::os::fd::OwnedFd::from_raw_fd(*fd) }),
        }
        .map_err(|e| ConfigError::Net {
            tap: n.tap.to_string(),
            reason: tap_reason(e),
        })?;
        taps.push((tap, n.clone()));
    }
    if !taps.is_empty() {
        if std::path::Path::new("/dev/vhost-net").exists() {
            tracing::info!("virtio-net: /dev/vhost-net present, but this build runs the in-process virtio-net device");
        } else {
            tracing::info!("virtio-net: no /dev/vhost-net; using the in-process virtio-net device");
        }
    }
    let mut filesystems = Vec::with_capacity(config.filesystems.len());
    for f in &config.filesystems {
        let conn = crate::devices::virtio::vhost_user::Connection::open(
            &f.socket,
            crate::devices::virtio::vhost_user::fs::QUEUES,
        )
        .map_err(|e| ConfigError::Fs {
            tag: f.tag.clone(),
            reason: e.to_string(),
        })?;
        filesystems.push((conn, f.clone()));
    }
    let mut vhost_user_disks = Vec::with_capacity(config.vhost_user_disks.len());
    for d in &config.vhost_user_disks {
        use crate::devices::virtio::vhost_user::{blk, Connection};
        let disk_err = |reason: String| ConfigError::Disk {
            path: format!("vhost-user={}", d.socket.display()),
            reason,
        };
        let mut conn =
            Connection::open(&d.socket, blk::QUEUES).map_err(|e| disk_err(e.to_string()))?;
        let cfg = conn
            .config(blk::CONFIG_LEN)
            .map_err(|e| disk_err(e.to_string()))?;
        vhost_user_disks.push((conn, cfg));
    }
    let mut vhost_user_nets = Vec::with_capacity(config.vhost_user_nets.len());
    for n in &config.vhost_user_nets {
        use crate::devices::virtio::vhost_user::{net, Connection};
        let conn = Connection::open(&n.socket, net::QUEUES).map_err(|e| ConfigError::Net {
            tap: format!("vhost-user={}", n.socket.display()),
            reason: e.to_string(),
        })?;
        vhost_user_nets.push((conn, n.clone()));
    }
    Ok(Backends {
        disks,
        taps,
        vhost_user_disks,
        vhost_user_nets,
        filesystems,
        rng: config.rng,
    })
}

/// Step 2: the KVM VM with its in-kernel irqchip and PIT, TSS and identity map in the MMIO gap.
fn create_vm(kvm: &KvmContext) -> Result<VmFd, VmError> {
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
    Ok(vm_fd)
}

/// Step 3: RAM registered as KVM slots (manual dirty-log protection is chosen before, by
/// `GuestRam::use_manual_protect`).
fn register_memory(vm_fd: &VmFd, ram: &GuestRam, boot_timer: bool) -> Result<(), VmError> {
    register_slots(vm_fd, &ram.registration()?, boot_timer)
}

fn register_slots(
    vm_fd: &VmFd,
    regions: &[kvm_bindings::kvm_userspace_memory_region],
    boot_timer: bool,
) -> Result<(), VmError> {
    let started = std::time::Instant::now();
    crate::memory::set_slot_regions(vm_fd, regions)?;
    if boot_timer {
        // On some hosts (software-emulated KVM) registering memory costs milliseconds that
        // are the host's, not the VMM's; the benchmark reports them apart.
        eprintln!(
            "microvirt boot-timer: memory slots ns={}",
            started.elapsed().as_nanos()
        );
    }
    Ok(())
}

/// Step 3 of a fresh boot, on a thread of its own: RAM registered with KVM while the rest of
/// the machine is built (backends opened, kernel and initrd loaded, devices wired, vCPUs
/// configured), none of which needs the slots. On some hosts (software-emulated KVM)
/// registering costs milliseconds of the host's per-page work; here it costs no waiting.
/// Joined before any vCPU runs, and on drop, so no early return leaves it behind.
struct Registration(Option<std::thread::JoinHandle<Result<(), VmError>>>);

impl Registration {
    fn start(vm_fd: &Arc<VmFd>, ram: &GuestRam, boot_timer: bool) -> Result<Registration, VmError> {
        let regions = ram.registration()?;
        let vm_fd = Arc::clone(vm_fd);
        let thread = std::thread::Builder::new()
            .name("vmm-memslots".into())
            .spawn(move || register_slots(&vm_fd, &regions, boot_timer))
            .map_err(|e| VmError::KvmSetup(format!("starting the memory registration: {e}")))?;
        Ok(Registration(Some(thread)))
    }

    fn finish(mut self) -> Result<(), VmError> {
        self.join()
    }

    fn join(&mut self) -> Result<(), VmError> {
        match self.0.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(VmError::KvmSetup("registering memory panicked".into()))),
            None => Ok(()),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// Guest RAM as `config` needs it: a memfd when vhost-user backends map it or huge pages back
/// it, anonymous memory otherwise.
pub(crate) fn guest_ram(config: &VmConfig) -> Result<GuestRam, VmError> {
    let regions = ram_regions(config.memory_mib * MIB);
    Ok(
        if config.has_vhost_user_devices() || config.hugepages.is_some() {
            GuestRam::shared(&regions, config.hugepages)?
        } else {
            GuestRam::anonymous(&regions)?
        },
    )
}

/// Step 5: one KVM vCPU per configured vCPU (configured later by boot or restore).
fn create_vcpus(vm_fd: &VmFd, count: u8) -> Result<Vec<Vcpu>, VmError> {
    (0..count)
        .map(|id| {
            Vcpu::new(vm_fd, id).map_err(|e| VmError::Vcpu(format!("KVM_CREATE_VCPU {id}: {e}")))
        })
        .collect()
}

/// Step 4: the VM, its RAM and its devices (fresh, or as `saved` records them), before any
/// vCPU exists.
struct Machine {
    kvm: KvmContext,
    vm_fd: Arc<VmFd>,
    ram: GuestRam,
    devices: DeviceManager,
    em: crate::devices::manager::Subscribers,
    wake: vmm_sys_util::eventfd::EventFd,
    end: VmEndSignal,
}

impl Machine {
    fn wire(
        kvm: KvmContext,
        vm_fd: Arc<VmFd>,
        ram: GuestRam,
        config: &VmConfig,
        backends: Backends,
        saved: Option<&crate::persist::DevicesState>,
    ) -> Result<Machine, String> {
        let end = VmEndSignal::default();
        let (devices, em, wake) =
            DeviceManager::build(&vm_fd, ram.memory(), &config.serial, &end, backends, saved)?;
        Ok(Machine {
            kvm,
            vm_fd,
            ram,
            devices,
            em,
            wake,
            end,
        })
    }
}

/// What the guest was started with, which the VM reports (and a snapshot records).
struct Launch {
    memory_mib: u64,
    cmdline: String,
    boot_timer: bool,
    seccomp: bool,
}

/// Step 6: the event thread and one thread per vCPU; with `paused` they park before doing
/// anything (a restore injects the state first).
fn start(p: Machine, vcpus: Vec<Vcpu>, launch: Launch, paused: bool) -> Result<Vm, VmError> {
    let state_support =
        Arc::new(VcpuStateSupport::probe(&p.kvm.kvm, &p.vm_fd).map_err(VmError::Vcpu)?);
    vcpu::register_kick_handler().map_err(VmError::Vcpu)?;
    let events = EventLoop::start(p.em, p.wake, paused, launch.seccomp)
        .map_err(|e| VmError::Device(format!("event thread: {e}")))?;
    let control = VcpuControl::new(if paused {
        RunState::Paused
    } else {
        RunState::Running
    });
    let first_run = Arc::new(OnceLock::new());
    let vcpu_count = vcpus.len() as u8;
    let memory = p.ram.memory().clone();
    let mut vcpu_threads = Vec::new();
    for v in vcpus {
        let ctx = VcpuContext {
            pio: p.devices.pio.clone(),
            mmio: p.devices.mmio.clone(),
            memory: memory.clone(),
            control: control.clone(),
            end: p.end.clone(),
            first_run: first_run.clone(),
            boot_timer: launch.boot_timer,
            state_support: state_support.clone(),
            seccomp: launch.seccomp,
        };
        match vcpu::spawn(v, ctx) {
            Ok(t) => vcpu_threads.push(t),
            Err(e) => {
                control.set(RunState::Stopping);
                events.stop();
                return Err(VmError::Vcpu(format!("thread: {e}")));
            }
        }
    }
    Ok(Vm {
        info: VmInfo {
            vcpus: vcpu_count,
            memory_mib: launch.memory_mib,
            acceleration: p.kvm.acceleration,
        },
        vm_fd: p.vm_fd,
        ram: p.ram,
        blocks: p.devices.blocks(),
        nets: p.devices.nets(),
        devices: p.devices,
        events,
        control,
        end: p.end,
        vcpu_threads: Mutex::new(vcpu_threads),
        first_run,
        cmdline: launch.cmdline,
        lifecycle: Mutex::new(()),
        backend_log: Mutex::new(None),
    })
}

impl Vm {
    /// Validates `config`, builds the VM and starts its vCPUs.
    pub fn build(config: &VmConfig) -> Result<Vm, VmError> {
        let kvm = KvmContext::open()?;
        config.validate(Some(kvm.max_vcpus))?;
        let extent = boot::check_fits(config.memory_mib, &config.kernel, config.initrd.as_deref())?;
        let mem_size = config.memory_mib * MIB;
        let vm_fd = Arc::new(create_vm(&kvm)?);
        let mut ram = guest_ram(config)?;
        ram.use_manual_protect(&vm_fd);
        let registration = Registration::start(&vm_fd, &ram, config.boot_timer)?;
        let backends = open_backends(config, true)?;
        let loaded = boot::load_images(
            ram.memory(),
            &boot::Images {
                mem_size,
                kernel: &config.kernel,
                extent,
                initrd: config.initrd.as_deref(),
                map_pages: ram.is_anonymous(),
            },
        )?;
        ram.note_file_backed(&loaded.mapped);
        let machine =
            Machine::wire(kvm, vm_fd, ram, config, backends, None).map_err(VmError::Device)?;
        let cmdline = format!("{}{}", config.cmdline, machine.devices.cmdline_entries);
        if cmdline.len() >= CMDLINE_MAX_SIZE {
            return Err(ConfigError::CmdlineTooLong {
                len: cmdline.len(),
                max: CMDLINE_MAX_SIZE - 1,
            }
            .into());
        }
        let virtio: Vec<_> = (machine.devices.virtio.iter())
            .map(|v| (v.slot.base, v.slot.irq))
            .collect();
        let entry = boot::write_boot_info(
            machine.ram.memory(),
            &loaded,
            &boot::DescribedMachine {
                mem_size,
                vcpus: config.vcpus,
                virtio: &virtio,
            },
            &cmdline,
        )?;
        let vcpus = create_vcpus(&machine.vm_fd, config.vcpus)?;
        for v in &vcpus {
            v.configure(&machine.kvm.kvm, config.vcpus, &entry)
                .map_err(|e| VmError::Vcpu(format!("vCPU {}: {e}", v.id)))?;
        }
        let launch = Launch {
            memory_mib: config.memory_mib,
            cmdline,
            boot_timer: config.boot_timer,
            seccomp: config.seccomp,
        };
        registration.finish()?;
        start(machine, vcpus, launch, false)
    }

    /// Builds the machine a snapshot recorded and lets it continue where it was. `config` says
    /// what the caller expects (vCPUs, memory) and where the host resources are (disks, TAPs,
    /// console); its kernel is not used. Every mismatch is refused before anything runs.
    pub fn restore(config: &VmConfig, paths: &SnapshotPaths) -> Result<Vm, VmError> {
        let state = read_state_file(&paths.state)?;
        Self::restore_state(config, state, paths)
    }

    /// As `restore`, with the state already read.
    pub fn restore_state(
        config: &VmConfig,
        state: MachineState,
        paths: &SnapshotPaths,
    ) -> Result<Vm, VmError> {
        check_matches(config, &state)?;
        let Some(seal) = state.memory_seal else {
            return Err(VmError::StateMismatch(format!(
                "state file {}: it records no memory seal, so its memory file cannot be matched to it (it is a migration state, not a snapshot)",
                paths.state.display()
            )));
        };
        let file = GuestRam::from_file(&paths.memory, &state.memory, Some(&seal))?;
        // vhost-user backends can only serve memory they map too, never a private mapping of
        // the memory file: such a guest's RAM is a shared memfd the file is copied into.
        let ram = if config.has_vhost_user_devices() {
            let ram = guest_ram(config)?;
            ram.fill_from(&file)?;
            ram
        } else {
            file
        };
        let mut vm = Self::restore_paused(config, state, ram, true)?;
        vm.announce_config_changes();
        // A snapshot may be restored many times, each copy a machine of its own: it gets a
        // generation ID of its own before it runs (a migration, one machine moving, keeps it).
        match vm.announce_new_generation() {
            Ok(id) => tracing::debug!(generation = %hex(&id), "new VMGenID generation"),
            Err(e) => {
                vm.stop();
                return Err(VmError::Restore(format!("VMGenID: {e}")));
            }
        }
        vm.resume();
        Ok(vm)
    }

    /// Builds the recorded machine on `ram` (already holding the guest's memory) and injects
    /// every state; returns it paused. `lock_disks` false leaves the disks unlocked for a
    /// migration target whose source still holds them (`Vm::lock_disks` later).
    pub(crate) fn restore_paused(
        config: &VmConfig,
        state: MachineState,
        ram: GuestRam,
        lock_disks: bool,
    ) -> Result<Vm, VmError> {
        check_matches(config, &state)?;
        Self::restore_into(
            RestoreShell::prepare(config, ram, lock_disks)?,
            config,
            state,
        )
    }

    /// The rest of a restore once the state is known: devices, vCPUs, the state put back.
    pub(crate) fn restore_into(
        shell: RestoreShell,
        config: &VmConfig,
        state: MachineState,
    ) -> Result<Vm, VmError> {
        check_matches(config, &state)?;
        let RestoreShell {
            kvm,
            vm_fd,
            ram,
            backends,
        } = shell;
        let machine = Machine::wire(
            kvm,
            Arc::new(vm_fd),
            ram,
            config,
            backends,
            Some(&state.devices),
        )
        .map_err(VmError::Restore)?;
        let vcpus = create_vcpus(&machine.vm_fd, state.vcpus)?;
        state.vm.restore(&machine.vm_fd).map_err(VmError::Restore)?;
        let launch = Launch {
            memory_mib: state.memory_mib,
            cmdline: state.cmdline.clone(),
            boot_timer: config.boot_timer,
            seccomp: config.seccomp,
        };
        let vm = start(machine, vcpus, launch, true)?;
        let mut replies = Vec::new();
        for s in state.vcpu_states {
            let (tx, rx) = std::sync::mpsc::channel();
            vm.control
                .request(s.id, VcpuRequest::RestoreState(Box::new(s), tx));
            replies.push(rx);
        }
        for (id, rx) in replies.into_iter().enumerate() {
            let r = rx
                .recv_timeout(Duration::from_secs(30))
                .map_err(|_| format!("vCPU {id} did not answer"))
                .and_then(|r| r);
            if let Err(e) = r {
                vm.stop();
                return Err(VmError::Restore(format!("vCPU {id}: {e}")));
            }
        }
        Ok(vm)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a restore can set up before it has the machine state: KVM, the VM and its irqchip,
/// guest RAM in its memory slots, the disks and TAPs. A migration target builds it while memory
/// is still arriving, so the guest's downtime does not pay for it.
pub(crate) struct RestoreShell {
    kvm: KvmContext,
    vm_fd: VmFd,
    ram: GuestRam,
    backends: Backends,
}

impl RestoreShell {
    pub(crate) fn prepare(
        config: &VmConfig,
        mut ram: GuestRam,
        lock_disks: bool,
    ) -> Result<RestoreShell, VmError> {
        let kvm = KvmContext::open()?;
        config.validate_devices(Some(kvm.max_vcpus))?;
        let backends = open_backends(config, lock_disks)?;
        let vm_fd = create_vm(&kvm)?;
        ram.use_manual_protect(&vm_fd);
        register_memory(&vm_fd, &ram, config.boot_timer)?;
        Ok(RestoreShell {
            kvm,
            vm_fd,
            ram,
            backends,
        })
    }

    pub(crate) fn memory(&self) -> &crate::memory::GuestMemory {
        self.ram.memory()
    }
}

/// The snapshot must be of the machine the caller asked for.
pub(crate) fn check_matches(config: &VmConfig, state: &MachineState) -> Result<(), VmError> {
    let mismatch = |what: String| Err(VmError::StateMismatch(what));
    if config.vcpus != state.vcpus {
        return mismatch(format!(
            "the snapshot has {} vCPU(s), {} were asked for",
            state.vcpus, config.vcpus
        ));
    }
    if config.memory_mib != state.memory_mib {
        return mismatch(format!(
            "the snapshot has {} MiB of memory, {} MiB were asked for",
            state.memory_mib, config.memory_mib
        ));
    }
    if state.vcpu_states.len() != state.vcpus as usize
        || state
            .vcpu_states
            .iter()
            .enumerate()
            .any(|(i, v)| v.id as usize != i)
    {
        return mismatch("the snapshot's vCPU states do not match its vCPU count".into());
    }
    let count = |kind: fn(&VirtioKindState) -> bool| {
        state
            .devices
            .virtio
            .iter()
            .filter(|d| kind(&d.kind))
            .count()
    };
    let disks = count(|k| matches!(k, VirtioKindState::Block { .. }));
    let nics = count(|k| matches!(k, VirtioKindState::Net { .. }));
    let rngs = count(|k| matches!(k, VirtioKindState::Rng { .. }));
    if rngs != usize::from(config.rng) {
        return mismatch(format!(
            "the snapshot has {rngs} virtio-rng device(s), the configuration {}",
            usize::from(config.rng)
        ));
    }
    if disks != config.disks.len() || nics != config.nets.len() {
        return mismatch(format!(
            "the snapshot has {disks} disk(s) and {nics} NIC(s), the configuration {} and {}",
            config.disks.len(),
            config.nets.len()
        ));
    }
    if state.memory != file_layout(&ram_regions(state.memory_mib * MIB)) {
        return mismatch(format!(
            "the snapshot's memory layout is not the one this VMM gives a {} MiB guest",
            state.memory_mib
        ));
    }
    Ok(())
}
