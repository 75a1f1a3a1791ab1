//! Counters for every intake outcome, retry and unknown-COMMIT branch, in a
//! Prometheus registry of their own (one per service, so tests stay apart).

use prometheus::{
    Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    outcomes: IntCounterVec,
    retries: IntCounterVec,
    unknown_commits: IntCounterVec,
    timeouts: IntCounterVec,
    group_commit_failures: IntCounterVec,
    request_seconds: HistogramVec,
    write_batch_plans: HistogramVec,
    write_batches_split: IntCounter,
    pool_connections: IntGauge,
    pool_idle: IntGauge,
    pool_waiters: IntGauge,
    feed_waiting: IntGauge,
    checkpoint_waiting: IntGauge,
    feed_wakeups: IntCounter,
    feed_lag: Gauge,
    commit_waits_for_standby: IntGauge,
    commits_blocked: IntGauge,
    barrier_waiting: IntGauge,
    strangers: IntCounterVec,
    stranger_lookups: IntCounter,
    public_reads_refused: IntCounter,
    receipt_log_leaves: IntGauge,
    receipt_log_rounds_failed: IntCounter,
    receipt_log_stuck: IntGauge,
    storage_full: IntGauge,
    receipt_log_lag: Gauge,
}

/// How a request with a token no login has shown lately was answered:
/// looked up and found unknown (401), or turned away before any lookup
/// because the lookups for such tokens were used up (503).
pub const STRANGER_ANSWERS: [&str; 2] = ["unauthorized", "turned_away"];

/// Every label value each counter can take, so every series exists at 0
/// from the start and alerts can be written before the first event.
pub const OUTCOMES: [&str; 11] = [
    "created",
    "replayed",
    "already_received",
    "key_reused",
    "refused",
    "invalid",
    "unauthorized",
    "forbidden",
    "unavailable",
    "throttled",
    "error",
];
/// The routes a deadline applies to.
pub const TIMED_ROUTES: [&str; 9] = [
    "/v1/plans",
    "/v1/plans/{receipt_id}",
    "/v1/receipts",
    "/v1/receipts/{receipt_id}",
    "/v1/receipts/{receipt_id}/proof",
    "/v1/signing-keys",
    "/v1/checkpoint",
    "/v1/checkpoint/consistency",
    "/readyz",
];
pub const GROUP_COMMIT_FAILURES: [&str; 3] = ["leader_panicked", "commit_failed", "no_connection"];

/// Backends, each with its own series of write batch sizes.
pub const BACKENDS: [&str; 2] = ["postgres", "sqlite"];

/// Write batch size buckets, in plans: one alone up to SQLite's largest.
const BATCH_BUCKETS: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 31.0, 64.0, 256.0];

/// How an unknown COMMIT was settled by the re-read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownCommitBranch {
    /// Our own row, column for column: it landed.
    Landed,
    /// Nothing under the key: it did not land; written once more.
    NotLanded,
    /// Another attempt's row: resolved like a unique violation.
    OtherRow,
    /// The re-read failed: 503, nothing more written.
    RereadFailed,
}

impl UnknownCommitBranch {
    pub const ALL: [UnknownCommitBranch; 4] = [
        UnknownCommitBranch::Landed,
        UnknownCommitBranch::NotLanded,
        UnknownCommitBranch::OtherRow,
        UnknownCommitBranch::RereadFailed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            UnknownCommitBranch::Landed => "landed",
            UnknownCommitBranch::NotLanded => "not_landed",
            UnknownCommitBranch::OtherRow => "other_row",
            UnknownCommitBranch::RereadFailed => "reread_failed",
        }
    }
}

/// Where a write queue reports: each batch's size, and each batch a
/// failure split into plans written one by one.
pub struct BatchMetrics {
    pub sizes: prometheus::Histogram,
    pub split: IntCounter,
}

/// Makes each metric and registers it in one registry, as it is defined.
/// Definitions are constants: a failure here is a bug every test would hit.
struct Definer<'a>(&'a Registry);

