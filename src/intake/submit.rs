//! The write path: insert both rows, let the unique indexes pick a winner,
//! and resolve a loser by lookups made after its transaction rolled back.

use chrono::{DurationRound, NaiveDateTime, TimeDelta, Utc};

use super::hashing::{self, CanonicalParts};
use super::{IdempotencyKey, Login, Submission};
use crate::storage::plans::{self, NewPlan, PlanRow};
use crate::storage::{Database, DbConn, StorageError, errors::is_unique_violation};

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

/// Keeps `submission` once. Blocking: call from `web::block`.
pub fn submit(
    db: &Database,
    login: &Login,
    key: &IdempotencyKey,
    submission: &Submission,
) -> Result<Accepted, SubmitError> {
    let plan = new_plan(login, submission, hashing::canonicalize(submission)?);
    let mut conn = db.conn()?;
    match plans::insert_plan_with_key(&mut conn, &plan, key.as_str()) {
        Ok(row) => Ok(Accepted {
            outcome: Outcome::Created,
            plan: row,
        }),
        Err(e) if is_unique_violation(&e) => resolve_conflict(&mut conn, &plan, key, e),
        Err(e) => Err(e.into()),
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
        return if request_hash == plan.request_hash {
            Ok(Accepted {
                outcome: Outcome::Replayed,
                plan: row,
            })
        } else {
            Err(SubmitError::KeyReused)
        };
    }
    if let Some(row) = plans::find_by_content(conn, &plan.maker, &plan.run_id, &plan.content_hash)?
    {
        return Ok(Accepted {
            outcome: Outcome::AlreadyReceived,
            plan: row,
        });
    }
    Err(original.into())
}

fn new_plan(login: &Login, submission: &Submission, parts: CanonicalParts) -> NewPlan {
    NewPlan {
        receipt_id: new_receipt_id(),
        maker: login.name.clone(),
        run_id: submission.run_id.as_str().to_owned(),
        content_hash: parts.hashes.content_hash,
        request_hash: parts.hashes.request_hash,
        content: parts.content,
        approved_inputs: parts.approved_inputs,
        permissions: serde_json::Value::from(login.permission_names()).to_string(),
        received_at: now_micros(),
    }
}

/// `rcpt_` and 128 random bits in hex: made here, before the attempt, so a
/// re-read after an unknown COMMIT can tell this attempt's row from another's.
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
