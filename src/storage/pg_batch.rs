//! Postgres group commit. Every new plan alone costs a round trip and a
//! commit; plans that arrive while writes are in flight are written
//! together instead: one statement (`plans::write_postgres_batch`), one
//! round trip, one commit for the batch, each plan with its own outcome.
//!
//! Writers queue here. While fewer than `writers` batches are in flight,
//! a writer that finds plans queued takes up to `max_batch` of them (its
//! own among them when it was first) and writes them on a pooled
//! connection; the others wait for their answers. A lone plan is written at
//! once, with the single statement, so low load adds no latency.
//!
//! Why this keeps the guarantee:
//! - each plan is `plan_intake_write` exactly as alone (login check, key
//!   read, both rows or neither, conflict resolution with fresh reads), so
//!   the unique indexes still decide every race, and the order of
//!   resolution and binding a key by its first answer are unchanged;
//! - plans are written in the order of their conflict keys (maker, run,
//!   content hash, key), so two batches that share plans take their index
//!   locks in the same order; later plans see earlier ones of the same
//!   transaction, so duplicates in one batch settle as if sent one after
//!   the other;
//! - the statement commits itself: an error no call resolves fails all of
//!   it and nothing lands; such an error (a CHECK, a lock timeout, a
//!   deadlock) sends the batch's plans again one by one, so the guilty plan
//!   gets its own answer and the others land. A lost connection leaves
//!   every plan's outcome unknown, settled by each request's own whole-row
//!   re-read, as for a single write;
//! - a writer whose deadline passes while queued leaves unwritten.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

use super::errors::{
    FailureClass, StorageError, TransientCause, classify, copy_error, marked_sqlstate,
};
use super::group_commit::batch_failed;
use super::plans::{self, BatchEntry, BatchFailure, NewPlan, WriteFailure, Written};
use super::{DbConn, PooledConn};
use crate::deadline::Deadline;

type WriteResult = Result<Written, WriteFailure>;

/// The most plans one batch may hold: each keeps up to two subtransaction
/// ids until its COMMIT, and a backend caches 64 (past them every snapshot
/// on the primary and its standbys slows down).
pub const MAX_PG_BATCH: usize = 31;
/// The default bound: half the subtransaction cache.
pub const DEFAULT_PG_BATCH: usize = 16;

/// One request's write, and its result once a batch has written it.
struct Slot {
    plan: NewPlan,
    key: String,
    token_hash: String,
    deadline: Deadline,
    result: Mutex<Option<WriteResult>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Arc<Slot>>,
    /// Batches being written now.
    writing: usize,
    /// Test seam: no batch is taken until this many plans are queued.
    #[cfg(feature = "test-seams")]
    gather: usize,
}

pub struct PgWriteQueue {
    queue: Mutex<Queue>,
    done: Condvar,
    max_batch: usize,
    writers: usize,
    metrics: OnceLock<BatchMetrics>,
}

