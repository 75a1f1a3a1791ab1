//! The write path: insert both rows, let the unique indexes pick a winner,
//! resolve a loser by lookups made after its transaction rolled back, retry
//! what the server rolled back, and re-read what COMMIT left unknown.

use std::sync::Arc;

use super::hashing::CanonicalParts;
use super::receipt::CorruptRow;
use super::receipt::ReceiptOfRow;
use super::signing::{ReceiptSignature, SigningKey, StoredSignature};
use super::{Caller, IdempotencyKey, Intake, Login, Receipt, Submission};
use crate::deadline::Deadline;
use crate::metrics::UnknownCommitBranch;
use crate::storage::StorageError;
use crate::storage::errors::{
    FailureClass, TransientCause, classify, is_storage_full, marked_sqlstate,
};
use crate::storage::plans::{self, BatchFailure, NewPlan, ReceiptRow, WriteFailure, Written};

pub use plan_intake_wire::Outcome;

/// A request the write path answered 201 or 200: how, and the receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub outcome: Outcome,
    pub receipt: Receipt,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The key was used by this maker for a different request: 422.
    #[error("idempotency key reused for a different request")]
    KeyReused,
    /// The token no longer names an active login that may submit (revoked
    /// or rotated since it was found): 401, nothing written.
    #[error("unknown or revoked token")]
    Unauthorized,
    /// A stored plan's receipt cannot be read back: 500.
    #[error(transparent)]
    Corrupt(#[from] CorruptRow),
    /// A CHECK rule of the table refuses this plan: 422, never retried.
    #[error("the database refused the plan (rule {})", .constraint.as_deref().unwrap_or("unnamed"))]
    Refused {
        constraint: Option<String>,
        #[source]
        source: diesel::result::Error,
    },
    /// Transient failures outlived the retry budget: 503, nothing written.
    #[error("gave up after {attempts} attempts")]
    RetriesExhausted {
        attempts: u32,
        #[source]
        last: diesel::result::Error,
    },
    /// COMMIT's outcome is unknown and the re-read failed: 503, nothing more written.
    #[error("COMMIT outcome unknown ({commit_error}) and the re-read failed")]
    CommitUnknown {
        commit_error: diesel::result::Error,
        #[source]
        reread_error: StorageError,
    },
    /// The batch this write shared failed as a whole (a SQLite batch whose
    /// writer panicked or whose COMMIT failed; no connection for a batch;
    /// its deadline passed while queued); nothing landed: 503.
    #[error("the shared write batch failed: {}", .0.as_str())]
    BatchFailed(BatchFailure),
    /// The database failed in a way no retry here can mend: 503.
    #[error("the database failed the write")]
    Unavailable(#[source] diesel::result::Error),
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The database is not set up for the service (grants its role lacks):
    /// 503 naming it.
    #[error(transparent)]
    NotSetUp(super::read::NotSetUp),
    /// The database's storage is full: 503 saying so, nothing written.
    #[error("the database's storage is full")]
    StorageFull(#[source] diesel::result::Error),
    /// The plan's receipt would be larger than a leaf of the receipt log
    /// may be: 422, nothing written.
    #[error(
        "this plan's receipt would be {bytes} bytes, more than the {max} a receipt may be (it is a leaf of the receipt log, whose tiles hold leaves of at most {max} bytes): name fewer or shorter approved inputs",
        max = plan_intake_wire::body::MAX_RECEIPT_BYTES
    )]
    ReceiptTooLarge { bytes: usize },
}

impl SubmitError {
    /// True when the request's deadline passed before the write settled.
    pub fn deadline_passed(&self) -> bool {
        matches!(
            self,
            SubmitError::Storage(StorageError::DeadlineExceeded(_))
        )
    }
}

impl From<diesel::result::Error> for SubmitError {
    fn from(e: diesel::result::Error) -> Self {
        SubmitError::Storage(StorageError::Query(e))
    }
}

