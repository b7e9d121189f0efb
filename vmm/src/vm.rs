//! The handle to a running VM: pause/resume (vCPUs and device I/O), state save, snapshot,
//! dirty logging, and how it ends. Building one is `builder.rs`.

use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use kvm_ioctls::VmFd;

use crate::boot;
use crate::config::ConfigError;
use crate::devices::i8042::I8042;
use crate::devices::manager::{DeviceManager, EventLoop};
use crate::devices::virtio::block::Block;
use crate::devices::virtio::net::Net;
use crate::devices::virtio::vhost_user::log::SharedDirtyLog;
use crate::devices::virtio::vhost_user::BackendState;
use crate::kvm::{KvmAcceleration, KvmError};
use crate::memory::{DirtyLog, GuestRam, MemoryError};
use crate::persist::vm::KvmVmState;
use crate::persist::{
    commit_state_file, write_state_file_uncommitted, MachineState, SnapshotPaths, StateFileError,
};
use crate::vcpu::{self, RunState, VcpuControl, VcpuRequest};

pub use crate::devices::manager::{VirtioSlot, VIRTIO_FIRST_IRQ};
pub use crate::end::{VmEnd, VmEndSignal};
pub use crate::memory::GuestMemory;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Kvm(#[from] KvmError),
    #[error("KVM: {0}")]
    KvmSetup(String),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error("vCPU setup: {0}")]
    Vcpu(String),
    #[error("devices: {0}")]
    Device(String),
    #[error(transparent)]
    StateFile(#[from] StateFileError),
    #[error("snapshot: {0}")]
    StateMismatch(String),
    #[error("restore: {0}")]
    Restore(String),
    #[error("snapshot: {0}")]
    Snapshot(String),
    #[error("pause: {0}")]
    PauseTimeout(String),
}

impl VmError {
    /// True for errors in what the user asked for (exit code 2), as opposed to host failures.
    pub fn is_config_error(&self) -> bool {
        matches!(
            self,
            VmError::Config(_)
                | VmError::StateFile(_)
                | VmError::StateMismatch(_)
                | VmError::Memory(MemoryError::File { .. })
        )
    }
}

/// How long `pause` waits for every vCPU and the device thread to stop.
pub const PAUSE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) fn kvm_err(what: &str) -> impl Fn(kvm_ioctls::Error) -> VmError + '_ {
    move |e| VmError::KvmSetup(format!("{what}: {e}"))
}

/// Facts about the running VM for front ends.
#[derive(Clone, Debug)]
pub struct VmInfo {
    pub vcpus: u8,
    pub memory_mib: u64,
    pub acceleration: KvmAcceleration,
}

/// How far a snapshot got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotProgress {
    /// vCPUs and device I/O are stopped.
    Paused,
    /// Guest memory scanned and written so far, of `total` bytes.
    Memory { done: u64, total: u64 },
}

/// What a snapshot wrote and how long the guest was stopped for it.
#[derive(Clone, Copy, Debug, Default)]
pub struct SnapshotStats {
    pub state_bytes: u64,
    /// Size of guest RAM, the memory file's apparent size.
    pub memory_bytes: u64,
    /// Non-zero pages actually written.
    pub memory_written_bytes: u64,
    pub paused_for: Duration,
}

/// How `Vm::request_shutdown` asked the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShutdownRequest {
    AcpiPowerButton,
    CtrlAltDel,
}

pub struct Vm {
    pub info: VmInfo,
    pub(crate) vm_fd: Arc<VmFd>,
    pub(crate) ram: GuestRam,
    pub(crate) devices: DeviceManager,
    pub(crate) blocks: Vec<Arc<Mutex<Block>>>,
    pub(crate) nets: Vec<Arc<Mutex<Net>>>,
    pub(crate) events: EventLoop,
    pub(crate) control: Arc<VcpuControl>,
    pub(crate) end: VmEndSignal,
    pub(crate) vcpu_threads: Mutex<Vec<JoinHandle<()>>>,
    pub(crate) first_run: Arc<OnceLock<SystemTime>>,
    pub(crate) cmdline: String,
    /// Serializes pause, resume and snapshot from different front-end threads.
    pub(crate) lifecycle: Mutex<()>,
    /// The dirty log vhost-user backends write while a migration logs.
    pub(crate) backend_log: Mutex<Option<Arc<SharedDirtyLog>>>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("info", &self.info)
            .field("state", &self.control.state())
            .field("end", &self.end.get())
            .finish_non_exhaustive()
    }
}

