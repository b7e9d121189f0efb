//! vCPU threads: configuration, the run loop, and pause/resume through `immediate_exit` plus a
//! signal so a vCPU inside KVM_RUN returns promptly.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use kvm_bindings::{kvm_run, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::arch::{cpuid, regs};
use crate::boot::{read_guest_bytes, BootEntry};
use crate::bus::Bus;
use crate::end::{VmEnd, VmEndSignal};
use crate::memory::GuestMemory;
use crate::persist::vcpu::{self as vcpu_state, VcpuState, VcpuStateSupport};

/// The real-time signal that kicks a vCPU out of KVM_RUN.
pub fn vcpu_kick_signal() -> i32 {
    SIGRTMIN()
}

thread_local! {
    // Set by each vCPU thread to its own kvm_run so the signal handler can set immediate_exit.
    static KVM_RUN_PTR: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    KVM_RUN_PTR.with(|p| {
        let run = p.get();
        if !run.is_null() {
            // SAFETY: the pointer is this thread's own mmapped kvm_run, valid while the vCPU
            // thread runs; the handler only runs on that thread.
            unsafe { (*run).immediate_exit = 1 };
        }
    });
}

static REGISTER_KICK: std::sync::Once = std::sync::Once::new();

pub fn register_kick_handler() -> Result<(), String> {
    let mut res = Ok(());
    REGISTER_KICK.call_once(|| {
        res = register_signal_handler(vcpu_kick_signal(), kick_handler).map_err(|e| e.to_string());
    });
    res
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunState {
    Running,
    Paused,
    Stopping,
}

/// What a parked vCPU is asked to do on its own thread (KVM wants vCPU ioctls there).
pub enum VcpuRequest {
    SaveState(Sender<Result<VcpuState, String>>),
    RestoreState(Box<VcpuState>, Sender<Result<(), String>>),
}

struct ControlState {
    run: RunState,
    parked: usize,
    /// Each vCPU's requests in the order they were made: a second request waits for the
    /// first, it never replaces it.
    requests: BTreeMap<u8, std::collections::VecDeque<VcpuRequest>>,
}

/// Shared run state of all vCPUs, and the command channel to parked vCPUs.
pub struct VcpuControl {
    state: Mutex<ControlState>,
    changed: Condvar,
    /// Where each vCPU was when it last parked (vCPU id → RIP), for diagnosing stuck guests.
    parked_at: Mutex<BTreeMap<u8, u64>>,
}

impl VcpuControl {
    pub fn new(initial: RunState) -> Arc<Self> {
        Arc::new(VcpuControl {
            state: Mutex::new(ControlState {
                run: initial,
                parked: 0,
                requests: BTreeMap::new(),
            }),
            changed: Condvar::new(),
            parked_at: Mutex::default(),
        })
    }

    pub fn set(&self, s: RunState) {
        let mut g = self.state.lock().unwrap();
        g.run = s;
        if s == RunState::Stopping {
            // Nobody will serve them: their senders drop and the askers see an error.
            g.requests.clear();
        }
        self.changed.notify_all();
    }

    pub fn state(&self) -> RunState {
        self.state.lock().unwrap().run
    }

    /// Waits until `n` vCPUs are parked (paused) or the state leaves Paused.
    /// Waits until `n` vCPUs are parked (or the state left Paused); false if `deadline`
    /// passed first.
    pub fn wait_parked(&self, n: usize, deadline: std::time::Instant) -> bool {
        let mut g = self.state.lock().unwrap();
        while g.run == RunState::Paused && g.parked < n {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self.changed.wait_timeout(g, left).unwrap().0;
        }
        true
    }

    /// Queues `req` for parked vCPU `id`; it runs on that vCPU's thread after the requests
    /// before it. While the vCPUs are stopping nobody will serve it: it is dropped at once, and
    /// the asker's reply channel reports that.
    pub fn request(&self, id: u8, req: VcpuRequest) {
        let mut g = self.state.lock().unwrap();
        if g.run == RunState::Stopping {
            return;
        }
        g.requests.entry(id).or_default().push_back(req);
        self.changed.notify_all();
    }

    /// RIP of every vCPU at its last park.
    pub fn parked_at(&self) -> Vec<(u8, u64)> {
        self.parked_at
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect()
    }

    /// Called by a vCPU thread: parks while paused, first recording where vCPU `id` stopped
    /// (`rip`), so that whoever waits for the vCPUs to park sees every RIP, and serves requests
    /// while parked. Returns false when the vCPU must stop.
    fn park_if_paused(
        &self,
        id: u8,
        rip: impl FnOnce() -> Option<u64>,
        mut serve: impl FnMut(VcpuRequest),
    ) -> bool {
        let mut g = self.state.lock().unwrap();
        if g.run == RunState::Paused {
            // Recorded under the state lock, before this vCPU counts as parked: a pause that
            // lands between a check and the park can no longer lose the RIP.
            if let Some(rip) = rip() {
                self.parked_at.lock().unwrap().insert(id, rip);
            }
            g.parked += 1;
            self.changed.notify_all();
            while g.run == RunState::Paused {
                if let Some(req) = g.requests.get_mut(&id).and_then(|q| q.pop_front()) {
                    drop(g);
                    serve(req);
                    g = self.state.lock().unwrap();
                    continue;
                }
                g = self.changed.wait(g).unwrap();
            }
            g.parked -= 1;
        }
        g.run != RunState::Stopping
    }
}

pub struct Vcpu {
    pub id: u8,
    pub fd: VcpuFd,
}

impl Vcpu {
    pub fn new(vm: &VmFd, id: u8) -> Result<Self, kvm_ioctls::Error> {
        Ok(Vcpu {
            id,
            fd: vm.create_vcpu(id as u64)?,
        })
    }

    /// CPUID, MSRs, FPU and LAPIC for every vCPU; registers only for the boot processor
    /// (application processors wait for INIT/SIPI in the in-kernel LAPIC).
    pub fn configure(&self, kvm: &Kvm, count: u8, boot: &BootEntry) -> Result<(), String> {
        let mut cpuid: CpuId = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| format!("KVM_GET_SUPPORTED_CPUID: {e}"))?;
        cpuid::shape(cpuid.as_mut_slice(), self.id, count);
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(|e| format!("KVM_SET_CPUID2: {e}"))?;

        let msrs =
            Msrs::from_entries(&regs::boot_msrs()).map_err(|e| format!("MSR list: {e:?}"))?;
        let n = self
            .fd
            .set_msrs(&msrs)
            .map_err(|e| format!("KVM_SET_MSRS: {e}"))?;
        if n != msrs.as_slice().len() {
            return Err(format!(
                "KVM_SET_MSRS set {n} of {} MSRs",
                msrs.as_slice().len()
            ));
        }
        self.fd
            .set_fpu(&regs::boot_fpu())
            .map_err(|e| format!("KVM_SET_FPU: {e}"))?;
        let mut lapic = self
            .fd
            .get_lapic()
            .map_err(|e| format!("KVM_GET_LAPIC: {e}"))?;
        regs::set_lint(&mut lapic);
        self.fd
            .set_lapic(&lapic)
            .map_err(|e| format!("KVM_SET_LAPIC: {e}"))?;
        if self.id == 0 {
            let sregs = self
                .fd
                .get_sregs()
                .map_err(|e| format!("KVM_GET_SREGS: {e}"))?;
            self.fd
                .set_sregs(&regs::boot_sregs(sregs, boot.mode))
                .map_err(|e| format!("KVM_SET_SREGS: {e}"))?;
            self.fd
                .set_regs(&regs::boot_regs(boot.entry, boot.boot_info, boot.mode))
                .map_err(|e| format!("KVM_SET_REGS: {e}"))?;
        }
        Ok(())
    }
}

