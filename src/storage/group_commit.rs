//! SQLite group commit. SQLite admits one writer at a time and every COMMIT
//! waits for an fsync (`synchronous=FULL`). Writers that arrive while another
//! commits queue here; the first of them to find no leader writes the whole
//! queue in one `BEGIN IMMEDIATE` transaction, each plan inside its own
//! SAVEPOINT, and commits once for all of them.
//!
//! Each request's outcome is its own: a unique violation rolls back only that
//! request's savepoint (its plan row with it) and comes back to it as a
//! conflict, resolved by lookups after the batch has committed, as always.
//! If the batch cannot begin, nothing was written and every request sees a
//! transient error; if its COMMIT fails, every request sees an unknown
//! outcome and settles it by re-reading, as a lone write would. The unique
//! indexes still decide every race; the queue only decides who writes when.

use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use diesel::result::Error as DieselError;
use diesel::{Connection, SqliteConnection};

use super::plans::{NewPlan, PlanRow, WriteFailure, insert_both_rows};

type WriteResult = Result<PlanRow, WriteFailure>;

/// One request's write, and its result once the batch is done.
struct Slot {
    plan: NewPlan,
    key: String,
    result: Mutex<Option<WriteResult>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Arc<Slot>>,
    leading: bool,
}

#[derive(Default)]
pub struct WriteQueue {
    queue: Mutex<Queue>,
    done: Condvar,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl WriteQueue {
    /// Writes `plan` and its key row, in a batch with whatever else is queued.
    /// `conn` writes the batch if this caller ends up leading it.
    pub fn write(&self, conn: &mut SqliteConnection, plan: &NewPlan, key: &str) -> WriteResult {
        let slot = Arc::new(Slot {
            plan: plan.clone(),
            key: key.to_owned(),
            result: Mutex::new(None),
        });
        let mut queue = lock(&self.queue);
        queue.waiting.push(Arc::clone(&slot));
        loop {
            if let Some(result) = lock(&slot.result).take() {
                return result;
            }
            if queue.leading {
                queue = self
                    .done
                    .wait(queue)
                    .unwrap_or_else(PoisonError::into_inner);
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
            let results = write_batch(conn, &batch.batch);
            for (slot, result) in batch.batch.iter().zip(results) {
                *lock(&slot.result) = Some(result);
            }
            drop(batch);
            queue = lock(&self.queue);
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
                *result = Some(Err(lost("the batch writer stopped before answering")));
            }
        }
        lock(&self.queue.queue).leading = false;
        self.queue.done.notify_all();
    }
}

fn write_batch(conn: &mut SqliteConnection, batch: &[Arc<Slot>]) -> Vec<WriteResult> {
    let mut results: Vec<Option<WriteResult>> = batch.iter().map(|_| None).collect();
    let body_done = Cell::new(false);
    let outcome = conn.immediate_transaction(|c| {
        for (slot, result) in batch.iter().zip(results.iter_mut()) {
            // A savepoint each: one plan's violation must not undo the others.
            let written = c.transaction(|c| insert_both_rows(c, &slot.plan, &slot.key));
            *result = Some(written.map_err(|error| WriteFailure {
                error,
                commit_sent: false,
            }));
        }
        body_done.set(true);
        Ok::<(), DieselError>(())
    });
    match outcome {
        Ok(()) => results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(lost("no result recorded"))))
            .collect(),
        // BEGIN failed (busy) or COMMIT failed: one error for every request.
        Err(error) => batch
            .iter()
            .map(|_| {
                Err(WriteFailure {
                    error: copy_error(&error),
                    commit_sent: body_done.get(),
                })
            })
            .collect(),
    }
}

/// diesel's errors are not `Clone`; keep what classification reads: the
/// kind and the server's message.
fn copy_error(error: &DieselError) -> DieselError {
    match error {
        DieselError::DatabaseError(kind, info) => {
            DieselError::DatabaseError(*kind, Box::new(info.message().to_owned()))
        }
        DieselError::BrokenTransactionManager => DieselError::BrokenTransactionManager,
        other => DieselError::QueryBuilderError(other.to_string().into()),
    }
}

fn lost(why: &str) -> WriteFailure {
    WriteFailure {
        error: DieselError::QueryBuilderError(why.into()),
        commit_sent: false,
    }
}
