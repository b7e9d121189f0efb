//! Pre-copy live migration over any byte stream (a TCP connection between launchers).
//!
//! Source: dirty logging on; every non-zero page sent while the guest runs; then rounds of the
//! pages dirtied meanwhile, until the estimated downtime (dirty bytes / measured bandwidth) fits
//! `max_downtime`, the rounds run out or the completion timeout passes (then the migration is
//! cancelled and the VM stays). Stop-and-copy: pause, the last dirty pages, the machine state.
//! The target restores it paused and says `Restored`; only then does the source commit (its VM
//! ends as `VmEnd::Migrated`) and say `Go`, and the target resumes. Any failure before the
//! commit resumes the source: a failed migration leaves the VM running where it was.

pub mod wire;

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::builder::RestoreShell;
use crate::config::VmConfig;
use crate::end::VmEnd;
use crate::layout::{ram_regions, MIB};
use crate::memory::{file_layout, DirtyLog, GuestRam, Unbacked, PAGE_SIZE};
use crate::persist::{self, FORMAT_VERSION, VMM_VERSION};
use crate::vm::{Vm, VmError};
use wire::{Hello, Kind, PagesWriter, WireError, MAX_RUN_PAGES};

/// How a migration may proceed: KubeVirt's `MigrationConfiguration`, with its v1.9 defaults.
/// How long a silent link is waited on is the stream's business (the launcher sets read and
/// write timeouts on its sockets).
#[derive(Clone, Debug)]
pub struct MigrationConfig {
    /// The longest the guest may be stopped for the final copy (`maxDowntimeMs`, 900).
    pub max_downtime: Duration,
    /// Bytes per second at most (`bandwidthPerMigration`); None: as fast as the link goes.
    pub bandwidth_limit: Option<u64>,
    /// Cancel (the VM stays) when the migration has not completed by then
    /// (`completionTimeoutPerGiB` × the guest's GiB, 150 s per GiB).
    pub completion_timeout: Duration,
    /// Cancel when the data still to send has not reached a new low for this long
    /// (`progressTimeout`, 150 s).
    pub progress_timeout: Duration,
    /// Throttle the vCPUs in growing steps while the guest dirties memory faster than it can
    /// be sent (`allowAutoConverge`).
    pub auto_converge: bool,
    /// Set from another thread to cancel (the VM stays on the source); checked between page
    /// runs and passes.
    pub abort: Arc<AtomicBool>,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig {
            max_downtime: Duration::from_millis(900),
            bandwidth_limit: None,
            completion_timeout: Duration::from_secs(150),
            progress_timeout: Duration::from_secs(150),
            auto_converge: false,
            abort: Arc::default(),
        }
    }
}

impl MigrationConfig {
    /// KubeVirt's rule: `completionTimeoutPerGiB` seconds for every GiB of guest memory.
    pub fn with_timeout_per_gib(mut self, seconds_per_gib: u64, memory_mib: u64) -> Self {
        let gib = memory_mib.div_ceil(1024).max(1);
        self.completion_timeout = Duration::from_secs(seconds_per_gib.saturating_mul(gib));
        self
    }
}

/// Where a migration is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Hello, shape check, Ready.
    #[default]
    Handshake,
    /// Memory copied while the guest runs (pass 0: every non-zero page; then dirty pages).
    Precopy,
    /// Guest paused: the last dirty pages and the machine state.
    StopAndCopy,
    /// The target restored the machine; the source hands over (disks, Go, Running).
    Switchover,
    Completed,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Phase::Handshake => "handshake",
            Phase::Precopy => "pre-copy",
            Phase::StopAndCopy => "stop-and-copy",
            Phase::Switchover => "switch-over",
            Phase::Completed => "completed",
        })
    }
}