/// A write's first attempt, made through the writers' queue by an async
/// caller, whose outcome needs more than an answer: a retry, a re-read
/// after an unknown COMMIT, a wait for the standby. [`Intake::submit_after`]
/// goes on from it on a blocking thread.
pub struct FirstAttempt {
    plan: Arc<NewPlan>,
    written: Result<Written, WriteFailure>,
}

impl Intake {
    /// The first attempt, awaited on the writers' queue. The
    /// answer when it is final now (created, unauthorized, and replays
    /// when nothing waits for a standby), else the attempt to go on from.
    pub(super) async fn first_attempt(
        &self,
        caller: &Caller,
        key: &IdempotencyKey,
        submission: &Submission,
        parts: &CanonicalParts<'_>,
        deadline: &Deadline,
    ) -> Result<Result<Accepted, SubmitError>, FirstAttempt> {
        let plan = new_plan(&caller.login, submission, parts, self.signing_key());
        let written = self
            .db
            .write_plan_async(&plan, key.as_str(), &caller.token_hash, deadline)
            .await;
        let answer_now = !self.db.replays_wait_for_standby();
        match written {
            // Where commits wait for a standby, even a new plan waits for
            // the barrier (`storage::replication`): its COMMIT may have been
            // told it committed when its wait was cancelled.
            Ok(Written::Created(_)) if answer_now => {
                Ok(Ok(created(&plan, &caller.login, submission)))
            }
            Ok(Written::Unauthorized) => Ok(Err(SubmitError::Unauthorized)),
            Ok(Written::KeyHeld {
                request_hash,
                plan: row,
            }) if answer_now => Ok(replay_or_refuse(&request_hash, &plan, &row)),
            Ok(Written::AlreadyReceived(row)) if answer_now => {
                Ok(accepted(Outcome::AlreadyReceived, &row))
            }
            written => Err(FirstAttempt { plan, written }),
        }
    }

