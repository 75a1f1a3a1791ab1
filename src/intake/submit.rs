//! The write path: insert both rows, let the unique indexes pick a winner,
//! resolve a loser by lookups made after its transaction rolled back, retry
//! what the server rolled back, and re-read what COMMIT left unknown.

use chrono::{DurationRound, NaiveDateTime, TimeDelta, Utc};

use super::hashing::{self, CanonicalParts};
use super::retry::RetryPolicy;
use super::{IdempotencyKey, Login, Submission};
use crate::metrics::{Metrics, UnknownCommitBranch};
use crate::storage::errors::{FailureClass, classify};
use crate::storage::plans::{self, NewPlan, PlanRow};
use crate::storage::{Database, DbConn, PooledConn, StorageError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// This request wrote the plan: 201.
    Created,
    /// Same maker and key, same request: the stored receipt, 200.
    Replayed,
    /// A new key for a plan this maker already sent for this run: 200.
    AlreadyReceived,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Created => "created",
            Outcome::Replayed => "replayed",
            Outcome::AlreadyReceived => "already_received",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub outcome: Outcome,
    pub plan: PlanRow,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The key was used by this maker for a different request: 422.
    #[error("idempotency key reused for a different request")]
    KeyReused,
    /// Transient failures outlived the retry budget: 503, nothing written.
    #[error("gave up after {attempts} attempts: {last}")]
    RetriesExhausted { attempts: u32, last: String },
    /// COMMIT's outcome is unknown and the re-read failed: 503, nothing more written.
    #[error("COMMIT outcome unknown ({commit_error}) and the re-read failed: {reread_error}")]
    CommitUnknown {
        commit_error: String,
        reread_error: String,
    },
    #[error("cannot canonicalize the submission: {0}")]
    Canonical(#[from] serde_json::Error),
    #[error(transparent)]
    Storage(#[from] StorageError),
}

impl From<diesel::result::Error> for SubmitError {
    fn from(e: diesel::result::Error) -> Self {
        SubmitError::Storage(StorageError::Query(e))
    }
}

/// The write path and what it needs: the database, the retry policy and the
/// counters. Cheap to clone; shared by every worker.
#[derive(Clone)]
pub struct Intake {
    pub db: Database,
    pub retry: RetryPolicy,
    pub metrics: Metrics,
}

impl Intake {
    pub fn new(db: Database, retry: RetryPolicy, metrics: Metrics) -> Self {
        Self { db, retry, metrics }
    }

    /// Keeps `submission` once. Blocking: call from `web::block`.
    pub fn submit(
        &self,
        login: &Login,
        key: &IdempotencyKey,
        submission: &Submission,
    ) -> Result<Accepted, SubmitError> {
        let parts = hashing::canonicalize(submission)?;
        self.write(None, login, key, submission, &parts)
    }

    /// As [`Intake::submit`], with the first attempt on a connection the
    /// caller already holds.
    pub fn submit_on(
        &self,
        conn: PooledConn,
        login: &Login,
        key: &IdempotencyKey,
        submission: &Submission,
    ) -> Result<Accepted, SubmitError> {
        let parts = hashing::canonicalize(submission)?;
        self.write(Some(conn), login, key, submission, &parts)
    }

    fn write(
        &self,
        mut first_conn: Option<PooledConn>,
        login: &Login,
        key: &IdempotencyKey,
        submission: &Submission,
        parts: &CanonicalParts,
    ) -> Result<Accepted, SubmitError> {
        let mut attempt: u32 = 0;
        // After an unknown COMMIT that did not land, the insert is made once
        // more even if the retry budget is spent; only once per request.
        let mut reinsert_allowed = true;
        loop {
            attempt += 1;
            let plan = new_plan(login, submission, parts);
            let mut conn = match first_conn.take() {
                Some(conn) => conn,
                None => self.db.conn()?,
            };
            let failure = match self.db.write_plan(&mut conn, &plan, key.as_str()) {
                Ok(row) => return Ok(accepted(Outcome::Created, row)),
                Err(failure) => failure,
            };
            let class = classify(&failure.error, failure.commit_sent);
            match class {
                FailureClass::Conflict => {
                    return resolve_conflict(&mut conn, &plan, key, failure.error);
                }
                FailureClass::Transient(cause) => {
                    // A broken connection goes back and is discarded by the pool.
                    drop(conn);
                    if attempt >= self.retry.max_attempts {
                        tracing::warn!(maker = %login.name, key = key.as_str(), attempt, cause = cause.as_str(), error = %failure.error, "retries exhausted");
                        return Err(SubmitError::RetriesExhausted {
                            attempts: attempt,
                            last: failure.error.to_string(),
                        });
                    }
                    self.metrics.retry(cause.as_str());
                    let delay = self.retry.delay(attempt, &mut rand::rng());
                    tracing::info!(maker = %login.name, key = key.as_str(), attempt, cause = cause.as_str(), delay_ms = delay.as_millis() as u64, error = %failure.error, "transient failure; retrying");
                    std::thread::sleep(delay);
                }
                FailureClass::UnknownOutcome => {
                    drop(conn);
                    tracing::warn!(maker = %login.name, key = key.as_str(), attempt, error = %failure.error, "COMMIT outcome unknown; re-reading");
                    // Ok(None): nothing under the key, so it did not land.
                    match self.settle_unknown_commit(login, key, attempt, &plan, &failure.error) {
                        Ok(Some(accepted)) => return Ok(accepted),
                        Err(e) => return Err(e),
                        Ok(None) if reinsert_allowed || attempt < self.retry.max_attempts => {
                            reinsert_allowed = false;
                        }
                        Ok(None) => {
                            return Err(SubmitError::RetriesExhausted {
                                attempts: attempt,
                                last: failure.error.to_string(),
                            });
                        }
                    }
                }
                FailureClass::Infrastructure => {
                    return Err(StorageError::Unavailable(failure.error.to_string()).into());
                }
                FailureClass::Permanent | FailureClass::Other => {
                    tracing::error!(maker = %login.name, key = key.as_str(), attempt, ?class, error = %failure.error, "write failed; not retried");
                    return Err(failure.error.into());
                }
            }
        }
    }

    /// After a COMMIT whose outcome is unknown: re-read by (maker, key) on a
    /// fresh connection and compare the whole row with the one this attempt
    /// wrote, never just an id.
    fn settle_unknown_commit(
        &self,
        login: &Login,
        key: &IdempotencyKey,
        attempt: u32,
        plan: &NewPlan,
        commit_error: &diesel::result::Error,
    ) -> Result<Option<Accepted>, SubmitError> {
        let reread = self.db.conn().and_then(|mut conn| {
            plans::find_by_key(&mut conn, &plan.maker, key.as_str()).map_err(StorageError::from)
        });
        let branch_and_result = match reread {
            Err(e) => {
                tracing::error!(maker = %login.name, key = key.as_str(), attempt, error = %e, "re-read after unknown COMMIT failed; writing nothing more");
                (
                    UnknownCommitBranch::RereadFailed,
                    Err(SubmitError::CommitUnknown {
                        commit_error: commit_error.to_string(),
                        reread_error: e.to_string(),
                    }),
                )
            }
            Ok(None) => (UnknownCommitBranch::NotLanded, Ok(None)),
            Ok(Some((request_hash, row)))
                if request_hash == plan.request_hash && plan.is_stored_as(&row) =>
            {
                (
                    UnknownCommitBranch::Landed,
                    Ok(Some(accepted(Outcome::Created, row))),
                )
            }
            Ok(Some((request_hash, row))) => (
                UnknownCommitBranch::OtherRow,
                replay_or_refuse(&request_hash, plan, row).map(Some),
            ),
        };
        let (branch, settled) = branch_and_result;
        self.metrics.unknown_commit(branch);
        tracing::info!(maker = %login.name, key = key.as_str(), attempt, branch = branch.as_str(), "unknown COMMIT settled");
        settled
    }
}

/// Another writer holds the key or the plan. Its transaction has committed
/// (a unique index makes the loser wait for that), ours has rolled back.
fn resolve_conflict(
    conn: &mut DbConn,
    plan: &NewPlan,
    key: &IdempotencyKey,
    original: diesel::result::Error,
) -> Result<Accepted, SubmitError> {
    if let Some((request_hash, row)) = plans::find_by_key(conn, &plan.maker, key.as_str())? {
        return replay_or_refuse(&request_hash, plan, row);
    }
    if let Some(row) = plans::find_by_content(conn, &plan.maker, &plan.run_id, &plan.content_hash)?
    {
        return Ok(accepted(Outcome::AlreadyReceived, row));
    }
    Err(original.into())
}

/// The key is held by a stored request: the same one is a replay, another is refused.
fn replay_or_refuse(
    stored_request_hash: &str,
    plan: &NewPlan,
    row: PlanRow,
) -> Result<Accepted, SubmitError> {
    if stored_request_hash == plan.request_hash {
        Ok(accepted(Outcome::Replayed, row))
    } else {
        Err(SubmitError::KeyReused)
    }
}

fn accepted(outcome: Outcome, plan: PlanRow) -> Accepted {
    Accepted { outcome, plan }
}

fn new_plan(login: &Login, submission: &Submission, parts: &CanonicalParts) -> NewPlan {
    NewPlan {
        receipt_id: new_receipt_id(),
        maker: login.name.clone(),
        run_id: submission.run_id.as_str().to_owned(),
        content_hash: parts.hashes.content_hash.clone(),
        request_hash: parts.hashes.request_hash.clone(),
        content: parts.content.clone(),
        approved_inputs: parts.approved_inputs.clone(),
        permissions: serde_json::Value::from(login.permission_names()).to_string(),
        received_at: now_micros(),
    }
}

/// `rcpt_` and 128 random bits in hex: made here, per attempt, so a re-read
/// after an unknown COMMIT can tell this attempt's row from another's.
fn new_receipt_id() -> String {
    let bits: u128 = rand::random();
    format!("rcpt_{bits:032x}")
}

/// Now, in UTC, cut to the microseconds both backends keep.
pub fn now_micros() -> NaiveDateTime {
    let now = Utc::now();
    now.duration_trunc(TimeDelta::microseconds(1))
        .unwrap_or(now)
        .naive_utc()
}
