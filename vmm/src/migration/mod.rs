//! Pre-copy live migration over any byte stream (a TCP connection between launchers).
//! `protocol` is the message sequence both sides follow, `wire` its framing, `source` and
//! `target` the two sides, `convergence` when pre-copy stops.
//!
//! Source: dirty logging on; every non-zero page sent while the guest runs; then rounds of the
//! pages dirtied meanwhile, until the estimated downtime (dirty bytes / measured bandwidth) fits
//! `max_downtime`, the rounds run out or the completion timeout passes (then the migration is
//! cancelled and the VM stays). Stop-and-copy: pause, the last dirty pages, the machine state.
//! The target restores it paused and says `Restored`; only then does the source commit (its VM
//! ends as `VmEnd::Migrated`) and say `Go`, and the target resumes. Any failure before the
//! commit resumes the source: a failed migration leaves the VM running where it was.

mod convergence;
pub mod protocol;
mod source;
mod target;
pub mod wire;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crate::vm::VmError;
use wire::{Kind, WireError};

use protocol::Stage;

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
    /// This side's own bug: a frame the protocol does not let it say now.
    #[error("{kind:?} is not this side's to say in stage {stage:?}")]
    OutOfTurn { kind: Kind, stage: Stage },
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::VmConfig;
    use crate::layout::{ram_regions, MIB};
    use crate::memory::file_layout;
    use crate::persist::{FORMAT_VERSION, VMM_VERSION};
    use crate::vm::Vm;
    use proptest::prelude::*;
    use std::io::{Read, Write};
    use wire::Hello;

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
            page_streams: 0,
        };
        wire::write_frame(&mut s, Kind::Hello, &postcard::to_stdvec(&hello).unwrap()).unwrap();
        s
    }

    /// A frame of any kind with any payload, correctly checksummed, so the receiver's checks
    /// past the checksum are what is exercised.
    fn frame() -> impl Strategy<Value = Vec<u8>> {
        (
            prop_oneof![
                Just(1u8),
                Just(2),
                Just(3),
                Just(4),
                Just(5),
                Just(7),
                any::<u8>()
            ],
            proptest::collection::vec(any::<u8>(), 0..600),
            any::<u64>(),
            0u32..4,
        )
            .prop_map(|(kind, mut payload, gpa, pages)| {
                if (kind == Kind::Pages as u8 || kind == Kind::Plan as u8) && payload.len() > 12 {
                    // Often a plausible run header, so range checks meet real candidates.
                    payload[..8].copy_from_slice(&((gpa % (32 << 20)) & !0xfff).to_le_bytes());
                    payload[8..12].copy_from_slice(&pages.to_le_bytes());
                }
                let mut f = Vec::new();
                match Kind::try_from(kind).ok() {
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

    /// A Plan naming memory outside guest RAM fails the migration with the run it named,
    /// before anything is allocated for it.
    #[test]
    fn a_plan_outside_guest_ram_fails_the_migration() {
        let c = config();
        let mut s = valid_start(&c);
        let plan = wire::plan_payloads([(0u64, 1u32), (15 << 20, 512)].into_iter());
        wire::write_frame(&mut s, Kind::Plan, &plan[0]).unwrap();
        let e = Vm::migrate_in(&mut Scripted(std::io::Cursor::new(s)), &c).unwrap_err();
        assert_eq!((e.side, e.phase), (Side::Target, Phase::Precopy), "{e}");
        assert!(
            e.to_string()
                .contains("page run at 0xf00000 of 512 pages is not inside guest RAM"),
            "{e}"
        );
        // Runs inside RAM that name more of it than there is: refused, not queued.
        let mut s = valid_start(&c);
        let whole = wire::plan_payloads([(0u64, 4096u32)].into_iter());
        for _ in 0..2 {
            wire::write_frame(&mut s, Kind::Plan, &whole[0]).unwrap();
        }
        let e = Vm::migrate_in(&mut Scripted(std::io::Cursor::new(s)), &c).unwrap_err();
        assert!(e.to_string().contains("more than guest RAM"), "{e}");
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
