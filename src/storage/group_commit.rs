//! SQLite's batches. SQLite admits one writer at a time and every COMMIT
//! waits for an fsync (`synchronous=FULL`). The plans queued meanwhile
//! (`write_queue`, one writer thread on SQLite) are answered here: each
//! plan's login check and key read first, with no write lock (a refusal or
//! a replay ends there, so a batch of them never waits for another writer
//! of the file), then the rest in one `BEGIN IMMEDIATE` transaction, each
//! plan's rows inside its own SAVEPOINT, committed once for all of them.
//!
//! Each request's outcome is its own: a unique violation rolls back only that
//! request's savepoint (its plan row with it) and is resolved at once, inside
//! the batch, by lookups that see the row that won (this transaction holds
//! the write lock): the key row decides, else the plan kept for the content
//! gets this request's key row, so the key is bound by its first answer.
//! If the batch cannot begin, nothing was written and every request sees a
//! transient error (retried). If its COMMIT fails, SQLite has rolled the
//! whole batch back, and if the writer panics its transaction is abandoned:
//! either way nothing landed and every request is answered 503 (retry with
//! the same key). The unique indexes still decide every race; the queue
//! only decides who writes when. The other writer of the file, the receipt
//! log's appender, takes its turn between two batches.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
#[cfg(feature = "test-seams")]
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::result::Error as DieselError;
use diesel::{Connection, QueryResult, SqliteConnection};

use super::errors::{copy_error, is_unique_violation};
use super::logins;
use super::plans::{
    BatchFailure, NewPlan, WriteFailure, Written, find_receipt_by_key_on_sqlite, insert_both_rows,
    resolve_in_transaction,
};
use super::write_queue::TIME_TO_SEND;
use crate::deadline::Deadline;

type WriteResult = Result<Written, WriteFailure>;

/// One plan of a batch: its rows, its key, the caller's token (`None`:
/// written without the login check and key read, a test seam's write), and
/// its deadline.
pub struct Entry<'a> {
    pub plan: &'a NewPlan,
    pub key: &'a str,
    pub token_hash: Option<&'a str>,
    pub deadline: Deadline,
}

#[derive(Default)]
struct Turns {
    /// A batch, or the appender, is writing.
    writing: bool,
    /// Other writers of this file (the receipt log's appender) waiting for
    /// their turn: no new batch begins until each has had it.
    wanted: usize,
}