impl Vm {
    /// The VM's virtio-net devices, in guest order.
    pub fn nets(&self) -> &[Arc<Mutex<Net>>] {
        &self.nets
    }

    /// The VM's virtio-blk devices, in guest order.
    pub fn blocks(&self) -> &[Arc<Mutex<Block>>] {
        &self.blocks
    }

    pub fn memory(&self) -> &GuestMemory {
        self.ram.memory()
    }

    pub fn vm_fd(&self) -> &Arc<VmFd> {
        &self.vm_fd
    }

    /// The kernel command line the guest got (with the virtio devices' entries).
    pub fn cmdline(&self) -> &str {
        &self.cmdline
    }

    /// When the first vCPU first entered KVM_RUN.
    pub fn first_run(&self) -> Option<SystemTime> {
        self.first_run.get().copied()
    }

    pub fn end_signal(&self) -> VmEndSignal {
        self.end.clone()
    }

    fn pause_vcpus(&self, deadline: Instant) -> bool {
        self.control.set(RunState::Paused);
        let live = {
            let threads = self.vcpu_threads.lock().unwrap();
            threads.iter().for_each(vcpu::kick);
            threads.iter().filter(|t| !t.is_finished()).count()
        };
        self.control.wait_parked(live, deadline)
    }

    /// Quiesces the machine: every vCPU parks outside guest mode, then the device event loop
    /// parks between events. When this returns Ok no block request is in flight, no frame is
    /// received, and nothing writes guest memory or raises an interrupt until `resume`. If
    /// the machine does not quiesce within `PAUSE_DEADLINE` it is left running and the error
    /// says which part did not stop: a snapshot or migration then fails instead of hanging.
    pub fn pause(&self) -> Result<(), VmError> {
        let _g = self.lifecycle.lock().unwrap_or_else(|p| p.into_inner());
        self.pause_locked()
    }

    fn pause_locked(&self) -> Result<(), VmError> {
        if self.control.state() == RunState::Stopping {
            return Ok(());
        }
        let deadline = Instant::now() + PAUSE_DEADLINE;
        if !self.pause_vcpus(deadline) {
            self.control.set(RunState::Running);
            return Err(VmError::PauseTimeout(format!(
                "the vCPUs did not stop within {PAUSE_DEADLINE:?}; the VM keeps running"
            )));
        }
        if !self.events.pause(deadline) {
            self.events.resume();
            self.control.set(RunState::Running);
            return Err(VmError::PauseTimeout(format!(
                "the device thread did not finish its request within {PAUSE_DEADLINE:?} (a disk or network backend that does not answer?); the VM keeps running"
            )));
        }
        Ok(())
    }

    /// Devices first, so work the guest queued meets a running device loop, then the vCPUs.
    pub fn resume(&self) {
        let _g = self.lifecycle.lock().unwrap_or_else(|p| p.into_inner());
        self.resume_locked();
    }

    fn resume_locked(&self) {
        if self.control.state() == RunState::Stopping {
            return;
        }
        // Rings taken back from vhost-user backends (a snapshot, a failed migration) go back
        // to them before the guest runs.
        self.restart_backends();
        self.events.resume();
        self.control.set(RunState::Running);
    }

    /// True once `pause` has returned and until `resume`.
    pub fn is_paused(&self) -> bool {
        self.control.state() == RunState::Paused && self.events.is_paused()
    }

    /// Where each vCPU is executing (vCPU id, RIP): pauses the vCPUs for a moment. For
    /// diagnosing a guest that stopped making progress.
    pub fn vcpu_rips(&self) -> Vec<(u8, u64)> {
        let _g = self.lifecycle.lock().unwrap_or_else(|p| p.into_inner());
        let was = self.control.state();
        self.pause_vcpus(Instant::now() + PAUSE_DEADLINE);
        let rips = self.control.parked_at();
        if was == RunState::Running {
            self.control.set(RunState::Running);
        }
        rips
    }

    pub fn state(&self) -> RunState {
        self.control.state()
    }

    /// Refuses, naming them with the reason, devices a migration cannot carry.
    pub fn check_migratable(&self) -> Result<(), String> {
        let blockers = self.devices.persist_blockers(true);
        if blockers.is_empty() {
            Ok(())
        } else {
            Err(blockers.join("; "))
        }
    }