impl Definer<'_> {
    fn register<C: prometheus::core::Collector + Clone + 'static>(&self, metric: C) -> C {
        self.0
            .register(Box::new(metric.clone()))
            .expect("metric registered once"); // ok: constant, checked by every test
        metric
    }

    /// A counter family with each of `values` present at 0.
    fn counters(&self, name: &str, help: &str, label: &str, values: &[&str]) -> IntCounterVec {
        let family =
            IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric definition"); // ok: constant
        for value in values {
            family.with_label_values(&[value]);
        }
        self.register(family)
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::new(name, help).expect("valid metric definition")) // ok: constant
    }

    fn int_gauge(&self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::new(name, help).expect("valid metric definition")) // ok: constant
    }

    fn gauge(&self, name: &str, help: &str) -> Gauge {
        self.register(Gauge::new(name, help).expect("valid metric definition")) // ok: constant
    }

    fn histograms(&self, name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        self.register(HistogramVec::new(opts, labels).expect("valid metric definition")) // ok: constant
    }
}

/// Request latency buckets, in seconds: 1 ms to 5 s.
const LATENCY_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let define = Definer(&registry);
        let branches: Vec<&str> = UnknownCommitBranch::ALL
            .iter()
            .map(|b| b.as_str())
            .collect();
        Self {
            outcomes: define.counters(
                "plan_intake_outcomes_total",
                "Answers to POST /v1/plans, by outcome",
                "outcome",
                &OUTCOMES,
            ),
            retries: define.counters(
                "plan_intake_retries_total",
                "Writes retried, by failure class",
                "class",
                &[],
            ),
            unknown_commits: define.counters(
                "plan_intake_unknown_commit_total",
                "COMMITs with an unknown outcome, by how the re-read settled them",
                "branch",
                &branches,
            ),
            timeouts: define.counters(
                "plan_intake_request_timeouts_total",
                "Requests answered 503 because their deadline passed, by route pattern",
                "route",
                &TIMED_ROUTES,
            ),
            group_commit_failures: define.counters(
                "plan_intake_group_commit_failures_total",
                "Writers answered 503 because their shared write batch failed, or found no connection for it, by reason",
                "reason",
                &GROUP_COMMIT_FAILURES,
            ),
            request_seconds: define.histograms(
                "plan_intake_http_request_duration_seconds",
                "HTTP request latency, by route pattern and status",
                &["route", "status"],
                &LATENCY_BUCKETS,
            ),
            write_batch_plans: {
                let batches = define.histograms(
                    "plan_intake_write_batch_plans",
                    "Plans written together by one statement and one commit (group commit), by backend",
                    &["backend"],
                    &BATCH_BUCKETS,
                );
                for backend in BACKENDS {
                    batches.with_label_values(&[backend]);
                }
                batches
            },
            write_batches_split: define.counter(
                "plan_intake_write_batches_split_total",
                "Postgres write batches that failed for one plan's reason and were written again one plan at a time",
            ),
            pool_connections: define.int_gauge(
                "plan_intake_db_pool_connections",
                "Database connections open in the pool",
            ),
            pool_idle: define.int_gauge("plan_intake_db_pool_idle", "Open connections not in use"),
            pool_waiters: define.int_gauge(
                "plan_intake_db_pool_waiters",
                "Requests waiting for a database connection",
            ),
            feed_waiting: define.int_gauge(
                "plan_intake_feed_waiting_readers",
                "Feed readers waiting (wait=S) for a receipt past their cursor",
            ),
            checkpoint_waiting: define.int_gauge(
                "plan_intake_checkpoint_waiting_readers",
                "Readers waiting (GET /v1/checkpoint/extension?wait=S) for a checkpoint that holds their leaves; bounded, in all and per address",
            ),
            feed_wakeups: define.counter(
                "plan_intake_feed_wakeups_total",
                "Waiting feed readers woken by a write (any instance's)",
            ),
            feed_lag: define.gauge(
                "plan_intake_feed_lag_seconds",
                "Age of the oldest write still holding the feed back, as of the last feed read",
            ),
            commit_waits_for_standby: define.int_gauge(
                "plan_intake_commit_waits_for_standby",
                "1 when every acknowledged commit is on a synchronous standby too (Postgres synchronous_standby_names set, synchronous_commit on, remote_write or remote_apply), else 0; refreshed every 5 s and on /readyz",
            ),
            commits_blocked: define.int_gauge(
                "plan_intake_commits_blocked",
                "1 when commits wait for a synchronous standby and none is attached (or none is synchronous): no write can complete now; refreshed every 5 s and on /readyz",
            ),
            barrier_waiting: define.int_gauge(
                "plan_intake_replication_barrier_waiting",
                "Answers (replays, reads) waiting for the synchronous standby to confirm what they hand out",
            ),
            strangers: define.counters(
                "plan_intake_strangers_total",
                "Requests with a token no login has shown lately, refused: unauthorized (looked up, unknown) or turned_away (503, the lookups for such tokens used up)",
                "answer",
                &STRANGER_ANSWERS,
            ),
            receipt_log_leaves: define.int_gauge(
                "plan_intake_receipt_log_leaves",
                "Receipts under the newest checkpoint this instance signed (0 until it signs one; another instance may be appending)",
            ),
            receipt_log_rounds_failed: define.counter(
                "plan_intake_receipt_log_rounds_failed_total",
                "Append rounds of the receipt log that wrote nothing because of an error (logged); an inconsistent tree fails every round",
            ),
            receipt_log_stuck: define.int_gauge(
                "plan_intake_receipt_log_stuck",
                "1 while this instance's receipt log appender cannot go on (an inconsistent or unreadable tree, a signing failure, or rounds failing for 30 s; /readyz names why), else 0",
            ),
            storage_full: define.int_gauge(
                "plan_intake_storage_full",
                "1 once a write found the database's storage full (Postgres disk_full, SQLite SQLITE_FULL), until a write lands again; /readyz says storage-full meanwhile",
            ),
            receipt_log_lag: define.gauge(
                "plan_intake_receipt_log_lag_seconds",
                "Seconds since the oldest receipt settled in the feed but not yet in the receipt log was received (0: the log holds every one); read by the appender after each round",
            ),
            stranger_lookups: define.counter(
                "plan_intake_stranger_lookups_total",
                "Database lookups of tokens no login has shown lately (bounded per second)",
            ),
            public_reads_refused: define.counter(
                "plan_intake_public_reads_refused_total",
                "Public evidence requests (consistency, extension, tiles, signing keys) from callers that are not familiar logins answered 503 busy because that second's database reads for them were spent",
            ),
            registry,
        }
    }

    /// A stranger refused: `answer` is one of [`STRANGER_ANSWERS`].
    pub fn stranger(&self, answer: &str) {
        self.strangers.with_label_values(&[answer]).inc();
    }

    /// A public evidence request refused: its second's reads were spent.
    pub fn public_read_refused(&self) {
        self.public_reads_refused.inc();
    }

    /// One database lookup of a token no login has shown lately.
    pub fn stranger_lookup(&self) {
        self.stranger_lookups.inc();
    }

    /// The gauge of readers waiting for a checkpoint.
    pub fn checkpoint_waiting(&self) -> IntGauge {
        self.checkpoint_waiting.clone()
    }

    /// One more reader waiting on the feed, until the guard is dropped.
    pub fn feed_reader_waiting(&self) -> impl Drop + use<> {
        struct Waiting(IntGauge);
        impl Drop for Waiting {
            fn drop(&mut self) {
                self.0.dec();
            }
        }
        self.feed_waiting.inc();
        Waiting(self.feed_waiting.clone())
    }

    pub fn feed_wakeup(&self) {
        self.feed_wakeups.inc();
    }

    pub fn feed_wakeup_count(&self) -> u64 {
        self.feed_wakeups.get()
    }

    pub fn feed_waiting_count(&self) -> i64 {
        self.feed_waiting.get()
    }

    pub fn set_commit_waits_for_standby(&self, waits: bool) {
        self.commit_waits_for_standby.set(i64::from(waits));
    }

    pub fn set_receipt_log_size(&self, leaves: u64) {
        self.receipt_log_leaves
            .set(i64::try_from(leaves).unwrap_or(i64::MAX));
    }

    pub fn receipt_log_round_failed(&self) {
        self.receipt_log_rounds_failed.inc();
    }

    pub fn set_receipt_log_stuck(&self, stuck: bool) {
        self.receipt_log_stuck.set(i64::from(stuck));
    }

    pub fn set_storage_full(&self, full: bool) {
        self.storage_full.set(i64::from(full));
    }

    pub fn set_receipt_log_lag(&self, seconds: f64) {
        self.receipt_log_lag.set(seconds);
    }

    pub fn set_commits_blocked(&self, blocked: bool) {
        self.commits_blocked.set(i64::from(blocked));
    }

    pub fn set_barrier_waiting(&self, waiting: usize) {
        self.barrier_waiting
            .set(i64::try_from(waiting).unwrap_or(i64::MAX));
    }

    pub fn set_feed_lag(&self, seconds: f64) {
        self.feed_lag.set(seconds);
    }

    pub fn timeout(&self, route: &str) {
        self.timeouts.with_label_values(&[route]).inc();
    }

    pub fn timeout_count(&self, route: &str) -> u64 {
        self.timeouts.with_label_values(&[route]).get()
    }

    /// Makes each of `classes` (storage's failure classes) a series of the
    /// retry counter at 0, so an alert sees it before the first retry.
    pub fn expect_retry_classes<'a>(&self, classes: impl IntoIterator<Item = &'a str>) {
        for class in classes {
            self.retries.with_label_values(&[class]);
        }
    }

    /// Where `backend`'s (`postgres`, `sqlite`) write batches are counted.
    pub fn write_batches(&self, backend: &str) -> BatchMetrics {
        BatchMetrics {
            sizes: self.write_batch_plans.with_label_values(&[backend]),
            split: self.write_batches_split.clone(),
        }
    }

    /// How many write batches `backend` wrote, and how many plans they held.
    pub fn write_batch_totals(&self, backend: &str) -> (u64, f64) {
        let sizes = self.write_batch_plans.with_label_values(&[backend]);
        (sizes.get_sample_count(), sizes.get_sample_sum())
    }

    pub fn write_batches_split_count(&self) -> u64 {
        self.write_batches_split.get()
    }

    pub fn group_commit_failure(&self, reason: &str) {
        self.group_commit_failures
            .with_label_values(&[reason])
            .inc();
    }

    pub fn group_commit_failure_count(&self, reason: &str) -> u64 {
        self.group_commit_failures
            .with_label_values(&[reason])
            .get()
    }

    pub fn outcome(&self, outcome: &str) {
        self.outcomes.with_label_values(&[outcome]).inc();
    }

    pub fn retry(&self, class: &str) {
        self.retries.with_label_values(&[class]).inc();
    }

    pub fn unknown_commit(&self, branch: UnknownCommitBranch) {
        self.unknown_commits
            .with_label_values(&[branch.as_str()])
            .inc();
    }

    pub fn observe_request(&self, route: &str, status: u16, seconds: f64) {
        self.request_seconds
            .with_label_values(&[route, &status.to_string()])
            .observe(seconds);
    }

    /// The pool's state as of now, shown by the next render.
    pub fn set_pool(&self, connections: u32, idle: u32, waiters: i64) {
        self.pool_connections.set(i64::from(connections));
        self.pool_idle.set(i64::from(idle));
        self.pool_waiters.set(waiters);
    }

    pub fn outcome_count(&self, outcome: &str) -> u64 {
        self.outcomes.with_label_values(&[outcome]).get()
    }

    pub fn retry_count(&self, class: &str) -> u64 {
        self.retries.with_label_values(&[class]).get()
    }

    pub fn unknown_commit_count(&self, branch: UnknownCommitBranch) -> u64 {
        self.unknown_commits
            .with_label_values(&[branch.as_str()])
            .get()
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buffer) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(buffer).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
