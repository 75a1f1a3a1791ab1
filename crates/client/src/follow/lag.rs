//! How far behind the feed's end a follower is, kept and told.

use std::sync::atomic::AtomicU64;

use super::*;

/// How far behind the feed's end a follower is, as of its last page: 0
/// once a page came back short of its limit (it read to the end), else the
/// age of the last receipt it handed on and, when verifying, the receipts
/// the log held beyond it.
#[derive(Debug)]
pub struct Lag {
    /// `u64::MAX`: unknown.
    receipts: AtomicU64,
    millis: AtomicU64,
}

impl Default for Lag {
    fn default() -> Self {
        Self {
            receipts: AtomicU64::new(u64::MAX),
            millis: AtomicU64::new(0),
        }
    }
}

impl Lag {
    /// Receipts between the last one handed on and the feed's end, when
    /// known (at the end; or verifying: the log's newest checkpoint).
    pub fn receipts(&self) -> Option<u64> {
        Some(self.receipts.load(Ordering::Relaxed)).filter(|&n| n != u64::MAX)
    }

    /// Seconds between the last receipt handed on and now, while behind.
    pub fn seconds(&self) -> f64 {
        self.millis.load(Ordering::Relaxed) as f64 / 1000.0
    }

    fn set(&self, receipts: Option<u64>, behind: Duration) {
        self.receipts
            .store(receipts.unwrap_or(u64::MAX), Ordering::Relaxed);
        self.millis.store(
            u64::try_from(behind.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }
}

/// Keeps [`Lag`] up to date and tells it every `lag_every`.
pub(crate) struct LagReport<'a> {
    options: &'a FollowOptions,
    lag: std::sync::Arc<Lag>,
    told: Option<std::time::Instant>,
}

impl<'a> LagReport<'a> {
    pub(crate) fn new(options: &'a FollowOptions) -> Self {
        Self {
            options,
            lag: options.lag.clone().unwrap_or_default(),
            told: None,
        }
    }

    /// An empty page: the follower stands at the feed's end.
    pub(crate) fn at_end(&mut self) {
        self.lag.set(Some(0), Duration::ZERO);
        self.tell();
    }

    /// A page handed on; `logged_beyond`: receipts the log held past it.
    pub(crate) fn handed_on(&mut self, page: &Page, logged_beyond: Option<u64>) {
        // Short of its limit: the page reached the feed's end (or, with
        // `expand`, its byte budget: a verifying follower knows which).
        let short = page.receipts.len() < self.options.limit as usize;
        if short && logged_beyond.unwrap_or(0) == 0 {
            self.lag.set(Some(0), Duration::ZERO);
        } else {
            let age = page
                .receipts
                .last()
                .and_then(|entry| received_at(entry))
                .and_then(|at| std::time::SystemTime::now().duration_since(at).ok())
                .unwrap_or_default();
            self.lag.set(logged_beyond, age);
        }
        self.tell();
    }

    fn tell(&mut self) {
        if self
            .told
            .is_some_and(|told| told.elapsed() < self.options.lag_every)
        {
            return;
        }
        self.told = Some(std::time::Instant::now());
        let seconds = self.lag.seconds();
        match self.lag.receipts() {
            Some(receipts) => tracing::info!(
                receipts_behind = receipts,
                seconds_behind = seconds,
                "following: {receipts} receipt(s) and {seconds:.1} s behind the feed's end"
            ),
            None => tracing::info!(
                seconds_behind = seconds,
                "following: {seconds:.1} s behind the feed's end"
            ),
        }
    }
}

/// When the receipt in `entry` (or the receipt of an expanded plan) was
/// received.
fn received_at(entry: &RawValue) -> Option<std::time::SystemTime> {
    #[derive(serde::Deserialize)]
    struct Entry {
        received_at: Option<String>,
        receipt: Option<Received>,
    }
    #[derive(serde::Deserialize)]
    struct Received {
        received_at: String,
    }
    let entry: Entry = serde_json::from_str(entry.get()).ok()?;
    let text = entry.received_at.or(entry.receipt.map(|r| r.received_at))?;
    humantime::parse_rfc3339(&text).ok()
}