pub struct VcpuContext {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub memory: GuestMemory,
    pub control: Arc<VcpuControl>,
    pub end: VmEndSignal,
    pub first_run: Arc<std::sync::OnceLock<std::time::SystemTime>>,
    pub boot_timer: bool,
    pub state_support: Arc<VcpuStateSupport>,
    /// Install the vCPU seccomp filter before the first KVM_RUN.
    pub seccomp: bool,
}

pub fn spawn(mut vcpu: Vcpu, ctx: VcpuContext) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("vcpu{}", vcpu.id))
        .spawn(move || {
            if let Err(e) = crate::privileges::drop_capabilities() {
                ctx.end.signal(VmEnd::VcpuError {
                    vcpu: vcpu.id,
                    message: e.to_string(),
                });
                return;
            }
            if ctx.seccomp {
                if let Err(e) = crate::seccomp::install(crate::seccomp::ThreadKind::Vcpu(vcpu.id)) {
                    ctx.end.signal(VmEnd::VcpuError {
                        vcpu: vcpu.id,
                        message: e.to_string(),
                    });
                    return;
                }
            }
            KVM_RUN_PTR.with(|p| p.set(vcpu.fd.get_kvm_run() as *mut kvm_run));
            let end = run_loop(&mut vcpu, &ctx);
            KVM_RUN_PTR.with(|p| p.set(std::ptr::null_mut()));
            if let Some(end) = end {
                ctx.end.signal(end);
            }
        })
}