/// Where a migration is, reported after every pass (KubeVirt's migration metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MigrationProgress {
    pub phase: Phase,
    pub pass: u32,
    /// Bytes on the wire so far.
    pub data_processed_bytes: u64,
    /// Dirty bytes still to send.
    pub data_remaining_bytes: u64,
    pub dirty_rate_bytes_per_s: f64,
    pub transfer_rate_bytes_per_s: f64,
    /// What stopping now would cost: remaining bytes at the measured transfer rate.
    pub expected_downtime: Duration,
    /// Auto-converge's share of time the vCPUs are held, in percent.
    pub throttle_percent: u8,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct MigrationStats {
    /// Pre-copy passes, the first full one included.
    pub passes: u32,
    /// Bytes on the wire (frame headers included).
    pub bytes_sent: u64,
    pub total_time: Duration,
    /// Source paused → target says it runs.
    pub downtime: Duration,
    /// Auto-converge's highest throttle, in percent.
    pub max_throttle_percent: u8,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("{0}")]
    Vm(#[from] VmError),
    #[error("refused by the target: {0}")]
    Refused(String),
    #[error("the target failed: {0}")]
    TargetFailed(String),
    #[error("cancelled: {0}")]
    Cancelled(String),
    #[error("not completed within the completion timeout ({0:?})")]
    Timeout(Duration),
    #[error("no progress for the progress timeout ({0:?}): the guest dirties memory as fast as it is sent (allow auto-converge or more bandwidth)")]
    Stalled(Duration),
    #[error("the VM is not running ({0})")]
    NotRunning(String),
    /// The target was told to run the guest and then went silent: it may run it. The source
    /// stays paused (never two running copies); whoever can see the target decides.
    #[error("the target was told to run the guest and did not confirm ({0}); the VM stays paused here, as the target may be running it")]
    Unconfirmed(String),
}

impl From<std::io::Error> for MigrationError {
    fn from(e: std::io::Error) -> Self {
        MigrationError::Wire(WireError::Io(e))
    }
}

/// Which end of a migration an error happened on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Source,
    Target,
}

/// A failed migration: on which side, in which phase, and why.
#[derive(Debug, thiserror::Error)]
#[error("migration failed on the {} in {phase}{}: {error}", match side { Side::Source => "source", Side::Target => "target" }, pass.map(|p| format!(" (pass {p})")).unwrap_or_default())]
pub struct MigrationFailure {
    pub side: Side,
    pub phase: Phase,
    pub pass: Option<u32>,
    #[source]
    pub error: MigrationError,
}

impl MigrationFailure {
    /// Where the VM is now: true when it still runs (or is paused as before) on the source.
    pub fn vm_stays_on_source(&self) -> bool {
        !matches!(self.error, MigrationError::Unconfirmed(_))
    }
}

fn hello_for(vm: &Vm) -> Hello {
    Hello {
        vmm_version: VMM_VERSION.into(),
        state_format: FORMAT_VERSION,
        vcpus: vm.info.vcpus,
        memory_mib: vm.info.memory_mib,
        memory: vm.ram.layout().to_vec(),
    }
}

/// Keeps the average rate at or under a limit by sleeping, and notices an abort.
struct Throttle {
    limit: Option<u64>,
    started: Instant,
    sent: u64,
    abort: Arc<AtomicBool>,
}

impl Throttle {
    fn check_abort(&self) -> Result<(), MigrationError> {
        if self.abort.load(Ordering::SeqCst) {
            return Err(MigrationError::Cancelled("aborted on request".into()));
        }
        Ok(())
    }

    fn account(&mut self, bytes: u64) {
        self.sent += bytes;
        if let Some(limit) = self.limit.filter(|l| *l > 0) {
            let due = Duration::from_secs_f64(self.sent as f64 / limit as f64);
            if let Some(wait) = due.checked_sub(self.started.elapsed()) {
                // In slices, so a cancel is not held up by a long wait at a low limit.
                let until = Instant::now() + wait;
                while Instant::now() < until && !self.abort.load(Ordering::SeqCst) {
                    std::thread::sleep((until - Instant::now()).min(Duration::from_millis(50)));
                }
            }
        }
    }
}

