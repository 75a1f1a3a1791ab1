//! Counters for every intake outcome, retry and unknown-COMMIT branch, in a
//! Prometheus registry of their own (one per service, so tests stay apart).

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    outcomes: IntCounterVec,
    retries: IntCounterVec,
    unknown_commits: IntCounterVec,
    request_seconds: HistogramVec,
    pool_connections: IntGauge,
    pool_idle: IntGauge,
    pool_waiters: IntGauge,
}

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
    pub fn as_str(self) -> &'static str {
        match self {
            UnknownCommitBranch::Landed => "landed",
            UnknownCommitBranch::NotLanded => "not_landed",
            UnknownCommitBranch::OtherRow => "other_row",
            UnknownCommitBranch::RereadFailed => "reread_failed",
        }
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let outcomes = IntCounterVec::new(
            Opts::new(
                "plan_intake_outcomes_total",
                "Answers to POST /v1/plans, by outcome",
            ),
            &["outcome"],
        )
        .expect("valid metric definition"); // ok: constant, checked by every test
        let retries = IntCounterVec::new(
            Opts::new(
                "plan_intake_retries_total",
                "Write transactions retried, by failure class",
            ),
            &["class"],
        )
        .expect("valid metric definition"); // ok: constant
        let unknown_commits = IntCounterVec::new(
            Opts::new(
                "plan_intake_unknown_commit_total",
                "COMMITs with an unknown outcome, by how the re-read settled them",
            ),
            &["branch"],
        )
        .expect("valid metric definition"); // ok: constant
        let request_seconds = HistogramVec::new(
            HistogramOpts::new(
                "plan_intake_http_request_duration_seconds",
                "HTTP request latency, by route pattern and status",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            &["route", "status"],
        )
        .expect("valid metric definition"); // ok: constant
        let gauge =
            |name: &str, help: &str| IntGauge::new(name, help).expect("valid metric definition"); // ok: constant
        let pool_connections = gauge(
            "plan_intake_db_pool_connections",
            "Database connections open in the pool",
        );
        let pool_idle = gauge("plan_intake_db_pool_idle", "Open connections not in use");
        let pool_waiters = gauge(
            "plan_intake_db_pool_waiters",
            "Requests waiting for a database connection",
        );
        for collector in [&outcomes, &retries, &unknown_commits] {
            registry
                .register(Box::new(collector.clone()))
                .expect("metric registered once"); // ok: a fresh registry
        }
        registry
            .register(Box::new(request_seconds.clone()))
            .expect("metric registered once"); // ok: a fresh registry
        for collector in [&pool_connections, &pool_idle, &pool_waiters] {
            registry
                .register(Box::new(collector.clone()))
                .expect("metric registered once"); // ok: a fresh registry
        }
        Self {
            registry,
            outcomes,
            retries,
            unknown_commits,
            request_seconds,
            pool_connections,
            pool_idle,
            pool_waiters,
        }
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
