//! The time a request has left. Made when a request arrives, handed down to
//! every step that may wait (a pool checkout, a lock, a retry's backoff), so
//! that what cannot finish in time gives up instead of pinning a connection.

use std::time::{Duration, Instant};

/// What a database wait keeps in hand so the answer still leaves in time:
/// a tenth of what is left, at most this much.
const ANSWER_RESERVE: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    at: Instant,
    /// When it was made (the request's arrival).
    made: Instant,
}

impl Deadline {
    pub fn after(timeout: Duration) -> Self {
        let made = Instant::now();
        Self {
            at: made + timeout,
            made,
        }
    }

    /// When the deadline was made: what the request read or wrote, it did
    /// after this.
    pub fn made(&self) -> Instant {
        self.made
    }

    /// Time left, zero once passed.
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    pub fn passed(&self) -> bool {
        self.remaining().is_zero()
    }

    /// Too little left to start another wait: what is left is the reserve
    /// kept for answering. A lock or busy wait that ran to its budget ends
    /// here, so its failure is the deadline's, not a reason to retry.
    pub fn nearly_passed(&self) -> bool {
        self.remaining() <= ANSWER_RESERVE
    }

    /// How long one database wait (a lock, a busy handler, a checkout) may
    /// last: the time left less a reserve for answering.
    pub fn wait_budget(&self) -> Duration {
        let left = self.remaining();
        left.saturating_sub((left / 10).min(ANSWER_RESERVE))
    }

    /// Whole milliseconds of [`Deadline::wait_budget`], at least 1 (0 would
    /// mean "no limit" to Postgres and SQLite alike).
    pub fn wait_budget_ms(&self) -> u32 {
        u32::try_from(self.wait_budget().as_millis())
            .unwrap_or(u32::MAX)
            .max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_is_within_what_is_left_and_never_zero() {
        let deadline = Deadline::after(Duration::from_secs(10));
        assert!(deadline.wait_budget() <= deadline.remaining());
        assert!(deadline.wait_budget() >= Duration::from_millis(9_800));
        let passed = Deadline::after(Duration::ZERO);
        assert!(passed.passed());
        assert_eq!(passed.wait_budget_ms(), 1);
    }
}
