//! Counters for every intake outcome, retry and unknown-COMMIT branch, in a
//! Prometheus registry of their own (one per service, so tests stay apart).

use prometheus::{Encoder, IntCounterVec, Opts, Registry, TextEncoder};

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    outcomes: IntCounterVec,
    retries: IntCounterVec,
    unknown_commits: IntCounterVec,
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
        for collector in [&outcomes, &retries, &unknown_commits] {
            registry
                .register(Box::new(collector.clone()))
                .expect("metric registered once"); // ok: a fresh registry
        }
        Self {
            registry,
            outcomes,
            retries,
            unknown_commits,
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