    /// Takes the rings back from every vhost-user backend, with their positions, once the
    /// vCPUs are paused (see `VhostUserDevice::quiesce`): the machine state is then exact.
    pub fn quiesce_backends(&self) -> Result<(), VmError> {
        for d in self.devices.vhost_user() {
            let mut d = d.lock().unwrap_or_else(|p| p.into_inner());
            d.quiesce()
                .map_err(|e| VmError::Device(format!("{}: {e}", d.id())))?;
        }
        Ok(())
    }

    /// Hands stopped rings back to their backends (a migration that failed after
    /// `quiesce_backends`). A backend that cannot take them back fails its device (the driver
    /// sees DEVICE_NEEDS_RESET); the guest runs on.
    pub fn restart_backends(&self) {
        for d in self.devices.vhost_user() {
            let mut d = d.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = d.restart() {
                tracing::error!(device = %d.id(), "vhost-user: restarting the rings: {e}");
            }
        }
    }

    /// Refuses, naming them with the reason, devices whose state a snapshot cannot carry.
    pub fn check_persistable(&self) -> Result<(), String> {
        let blockers = self.devices.persist_blockers(false);
        if blockers.is_empty() {
            Ok(())
        } else {
            Err(blockers.join("; "))
        }
    }

    /// The whole machine's state but guest memory. The VM must be paused.
    pub fn save_state(&self) -> Result<MachineState, VmError> {
        if let Some(d) = self.devices.vhost_user().iter().find(|d| {
            d.lock().unwrap_or_else(|p| p.into_inner()).backend_state() == BackendState::Running
        }) {
            let id = d.lock().unwrap_or_else(|p| p.into_inner()).id().to_string();
            return Err(VmError::Snapshot(format!(
                "{id}: its backend still runs the rings (quiesce_backends first)"
            )));
        }
        if !self.is_paused() {
            return Err(VmError::Snapshot("the VM is not paused".into()));
        }
        if let Some(end) = self.end.get() {
            return Err(VmError::Snapshot(format!("the VM has ended ({end})")));
        }
        let mut replies = Vec::new();
        for id in 0..self.info.vcpus {
            let (tx, rx) = std::sync::mpsc::channel();
            self.control.request(id, VcpuRequest::SaveState(tx));
            replies.push(rx);
        }
        let mut vcpu_states = Vec::with_capacity(replies.len());
        for (id, rx) in replies.into_iter().enumerate() {
            let s = rx
                .recv_timeout(Duration::from_secs(30))
                .map_err(|_| format!("vCPU {id} did not answer (has the VM ended?)"))
                .and_then(|r| r)
                .map_err(|e| VmError::Snapshot(format!("vCPU {id}: {e}")))?;
            vcpu_states.push(s);
        }
        Ok(MachineState {
            vcpus: self.info.vcpus,
            memory_mib: self.info.memory_mib,
            cmdline: self.cmdline.clone(),
            memory: self.ram.layout().to_vec(),
            vm: KvmVmState::save(&self.vm_fd).map_err(VmError::Snapshot)?,
            vcpu_states,
            devices: self.devices.save(),
            memory_seal: None,
        })
    }

    /// Pauses, writes the state and memory files, and resumes unless `stay_paused` (or unless
    /// the VM was paused before). A failure leaves the VM as it was and the previous files
    /// at `paths`, if any, in place.
    pub fn snapshot(
        &self,
        paths: &SnapshotPaths,
        stay_paused: bool,
    ) -> Result<SnapshotStats, VmError> {
        self.snapshot_with_progress(paths, stay_paused, &mut |_| {})
    }

    /// `snapshot`, telling `progress` how far it got.
    pub fn snapshot_with_progress(
        &self,
        paths: &SnapshotPaths,
        stay_paused: bool,
        progress: &mut dyn FnMut(SnapshotProgress),
    ) -> Result<SnapshotStats, VmError> {
        let _g = self.lifecycle.lock().unwrap_or_else(|p| p.into_inner());
        self.check_persistable().map_err(VmError::Snapshot)?;
        let was_paused = self.is_paused();
        let started = Instant::now();
        self.pause_locked()?;
        progress(SnapshotProgress::Paused);
        let r = self
            .quiesce_backends()
            .and_then(|()| self.write_snapshot(paths, progress));
        let paused_for = started.elapsed();
        if !was_paused && (!stay_paused || r.is_err()) {
            self.resume_locked();
        }
        r.map(|(state_bytes, mem)| SnapshotStats {
            state_bytes,
            memory_bytes: mem.logical_bytes,
            memory_written_bytes: mem.written_bytes,
            paused_for,
        })
    }

