//! SQLite group commit. SQLite admits one writer at a time and every COMMIT
//! waits for an fsync (`synchronous=FULL`). Writers that arrive while another
//! commits queue here; the first of them to find no leader writes the whole
//! queue in one `BEGIN IMMEDIATE` transaction, each plan inside its own
//! SAVEPOINT, and commits once for all of them.
//!
//! Each request's outcome is its own: a unique violation rolls back only that
//! request's savepoint (its plan row with it) and is resolved at once, inside
//! the batch, by lookups that see the row that won (this transaction holds
//! the write lock): the key row decides, else the plan kept for the content
//! gets this request's key row, so the key is bound by its first answer.
//! If the batch cannot begin, nothing was written and every request sees a
//! transient error (retried). If its COMMIT fails, SQLite has rolled the
//! whole batch back, and if the leader panics its transaction is abandoned:
//! either way nothing landed and every request is answered 503 (retry with
//! the same key). A writer whose deadline passes while still queued leaves
//! the queue unwritten. The unique indexes still decide every race; the
//! queue only decides who writes when.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
#[cfg(feature = "test-seams")]
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::result::Error as DieselError;
use diesel::{Connection, SqliteConnection};

use super::errors::{copy_error, is_unique_violation};
use super::plans::{
    BatchFailure, NewPlan, WriteFailure, Written, insert_both_rows, resolve_in_transaction,
};
use crate::deadline::Deadline;

type WriteResult = Result<Written, WriteFailure>;

/// One request's write, and its result once the batch is done.
struct Slot {
    plan: Arc<NewPlan>,
    key: String,
    deadline: Deadline,
    result: Mutex<Option<WriteResult>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Arc<Slot>>,
    leading: bool,
    /// Other writers of this file (the receipt log's appender) waiting for
    /// their turn: no new batch begins until each has had it.
    turns_wanted: usize,
}

