//! The source's side of a migration: dirty logging on, every non-zero page sent while the
//! guest runs, then passes of the pages dirtied meanwhile until the convergence policy says
//! stop, then stop-and-copy (the last pages and the machine state) and the switch-over. Any
//! failure before the target confirms it runs the guest resumes the guest here.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{GuestAddress, GuestMemoryBackend};

use super::convergence::Convergence;
use super::protocol::Conversation;
use super::wire::{self, Hello, Kind, PagesWriter, WireError, MAX_RUN_PAGES};
use super::{
    MigrationConfig, MigrationError, MigrationFailure, MigrationProgress, MigrationStats, Phase,
    Side,
};
use crate::end::VmEnd;
use crate::memory::PAGE_SIZE;
use crate::persist::{self, FORMAT_VERSION, VMM_VERSION};
use crate::vm::{Vm, VmError};

fn hello_for(vm: &Vm, page_streams: u8) -> Hello {
    Hello {
        page_streams,
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

/// Groups `pages` (ascending) into runs of consecutive pages, at most `MAX_RUN_PAGES` long and
/// never crossing a chunk (`wire::CHUNK_BYTES`: with page streams a chunk is one stream's), and
/// hands each to `emit`.
fn for_each_run(
    pages: impl Iterator<Item = u64>,
    mut emit: impl FnMut((u64, u32)) -> Result<(), MigrationError>,
) -> Result<(), MigrationError> {
    let mut run: Option<(u64, u32)> = None;
    for gpa in pages {
        run = match run {
            Some((start, n))
                if start + n as u64 * PAGE_SIZE == gpa
                    && n < MAX_RUN_PAGES
                    && !gpa.is_multiple_of(wire::CHUNK_BYTES) =>
            {
                Some((start, n + 1))
            }
            Some(r) => {
                emit(r)?;
                Some((gpa, 1))
            }
            None => Some((gpa, 1)),
        };
    }
    if let Some(r) = run {
        emit(r)?;
    }
    Ok(())
}

/// Auto-converge: a thread that holds the vCPUs for `percent` of the time. Raised in steps
/// (20 %, then 10 % more per pass, at most 99 %) while the guest dirties memory faster than
/// half the transfer rate, the point where pre-copy stops gaining on it.
///
/// Each hold lasts in proportion to how long the vCPUs really ran before it, from the resume
/// until they parked again, rather than to a fixed slice: getting a vCPU out of guest mode
/// takes a while (longer on a loaded host), and with fixed slices that time counts as neither
/// run nor hold, so a 99 % throttle let the guest run several times longer than 1 %.
struct VcpuThrottle {
    percent: AtomicU8,
    stop: AtomicBool,
}

/// How long the vCPUs run between holds at the highest throttle; lower throttles run longer.
const THROTTLE_SLICE: Duration = Duration::from_millis(20);

impl VcpuThrottle {
    fn run(&self, vm: &Vm) {
        let mut resumed = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            let pct = self.percent.load(Ordering::SeqCst) as u32;
            if pct == 0 {
                std::thread::sleep(THROTTLE_SLICE);
                resumed = Instant::now();
                continue;
            }
            std::thread::sleep(THROTTLE_SLICE * (100 - pct) / 100);
            vm.hold_vcpus(resumed, pct as f64 / (100 - pct) as f64);
            resumed = Instant::now();
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
        for_each_run(pages, |(gpa, n)| {
            self.send_run(w, pw, gpa, n)?;
            throttle.account(n as u64 * PAGE_SIZE);
            throttle.check_abort()
        })
    }

    /// One run of `n` pages at `gpa`, copied from guest memory into `pw`'s frame.
    fn send_run(
        &self,
        w: &mut impl Write,
        pw: &mut PagesWriter,
        gpa: u64,
        n: u32,
    ) -> Result<(), MigrationError> {
        let len = (n as u64 * PAGE_SIZE) as usize;
        let slice = self
            .memory()
            .get_slice(GuestAddress(gpa), len)
            .map_err(|e| VmError::Memory(crate::memory::MemoryError::Map(e.to_string())))?;
        pw.push_with(w, gpa, len, |dst| {
            slice.copy_to(dst);
        })?;
        Ok(())
    }

    /// Every non-zero page of RAM (see `GuestRam::nonzero_pages`).
    fn nonzero_pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.ram.nonzero_pages()
    }
}

impl Vm {
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
        self.migrate_out_streams(stream, &mut [] as &mut [std::io::Sink], config, progress)
    }

    /// As `migrate_out`, the pages carried on `page_streams` (connected to the same target,
    /// at most 255) beside the conversation on `stream`: each stream has a thread of its own
    /// copying, checksumming and sending its share of every pass (the chunks
    /// `wire::page_stream_of` gives it), while this thread scans for the pages to send.
    pub fn migrate_out_streams<S: Read + Write, P: Write + Send>(
        &self,
        stream: &mut S,
        page_streams: &mut [P],
        config: &MigrationConfig,
        progress: &mut dyn FnMut(MigrationProgress),
    ) -> Result<MigrationStats, MigrationFailure> {
        let mut at = Position::default();
        if page_streams.len() > u8::MAX as usize {
            return Err(at.fail(MigrationError::Wire(WireError::Malformed(
                "Hello: at most 255 page streams",
            ))));
        }
        if let Some(end) = self.end.get() {
            return Err(at.fail(MigrationError::NotRunning(end.to_string())));
        }
        if let Err(why) = self.check_migratable() {
            return Err(at.fail(MigrationError::Vm(VmError::Snapshot(why))));
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
            let conv = Conversation::open(&mut *stream)?;
            let mut sender = Sender {
                vm: self,
                conv,
                config,
                progress,
                at: &mut at,
                vcpu_throttle: &vcpu_throttle,
                pw: PagesWriter::default(),
                page_writers: page_streams
                    .iter()
                    .map(|_| PagesWriter::default())
                    .collect(),
                page_streams,
                throttle: Throttle {
                    limit: config.bandwidth_limit,
                    started: Instant::now(),
                    sent: 0,
                    abort: config.abort.clone(),
                },
                pass: 0,
                max_throttle: 0,
            };
            let r = sender.send_machine();
            vcpu_throttle.stop.store(true, Ordering::SeqCst);
            r
        });
        r.map_err(|e| {
            let failure = at.fail(e);
            let _ = self.stop_dirty_log();
            if failure.vm_stays_on_source() {
                // The target learns why, unless the connection itself is what failed. Written
                // past the conversation: whatever stage it broke in, a Cancel ends it.
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
                // Resumes only what the migration paused; a VM paused before stays paused
                // (rings taken back from vhost-user backends go back to them on its resume).
                if !was_paused {
                    self.resume();
                }
            }
            failure
        })
    }
}