/// Auto-converge: a thread that holds the vCPUs for `percent` of every slice. Raised in steps
/// (20 %, then 10 % more per pass, at most 99 %) while the guest dirties memory faster than
/// half the transfer rate, the point where pre-copy stops gaining on it.
struct VcpuThrottle {
    percent: AtomicU8,
    stop: AtomicBool,
}

const THROTTLE_SLICE: Duration = Duration::from_millis(20);

impl VcpuThrottle {
    fn run(&self, vm: &Vm) {
        while !self.stop.load(Ordering::SeqCst) {
            let pct = self.percent.load(Ordering::SeqCst) as u32;
            if pct == 0 {
                std::thread::sleep(THROTTLE_SLICE);
                continue;
            }
            vm.hold_vcpus(THROTTLE_SLICE * pct / 100);
            std::thread::sleep(THROTTLE_SLICE * (100 - pct) / 100);
        }
    }

    fn raise(&self) -> u8 {
        let now = match self.percent.load(Ordering::SeqCst) {
            0 => 20,
            p => (p + 10).min(99),
        };
        self.percent.store(now, Ordering::SeqCst);
        now
    }
}

/// Reads the target's next frame, which must be `want`; its Refuse or Failed becomes the
/// error with the target's reason.
fn expect_answer(
    stream: &mut impl Read,
    want: Kind,
    name: &'static str,
) -> Result<(), MigrationError> {
    let reason = |why: Vec<u8>| String::from_utf8_lossy(&why).into_owned();
    match wire::read_frame(stream)? {
        (got, _) if got == want => Ok(()),
        (Kind::Refuse, why) => Err(MigrationError::Refused(reason(why))),
        (Kind::Failed, why) => Err(MigrationError::TargetFailed(reason(why))),
        (got, _) => Err(WireError::Unexpected {
            expected: name,
            got,
        }
        .into()),
    }
}

/// Where the source is, for the error it may end in.
#[derive(Default)]
struct Position {
    phase: Phase,
    pass: Option<u32>,
}

impl Position {
    fn fail(&self, error: MigrationError) -> MigrationFailure {
        let side = match error {
            MigrationError::Refused(_) | MigrationError::TargetFailed(_) => Side::Target,
            _ => Side::Source,
        };
        MigrationFailure {
            side,
            phase: self.phase,
            pass: self.pass,
            error,
        }
    }
}

impl Vm {
    /// Sends pages of `pages` (guest-physical addresses, ascending) in runs.
    fn send_pages(
        &self,
        w: &mut impl Write,
        pages: impl Iterator<Item = u64>,
        pw: &mut PagesWriter,
        throttle: &mut Throttle,
    ) -> Result<(), MigrationError> {
        let mem = self.memory();
        let mut run: Option<(u64, u32)> = None;
        let mut emit = |pw: &mut PagesWriter, (gpa, n): (u64, u32)| -> Result<(), MigrationError> {
            let len = (n as u64 * PAGE_SIZE) as usize;
            let slice = mem
                .get_slice(GuestAddress(gpa), len)
                .map_err(|e| VmError::Memory(crate::memory::MemoryError::Map(e.to_string())))?;
            pw.push_with(w, gpa, len, |dst| {
                slice.copy_to(dst);
            })?;
            throttle.account(len as u64);
            throttle.check_abort()
        };
        for gpa in pages {
            run = match run {
                Some((start, n)) if start + n as u64 * PAGE_SIZE == gpa && n < MAX_RUN_PAGES => {
                    Some((start, n + 1))
                }
                Some(r) => {
                    emit(pw, r)?;
                    Some((gpa, 1))
                }
                None => Some((gpa, 1)),
            };
        }
        if let Some(r) = run {
            emit(pw, r)?;
        }
        Ok(())
    }