    /// The write itself, attempt after attempt, for [`Intake::submit`],
    /// from `first` when one was made.
    pub(super) fn write_from(
        &self,
        caller: &Caller,
        key: &IdempotencyKey,
        submission: &Submission,
        parts: &CanonicalParts,
        deadline: &Deadline,
        mut first: Option<FirstAttempt>,
    ) -> Result<Accepted, SubmitError> {
        let login = &caller.login;
        let mut attempt: u32 = 0;
        // After an unknown COMMIT that did not land, the insert is made once
        // more even if the retry budget is spent; only once per request.
        let mut reinsert_allowed = true;
        // Pooled connections to a server that has turned read-only are each
        // discarded and the write moves on at once, uncounted: as many as
        // the pool can hold, and one more.
        let mut read_only_left = self.db.max_connections() + 1;
        loop {
            attempt += 1;
            let (plan, written) = match first.take() {
                Some(FirstAttempt { plan, written }) => (plan, written),
                None => {
                    let plan = new_plan(login, submission, parts, self.signing_key());
                    let written =
                        self.db
                            .write_plan(&plan, key.as_str(), &caller.token_hash, deadline);
                    (plan, written)
                }
            };
            let failure = match written {
                Ok(Written::Created(_)) => {
                    self.db.await_replicated(deadline)?;
                    return Ok(created(&plan, login, submission));
                }
                // A committed key row, found by a read: nothing was written.
                Ok(Written::KeyHeld {
                    request_hash,
                    plan: row,
                }) => {
                    let replay = replay_or_refuse(&request_hash, &plan, &row)?;
                    self.db.await_replicated(deadline)?;
                    return Ok(replay);
                }
                // Only this request's key row was written, for the kept plan.
                Ok(Written::AlreadyReceived(row)) => {
                    self.db.await_replicated(deadline)?;
                    return accepted(Outcome::AlreadyReceived, &row);
                }
                Ok(Written::Unauthorized) => return Err(SubmitError::Unauthorized),
                Err(failure) => failure,
            };
            let log = Attempt {
                login,
                key,
                attempt,
            };
            if is_storage_full(&failure.error) {
                return Err(self.storage_is_full(&log, failure.error));
            }
            if let Some(batch) = failure.batch {
                return Err(self.batch_failed(batch, &log));
            }
            let error = failure.error;
            match classify(&error, failure.commit_sent, failure.connection_lost) {
                FailureClass::Conflict => {
                    let found = self.db.read(deadline, |conn| {
                        plans::find_by_key(conn, &plan.maker, key.as_str())
                    })?;
                    let resolved = resolve_conflict(found, &plan, error)?;
                    self.db.await_replicated(deadline)?;
                    return Ok(resolved);
                }
                FailureClass::Transient(cause) => {
                    // The write discarded a connection that found the
                    // server read-only; the pool discards a broken one.
                    let read_only = cause == TransientCause::ReadOnlyNode;
                    if read_only && read_only_left > 0 {
                        read_only_left -= 1;
                        attempt -= 1;
                        self.metrics.retry(cause.as_str());
                        tracing::warn!(maker = %login.name, key = key.as_str(), %error, "the database server is read-only now; retrying on a new connection");
                    } else {
                        self.back_off(cause, error, deadline, &log)?;
                    }
                }
                FailureClass::UnknownOutcome => {
                    if let Some(accepted) =
                        self.after_unknown_commit(&log, &plan, error, deadline, reinsert_allowed)?
                    {
                        self.db.await_replicated(deadline)?;
                        return Ok(accepted);
                    }
                    reinsert_allowed = false;
                }
                FailureClass::Refused => return Err(refused(&log, error)),
                FailureClass::StorageFull => return Err(self.storage_is_full(&log, error)),
                FailureClass::Unavailable => {
                    tracing::error!(maker = %login.name, key = key.as_str(), attempt, sqlstate = marked_sqlstate(&error), %error, "write failed; not retried");
                    // Grants the role lacks are told as such, not as an
                    // unavailable database.
                    if let Some(StorageError::MissingGrants { role, missing }) =
                        self.db.missing_grants(deadline)
                    {
                        let not_set_up = super::read::NotSetUp::MissingGrants { role, missing };
                        tracing::error!("{not_set_up}");
                        return Err(SubmitError::NotSetUp(not_set_up));
                    }
                    return Err(SubmitError::Unavailable(error));
                }
            }
        }
    }

    /// A COMMIT whose outcome is unknown: the plan as it landed, or `None`
    /// when it did not land and may be written again (once more past the
    /// retry budget, never past the deadline).
    fn after_unknown_commit(
        &self,
        log: &Attempt<'_>,
        plan: &NewPlan,
        commit_error: diesel::result::Error,
        deadline: &Deadline,
        reinsert_allowed: bool,
    ) -> Result<Option<Accepted>, SubmitError> {
        let Attempt {
            login,
            key,
            attempt,
        } = *log;
        tracing::warn!(maker = %login.name, key = key.as_str(), attempt, error = %commit_error, "COMMIT outcome unknown; re-reading");
        // Err(error): nothing under the key, so it did not land.
        match self.settle_unknown_commit(log, plan, commit_error, deadline)? {
            Ok(accepted) => Ok(Some(accepted)),
            Err(_) if deadline.passed() => {
                Err(StorageError::DeadlineExceeded("writing the plan again").into())
            }
            Err(_) if reinsert_allowed || attempt < self.retry.max_attempts => Ok(None),
            Err(last) => Err(SubmitError::RetriesExhausted {
                attempts: attempt,
                last,
            }),
        }
    }