    fn write_snapshot(
        &self,
        paths: &SnapshotPaths,
        progress: &mut dyn FnMut(SnapshotProgress),
    ) -> Result<(u64, crate::memory::MemoryFileStats), VmError> {
        let mut state = self.save_state()?;
        let mem_err = |source| MemoryError::File {
            path: paths.memory.display().to_string(),
            source,
        };
        let seal = crate::persist::new_memory_seal().map_err(mem_err)?;
        state.memory_seal = Some(seal);
        // Both files are written whole as temporaries before either is renamed, so a failure
        // while writing leaves the previous pair as it was. Memory goes to a new file: a VM
        // restored from the old one maps its inode, which must never change under it. The
        // seal in both makes a pair that a crash between the renames would mix refuse to
        // restore instead of running one snapshot's vCPUs on another's RAM.
        let tmp = crate::persist::temporary_of(&paths.memory);
        let mem = self.ram.write_file(&tmp, &seal, &mut |done, total| {
            progress(SnapshotProgress::Memory { done, total })
        })?;
        let state_bytes = write_state_file_uncommitted(&paths.state, &state)?;
        std::fs::rename(&tmp, &paths.memory).map_err(mem_err)?;
        commit_state_file(&paths.state)?;
        Ok((state_bytes, mem))
    }

    /// Starts KVM's dirty log on every RAM slot (and clears the VMM's own bitmap); vhost-user
    /// backends log what they write into a shared log from here on too.
    pub fn start_dirty_log(&self) -> Result<(), VmError> {
        self.ram.start_dirty_log(&self.vm_fd)?;
        let devices = self.devices.vhost_user();
        if devices.is_empty() {
            return Ok(());
        }
        let end = self
            .ram
            .layout()
            .iter()
            .map(|r| r.guest_addr + r.size)
            .max()
            .unwrap_or(0);
        let log = Arc::new(
            SharedDirtyLog::new(end)
                .map_err(|e| VmError::Device(format!("the backends' dirty log: {e}")))?,
        );
        *self.backend_log.lock().unwrap_or_else(|p| p.into_inner()) = Some(log.clone());
        for d in devices {
            let mut d = d.lock().unwrap_or_else(|p| p.into_inner());
            d.start_logging(log.clone())
                .map_err(|e| VmError::Device(format!("{}: {e}", d.id())))?;
        }
        Ok(())
    }

    /// Pages written since logging started or since the last call (guest, VMM and backend
    /// writes).
    pub fn dirty_log(&self) -> Result<DirtyLog, VmError> {
        let mut log = self.ram.dirty_log(&self.vm_fd)?;
        if let Some(b) = &*self.backend_log.lock().unwrap_or_else(|p| p.into_inner()) {
            b.take_into(&mut log);
        }
        Ok(log)
    }

    pub fn stop_dirty_log(&self) -> Result<(), VmError> {
        let logged = self
            .backend_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if logged.is_some() {
            for d in self.devices.vhost_user() {
                let mut d = d.lock().unwrap_or_else(|p| p.into_inner());
                if let Err(e) = d.stop_logging() {
                    tracing::error!(device = %d.id(), "vhost-user: stopping the dirty log: {e}");
                }
            }
        }
        Ok(self.ram.stop_dirty_log(&self.vm_fd)?)
    }

    /// Takes the disks' advisory locks, waiting up to `wait` for another holder (a migration
    /// source winding down) to let go.
    pub fn lock_disks(&self, wait: Duration) -> Result<(), VmError> {
        let deadline = Instant::now() + wait;
        for b in &self.blocks {
            loop {
                let r = b.lock().unwrap_or_else(|p| p.into_inner()).disk().lock();
                match r {
                    Ok(()) => break,
                    Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => return Err(VmError::Device(e.to_string())),
                }
            }
        }
        Ok(())
    }

    /// Flushes every disk and releases its lock (a migration source at switch-over).
    pub fn release_disks(&self) -> Result<(), VmError> {
        for b in &self.blocks {
            let r = b.lock().unwrap_or_else(|p| p.into_inner()).disk().release();
            r.map_err(|e| VmError::Device(e.to_string()))?;
        }
        Ok(())
    }