fn run_loop(vcpu: &mut Vcpu, ctx: &VcpuContext) -> Option<VmEnd> {
    let id = vcpu.id;
    loop {
        let fd = &vcpu.fd;
        let serve = |req| match req {
            VcpuRequest::SaveState(reply) => {
                let _ = reply.send(vcpu_state::save(fd, id, &ctx.state_support));
            }
            VcpuRequest::RestoreState(state, reply) => {
                let r = vcpu_state::restore_identity(fd, &state, &ctx.state_support)
                    .and_then(|()| vcpu_state::restore(fd, &state));
                let _ = reply.send(r);
            }
        };
        if !ctx
            .control
            .park_if_paused(id, || fd.get_regs().ok().map(|r| r.rip), serve)
        {
            return None;
        }
        if ctx.first_run.get().is_none() {
            let now = std::time::SystemTime::now();
            if ctx.first_run.set(now).is_ok() && ctx.boot_timer {
                let ns = now
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                eprintln!("microvirt boot-timer: first KVM_RUN unix_ns={ns}");
            }
        }
        match vcpu.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !ctx.pio.read(port as u64, data) {
                    data.fill(0xff); // nothing decodes this port: floating bus
                }
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                ctx.pio.write(port as u64, data);
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !ctx.mmio.read(addr, data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                ctx.mmio.write(addr, data);
            }
            Ok(VcpuExit::Hlt) => {
                // With the in-kernel LAPIC, HLT is handled by KVM; seeing it means the guest
                // halted with nothing that could wake it.
                return Some(VmEnd::Halted { vcpu: id });
            }
            Ok(VcpuExit::Shutdown) => return Some(VmEnd::TripleFault { vcpu: id }),
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                return Some(match kind {
                    kvm_bindings::KVM_SYSTEM_EVENT_RESET => VmEnd::Reset,
                    _ => VmEnd::PoweredOff,
                })
            }
            Ok(VcpuExit::InternalError) => return Some(internal_error(vcpu, &ctx.memory)),
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                return Some(VmEnd::EntryFailure {
                    vcpu: id,
                    reason,
                    cpu,
                })
            }
            Ok(other) => {
                return Some(VmEnd::VcpuError {
                    vcpu: id,
                    message: format!("unhandled exit {other:?}"),
                })
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                vcpu.fd.set_kvm_immediate_exit(0);
            }
            Err(e) => {
                return Some(VmEnd::VcpuError {
                    vcpu: id,
                    message: format!("KVM_RUN: {e}"),
                })
            }
        }
    }
}

fn internal_error(vcpu: &mut Vcpu, mem: &GuestMemory) -> VmEnd {
    let run = vcpu.fd.get_kvm_run();
    // SAFETY: exit_reason is KVM_EXIT_INTERNAL_ERROR, so the `internal` union member is valid.
    let internal = unsafe { run.__bindgen_anon_1.internal };
    let suberror = internal.suberror;
    let (rip, insn) = match (vcpu.fd.get_regs(), vcpu.fd.get_sregs()) {
        (Ok(r), Ok(s)) => {
            let rip = s.cs.base.wrapping_add(r.rip);
            let bytes = regs::translate_gva(mem, &s, rip).map(|gpa| read_guest_bytes(mem, gpa, 15));
            (rip, bytes.unwrap_or_default())
        }
        _ => (0, Vec::new()),
    };
    VmEnd::InternalError {
        vcpu: vcpu.id,
        suberror,
        rip,
        insn,
    }
}

/// Interrupts a vCPU thread inside KVM_RUN.
pub fn kick(handle: &JoinHandle<()>) {
    let _ = handle.kill(vcpu_kick_signal());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two requests for one vCPU are both served, in order; one made while stopping is
    /// dropped (its asker learns it), never left waiting.
    #[test]
    fn requests_queue_in_order_and_none_is_overwritten() {
        let c = VcpuControl::new(RunState::Paused);
        let (tx1, rx1) = std::sync::mpsc::channel();
        let (tx2, rx2) = std::sync::mpsc::channel();
        c.request(0, VcpuRequest::SaveState(tx1));
        c.request(0, VcpuRequest::SaveState(tx2));
        let vcpu = c.clone();
        let served = std::thread::spawn(move || {
            let mut order = Vec::new();
            let mut n = 0;
            vcpu.park_if_paused(
                0,
                || Some(0),
                |req| {
                    n += 1;
                    if let VcpuRequest::SaveState(reply) = req {
                        order.push(n);
                        let _ = reply.send(Err(format!("request {n}")));
                    }
                },
            );
            order
        });
        assert_eq!(rx1.recv().unwrap().unwrap_err(), "request 1");
        assert_eq!(rx2.recv().unwrap().unwrap_err(), "request 2");
        c.set(RunState::Running);
        assert_eq!(served.join().unwrap(), vec![1, 2]);
        c.set(RunState::Stopping);
        let (tx3, rx3) = std::sync::mpsc::channel();
        c.request(0, VcpuRequest::SaveState(tx3));
        assert!(
            rx3.recv().is_err(),
            "a request while stopping must not wait"
        );
    }

    /// A vCPU that never parks (stuck in the host, say) cannot hold `pause` forever.
    #[test]
    fn waiting_for_parked_vcpus_ends_at_the_deadline() {
        let c = VcpuControl::new(RunState::Paused);
        let start = std::time::Instant::now();
        let deadline = start + std::time::Duration::from_millis(200);
        assert!(!c.wait_parked(1, deadline), "nobody parked");
        assert!(start.elapsed() >= std::time::Duration::from_millis(200));
        assert!(c.wait_parked(0, deadline), "nothing to wait for");
    }
}