    /// Waits before the next attempt of a transient failure, or gives up
    /// when the retry budget or the deadline would be spent.
    fn back_off(
        &self,
        cause: TransientCause,
        error: diesel::result::Error,
        deadline: &Deadline,
        log: &Attempt<'_>,
    ) -> Result<(), SubmitError> {
        let Attempt {
            login,
            key,
            attempt,
        } = *log;
        if attempt >= self.retry.max_attempts {
            tracing::warn!(maker = %login.name, key = key.as_str(), attempt, cause = cause.as_str(), %error, "retries exhausted");
            return Err(SubmitError::RetriesExhausted {
                attempts: attempt,
                last: error,
            });
        }
        let delay = self.retry.delay(attempt, &mut rand::rng());
        if deadline.nearly_passed() || delay >= deadline.remaining() {
            tracing::warn!(maker = %login.name, key = key.as_str(), attempt, cause = cause.as_str(), %error, "no time left to retry");
            return Err(StorageError::DeadlineExceeded("retrying the write").into());
        }
        self.metrics.retry(cause.as_str());
        tracing::info!(maker = %login.name, key = key.as_str(), attempt, cause = cause.as_str(), delay_ms = delay.as_millis() as u64, %error, "transient failure; retrying");
        std::thread::sleep(delay);
        Ok(())
    }

    /// The database's storage is full: said at ERROR, remembered for
    /// `/readyz` and the gauge until a write lands again.
    fn storage_is_full(&self, log: &Attempt<'_>, error: diesel::result::Error) -> SubmitError {
        let Attempt {
            login,
            key,
            attempt,
        } = *log;
        tracing::error!(maker = %login.name, key = key.as_str(), attempt, %error, "the database's storage is full; nothing was written");
        self.storage_full.failed();
        self.metrics.set_storage_full(true);
        SubmitError::StorageFull(error)
    }

    fn batch_failed(&self, batch: BatchFailure, log: &Attempt<'_>) -> SubmitError {
        let Attempt {
            login,
            key,
            attempt,
        } = *log;
        tracing::warn!(maker = %login.name, key = key.as_str(), attempt, reason = batch.as_str(), "the shared write batch failed; nothing landed");
        match batch {
            BatchFailure::NotWrittenInTime => {
                StorageError::DeadlineExceeded("queued for a write batch").into()
            }
            other => {
                self.metrics.group_commit_failure(other.as_str());
                SubmitError::BatchFailed(other)
            }
        }
    }

    /// After a COMMIT whose outcome is unknown: re-read by (maker, key) on a
    /// fresh connection and compare the whole row with the one this attempt
    /// wrote, never just an id. `Ok(Err(commit_error))`: it did not land.
    fn settle_unknown_commit(
        &self,
        log: &Attempt<'_>,
        plan: &NewPlan,
        commit_error: diesel::result::Error,
        deadline: &Deadline,
    ) -> Result<Result<Accepted, diesel::result::Error>, SubmitError> {
        let Attempt {
            login,
            key,
            attempt,
        } = *log;
        let reread = self.db.read(deadline, |conn| {
            plans::find_by_key(conn, &plan.maker, key.as_str())
        });
        let (branch, settled) = match reread {
            Err(e) => {
                tracing::error!(maker = %login.name, key = key.as_str(), attempt, error = %e, "re-read after unknown COMMIT failed; writing nothing more");
                (
                    UnknownCommitBranch::RereadFailed,
                    Err(SubmitError::CommitUnknown {
                        commit_error,
                        reread_error: e,
                    }),
                )
            }
            Ok(None) => (UnknownCommitBranch::NotLanded, Ok(Err(commit_error))),
            Ok(Some((request_hash, row)))
                if request_hash == plan.request_hash && plan.is_stored_as(&row) =>
            {
                // It joined the feed: readers waiting for it are woken now,
                // as after any other write (not at their next re-read).
                self.db.feed_signal().bump();
                (
                    UnknownCommitBranch::Landed,
                    accepted(Outcome::Created, &row.receipt_row()).map(Ok),
                )
            }
            Ok(Some((request_hash, row))) => (
                UnknownCommitBranch::OtherRow,
                replay_or_refuse(&request_hash, plan, &row.receipt_row()).map(Ok),
            ),
        };
        self.metrics.unknown_commit(branch);
        tracing::info!(maker = %login.name, key = key.as_str(), attempt, branch = branch.as_str(), "unknown COMMIT settled");
        settled
    }
}