/// Writes SQLite's batches, and gives the file's other writer its turns.
pub struct SqliteBatches {
    turns: Mutex<Turns>,
    done: Condvar,
    /// The configured busy timeout; a batch waits no longer than this, nor
    /// past the earliest deadline among its writers.
    busy_timeout: Duration,
    /// Test seam: the next batch's writer panics mid-transaction.
    #[cfg(feature = "test-seams")]
    panic_next_batch: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SqliteBatches {
    pub fn new(busy_timeout: Duration) -> Self {
        Self {
            turns: Mutex::default(),
            done: Condvar::new(),
            busy_timeout,
            #[cfg(feature = "test-seams")]
            panic_next_batch: AtomicBool::new(false),
        }
    }

    /// Makes the next batch's writer panic mid-transaction (for tests of
    /// that failure path; nothing else calls it).
    #[cfg(feature = "test-seams")]
    pub fn panic_in_next_batch(&self) {
        self.panic_next_batch.store(true, Ordering::SeqCst);
    }

    /// Whether a test asked this batch's writer to panic; never in a build
    /// without the test seams.
    fn panic_injected(&self) -> bool {
        #[cfg(feature = "test-seams")]
        {
            self.panic_next_batch.swap(false, Ordering::SeqCst)
        }
        #[cfg(not(feature = "test-seams"))]
        {
            false
        }
    }

    /// Answers `batch` on `conn`: refusals and replays from reads, handed
    /// to `early` (the plan's index, its answer) at once, before the write
    /// lock is asked for, so they never wait for a writer of the file; the
    /// rest written in one transaction, once the appender has had any turn
    /// it waits for, their answers returned (`None`: given to `early`).
    pub fn write(
        &self,
        conn: &mut SqliteConnection,
        batch: &[Entry<'_>],
        early: &dyn Fn(usize, WriteResult),
    ) -> Vec<Option<WriteResult>> {
        let mut to_write = Vec::new();
        for (at, entry) in batch.iter().enumerate() {
            match answered_by_reads(conn, entry) {
                Some(answer) => early(at, answer),
                None => to_write.push(at),
            }
        }
        let mut answers: Vec<Option<WriteResult>> = batch.iter().map(|_| None).collect();
        if to_write.is_empty() {
            return answers;
        }
        let entries: Vec<&Entry<'_>> = to_write.iter().map(|&at| &batch[at]).collect();
        for (at, written) in to_write.into_iter().zip(self.write_in_turn(conn, &entries)) {
            answers[at] = Some(written);
        }
        answers
    }

    /// Writes `batch` in one transaction once the appender has had any turn
    /// it waits for; a plan whose deadline passes (or nearly) meanwhile is
    /// never written (its request has been answered 503).
    fn write_in_turn(&self, conn: &mut SqliteConnection, batch: &[&Entry<'_>]) -> Vec<WriteResult> {
        let late = || Err(batch_failed(BatchFailure::NotWrittenInTime));
        let patience = batch
            .iter()
            .map(|entry| entry.deadline.remaining())
            .max()
            .unwrap_or_default();
        let until = std::time::Instant::now() + patience;
        let mut turns = lock(&self.turns);
        while turns.writing || turns.wanted > 0 {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return batch.iter().map(|_| late()).collect();
            }
            turns = self
                .done
                .wait_timeout(turns, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        turns.writing = true;
        drop(turns);
        let _turn = Turn(self);
        let timely: Vec<usize> = (0..batch.len())
            .filter(|&at| batch[at].deadline.remaining() >= TIME_TO_SEND)
            .collect();
        let mut answers: Vec<WriteResult> = batch.iter().map(|_| late()).collect();
        if timely.is_empty() {
            return answers;
        }
        let entries: Vec<&Entry<'_>> = timely.iter().map(|&at| batch[at]).collect();
        for (at, written) in timely
            .into_iter()
            .zip(self.write_batch_guarded(conn, &entries))
        {
            answers[at] = written;
        }
        answers
    }

    /// Runs `write` (another writer of this file, on a connection of its
    /// own) between two batches: the batch being written ends first, and
    /// none begins until `write` returns. SQLite's busy handler polls, so a
    /// writer competing with back-to-back batches could wait for seconds;
    /// here it waits for one batch at most, and the plans queued meanwhile
    /// go in the next.
    pub fn between_batches<R>(&self, write: impl FnOnce() -> R) -> R {
        let mut turns = lock(&self.turns);
        turns.wanted += 1;
        while turns.writing {
            turns = self
                .done
                .wait(turns)
                .unwrap_or_else(PoisonError::into_inner);
        }
        turns.wanted -= 1;
        turns.writing = true;
        drop(turns);
        let _turn = Turn(self);
        write()
    }

    /// Writes one batch; a panic while writing answers every writer in it.
    fn write_batch_guarded(
        &self,
        conn: &mut SqliteConnection,
        batch: &[&Entry<'_>],
    ) -> Vec<WriteResult> {
        let patience = batch
            .iter()
            .map(|slot| slot.deadline.wait_budget())
            .fold(self.busy_timeout, Duration::min)
            .max(Duration::from_millis(1));
        if let Err(error) =
            conn.batch_execute(&format!("PRAGMA busy_timeout = {}", patience.as_millis()))
        {
            return batch
                .iter()
                .map(|_| Err(WriteFailure::new(copy_error(&error), false)))
                .collect();
        }
        let panic_now = self.panic_injected();
        match catch_unwind(AssertUnwindSafe(|| write_batch(conn, batch, panic_now))) {
            Ok(results) => {
                // The batch's patience was this connection's for the batch
                // only: the pool hands it on with its configured timeout.
                if patience != self.busy_timeout
                    && let Err(error) = conn.batch_execute(&format!(
                        "PRAGMA busy_timeout = {}",
                        self.busy_timeout.as_millis()
                    ))
                {
                    tracing::warn!(%error, "could not restore the connection's busy timeout");
                }
                results
            }
            Err(_) => {
                tracing::error!(
                    writers = batch.len(),
                    "the SQLite batch's writer panicked; its batch is abandoned"
                );
                // Give the write lock back now. diesel still counts the
                // transaction as open, so the pool discards this connection.
                let _ = conn.batch_execute("ROLLBACK");
                batch
                    .iter()
                    .map(|_| Err(batch_failed(BatchFailure::LeaderPanicked)))
                    .collect()
            }
        }
    }
}

/// A turn at writing the file; dropped, even by a panic, it ends.
struct Turn<'a>(&'a SqliteBatches);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        lock(&self.0.turns).writing = false;
        self.0.done.notify_all();
    }
}

fn write_batch(
    conn: &mut SqliteConnection,
    batch: &[&Entry<'_>],
    panic_inside: bool,
) -> Vec<WriteResult> {
    let mut results: Vec<Option<WriteResult>> = batch.iter().map(|_| None).collect();
    let body_done = Cell::new(false);
    let outcome = conn.immediate_transaction(|c| {
        if panic_inside {
            panic!("injected panic in the SQLite batch's writer (test seam)");
        }
        for (entry, result) in batch.iter().zip(results.iter_mut()) {
            *result = Some(write_rows(c, entry).map_err(|error| WriteFailure::new(error, false)));
        }
        body_done.set(true);
        Ok::<(), DieselError>(())
    });
    match outcome {
        Ok(()) => results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(batch_failed(BatchFailure::LeaderPanicked))))
            .collect(),
        // COMMIT failed: SQLite rolled the whole batch back.
        Err(error) if body_done.get() => {
            tracing::error!(writers = batch.len(), %error, "the group commit failed; nothing in the batch landed");
            batch
                .iter()
                .map(|_| {
                    let mut failure = WriteFailure::new(copy_error(&error), false);
                    failure.batch = Some(BatchFailure::CommitFailed);
                    Err(failure)
                })
                .collect()
        }
        // BEGIN failed (busy): nothing was written; one error for every request.
        Err(error) => batch
            .iter()
            .map(|_| Err(WriteFailure::new(copy_error(&error), false)))
            .collect(),
    }
}

/// A plan's answer when reads give it, with no write lock: its token no
/// longer names the maker's active login with `plans:submit`, or its key
/// row is committed (a replay, or a key reused). `None`: it is to be
/// written (also for a test seam's entry, which skips the reads).
fn answered_by_reads(c: &mut SqliteConnection, entry: &Entry<'_>) -> Option<WriteResult> {
    let token_hash = entry.token_hash?;
    let plan = entry.plan;
    let read = |c: &mut SqliteConnection| -> QueryResult<Option<Written>> {
        let login = logins::find_active_on_sqlite(c, token_hash, plan.received_at)?;
        if !login.is_some_and(|row| row.name == plan.maker && logins::may_submit(&row)) {
            return Ok(Some(Written::Unauthorized));
        }
        Ok(
            find_receipt_by_key_on_sqlite(c, &plan.maker, entry.key)?.map(|(request_hash, row)| {
                Written::KeyHeld {
                    request_hash,
                    plan: row,
                }
            }),
        )
    };
    read(c)
        .map_err(|error| WriteFailure::new(error, false))
        .transpose()
}

/// One plan's rows inside the batch's transaction, in a savepoint of their
/// own (one plan's violation must not undo the others); a unique violation
/// is resolved after the savepoint rolled back: this transaction holds the
/// write lock, so the winner is in view.
fn write_rows(c: &mut SqliteConnection, entry: &Entry<'_>) -> QueryResult<Written> {
    match c
        .transaction(|c| insert_both_rows(c, entry.plan, entry.key))
        .map(Written::Created)
    {
        Err(error) if is_unique_violation(&error) => {
            resolve_in_transaction(c, entry.plan, entry.key).and_then(|found| found.ok_or(error))
        }
        other => other,
    }
}

pub(super) fn batch_failed(why: BatchFailure) -> WriteFailure {
    let mut failure = WriteFailure::new(DieselError::QueryBuilderError(why.as_str().into()), false);
    failure.batch = Some(why);
    failure
}