/// The source's side of one migration, phase by phase.
struct Sender<'a, 's, S, P> {
    vm: &'a Vm,
    conv: Conversation<'s, S>,
    config: &'a MigrationConfig,
    progress: &'a mut dyn FnMut(MigrationProgress),
    at: &'a mut Position,
    vcpu_throttle: &'a VcpuThrottle,
    pw: PagesWriter,
    /// The streams pages travel on beside the conversation (none: on the conversation's),
    /// each with its frame.
    page_streams: &'a mut [P],
    page_writers: Vec<PagesWriter>,
    throttle: Throttle,
    pass: u32,
    max_throttle: u8,
}

impl<S: Read + Write, P: Write + Send> Sender<'_, '_, S, P> {
    fn send_machine(&mut self) -> Result<MigrationStats, MigrationError> {
        let started = Instant::now();
        self.handshake()?;
        let bandwidth = self.precopy(started)?;
        let paused_at = Instant::now();
        self.stop_and_copy(bandwidth)?;
        self.switch_over()?;
        // The commit point: the guest runs on the target.
        let downtime = paused_at.elapsed();
        self.vm.end.signal(VmEnd::Migrated);
        self.at.phase = Phase::Completed;
        self.report(Phase::Completed, 0, 0.0, bandwidth, Duration::ZERO);
        Ok(MigrationStats {
            passes: self.pass + 1,
            bytes_sent: self.pw.bytes_sent,
            total_time: started.elapsed(),
            downtime,
            max_throttle_percent: self.max_throttle,
        })
    }

    fn report(
        &mut self,
        phase: Phase,
        remaining: u64,
        dirty_rate: f64,
        bandwidth: f64,
        expected_downtime: Duration,
    ) {
        let throttle_percent = match phase {
            Phase::Precopy => self.vcpu_throttle.percent.load(Ordering::SeqCst),
            Phase::Completed => self.max_throttle,
            _ => 0,
        };
        (self.progress)(MigrationProgress {
            phase,
            pass: self.pass,
            data_processed_bytes: self.pw.bytes_sent,
            data_remaining_bytes: remaining,
            dirty_rate_bytes_per_s: dirty_rate,
            transfer_rate_bytes_per_s: bandwidth,
            expected_downtime,
            throttle_percent,
        });
    }

