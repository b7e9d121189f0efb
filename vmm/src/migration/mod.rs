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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

use crate::builder::check_matches;
use crate::config::VmConfig;
use crate::end::VmEnd;
use crate::layout::{ram_regions, MIB};
use crate::memory::{file_layout, DirtyLog, GuestRam, PAGE_SIZE};
use crate::persist::{self, FORMAT_VERSION, VMM_VERSION};
use crate::vm::{Vm, VmError};
use wire::{Hello, Kind, PagesWriter, WireError, MAX_RUN_PAGES};

/// How a migration may proceed (KubeVirt's MigrationPolicy / migration configuration).
#[derive(Clone, Debug)]
pub struct MigrationConfig {
    /// The longest the guest may be stopped for the final copy (Cloud Hypervisor's default).
    pub max_downtime: Duration,
    /// Bytes per second at most; None: as fast as the connection goes.
    pub bandwidth_limit: Option<u64>,
    /// Cancel (the VM stays) when pre-copy has not converged by then.
    pub completion_timeout: Duration,
    /// Pre-copy rounds before stop-and-copy is forced (the downtime may then exceed the target).
    pub max_rounds: u32,
    /// Set from another thread to cancel (the VM stays on the source); checked between page
    /// runs and rounds.
    pub abort: Arc<AtomicBool>,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig {
            max_downtime: Duration::from_millis(300),
            bandwidth_limit: None,
            completion_timeout: Duration::from_secs(150),
            max_rounds: 30,
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

/// Where a migration is, reported after every round (KubeVirt's migration metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MigrationProgress {
    pub round: u32,
    /// Bytes sent so far.
    pub data_processed_bytes: u64,
    /// Dirty bytes still to send.
    pub data_remaining_bytes: u64,
    pub dirty_rate_bytes_per_s: f64,
    pub transfer_rate_bytes_per_s: f64,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct MigrationStats {
    pub rounds: u32,
    pub bytes_sent: u64,
    pub total_time: Duration,
    /// Guest paused → target told to go.
    pub downtime: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("migration: {0}")]
    Wire(#[from] WireError),
    #[error("migration: {0}")]
    Vm(#[from] VmError),
    #[error("migration refused by the target: {0}")]
    Refused(String),
    #[error("migration failed on the target: {0}")]
    TargetFailed(String),
    #[error("migration cancelled by the source: {0}")]
    Cancelled(String),
    #[error("migration did not converge within {0:?}; the VM stays on the source")]
    Timeout(Duration),
    #[error("migration: the VM is not running ({0})")]
    NotRunning(String),
}

impl From<std::io::Error> for MigrationError {
    fn from(e: std::io::Error) -> Self {
        MigrationError::Wire(WireError::Io(e))
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
                std::thread::sleep(wait);
            }
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
            let slice = mem
                .get_slice(GuestAddress(gpa), (n as u64 * PAGE_SIZE) as usize)
                .map_err(|e| VmError::Memory(crate::memory::MemoryError::Map(e.to_string())))?;
            let mut buf = vec![0u8; slice.len()];
            slice.copy_to(&mut buf[..]);
            pw.push(w, gpa, &buf)?;
            throttle.account(buf.len() as u64);
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

    /// Every non-zero page of RAM (the target's memory starts zeroed).
    fn nonzero_pages(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for region in self.memory().iter() {
            let Ok(host) = region.get_host_address(MemoryRegionAddress(0)) else {
                continue;
            };
            let len = region.len() as usize;
            // SAFETY: the region maps `len` bytes at `host` while the VM exists; the guest may
            // write them concurrently, which is why dirty logging is on: a page changed after
            // this look is sent again in a later round.
            let bytes = unsafe { std::slice::from_raw_parts(host as *const u8, len) };
            for (i, page) in bytes.chunks(PAGE_SIZE as usize).enumerate() {
                if !crate::memory::is_zero(page) {
                    out.push(region.start_addr().0 + i as u64 * PAGE_SIZE);
                }
            }
        }
        out
    }

    /// Migrates this VM to the target at the other end of `stream`. On success the VM has ended
    /// (`VmEnd::Migrated`) and runs on the target; on any error it runs here as before.
    pub fn migrate_out<S: Read + Write>(
        &self,
        stream: &mut S,
        config: &MigrationConfig,
        progress: &mut dyn FnMut(MigrationProgress),
    ) -> Result<MigrationStats, MigrationError> {
        if let Some(end) = self.end.get() {
            return Err(MigrationError::NotRunning(end.to_string()));
        }
        let started = Instant::now();
        let was_paused = self.is_paused();
        wire::write_header(stream)?;
        let hello = postcard::to_stdvec(&hello_for(self)).expect("hello serializes");
        wire::write_frame(stream, Kind::Hello, &hello)?;
        stream.flush()?;
        match wire::read_frame(stream)? {
            (Kind::Ready, _) => {}
            (Kind::Refuse, why) => {
                return Err(MigrationError::Refused(
                    String::from_utf8_lossy(&why).into_owned(),
                ))
            }
            (got, _) => {
                return Err(WireError::Unexpected {
                    expected: "Ready",
                    got,
                }
                .into())
            }
        }
        self.start_dirty_log()?;
        let r = self.precopy_and_switch(stream, config, progress, started);
        if r.is_err() {
            let _ = wire::write_frame(stream, Kind::Cancel, b"the source gave up");
            let _ = self.stop_dirty_log();
            // Resumes only what the migration paused; a VM paused before stays paused.
            if !was_paused {
                self.resume();
            }
        }
        r
    }

    fn precopy_and_switch<S: Read + Write>(
        &self,
        stream: &mut S,
        config: &MigrationConfig,
        progress: &mut dyn FnMut(MigrationProgress),
        started: Instant,
    ) -> Result<MigrationStats, MigrationError> {
        let mut pw = PagesWriter::default();
        let mut throttle = Throttle {
            limit: config.bandwidth_limit,
            started: Instant::now(),
            sent: 0,
            abort: config.abort.clone(),
        };
        let t = Instant::now();
        self.send_pages(
            stream,
            self.nonzero_pages().into_iter(),
            &mut pw,
            &mut throttle,
        )?;
        pw.flush(stream)?;
        let mut bandwidth = pw.bytes_sent as f64 / t.elapsed().as_secs_f64().max(1e-6);
        let mut round = 0;
        // Dirtying started with the first round: rates are over the time since.
        let mut last = t;
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
            progress(MigrationProgress {
                round,
                data_processed_bytes: pw.bytes_sent,
                data_remaining_bytes: dirty,
                dirty_rate_bytes_per_s: dirty as f64 / interval,
                transfer_rate_bytes_per_s: bandwidth,
            });
            let downtime = Duration::from_secs_f64(dirty as f64 / bandwidth.max(1.0));
            if dirty == 0 || downtime <= config.max_downtime || round >= config.max_rounds {
                break;
            }
            let t = Instant::now();
            let before = pw.bytes_sent;
            self.send_pages(stream, pending.pages(), &mut pw, &mut throttle)?;
            pw.flush(stream)?;
            bandwidth = (pw.bytes_sent - before) as f64 / t.elapsed().as_secs_f64().max(1e-6);
            round += 1;
        }
        // Stop and copy.
        let paused_at = Instant::now();
        self.pause();
        let last_dirty = self.dirty_log()?;
        self.send_pages(stream, pending.pages(), &mut pw, &mut throttle)?;
        self.send_pages(stream, last_dirty.pages(), &mut pw, &mut throttle)?;
        pw.flush(stream)?;
        let state = self.save_state()?;
        wire::write_frame(stream, Kind::State, &persist::encode(&state))?;
        stream.flush()?;
        match wire::read_frame(stream)? {
            (Kind::Restored, _) => {}
            (Kind::Failed, why) => {
                return Err(MigrationError::TargetFailed(
                    String::from_utf8_lossy(&why).into_owned(),
                ))
            }
            (got, _) => {
                return Err(WireError::Unexpected {
                    expected: "Restored",
                    got,
                }
                .into())
            }
        }
        // The commit point: from here the guest belongs to the target.
        self.end.signal(VmEnd::Migrated);
        let _ = wire::write_frame(stream, Kind::Go, &[]);
        let _ = stream.flush();
        progress(MigrationProgress {
            round,
            data_processed_bytes: pw.bytes_sent,
            data_remaining_bytes: 0,
            dirty_rate_bytes_per_s: 0.0,
            transfer_rate_bytes_per_s: bandwidth,
        });
        Ok(MigrationStats {
            rounds: round + 1,
            bytes_sent: pw.bytes_sent,
            total_time: started.elapsed(),
            downtime: paused_at.elapsed(),
        })
    }

    /// Receives a VM from the source at the other end of `stream` and runs it with `config`'s
    /// host resources (disks, TAPs, console). Refuses, before any memory moves, a machine other
    /// than `config` describes.
    pub fn migrate_in<S: Read + Write>(
        stream: &mut S,
        config: &VmConfig,
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
        wire::write_frame(stream, Kind::Ready, &[])?;
        stream.flush()?;
        loop {
            match wire::read_frame(stream)? {
                (Kind::Pages, p) => {
                    for run in wire::parse_pages(&p, &layout)? {
                        ram.memory()
                            .write_slice(run.bytes, GuestAddress(run.gpa))
                            .map_err(|_| WireError::OutOfRange {
                                gpa: run.gpa,
                                pages: (run.bytes.len() as u64 / PAGE_SIZE) as u32,
                            })?;
                    }
                }
                (Kind::State, p) => {
                    let fail = |stream: &mut S, e: String| -> MigrationError {
                        let _ = wire::write_frame(stream, Kind::Failed, e.as_bytes());
                        MigrationError::TargetFailed(e)
                    };
                    let state = persist::decode(&p, std::path::Path::new("<migration stream>"))
                        .map_err(|e| fail(stream, e.to_string()))?;
                    check_matches(config, &state).map_err(|e| fail(stream, e.to_string()))?;
                    let vm = Vm::restore_paused(config, state, ram, false)
                        .map_err(|e| fail(stream, e.to_string()))?;
                    wire::write_frame(stream, Kind::Restored, &[])?;
                    stream.flush()?;
                    return match wire::read_frame(stream) {
                        Ok((Kind::Go, _)) => {
                            vm.resume();
                            if let Err(e) = vm.lock_disks(Duration::from_secs(30)) {
                                tracing::warn!("after migration: {e}");
                            }
                            Ok(vm)
                        }
                        Ok((Kind::Cancel, why)) => {
                            vm.stop();
                            Err(MigrationError::Cancelled(
                                String::from_utf8_lossy(&why).into_owned(),
                            ))
                        }
                        Ok((got, _)) => {
                            vm.stop();
                            Err(WireError::Unexpected {
                                expected: "Go",
                                got,
                            }
                            .into())
                        }
                        Err(e) => {
                            vm.stop();
                            Err(e.into())
                        }
                    };
                }
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
        }
    }
}