/// Who and which attempt, for log lines.
#[derive(Clone, Copy)]
struct Attempt<'a> {
    login: &'a Login,
    key: &'a IdempotencyKey,
    attempt: u32,
}

/// A CHECK rule of the table refused the plan: the request's fault, never retried.
fn refused(log: &Attempt<'_>, error: diesel::result::Error) -> SubmitError {
    let Attempt {
        login,
        key,
        attempt,
    } = *log;
    tracing::info!(maker = %login.name, key = key.as_str(), attempt, %error, "a rule of the table refused the plan");
    let constraint = match &error {
        diesel::result::Error::DatabaseError(_, info) => info.constraint_name().map(str::to_owned),
        _ => None,
    };
    SubmitError::Refused {
        constraint,
        source: error,
    }
}

/// A unique violation the write could not resolve itself. Both backends
/// resolve conflicts inside the write (the key row that won decides, else
/// the kept plan gets this request's key row), so one reaching here found
/// neither row when it looked; a key row committed since still decides.
/// Nothing is answered `already_received` here, since that would leave the
/// key unbound.
fn resolve_conflict(
    found: Option<(String, plans::PlanRow)>,
    plan: &NewPlan,
    original: diesel::result::Error,
) -> Result<Accepted, SubmitError> {
    if let Some((request_hash, row)) = found {
        return replay_or_refuse(&request_hash, plan, &row.receipt_row());
    }
    Err(original.into())
}

/// The key is held by a stored request: the same one is a replay, another is refused.
fn replay_or_refuse(
    stored_request_hash: &str,
    plan: &NewPlan,
    row: &ReceiptRow,
) -> Result<Accepted, SubmitError> {
    if stored_request_hash == plan.request_hash {
        let answer = accepted(Outcome::Replayed, row);
        #[cfg(feature = "test-seams")]
        let answer = answer.map(defect_new_receipt_on_replay);
        answer
    } else {
        Err(SubmitError::KeyReused)
    }
}

/// Test seam, a known defect for the soak to find: with
/// `PLAN_INTAKE_TEST_DEFECT_NEW_RECEIPT_ON_REPLAY` set, a replay is
/// answered with a receipt id of its own instead of the stored one.
#[cfg(feature = "test-seams")]
fn defect_new_receipt_on_replay(mut accepted: Accepted) -> Accepted {
    if std::env::var_os("PLAN_INTAKE_TEST_DEFECT_NEW_RECEIPT_ON_REPLAY").is_some() {
        accepted.receipt.receipt_id = format!("rcpt_{:032x}", rand::random::<u128>());
    }
    accepted
}

/// The stored plan's receipt, answered with `outcome`.
fn accepted(outcome: Outcome, row: &ReceiptRow) -> Result<Accepted, SubmitError> {
    Ok(Accepted {
        outcome,
        receipt: Receipt::from_row(row, Some(outcome))?,
    })
}

/// The receipt of the plan this attempt wrote, from what it wrote: the same receipt a read of the row gives, without reading back
/// or parsing what was just serialized.
fn created(plan: &NewPlan, login: &Login, submission: &Submission) -> Accepted {
    let mut receipt = receipt_of(plan, login, submission);
    receipt.signature = plan
        .receipt_signature
        .as_deref()
        .and_then(<ReceiptSignature as StoredSignature>::from_stored);
    receipt.outcome = Some(Outcome::Created);
    Accepted {
        outcome: Outcome::Created,
        receipt,
    }
}