    /// Sends `pages` and flushes the last Pages frame; returns how long it took.
    fn send_pass(&mut self, pages: impl Iterator<Item = u64>) -> Result<Duration, MigrationError> {
        let t = Instant::now();
        if !self.page_streams.is_empty() {
            self.send_pass_on_page_streams(pages)?;
            return Ok(t.elapsed());
        }
        let stream = self.conv.pages_stream();
        self.vm
            .send_pages(stream, pages, &mut self.pw, &mut self.throttle)?;
        self.pw.flush(stream)?;
        Ok(t.elapsed())
    }

    /// One pass on the page streams: this thread groups the pages into runs and hands each to
    /// the thread of the stream that carries its chunk (through a short queue, so the scan
    /// stays just ahead of the copies); each stream's thread copies, checksums and sends.
    fn send_pass_on_page_streams(
        &mut self,
        pages: impl Iterator<Item = u64>,
    ) -> Result<(), MigrationError> {
        let vm = self.vm;
        let count = self.page_streams.len();
        let throttle = &mut self.throttle;
        let streams = self
            .page_streams
            .iter_mut()
            .zip(self.page_writers.iter_mut());
        std::thread::scope(|scope| {
            let mut queues = Vec::with_capacity(count);
            let mut workers = Vec::with_capacity(count);
            for (stream, pw) in streams {
                let (queue, runs) = std::sync::mpsc::sync_channel::<(u64, u32)>(16);
                queues.push(queue);
                workers.push(scope.spawn(move || -> Result<(), MigrationError> {
                    for (gpa, n) in runs {
                        vm.send_run(stream, pw, gpa, n)?;
                    }
                    pw.flush(stream)?;
                    Ok(())
                }));
            }
            let dispatched = for_each_run(pages, |(gpa, n)| {
                // A stream whose thread stopped has an error of its own, reported below.
                if queues[wire::page_stream_of(gpa, count)]
                    .send((gpa, n))
                    .is_err()
                {
                    return Err(MigrationError::Wire(WireError::Malformed("page stream")));
                }
                throttle.account(n as u64 * PAGE_SIZE);
                throttle.check_abort()
            });
            drop(queues);
            let mut first_error = None;
            for w in workers {
                if let Err(e) = w.join().expect("a page stream's thread panicked") {
                    first_error.get_or_insert(e);
                }
            }
            match first_error {
                Some(e) => Err(e),
                None => dispatched,
            }
        })?;
        self.pw.bytes_sent += self
            .page_writers
            .iter_mut()
            .map(|pw| std::mem::take(&mut pw.bytes_sent))
            .sum::<u64>();
        Ok(())
    }

    /// A Sync on every page stream: the target takes in everything before it on each stream
    /// before it answers the conversation's next Sync or takes in the State.
    fn mark_page_streams(&mut self) -> Result<(), MigrationError> {
        for stream in self.page_streams.iter_mut() {
            wire::write_frame(stream, Kind::Sync, &[])?;
            stream.flush()?;
            self.pw.bytes_sent += wire::FRAME_HEADER as u64;
        }
        Ok(())
    }

    /// The memory this side holds, as Plan frames, so the target allocates it while the pages
    /// are on their way rather than as each run lands (allocating is much of a target's
    /// work). It names backed pages, a superset of the non-zero ones pass 0 sends: the target
    /// allocates at most what the source holds.
    fn send_plan(&mut self) -> Result<(), MigrationError> {
        for payload in wire::plan_payloads(self.vm.ram.backed_runs().into_iter()) {
            self.conv.say(Kind::Plan, &payload)?;
            self.pw.bytes_sent += (wire::FRAME_HEADER + payload.len()) as u64;
        }
        Ok(())
    }

    /// Hello, answered Ready (or refused with the target's reason); each page stream then
    /// says which it is.
    fn handshake(&mut self) -> Result<(), MigrationError> {
        let count = self.page_streams.len() as u8;
        let hello = postcard::to_stdvec(&hello_for(self.vm, count)).expect("hello serializes");
        self.conv.say(Kind::Hello, &hello)?;
        self.conv.receive()?;
        for (i, stream) in self.page_streams.iter_mut().enumerate() {
            wire::write_page_stream_header(stream, i as u8)?;
        }
        Ok(())
    }