    /// Every non-zero page of RAM (the target's memory starts zeroed), found lazily so pages
    /// go out while the scan goes on: a large guest's scan never leaves the link silent.
    fn nonzero_pages(&self) -> impl Iterator<Item = u64> + '_ {
        let anonymous = self.ram.is_anonymous();
        self.memory().iter().flat_map(move |region| {
            let (host, len) = match region.get_host_address(MemoryRegionAddress(0)) {
                Ok(h) => (h as *const u8, region.len()),
                Err(_) => (std::ptr::null(), 0),
            };
            let start = region.start_addr().0;
            let mut unbacked = anonymous.then(|| Unbacked::new(host)).flatten();
            (0..len / PAGE_SIZE).filter_map(move |i| {
                if unbacked.as_mut().is_some_and(|u| u.is_unbacked(i)) {
                    return None;
                }
                // SAFETY: the region maps `len` bytes at `host` while the VM exists; the guest
                // may write them concurrently, which is why dirty logging is on: a page
                // changed after this look is sent again in a later pass.
                let page = unsafe {
                    std::slice::from_raw_parts(
                        host.add((i * PAGE_SIZE) as usize),
                        PAGE_SIZE as usize,
                    )
                };
                (!crate::memory::is_zero(page)).then_some(start + i * PAGE_SIZE)
            })
        })
    }

    /// Migrates this VM to the target at the other end of `stream`. On success the VM has ended
    /// (`VmEnd::Migrated`) and runs on the target; on any error it runs here as before (or,
    /// only when the target went silent after being told to run the guest, stays paused here:
    /// see `MigrationError::Unconfirmed`).
    pub fn migrate_out<S: Read + Write>(
        &self,
        stream: &mut S,
        config: &MigrationConfig,
        progress: &mut dyn FnMut(MigrationProgress),
    ) -> Result<MigrationStats, MigrationFailure> {
        let mut at = Position::default();
        if let Some(end) = self.end.get() {
            return Err(at.fail(MigrationError::NotRunning(end.to_string())));
        }
        let was_paused = self.is_paused();
        let vcpu_throttle = VcpuThrottle {
            percent: AtomicU8::new(0),
            stop: AtomicBool::new(false),
        };
        let r = std::thread::scope(|scope| {
            if config.auto_converge {
                let t = &vcpu_throttle;
                let _ = std::thread::Builder::new()
                    .name("auto-converge".into())
                    .spawn_scoped(scope, move || t.run(self));
            }
            let r = self.send_machine(stream, config, progress, &mut at, &vcpu_throttle);
            vcpu_throttle.stop.store(true, Ordering::SeqCst);
            r
        });
        r.map_err(|e| {
            let failure = at.fail(e);
            let _ = self.stop_dirty_log();
            if failure.vm_stays_on_source() {
                // The target learns why, unless the connection itself is what failed.
                if !matches!(failure.error, MigrationError::Wire(WireError::Io(_))) {
                    let _ = wire::write_frame(stream, Kind::Cancel, failure.to_string().as_bytes());
                    let _ = stream.flush();
                }
                if at.phase == Phase::Switchover {
                    // The disks were handed over; take them back before the guest runs.
                    if let Err(e) = self.lock_disks(Duration::from_secs(10)) {
                        tracing::error!("after a failed migration: {e}");
                    }
                }
                // Resumes only what the migration paused; a VM paused before stays paused.
                if !was_paused {
                    self.resume();
                }
            }
            failure
        })
    }

    fn send_machine<S: Read + Write>(
        &self,
        stream: &mut S,
        config: &MigrationConfig,
        progress: &mut dyn FnMut(MigrationProgress),
        at: &mut Position,
        vcpu_throttle: &VcpuThrottle,
    ) -> Result<MigrationStats, MigrationError> {
        let started = Instant::now();
        wire::write_header(stream)?;
        let hello = postcard::to_stdvec(&hello_for(self)).expect("hello serializes");
        wire::write_frame(stream, Kind::Hello, &hello)?;
        stream.flush()?;
        expect_answer(stream, Kind::Ready, "Ready")?;
        self.start_dirty_log()?;
        at.phase = Phase::Precopy;
        at.pass = Some(0);
        let mut pw = PagesWriter::default();
        let mut throttle = Throttle {
            limit: config.bandwidth_limit,
            started: Instant::now(),
            sent: 0,
            abort: config.abort.clone(),
        };
        let t = Instant::now();
        self.send_pages(stream, self.nonzero_pages(), &mut pw, &mut throttle)?;
        pw.flush(stream)?;
        let mut bandwidth = pw.bytes_sent as f64 / t.elapsed().as_secs_f64().max(1e-6);
        let mut pass = 0;
        // Dirtying started with the first pass: rates are over the time since.
        let mut last = t;
        let mut lowest = u64::MAX;
        let mut lowest_at = Instant::now();
        let mut max_throttle = 0;
        let mut pending: DirtyLog;
        loop {
            if started.elapsed() > config.completion_timeout {
                return Err(MigrationError::Timeout(config.completion_timeout));
            }
            if let Some(end) = self.end.get() {
                return Err(MigrationError::NotRunning(end.to_string()));
            }
            throttle.check_abort()?;
            pending = self.dirty_log()?;
            let interval = last.elapsed().as_secs_f64().max(1e-6);
            last = Instant::now();
            let dirty = pending.page_count() * PAGE_SIZE;
            let dirty_rate = dirty as f64 / interval;
            let expected_downtime = Duration::from_secs_f64(dirty as f64 / bandwidth.max(1.0));
            if dirty < lowest {
                lowest = dirty;
                lowest_at = Instant::now();
            } else if lowest_at.elapsed() > config.progress_timeout {
                return Err(MigrationError::Stalled(config.progress_timeout));
            }
            let converged = dirty == 0 || expected_downtime <= config.max_downtime;
            if !converged && config.auto_converge && dirty_rate > bandwidth / 2.0 {
                max_throttle = vcpu_throttle.raise().max(max_throttle);
            }
            progress(MigrationProgress {
                phase: Phase::Precopy,
                pass,
                data_processed_bytes: pw.bytes_sent,
                data_remaining_bytes: dirty,
                dirty_rate_bytes_per_s: dirty_rate,
                transfer_rate_bytes_per_s: bandwidth,
                expected_downtime,
                throttle_percent: vcpu_throttle.percent.load(Ordering::SeqCst),
            });
            if converged {
                break;
            }
            pass += 1;
            at.pass = Some(pass);
            let t = Instant::now();
            let before = pw.bytes_sent;
            self.send_pages(stream, pending.pages(), &mut pw, &mut throttle)?;
            pw.flush(stream)?;
            bandwidth = (pw.bytes_sent - before) as f64 / t.elapsed().as_secs_f64().max(1e-6);
        }
        // Converged. The last pass's pages still go out while the guest runs; then a Sync
        // waits until the target has taken in everything sent so far. Without it the
        // downtime would include the target draining the socket buffers (megabytes of pages
        // to checksum and fault in), not just the final few pages.
        self.send_pages(stream, pending.pages(), &mut pw, &mut throttle)?;
        pw.flush(stream)?;
        wire::write_frame(stream, Kind::Sync, &[])?;
        stream.flush()?;
        expect_answer(stream, Kind::Synced, "Synced")?;
        // Stop and copy: the throttle has nothing left to do.
        vcpu_throttle.stop.store(true, Ordering::SeqCst);
        at.phase = Phase::StopAndCopy;
        at.pass = None;
        let paused_at = Instant::now();
        self.pause()?;
        let last_dirty = self.dirty_log()?;
        progress(MigrationProgress {
            phase: Phase::StopAndCopy,
            pass,
            data_processed_bytes: pw.bytes_sent,
            data_remaining_bytes: last_dirty.page_count() * PAGE_SIZE,
            dirty_rate_bytes_per_s: 0.0,
            transfer_rate_bytes_per_s: bandwidth,
            expected_downtime: Duration::from_secs_f64(
                (last_dirty.page_count() * PAGE_SIZE) as f64 / bandwidth.max(1.0),
            ),
            throttle_percent: 0,
        });
        self.send_pages(stream, last_dirty.pages(), &mut pw, &mut throttle)?;
        pw.flush(stream)?;
        // A cancel is honoured up to the switch-over, even when no page was left to send.
        throttle.check_abort()?;
        let state = persist::encode(&self.save_state()?);
        wire::write_frame(stream, Kind::State, &state)?;
        pw.bytes_sent += (state.len() + wire::FRAME_HEADER) as u64;
        stream.flush()?;
        expect_answer(stream, Kind::Restored, "Restored")?;
        // Switch-over: the disks go first (flushed, unlocked) so the target can take them.
        at.phase = Phase::Switchover;
        self.release_disks()?;
        // A Go that could not be written never reached the target: it cannot run the guest.
        wire::write_frame(stream, Kind::Go, &[]).and_then(|()| stream.flush())?;
        // From here the target may run the guest. Only its Running (or a Failed: it did not)
        // settles that; silence, a cut link or a closed connection do not, since a target that
        // resumed and then lost its link looks the same as one that died first. Then the
        // source stays paused rather than risk two running copies of one guest.
        match wire::read_frame(stream) {
            Ok((Kind::Running, _)) => {}
            Ok((Kind::Failed, why)) => {
                return Err(MigrationError::TargetFailed(
                    String::from_utf8_lossy(&why).into_owned(),
                ))
            }
            Ok((got, _)) => {
                return Err(MigrationError::Unconfirmed(format!("it answered {got:?}")))
            }
            Err(e) => return Err(MigrationError::Unconfirmed(e.to_string())),
        }
        // The commit point: the guest runs on the target.
        let downtime = paused_at.elapsed();
        self.end.signal(VmEnd::Migrated);
        at.phase = Phase::Completed;
        progress(MigrationProgress {
            phase: Phase::Completed,
            pass,
            data_processed_bytes: pw.bytes_sent,
            data_remaining_bytes: 0,
            dirty_rate_bytes_per_s: 0.0,
            transfer_rate_bytes_per_s: bandwidth,
            expected_downtime: Duration::ZERO,
            throttle_percent: max_throttle,
        });
        Ok(MigrationStats {
            passes: pass + 1,
            bytes_sent: pw.bytes_sent,
            total_time: started.elapsed(),
            downtime,
            max_throttle_percent: max_throttle,
        })
    }

    /// Receives a VM from the source at the other end of `stream` and runs it with `config`'s
    /// host resources (disks, TAPs, console). Refuses, before any memory moves, a machine other
    /// than `config` describes. Whatever goes wrong, the guest never runs here unless the
    /// source handed it over (Go) and this side confirmed (Running).
    pub fn migrate_in<S: Read + Write>(
        stream: &mut S,
        config: &VmConfig,
    ) -> Result<Vm, MigrationFailure> {
        let mut phase = Phase::Handshake;
        Self::receive_machine(stream, config, &mut phase).map_err(|error| {
            // Tell the source why, unless it already knows (a refusal, its own cancel) or the
            // connection itself failed (writing to it could block on a dead TLS session).
            if !matches!(
                error,
                MigrationError::Refused(_)
                    | MigrationError::Cancelled(_)
                    | MigrationError::Wire(WireError::Io(_))
            ) {
                let _ = wire::write_frame(stream, Kind::Failed, error.to_string().as_bytes());
                let _ = stream.flush();
            }
            MigrationFailure {
                side: Side::Target,
                phase,
                pass: None,
                error,
            }
        })
    }

    fn receive_machine<S: Read + Write>(
        stream: &mut S,
        config: &VmConfig,
        phase: &mut Phase,
    ) -> Result<Vm, MigrationError> {
        wire::read_header(stream)?;
        let hello: Hello = match wire::read_frame(stream)? {
            (Kind::Hello, p) => {
                postcard::from_bytes(&p).map_err(|_| WireError::Malformed("Hello"))?
            }
            (got, _) => {
                return Err(WireError::Unexpected {
                    expected: "Hello",
                    got,
                }
                .into())
            }
        };
        let refuse = |stream: &mut S, why: String| -> MigrationError {
            let _ = wire::write_frame(stream, Kind::Refuse, why.as_bytes());
            let _ = stream.flush();
            MigrationError::Refused(why)
        };
        let layout = file_layout(&ram_regions(config.memory_mib * MIB));
        if hello.state_format != FORMAT_VERSION {
            return Err(refuse(stream, format!("state format {} (written by microvirt {}); this target reads format {FORMAT_VERSION}", hello.state_format, hello.vmm_version)));
        }
        if hello.vcpus != config.vcpus || hello.memory_mib != config.memory_mib {
            return Err(refuse(
                stream,
                format!(
                    "the source VM has {} vCPU(s) and {} MiB, this target was prepared for {} and {}",
                    hello.vcpus, hello.memory_mib, config.vcpus, config.memory_mib
                ),
            ));
        }
        if hello.memory != layout {
            return Err(refuse(stream, "the memory layouts differ".into()));
        }
        let ram =
            GuestRam::anonymous(&ram_regions(config.memory_mib * MIB)).map_err(VmError::from)?;
        // KVM's VM, its memory slots, disks and TAPs now, while the source still runs the
        // guest, not during the downtime; a host resource missing here refuses the migration
        // before any memory moves.
        let shell = match RestoreShell::prepare(config, ram, false) {
            Ok(s) => s,
            Err(e) => return Err(refuse(stream, format!("cannot prepare the machine: {e}"))),
        };
        wire::write_frame(stream, Kind::Ready, &[])?;
        stream.flush()?;
        *phase = Phase::Precopy;
        let state = loop {
            match wire::read_frame(stream)? {
                (Kind::Pages, p) => {
                    for run in wire::parse_pages(&p, &layout)? {
                        shell
                            .memory()
                            .write_slice(run.bytes, GuestAddress(run.gpa))
                            .map_err(|_| WireError::OutOfRange {
                                gpa: run.gpa,
                                pages: (run.bytes.len() as u64 / PAGE_SIZE) as u32,
                            })?;
                    }
                }
                (Kind::Sync, _) => {
                    wire::write_frame(stream, Kind::Synced, &[])?;
                    stream.flush()?;
                }
                (Kind::State, p) => break p,
                (Kind::Cancel, why) => {
                    return Err(MigrationError::Cancelled(
                        String::from_utf8_lossy(&why).into_owned(),
                    ))
                }
                (got, _) => {
                    return Err(WireError::Unexpected {
                        expected: "Pages or State",
                        got,
                    }
                    .into())
                }
            }
        };
        *phase = Phase::StopAndCopy;
        let state = persist::decode(&state, std::path::Path::new("<migration stream>"))
            .map_err(|e| MigrationError::TargetFailed(e.to_string()))?;
        let vm = Vm::restore_into(shell, config, state)
            .map_err(|e| MigrationError::TargetFailed(e.to_string()))?;
        wire::write_frame(stream, Kind::Restored, &[])?;
        stream.flush()?;
        *phase = Phase::Switchover;
        let go = wire::read_frame(stream);
        let refused = match go {
            Ok((Kind::Go, _)) => None,
            Ok((Kind::Cancel, why)) => Some(MigrationError::Cancelled(
                String::from_utf8_lossy(&why).into_owned(),
            )),
            Ok((got, _)) => Some(
                WireError::Unexpected {
                    expected: "Go",
                    got,
                }
                .into(),
            ),
            Err(e) => Some(e.into()),
        };
        if let Some(e) = refused {
            vm.stop();
            return Err(e);
        }
        if let Err(e) = vm.lock_disks(Duration::from_secs(10)) {
            vm.stop();
            return Err(MigrationError::TargetFailed(e.to_string()));
        }
        // Running is written before the guest runs: a source that does not get it knows this
        // side never ran the guest (see the source's switch-over).
        let confirmed = wire::write_frame(stream, Kind::Running, &[]).and_then(|()| stream.flush());
        if let Err(e) = confirmed {
            vm.stop();
            return Err(e.into());
        }
        vm.resume();
        vm.announce_network();
        *phase = Phase::Completed;
        Ok(vm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A stream that reads a prepared byte string and swallows what is written.
    struct Scripted(std::io::Cursor<Vec<u8>>);

    impl Read for Scripted {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(buf)
        }
    }

    impl Write for Scripted {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn config() -> VmConfig {
        let mut c = VmConfig::new("/nonexistent-kernel");
        c.memory_mib = 16;
        c
    }

    fn valid_start(c: &VmConfig) -> Vec<u8> {
        let mut s = Vec::new();
        wire::write_header(&mut s).unwrap();
        let hello = Hello {
            vmm_version: VMM_VERSION.into(),
            state_format: FORMAT_VERSION,
            vcpus: c.vcpus,
            memory_mib: c.memory_mib,
            memory: file_layout(&ram_regions(c.memory_mib * MIB)),
        };
        wire::write_frame(&mut s, Kind::Hello, &postcard::to_stdvec(&hello).unwrap()).unwrap();
        s
    }

    /// A frame of any kind with any payload, correctly checksummed, so the receiver's checks
    /// past the checksum are what is exercised.
    fn frame() -> impl Strategy<Value = Vec<u8>> {
        (
            prop_oneof![Just(1u8), Just(2), Just(3), Just(4), Just(5), any::<u8>()],
            proptest::collection::vec(any::<u8>(), 0..600),
            any::<u64>(),
            0u32..4,
        )
            .prop_map(|(kind, mut payload, gpa, pages)| {
                if kind == Kind::Pages as u8 && payload.len() > 12 {
                    // Often a plausible run header, so range checks meet real candidates.
                    payload[..8].copy_from_slice(&((gpa % (32 << 20)) & !0xfff).to_le_bytes());
                    payload[8..12].copy_from_slice(&pages.to_le_bytes());
                }
                let mut f = Vec::new();
                match Kind::from_u8(kind) {
                    Some(k) => wire::write_frame(&mut f, k, &payload).unwrap(),
                    None => {
                        f.push(kind);
                        f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
                        f.extend_from_slice(&[0; 4]);
                        f.extend_from_slice(&payload);
                    }
                }
                f
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever follows a valid handshake, the receiver ends in an error (never a panic,
        /// never a VM): no stream without a valid state and a Go starts a guest.
        #[test]
        fn hostile_streams_end_in_an_error(frames in proptest::collection::vec(frame(), 0..8),
                                          tail in proptest::collection::vec(any::<u8>(), 0..64)) {
            let c = config();
            let mut s = valid_start(&c);
            for f in frames {
                s.extend_from_slice(&f);
            }
            s.extend_from_slice(&tail);
            prop_assert!(Vm::migrate_in(&mut Scripted(std::io::Cursor::new(s)), &c).is_err());
        }

        /// Garbage from the first byte: refused at the header or the Hello.
        #[test]
        fn garbage_streams_are_refused(s in proptest::collection::vec(any::<u8>(), 0..256)) {
            let e = Vm::migrate_in(&mut Scripted(std::io::Cursor::new(s)), &config()).unwrap_err();
            prop_assert_eq!(e.phase, Phase::Handshake);
        }
    }

    #[test]
    fn a_hello_for_another_machine_is_refused_before_memory_moves() {
        let c = config();
        let mut other = c.clone();
        other.memory_mib = 32;
        let e = Vm::migrate_in(&mut Scripted(std::io::Cursor::new(valid_start(&other))), &c)
            .unwrap_err();
        assert!(matches!(e.error, MigrationError::Refused(_)), "{e}");
        assert_eq!((e.side, e.phase), (Side::Target, Phase::Handshake));
        assert!(e.to_string().contains("prepared for 1 and 16"), "{e}");
        let mut missing = c.clone();
        missing.disks = vec![crate::config::DiskConfig::new("/nonexistent/disk.img")];
        let e = Vm::migrate_in(
            &mut Scripted(std::io::Cursor::new(valid_start(&c))),
            &missing,
        )
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/disk.img"), "{e}");
    }
}