pub struct WriteQueue {
    queue: Mutex<Queue>,
    done: Condvar,
    /// The configured busy timeout; a batch waits no longer than this, nor
    /// past the earliest deadline among its writers.
    busy_timeout: Duration,
    /// Test seam: the next batch's leader panics mid-transaction.
    #[cfg(feature = "test-seams")]
    panic_next_batch: AtomicBool,
    batch_sizes: std::sync::OnceLock<prometheus::Histogram>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl WriteQueue {
    pub fn new(busy_timeout: Duration) -> Self {
        Self {
            queue: Mutex::default(),
            done: Condvar::new(),
            busy_timeout,
            #[cfg(feature = "test-seams")]
            panic_next_batch: AtomicBool::new(false),
            batch_sizes: std::sync::OnceLock::new(),
        }
    }

    /// Where each batch's size is recorded (the service's metrics).
    pub fn observe_batch_sizes(&self, histogram: prometheus::Histogram) {
        let _ = self.batch_sizes.set(histogram);
    }

    /// Makes the next batch's leader panic mid-transaction (for tests of
    /// that failure path; nothing else calls it).
    #[cfg(feature = "test-seams")]
    pub fn panic_in_next_batch(&self) {
        self.panic_next_batch.store(true, Ordering::SeqCst);
    }

    /// Whether a test asked this batch's leader to panic; never in a build
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

    /// Writes `plan` and its key row, in a batch with whatever else is queued.
    /// `conn` writes the batch if this caller ends up leading it.
    pub fn write(
        &self,
        conn: &mut SqliteConnection,
        plan: &Arc<NewPlan>,
        key: &str,
        deadline: &Deadline,
    ) -> WriteResult {
        let slot = Arc::new(Slot {
            plan: Arc::clone(plan),
            key: key.to_owned(),
            deadline: *deadline,
            result: Mutex::new(None),
        });
        let mut queue = lock(&self.queue);
        queue.waiting.push(Arc::clone(&slot));
        loop {
            if let Some(result) = lock(&slot.result).take() {
                return result;
            }
            if queue.leading || queue.turns_wanted > 0 {
                let left = slot.deadline.remaining();
                if left.is_zero() {
                    // Still queued: leave unwritten. Already in the batch
                    // being written: its answer comes within that batch's
                    // wait, which is bounded by the earliest deadline in it.
                    if let Some(at) = queue.waiting.iter().position(|s| Arc::ptr_eq(s, &slot)) {
                        queue.waiting.remove(at);
                        return Err(batch_failed(BatchFailure::NotWrittenInTime));
                    }
                    queue = self
                        .done
                        .wait(queue)
                        .unwrap_or_else(PoisonError::into_inner);
                } else {
                    queue = self
                        .done
                        .wait_timeout(queue, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
                continue;
            }
            // Lead one batch (ours is in it), then hand over: a leader that
            // kept leading under steady load would never answer its caller.
            queue.leading = true;
            let batch = Leading {
                queue: self,
                batch: std::mem::take(&mut queue.waiting),
            };
            drop(queue);
            let results = self.lead(conn, &batch.batch);
            for (slot, result) in batch.batch.iter().zip(results) {
                *lock(&slot.result) = Some(result);
            }
            drop(batch);
            queue = lock(&self.queue);
        }
    }

    /// Runs `write` (another writer of this file, on a connection of its
    /// own) between two batches: the batch being written ends first, and
    /// none begins until `write` returns. SQLite's busy handler polls, so a
    /// writer competing with back-to-back batches could wait for seconds;
    /// here it waits for one batch at most, and the plans queued meanwhile
    /// go in the next.
    pub fn between_batches<R>(&self, write: impl FnOnce() -> R) -> R {
        struct Turn<'a>(&'a WriteQueue);
        impl Drop for Turn<'_> {
            fn drop(&mut self) {
                lock(&self.0.queue).leading = false;
                self.0.done.notify_all();
            }
        }
        let mut queue = lock(&self.queue);
        queue.turns_wanted += 1;
        while queue.leading {
            queue = self
                .done
                .wait(queue)
                .unwrap_or_else(PoisonError::into_inner);
        }
        queue.turns_wanted -= 1;
        queue.leading = true;
        drop(queue);
        let _turn = Turn(self);
        write()
    }

    /// Writes one batch; a panic while writing answers every writer in it.
    fn lead(&self, conn: &mut SqliteConnection, batch: &[Arc<Slot>]) -> Vec<WriteResult> {
        if let Some(histogram) = self.batch_sizes.get() {
            histogram.observe(batch.len() as f64);
        }
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
                    "the group-commit leader panicked; its batch is abandoned"
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

/// A batch being written. Dropped, even by a panic, it answers every slot
/// still unanswered and gives up the lead, so no writer waits forever.
struct Leading<'a> {
    queue: &'a WriteQueue,
    batch: Vec<Arc<Slot>>,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        for slot in &self.batch {
            let mut result = lock(&slot.result);
            if result.is_none() {
                *result = Some(Err(batch_failed(BatchFailure::LeaderPanicked)));
            }
        }
        lock(&self.queue.queue).leading = false;
        self.queue.done.notify_all();
    }
}

fn write_batch(
    conn: &mut SqliteConnection,
    batch: &[Arc<Slot>],
    panic_inside: bool,
) -> Vec<WriteResult> {
    let mut results: Vec<Option<WriteResult>> = batch.iter().map(|_| None).collect();
    let body_done = Cell::new(false);
    let outcome = conn.immediate_transaction(|c| {
        if panic_inside {
            panic!("injected panic in the group-commit leader (test seam)");
        }
        for (slot, result) in batch.iter().zip(results.iter_mut()) {
            // A savepoint each: one plan's violation must not undo the others.
            let written = c
                .transaction(|c| insert_both_rows(c, &slot.plan, &slot.key))
                .map(Written::Created);
            // Resolved here, after the savepoint rolled back: this
            // transaction holds the write lock, so the winner is in view.
            let written = match written {
                Err(error) if is_unique_violation(&error) => {
                    resolve_in_transaction(c, &slot.plan, &slot.key)
                        .and_then(|found| found.ok_or(error))
                }
                other => other,
            };
            *result = Some(written.map_err(|error| WriteFailure::new(error, false)));
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

pub(super) fn batch_failed(why: BatchFailure) -> WriteFailure {
    let mut failure = WriteFailure::new(DieselError::QueryBuilderError(why.as_str().into()), false);
    failure.batch = Some(why);
    failure
}
