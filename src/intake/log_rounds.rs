//! Between the log's appender and the readers waiting for a checkpoint
//! (`GET /v1/checkpoint/extension?wait=S`): a reader asks for a round now
//! instead of waiting out the appender's second, and hears when one signed.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

#[derive(Clone)]
pub struct LogRounds(Arc<Inner>);

struct Inner {
    /// A reader waits for leaves no checkpoint holds yet.
    wanted: Mutex<bool>,
    wake: Condvar,
    /// The size of the last checkpoint this instance signed.
    signed: watch::Sender<u64>,
}

impl Default for LogRounds {
    fn default() -> Self {
        Self(Arc::new(Inner {
            wanted: Mutex::new(false),
            wake: Condvar::new(),
            signed: watch::channel(0).0,
        }))
    }
}

impl LogRounds {
    /// A reader waits: the appender runs its next round now.
    pub fn want(&self) {
        *self.0.wanted.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.0.wake.notify_one();
    }

    /// The appender's pause between rounds: until a reader wants one, or
    /// `at_most`. Whether one was wanted.
    pub fn pause(&self, at_most: Duration) -> bool {
        let wanted = self.0.wanted.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut wanted, _) = self
            .0
            .wake
            .wait_timeout_while(wanted, at_most, |wanted| !*wanted)
            .unwrap_or_else(PoisonError::into_inner);
        std::mem::take(&mut *wanted)
    }

    /// A round signed a checkpoint of `size` leaves: readers look again.
    pub fn signed(&self, size: u64) {
        self.0.signed.send_replace(size);
    }

    /// Changes whenever this instance signs a checkpoint.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.signed.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wanted_round_ends_the_pause_and_is_taken_once() {
        let rounds = LogRounds::default();
        rounds.want();
        assert!(rounds.pause(Duration::from_secs(60)), "the want was lost");
        assert!(
            !rounds.pause(Duration::from_millis(1)),
            "one want ended two pauses"
        );
    }

    #[test]
    fn a_want_from_another_thread_wakes_the_pause() {
        let rounds = LogRounds::default();
        let asker = rounds.clone();
        let waker = std::thread::spawn(move || asker.want());
        assert!(rounds.pause(Duration::from_secs(60)));
        waker.join().expect("the asking thread");
    }
}