    /// Announces every NIC's MAC from this host (after a migration): one RARP at once and four
    /// more 100 ms apart, from a thread of its own, as QEMU does, so a lost frame or a switch
    /// still learning does not leave the guest unreachable until it sends something itself.
    pub fn announce_network(&self) {
        if self.nets.is_empty() {
            return;
        }
        let nets = self.nets.clone();
        let spawned = std::thread::Builder::new()
            .name("net-announce".into())
            .spawn(move || {
                for round in 0..5 {
                    if round > 0 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    for n in &nets {
                        let n = n.lock().unwrap_or_else(|p| p.into_inner());
                        if let Err(e) = n.announce() {
                            tracing::debug!(nic = %n.id, "announce: {e}");
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("network announce thread: {e}");
        }
    }

    /// Keeps the vCPUs out of guest mode (devices keep running) for `held_per_run` times as
    /// long as they ran from `ran_since` until all of them parked: auto-converge's throttle.
    /// Does nothing unless the VM is running.
    pub(crate) fn hold_vcpus(&self, ran_since: Instant, held_per_run: f64) {
        let _g = self.lifecycle.lock().unwrap_or_else(|p| p.into_inner());
        if self.control.state() != RunState::Running {
            return;
        }
        // A throttle that cannot hold the vCPUs within the deadline just lets them run.
        self.pause_vcpus(Instant::now() + PAUSE_DEADLINE);
        std::thread::sleep(ran_since.elapsed().mul_f64(held_per_run));
        if self.control.state() == RunState::Paused {
            self.control.set(RunState::Running);
        }
    }

    /// Presses Ctrl-Alt-Del on the guest's keyboard: how a guest without ACPI is asked to shut
    /// down (Linux reboots on it, which `reboot=k` turns into a reset the VMM reports).
    pub fn ctrl_alt_del(&self) {
        self.i8042().ctrl_alt_del();
    }

    /// Asks the guest to shut down the way it can hear: the ACPI power button when it set up
    /// the GED's interrupt (as KubeVirt does for every guest), else Ctrl-Alt-Del.
    pub fn request_shutdown(&self) -> ShutdownRequest {
        match self.press_power_button() {
            Ok(true) => ShutdownRequest::AcpiPowerButton,
            Ok(false) => {
                self.ctrl_alt_del();
                ShutdownRequest::CtrlAltDel
            }
            Err(e) => {
                tracing::warn!("ACPI power button: {e}; pressing Ctrl-Alt-Del");
                self.ctrl_alt_del();
                ShutdownRequest::CtrlAltDel
            }
        }
    }

    /// Presses the ACPI power button (KubeVirt's graceful shutdown): a guest with ACPI hears
    /// it through the GED. Returns false, pressing nothing, when the guest has not set up the
    /// GED's interrupt (no ACPI, or not yet).
    pub fn press_power_button(&self) -> std::io::Result<bool> {
        let listening =
            crate::persist::vm::guest_takes_isa_irq(&self.vm_fd, crate::layout::GED_IRQ)
                .map_err(std::io::Error::other)?;
        if listening {
            self.ged().press_power_button()?;
        }
        Ok(listening)
    }

    /// Gives the guest a new VMGenID generation ID and announces it: every restore does, as
    /// one snapshot may be restored many times.
    pub fn announce_new_generation(&self) -> std::io::Result<crate::devices::ged::GenerationId> {
        let interrupt =
            crate::persist::vm::guest_takes_isa_irq(&self.vm_fd, crate::layout::GED_IRQ)
                .map_err(std::io::Error::other)?;
        self.ged()
            .announce_new_generation(self.ram.memory(), interrupt)
    }

    /// Tells the guest of every device restored with a config space other than the
    /// snapshot's (once, after the interrupt controllers are restored, so the interrupt is
    /// not lost).
    pub fn announce_config_changes(&mut self) {
        for e in self.devices.virtio.iter_mut().filter(|e| e.config_changed) {
            e.transport
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .config_changed();
            e.config_changed = false;
            tracing::debug!(device = %e.id, "config change announced");
        }
    }

    /// The generation ID in guest memory now.
    pub fn generation(&self) -> Option<crate::devices::ged::GenerationId> {
        crate::devices::ged::generation(self.ram.memory())
    }

    fn ged(&self) -> std::sync::MutexGuard<'_, crate::devices::ged::Ged> {
        self.devices.ged.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn i8042(&self) -> std::sync::MutexGuard<'_, I8042> {
        self.devices.i8042.lock().unwrap_or_else(|p| p.into_inner())
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
        self.events.stop();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.end.signal(VmEnd::Stopped);
        self.shutdown();
    }
}