    /// Every non-zero page, then the pages dirtied meanwhile, pass after pass, until the
    /// convergence policy says stop; the last pass's pages go out too, and a Sync waits until
    /// the target has taken in everything sent. Returns the last measured bandwidth.
    fn precopy(&mut self, started: Instant) -> Result<f64, MigrationError> {
        let vm = self.vm;
        vm.start_dirty_log()?;
        self.at.phase = Phase::Precopy;
        self.at.pass = Some(0);
        let logging_since = Instant::now();
        let mut policy = Convergence::new(self.config, started, logging_since);
        self.send_plan()?;
        let before = self.pw.bytes_sent;
        let took = self.send_pass(vm.nonzero_pages())?;
        policy.pass_sent(self.pw.bytes_sent - before, took);
        let pending = loop {
            policy.check_deadline(Instant::now())?;
            if let Some(end) = vm.end.get() {
                return Err(MigrationError::NotRunning(end.to_string()));
            }
            self.throttle.check_abort()?;
            let pending = vm.dirty_log()?;
            let r = policy.look(pending.page_count() * PAGE_SIZE, Instant::now())?;
            if r.throttle_up {
                self.max_throttle = self.vcpu_throttle.raise().max(self.max_throttle);
            }
            let bandwidth = policy.bandwidth();
            self.report(
                Phase::Precopy,
                r.dirty,
                r.dirty_rate,
                bandwidth,
                r.expected_downtime,
            );
            if r.converged {
                break pending;
            }
            self.pass += 1;
            self.at.pass = Some(self.pass);
            let before = self.pw.bytes_sent;
            let took = self.send_pass(pending.pages())?;
            policy.pass_sent(self.pw.bytes_sent - before, took);
        };
        // Converged. The last pass's pages still go out while the guest runs; then a Sync
        // waits until the target has taken in everything sent so far. Without it the
        // downtime would include the target draining the socket buffers (megabytes of pages
        // to checksum and fault in), not just the final few pages.
        self.send_pass(pending.pages())?;
        self.mark_page_streams()?;
        self.conv.say(Kind::Sync, &[])?;
        self.conv.receive()?;
        Ok(policy.bandwidth())
    }

    /// The guest paused: its last dirty pages and the machine state, until the target says
    /// it restored the machine.
    fn stop_and_copy(&mut self, bandwidth: f64) -> Result<(), MigrationError> {
        // Stop and copy: the throttle has nothing left to do.
        self.vcpu_throttle.stop.store(true, Ordering::SeqCst);
        self.at.phase = Phase::StopAndCopy;
        self.at.pass = None;
        self.vm.pause()?;
        // vhost-user backends stop too (their in-flight requests complete, logged), so the
        // last dirty log holds everything they wrote and the state their ring positions.
        self.vm.quiesce_backends()?;
        let last_dirty = self.vm.dirty_log()?;
        let remaining = last_dirty.page_count() * PAGE_SIZE;
        let expected = Duration::from_secs_f64(remaining as f64 / bandwidth.max(1.0));
        self.report(Phase::StopAndCopy, remaining, 0.0, bandwidth, expected);
        self.send_pass(last_dirty.pages())?;
        // A cancel is honoured up to the switch-over, even when no page was left to send.
        self.throttle.check_abort()?;
        self.mark_page_streams()?;
        let state = persist::encode(&self.vm.save_state()?);
        self.conv.say(Kind::State, &state)?;
        self.pw.bytes_sent += (state.len() + wire::FRAME_HEADER) as u64;
        self.conv.receive()?;
        Ok(())
    }

    /// The disks and then the guest handed over; only the target's Running settles it.
    fn switch_over(&mut self) -> Result<(), MigrationError> {
        // Switch-over: the disks go first (flushed, unlocked) so the target can take them.
        self.at.phase = Phase::Switchover;
        self.vm.release_disks()?;
        // A Go that could not be written never reached the target: it cannot run the guest.
        self.conv.say(Kind::Go, &[])?;
        // From here the target may run the guest. Only its Running (or a Failed: it did not)
        // settles that; silence, a cut link or a closed connection do not, since a target that
        // resumed and then lost its link looks the same as one that died first. Then the
        // source stays paused rather than risk two running copies of one guest.
        match self.conv.receive() {
            Ok(_) => Ok(()),
            Err(e @ MigrationError::TargetFailed(_)) => Err(e),
            Err(MigrationError::Wire(WireError::Unexpected { got, .. })) => {
                Err(MigrationError::Unconfirmed(format!("it answered {got:?}")))
            }
            Err(e) => Err(MigrationError::Unconfirmed(e.to_string())),
        }
    }
}