/// Refuses a plan whose receipt would not fit a leaf of the receipt log
/// (`MAX_RECEIPT_BYTES`). The receipt's size is known before the write:
/// its id and timestamp have fixed lengths. Most plans are far below any
/// doubt, which a bound on their variable parts (each character escaped
/// at most six times over) shows without making the receipt.
pub(super) fn check_receipt_size(
    login: &Login,
    submission: &Submission,
    parts: &CanonicalParts,
) -> Result<(), SubmitError> {
    use plan_intake_wire::body::MAX_RECEIPT_BYTES;
    /// The receipt's fixed members and their names, generously.
    const FIXED: usize = 1024;
    let variable: usize = submission
        .approved_inputs
        .iter()
        .map(|input| input.id.len() + 3)
        .sum::<usize>()
        + submission.run_id.as_str().len()
        + login.name.len()
        + login
            .permission_names()
            .iter()
            .map(|p| p.len() + 3)
            .sum::<usize>();
    if FIXED + 6 * variable <= MAX_RECEIPT_BYTES {
        return Ok(());
    }
    let plan = NewPlan {
        receipt_id: new_receipt_id(),
        maker: login.name.clone(),
        run_id: submission.run_id.as_str().to_owned(),
        content_hash: parts.hashes.content_hash.clone(),
        request_hash: parts.hashes.request_hash.clone(),
        content: String::new(),
        approved_inputs: String::new(),
        permissions: String::new(),
        received_at: crate::clock::now_micros(),
        receipt_signature: None,
    };
    let bytes = plan_intake_wire::evidence::signed_form(&receipt_of(&plan, login, submission))
        .map_or(usize::MAX, |form| form.len());
    if bytes > MAX_RECEIPT_BYTES {
        return Err(SubmitError::ReceiptTooLarge { bytes });
    }
    Ok(())
}

/// `plan`'s receipt as it will be stored, without signature or outcome.
fn receipt_of(plan: &NewPlan, login: &Login, submission: &Submission) -> Receipt {
    Receipt {
        receipt_id: plan.receipt_id.clone(),
        maker: plan.maker.clone(),
        run_id: plan.run_id.clone(),
        content_hash: plan.content_hash.clone(),
        request_hash: plan.request_hash.clone(),
        approved_inputs: submission
            .approved_inputs
            .iter()
            .map(|input| input.id.clone())
            .collect(),
        permissions: login
            .permission_names()
            .into_iter()
            .map(str::to_owned)
            .collect(),
        received_at: super::receipt::format_timestamp(&plan.received_at),
        signature: None,
        outcome: None,
        extra: Default::default(),
    }
}

/// The plan this attempt writes, its receipt signed by `signer` (before
/// the write, so the signature is kept with the plan and every replay
/// answers it).
fn new_plan(
    login: &Login,
    submission: &Submission,
    parts: &CanonicalParts,
    signer: Option<&SigningKey>,
) -> Arc<NewPlan> {
    let mut plan = NewPlan {
        receipt_id: new_receipt_id(),
        maker: login.name.clone(),
        run_id: submission.run_id.as_str().to_owned(),
        content_hash: parts.hashes.content_hash.clone(),
        request_hash: parts.hashes.request_hash.clone(),
        content: parts.content.to_owned(),
        approved_inputs: parts.approved_inputs.clone(),
        permissions: serde_json::Value::from(login.permission_names()).to_string(),
        received_at: crate::clock::now_micros(),
        receipt_signature: None,
    };
    if let Some(key) = signer {
        match key.sign(&receipt_of(&plan, login, submission)) {
            Ok(signature) => plan.receipt_signature = Some(signature.stored()),
            // Not reachable with an Ed25519 key and a receipt of strings;
            // the plan is still kept, unsigned, as by a service without a key.
            Err(error) => tracing::error!(%error, "a receipt could not be signed"),
        }
    }
    // Shared with the writer that writes it: a 1 MiB content is not copied.
    Arc::new(plan)
}

/// `rcpt_` and 128 random bits in hex: made here, per attempt, so a re-read
/// after an unknown COMMIT can tell this attempt's row from another's.
fn new_receipt_id() -> String {
    let bits: u128 = rand::random();
    format!("rcpt_{bits:032x}")
}
