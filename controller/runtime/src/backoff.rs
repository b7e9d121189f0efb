//! Per-object exponential retry backoff, as client-go's per-item rate limiter does it: each
//! consecutive failure of one object doubles its pause up to a cap, a success forgets it, and
//! a write conflict (the cache lagging our own last write) is retried sooner than a real error.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Consecutive failures per object key.
#[derive(Default)]
pub struct RetryBackoff {
    failures: Mutex<HashMap<String, u32>>,
}

impl RetryBackoff {
    /// Counts one more failure of `key` and returns the pause before its retry:
    /// `base × 2^(failures − 1)`, at most `max`.
    pub fn delay(&self, key: &str, base: Duration, max: Duration) -> Duration {
        let mut f = self.failures.lock().unwrap();
        let n = f.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        base.saturating_mul(1 << (*n - 1).min(20)).min(max)
    }

    /// [`delay`](Self::delay) after a failed reconcile: a conflict starts from a quarter of
    /// `base`, since a fresh read usually settles it.
    pub fn after_failure(
        &self,
        key: &str,
        conflict: bool,
        base: Duration,
        max: Duration,
    ) -> Duration {
        let base = if conflict { base / 4 } else { base };
        self.delay(key, base, max)
    }

    /// Forgets `key`'s failures (it reconciled).
    pub fn reset(&self, key: &str) {
        self.failures.lock().unwrap().remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_per_failure_up_to_the_cap_and_forgets_on_success() {
        let b = RetryBackoff::default();
        let ms = Duration::from_millis;
        assert_eq!(b.delay("a", ms(100), ms(350)), ms(100));
        assert_eq!(b.delay("a", ms(100), ms(350)), ms(200));
        assert_eq!(b.delay("a", ms(100), ms(350)), ms(350));
        assert_eq!(b.delay("b", ms(100), ms(350)), ms(100));
        b.reset("a");
        assert_eq!(b.after_failure("a", true, ms(100), ms(350)), ms(25));
        for _ in 0..100 {
            b.delay("c", ms(1), Duration::MAX);
        }
        assert_eq!(b.delay("c", ms(1), Duration::MAX), ms(1 << 20));
    }
}
