//! When pre-copy stops: the policy, apart from the frames. After each pass the source looks at
//! how much the guest dirtied meanwhile; it stops copying while the guest runs once what is
//! left would fit the downtime budget at the bandwidth the last pass measured (or nothing is
//! left), gives up when the completion timeout passes or the remainder has not reached a new
//! low for the progress timeout, and asks auto-converge to slow the vCPUs while the guest
//! dirties memory faster than half the transfer rate (the point where pre-copy stops gaining).

use std::time::{Duration, Instant};

use super::{MigrationConfig, MigrationError};

pub struct Convergence {
    max_downtime: Duration,
    completion_timeout: Duration,
    progress_timeout: Duration,
    auto_converge: bool,
    started: Instant,
    /// Bytes per second the last pass went out at.
    bandwidth: f64,
    /// When the dirty log was last read: dirty rates are over the time since.
    last_look: Instant,
    /// The least left to send so far, and when.
    lowest: u64,
    lowest_at: Instant,
}

/// What one look at the dirty log says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    /// Bytes dirtied since the last look (what the next pass sends).
    pub dirty: u64,
    pub dirty_rate: f64,
    /// What stopping now would cost at the measured bandwidth.
    pub expected_downtime: Duration,
    /// Stop copying while the guest runs.
    pub converged: bool,
    /// Slow the vCPUs one step more (auto-converge).
    pub throttle_up: bool,
}

impl Convergence {
    /// A migration that started at `started`, whose dirty logging began at `logging_since`.
    pub fn new(config: &MigrationConfig, started: Instant, logging_since: Instant) -> Self {
        Convergence {
            max_downtime: config.max_downtime,
            completion_timeout: config.completion_timeout,
            progress_timeout: config.progress_timeout,
            auto_converge: config.auto_converge,
            started,
            bandwidth: 0.0,
            last_look: logging_since,
            lowest: u64::MAX,
            lowest_at: logging_since,
        }
    }

    pub fn bandwidth(&self) -> f64 {
        self.bandwidth
    }

    /// A pass sent `bytes` in `took`: the bandwidth the next decision counts on.
    pub fn pass_sent(&mut self, bytes: u64, took: Duration) {
        self.bandwidth = bytes as f64 / took.as_secs_f64().max(1e-6);
    }

    /// The completion timeout, checked before each look.
    pub fn check_deadline(&self, now: Instant) -> Result<(), MigrationError> {
        if now.duration_since(self.started) > self.completion_timeout {
            return Err(MigrationError::Timeout(self.completion_timeout));
        }
        Ok(())
    }

    /// The dirty log says `dirty` bytes changed since the last look, at `now`.
    pub fn look(&mut self, dirty: u64, now: Instant) -> Result<Reading, MigrationError> {
        let interval = now.duration_since(self.last_look).as_secs_f64().max(1e-6);
        self.last_look = now;
        let dirty_rate = dirty as f64 / interval;
        let expected_downtime = Duration::from_secs_f64(dirty as f64 / self.bandwidth.max(1.0));
        if dirty < self.lowest {
            self.lowest = dirty;
            self.lowest_at = now;
        } else if now.duration_since(self.lowest_at) > self.progress_timeout {
            return Err(MigrationError::Stalled(self.progress_timeout));
        }
        let converged = dirty == 0 || expected_downtime <= self.max_downtime;
        Ok(Reading {
            dirty,
            dirty_rate,
            expected_downtime,
            converged,
            throttle_up: !converged && self.auto_converge && dirty_rate > self.bandwidth / 2.0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn policy(auto_converge: bool) -> (Convergence, Instant) {
        let t0 = Instant::now();
        let config = MigrationConfig {
            max_downtime: Duration::from_millis(100),
            completion_timeout: Duration::from_secs(60),
            progress_timeout: Duration::from_secs(10),
            auto_converge,
            ..Default::default()
        };
        let mut c = Convergence::new(&config, t0, t0);
        // 100 MiB/s measured by the first pass.
        c.pass_sent(100 * MIB, Duration::from_secs(1));
        (c, t0)
    }

    #[test]
    fn converges_once_the_rest_fits_the_downtime_budget() {
        let (mut c, t0) = policy(false);
        let s = Duration::from_secs;
        let r = c.look(50 * MIB, t0 + s(1)).unwrap();
        assert!(!r.converged, "{r:?}");
        assert_eq!(r.expected_downtime, Duration::from_millis(500));
        assert_eq!(r.dirty_rate, (50 * MIB) as f64);
        let r = c.look(10 * MIB, t0 + s(2)).unwrap();
        assert!(r.converged, "100 ms at 100 MiB/s: {r:?}");
        assert!(c.look(0, t0 + s(3)).unwrap().converged);
    }

    #[test]
    fn stalls_without_a_new_low_and_times_out_at_completion() {
        let (mut c, t0) = policy(false);
        let s = Duration::from_secs;
        c.look(50 * MIB, t0 + s(1)).unwrap();
        c.look(60 * MIB, t0 + s(10)).unwrap();
        let e = c.look(55 * MIB, t0 + s(12)).unwrap_err();
        assert!(matches!(e, MigrationError::Stalled(_)), "{e}");
        assert!(c.check_deadline(t0 + s(60)).is_ok());
        let e = c.check_deadline(t0 + s(61)).unwrap_err();
        assert!(matches!(e, MigrationError::Timeout(_)), "{e}");
    }

    #[test]
    fn auto_converge_throttles_only_a_guest_that_outruns_half_the_link() {
        let (mut c, t0) = policy(true);
        let s = Duration::from_secs;
        assert!(c.look(60 * MIB, t0 + s(1)).unwrap().throttle_up);
        assert!(!c.look(40 * MIB, t0 + s(2)).unwrap().throttle_up);
        let (mut off, t0) = policy(false);
        assert!(!off.look(60 * MIB, t0 + s(1)).unwrap().throttle_up);
    }
}