/// Where the queue reports: each batch's size, and each batch a failure
/// split into plans written one by one.
pub struct BatchMetrics {
    pub sizes: prometheus::Histogram,
    pub split: prometheus::IntCounter,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PgWriteQueue {
    /// `max_batch` plans at most per batch (1..=`MAX_PG_BATCH`), at most
    /// `writers` batches in flight at once.
    pub fn new(max_batch: usize, writers: usize) -> Self {
        Self {
            queue: Mutex::default(),
            done: Condvar::new(),
            max_batch: max_batch.clamp(1, MAX_PG_BATCH),
            writers: writers.max(1),
            metrics: OnceLock::new(),
        }
    }

    /// Where batches are counted (the service's metrics).
    pub fn observe(&self, metrics: BatchMetrics) {
        let _ = self.metrics.set(metrics);
    }

    /// Test seam: the next batch is taken only once `plans` are queued (0:
    /// at once again), so a test can force one batch.
    #[cfg(feature = "test-seams")]
    pub fn gather(&self, plans: usize) {
        lock(&self.queue).gather = plans;
    }

    /// Test seam: how many writers are queued, not yet in a batch.
    #[cfg(feature = "test-seams")]
    pub fn queued(&self) -> usize {
        lock(&self.queue).waiting.len()
    }

    #[cfg(feature = "test-seams")]
    fn gathering(queue: &mut Queue) -> bool {
        if queue.gather == 0 {
            return false;
        }
        let first_ran_out = queue
            .waiting
            .first()
            .is_some_and(|s| s.deadline.nearly_passed());
        if queue.waiting.len() >= queue.gather || first_ran_out {
            queue.gather = 0;
            return false;
        }
        true
    }

    #[cfg(not(feature = "test-seams"))]
    fn gathering(_queue: &mut Queue) -> bool {
        false
    }

    /// Writes `plan` and its key row for the caller whose token hashes to
    /// `token_hash`, in a batch with whatever else is queued; `connect`
    /// gives a batch its connection.
    pub fn write(
        &self,
        plan: &NewPlan,
        key: &str,
        token_hash: &str,
        deadline: &Deadline,
        connect: &dyn Fn(&Deadline) -> Result<PooledConn, StorageError>,
    ) -> WriteResult {
        let slot = Arc::new(Slot {
            plan: plan.clone(),
            key: key.to_owned(),
            token_hash: token_hash.to_owned(),
            deadline: *deadline,
            result: Mutex::new(None),
        });
        let mut queue = lock(&self.queue);
        queue.waiting.push(Arc::clone(&slot));
        loop {
            if let Some(result) = lock(&slot.result).take() {
                return result;
            }
            let queued_at = queue.waiting.iter().position(|s| Arc::ptr_eq(s, &slot));
            if let Some(at) = queued_at
                && slot.deadline.passed()
            {
                queue.waiting.remove(at);
                return Err(batch_failed(BatchFailure::NotWrittenInTime));
            }
            if queue.writing < self.writers
                && !queue.waiting.is_empty()
                && !Self::gathering(&mut queue)
            {
                queue.writing += 1;
                let take = queue.waiting.len().min(self.max_batch);
                let batch = Writing {
                    queue: self,
                    batch: queue.waiting.drain(..take).collect(),
                };
                drop(queue);
                let results = self.write_batch(&batch.batch, connect);
                for (slot, result) in batch.batch.iter().zip(results) {
                    *lock(&slot.result) = Some(result);
                }
                drop(batch);
                queue = lock(&self.queue);
                continue;
            }
            // Woken when a batch ends; a writer still queued wakes at its
            // deadline to leave.
            let left = slot
                .deadline
                .remaining()
                .max(std::time::Duration::from_millis(1));
            queue = self
                .done
                .wait_timeout(queue, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Writes one batch on a connection of its own: every writer answered.
    fn write_batch(
        &self,
        batch: &[Arc<Slot>],
        connect: &dyn Fn(&Deadline) -> Result<PooledConn, StorageError>,
    ) -> Vec<WriteResult> {
        if let Some(metrics) = self.metrics.get() {
            metrics.sizes.observe(batch.len() as f64);
        }
        // The batch waits for a connection no longer than its most urgent
        // writer may.
        let Some(earliest) = batch
            .iter()
            .map(|s| s.deadline)
            .min_by_key(Deadline::remaining)
        else {
            return Vec::new();
        };
        let mut conn = match connect(&earliest) {
            Ok(conn) => conn,
            Err(error) => {
                tracing::warn!(plans = batch.len(), %error, "no connection for a write batch");
                return batch
                    .iter()
                    .map(|slot| {
                        Err(batch_failed(if slot.deadline.passed() {
                            BatchFailure::NotWrittenInTime
                        } else {
                            BatchFailure::NoConnection
                        }))
                    })
                    .collect();
            }
        };
        let DbConn::Postgres(pg) = &mut *conn else {
            return batch
                .iter()
                .map(|_| Err(batch_failed(BatchFailure::NoConnection)))
                .collect();
        };
        let results = if let [slot] = batch {
            vec![write_one(pg, slot)]
        } else {
            write_many(pg, batch, self.metrics.get().map(|m| &m.split))
        };
        // Only a new connection finds the primary again.
        if results.iter().any(|r| r.as_ref().is_err_and(is_read_only)) {
            super::discard(&mut conn);
        }
        results
    }
}

fn write_one(pg: &mut diesel::PgConnection, slot: &Slot) -> WriteResult {
    if slot.deadline.passed() {
        return Err(batch_failed(BatchFailure::NotWrittenInTime));
    }
    plans::write_postgres(
        pg,
        &slot.plan,
        &slot.key,
        &slot.token_hash,
        slot.deadline.wait_budget_ms(),
    )
}

/// Several plans in one statement, in the order of their conflict keys; if
/// the statement fails for a reason that is not the connection's, each plan
/// is written again on its own.
fn write_many(
    pg: &mut diesel::PgConnection,
    batch: &[Arc<Slot>],
    split: Option<&prometheus::IntCounter>,
) -> Vec<WriteResult> {
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |s: &Slot| {
            (
                s.plan.maker.clone(),
                s.plan.run_id.clone(),
                s.plan.content_hash.clone(),
                s.key.clone(),
            )
        };
        key(&batch[a]).cmp(&key(&batch[b]))
    });
    let entries: Vec<BatchEntry<'_>> = order
        .iter()
        .map(|&at| {
            let slot = &batch[at];
            BatchEntry {
                plan: &slot.plan,
                idempotency_key: &slot.key,
                token_hash: &slot.token_hash,
                lock_timeout_ms: slot.deadline.wait_budget_ms(),
            }
        })
        .collect();
    let failure = match plans::write_postgres_batch(pg, &entries) {
        Ok(written) => {
            let mut results: Vec<Option<WriteResult>> = batch.iter().map(|_| None).collect();
            for (&at, written) in order.iter().zip(written) {
                results[at] = Some(Ok(written));
            }
            return results
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(batch_failed(BatchFailure::NoConnection))))
                .collect();
        }
        Err(failure) => failure,
    };
    let class = classify(&failure.error, failure.commit_sent, failure.connection_lost);
    let shared = matches!(
        class,
        FailureClass::UnknownOutcome
            | FailureClass::Transient(
                TransientCause::ConnectionLost | TransientCause::ReadOnlyNode
            )
    );
    if shared {
        // The connection (or the server's role) failed every plan alike:
        // each request settles it as it would alone (a re-read of its own
        // row after an unknown commit).
        tracing::warn!(plans = batch.len(), error = %failure.error, "a write batch failed as a whole");
        return batch
            .iter()
            .map(|_| {
                let mut copy = WriteFailure::new(copy_error(&failure.error), failure.commit_sent);
                copy.connection_lost = failure.connection_lost;
                Err(copy)
            })
            .collect();
    }
    if let Some(split) = split {
        split.inc();
    }
    tracing::info!(plans = batch.len(), sqlstate = marked_sqlstate(&failure.error), error = %failure.error, "a write batch failed; writing its plans one by one");
    order_preserving_one_by_one(pg, batch, &order)
}

/// Each plan alone, in the batch's lock order; answers in the batch's order.
fn order_preserving_one_by_one(
    pg: &mut diesel::PgConnection,
    batch: &[Arc<Slot>],
    order: &[usize],
) -> Vec<WriteResult> {
    let mut results: Vec<Option<WriteResult>> = batch.iter().map(|_| None).collect();
    for &at in order {
        results[at] = Some(write_one(pg, &batch[at]));
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(batch_failed(BatchFailure::NoConnection))))
        .collect()
}

fn is_read_only(failure: &WriteFailure) -> bool {
    classify(&failure.error, failure.commit_sent, failure.connection_lost)
        == FailureClass::Transient(TransientCause::ReadOnlyNode)
}

/// A batch being written. Dropped, even by a panic, it answers every writer
/// still unanswered and frees its place, so no writer waits forever.
struct Writing<'a> {
    queue: &'a PgWriteQueue,
    batch: Vec<Arc<Slot>>,
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        for slot in &self.batch {
            let mut result = lock(&slot.result);
            if result.is_none() {
                *result = Some(Err(batch_failed(BatchFailure::LeaderPanicked)));
            }
        }
        lock(&self.queue.queue).writing -= 1;
        self.queue.done.notify_all();
    }
}
