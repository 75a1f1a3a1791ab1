//! Bounded exponential backoff with full jitter, for transient failures.

use std::time::Duration;

use rand::RngExt;

/// How often and how long to retry a transient failure: attempts in all,
/// and full-jitter delays that double from `base_delay` up to `max_delay`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1 means never retry).
    pub max_attempts: u32,
    /// The cap of the first retry's delay; it doubles each retry.
    pub base_delay: Duration,
    /// No delay exceeds this.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(500),
        }
    }
}

impl RetryPolicy {
    /// The wait before retry number `retry` (1 for the first retry): uniform
    /// in `[0, min(max_delay, base_delay * 2^(retry-1))]`, so many writers
    /// that failed together do not retry together.
    pub fn delay(&self, retry: u32, rng: &mut impl rand::Rng) -> Duration {
        let ceiling = self
            .base_delay
            .saturating_mul(2u32.saturating_pow(retry.saturating_sub(1)))
            .min(self.max_delay);
        let micros = u64::try_from(ceiling.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(rng.random_range(0..=micros))
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn delays_stay_within_their_bounds_and_vary() {
        let policy = RetryPolicy {
            max_attempts: 8,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(100),
        };
        let mut rng = StdRng::seed_from_u64(7);
        for retry in 1..=10u32 {
            let cap = Duration::from_millis(10 * 2u64.pow(retry - 1)).min(policy.max_delay);
            let delays: Vec<Duration> = (0..200).map(|_| policy.delay(retry, &mut rng)).collect();
            assert!(
                delays.iter().all(|d| *d <= cap),
                "retry {retry} exceeded {cap:?}"
            );
            // Full jitter: the whole range is used, not just the cap.
            assert!(
                delays.iter().any(|d| *d < cap / 4),
                "retry {retry}: no small delays"
            );
            assert!(
                delays.iter().any(|d| *d > cap * 3 / 4),
                "retry {retry}: no large delays"
            );
        }
    }

    #[test]
    fn a_seed_gives_the_same_delays() {
        let policy = RetryPolicy::default();
        let a: Vec<_> = (1..5)
            .map(|r| policy.delay(r, &mut StdRng::seed_from_u64(1)))
            .collect();
        let b: Vec<_> = (1..5)
            .map(|r| policy.delay(r, &mut StdRng::seed_from_u64(1)))
            .collect();
        assert_eq!(a, b);
    }
}
