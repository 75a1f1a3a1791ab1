//! Group commit. Every new plan alone costs a round trip (Postgres) or
//! an fsync (SQLite) and a commit; plans that arrive while writes are in
//! flight are written together instead: on Postgres one statement
//! (`plans::write_postgres_batch`), on SQLite one transaction
//! (`group_commit`), one commit for the batch, each plan with its own
//! outcome.
//!
//! Requests queue their plans here and wait for the answer, a blocked
//! thread or an awaiting task (no thread of its own). A few writer threads
//! (one on SQLite, which admits one writer) each take whatever is queued,
//! up to `max_batch` plans, write them on a pooled connection and answer
//! each: one thread hop per batch, not per plan. A lone plan is written at
//! once, so low load adds no latency; a batch forms only from what queued
//! meanwhile.
//!
//! Why this keeps the guarantee on Postgres (SQLite's: `group_commit`):
//! - a batch's new plans are written set-based (`plan_intake_write_batch`:
//!   one INSERT for their plans, one for their key rows, `ON CONFLICT DO
//!   NOTHING`, undone together if a key row met a conflict, `plans` locked
//!   before either); every other plan is `plan_intake_write` exactly as
//!   alone (login check, key read, both rows or neither, conflict
//!   resolution with fresh reads), after them in the batch's order, so the
//!   unique indexes still decide every race, and binding a key by its first
//!   answer is unchanged;
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

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, OnceLock, PoisonError};
use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};

use super::errors::{
    FailureClass, StorageError, TransientCause, classify, copy_error, marked_sqlstate,
};
use super::group_commit::{Entry, SqliteBatches, batch_failed};
use super::plans::{self, BatchEntry, BatchFailure, NewPlan, WriteFailure, Written};
use super::{DbConn, PooledConn};
use crate::deadline::Deadline;
use crate::metrics::BatchMetrics;

type WriteResult = Result<Written, WriteFailure>;

/// The most plans one SQLite batch holds: one transaction, one fsync.
pub const SQLITE_MAX_BATCH: usize = 64;
/// The most plans one Postgres batch may hold: each keeps up to two subtransaction
/// ids until its COMMIT, and a backend caches 64 (past them every snapshot
/// on the primary and its standbys slows down).
pub const MAX_PG_BATCH: usize = 31;
/// The default bound: half the subtransaction cache.
pub const DEFAULT_PG_BATCH: usize = 16;

/// How an idle writer thread checks whether its queue is gone.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// A plan with less time left than this is not sent: its locks could wait
/// a millisecond or two, and one that times out fails its whole batch.
pub(super) const TIME_TO_SEND: Duration = Duration::from_millis(20);

/// Gives a batch its connection, waiting no longer than the deadline.
pub type Connect = Box<dyn Fn(&Deadline) -> Result<PooledConn, StorageError> + Send + Sync>;

/// Where a queued plan's result goes: a blocked thread or an awaiting task.
enum Reply {
    Blocking(std::sync::mpsc::SyncSender<WriteResult>),
    Async(tokio::sync::oneshot::Sender<WriteResult>),
}

/// One request's write, and where its result goes.
struct Slot {
    plan: Arc<NewPlan>,
    key: String,
    token_hash: String,
    deadline: Deadline,
    reply: Mutex<Option<Reply>>,
}

impl Slot {
    /// Hands the result over; a receiver that stopped waiting (its request
    /// answered 503 at its deadline) is not an error.
    fn answer(&self, result: WriteResult) {
        match lock(&self.reply).take() {
            Some(Reply::Blocking(tx)) => {
                let _ = tx.try_send(result);
            }
            Some(Reply::Async(tx)) => {
                let _ = tx.send(result);
            }
            None => {}
        }
    }
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Arc<Slot>>,
    /// The queue's owner is gone: writer threads end.
    closed: bool,
    /// Test seam: no batch is taken until this many plans are queued.
    #[cfg(feature = "test-seams")]
    gather: usize,
}

/// What the writer threads share with the queue.
struct Shared {
    queue: Mutex<Queue>,
    /// Writers wait here for plans.
    arrived: Condvar,
    max_batch: usize,
    metrics: OnceLock<BatchMetrics>,
    connect: Connect,
    /// Called after a batch created plans (wakes the feed's readers).
    created: Box<dyn Fn() + Send + Sync>,
    /// Writes SQLite's batches.
    sqlite: Arc<SqliteBatches>,
}

/// The queue of plans waiting to be written, and its writer threads.
pub struct PlanQueue {
    shared: Arc<Shared>,
    writers: usize,
    started: Once,
    /// The writer threads, joined when the queue goes: their pool
    /// connections are then closed properly before the process ends.
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PlanQueue {
    /// `max_batch` plans at most per batch (at least one), written by
    /// `writers` threads (started at the first write), each batch on a
    /// connection from `connect` (a SQLite one by `sqlite`); `created` is
    /// called after every batch that created a plan.
    pub fn new(
        max_batch: usize,
        writers: usize,
        connect: Connect,
        created: Box<dyn Fn() + Send + Sync>,
        sqlite: Arc<SqliteBatches>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                queue: Mutex::default(),
                arrived: Condvar::new(),
                max_batch: max_batch.max(1),
                metrics: OnceLock::new(),
                connect,
                created,
                sqlite,
            }),
            writers: writers.max(1),
            started: Once::new(),
            threads: Mutex::default(),
        }
    }

    /// Where batches are counted (the service's metrics).
    pub fn observe(&self, metrics: BatchMetrics) {
        let _ = self.shared.metrics.set(metrics);
    }

    /// Test seam: the next batch is taken only once `plans` are queued (0:
    /// at once again), so a test can force one batch.
    #[cfg(feature = "test-seams")]
    pub fn gather(&self, plans: usize) {
        lock(&self.shared.queue).gather = plans;
        self.shared.arrived.notify_all();
    }

    /// Test seam: how many plans are queued, not yet in a batch.
    #[cfg(feature = "test-seams")]
    pub fn queued(&self) -> usize {
        lock(&self.shared.queue).waiting.len()
    }

    /// Writes `plan` and its key row for the caller whose token hashes to
    /// `token_hash`, in a batch with whatever else is queued; blocks until
    /// it is written, or leaves the queue unwritten at `deadline`.
    pub fn write(
        &self,
        plan: &Arc<NewPlan>,
        key: &str,
        token_hash: &str,
        deadline: &Deadline,
    ) -> WriteResult {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let slot = self.enqueue(plan, key, token_hash, deadline, Reply::Blocking(tx));
        match rx.recv_timeout(deadline.remaining()) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if self.leave(&slot) {
                    return Err(batch_failed(BatchFailure::NotWrittenInTime));
                }
                // Already in a batch: its answer comes with the batch (a
                // batch that ends without answering drops the slot, and so
                // the sender, with it).
                drop(slot);
                rx.recv()
                    .unwrap_or_else(|_| Err(batch_failed(BatchFailure::LeaderPanicked)))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err(batch_failed(BatchFailure::LeaderPanicked))
            }
        }
    }

    /// [`PlanQueue::write`] for an async caller: no thread waits for the
    /// batch. A caller that stops waiting (its deadline) leaves the plan
    /// queued; a writer drops it unwritten once its deadline has passed.
    pub async fn write_async(
        &self,
        plan: &Arc<NewPlan>,
        key: &str,
        token_hash: &str,
        deadline: &Deadline,
    ) -> WriteResult {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.enqueue(plan, key, token_hash, deadline, Reply::Async(tx));
        rx.await
            .unwrap_or_else(|_| Err(batch_failed(BatchFailure::LeaderPanicked)))
    }

    fn enqueue(
        &self,
        plan: &Arc<NewPlan>,
        key: &str,
        token_hash: &str,
        deadline: &Deadline,
        reply: Reply,
    ) -> Arc<Slot> {
        self.started.call_once(|| {
            for n in 0..self.writers {
                let shared = Arc::clone(&self.shared);
                let spawned = std::thread::Builder::new()
                    .name(format!("plan-intake-writer-{n}"))
                    .spawn(move || shared.run_writer());
                match spawned {
                    Ok(thread) => lock(&self.threads).push(thread),
                    Err(error) => tracing::error!(%error, "cannot start a writer thread"),
                }
            }
        });
        let slot = Arc::new(Slot {
            plan: Arc::clone(plan),
            key: key.to_owned(),
            token_hash: token_hash.to_owned(),
            deadline: *deadline,
            reply: Mutex::new(Some(reply)),
        });
        lock(&self.shared.queue)
            .waiting
            .push_back(Arc::clone(&slot));
        self.shared.arrived.notify_one();
        slot
    }

    /// Takes `slot` out of the queue if no batch has it yet.
    fn leave(&self, slot: &Arc<Slot>) -> bool {
        let mut queue = lock(&self.shared.queue);
        match queue.waiting.iter().position(|s| Arc::ptr_eq(s, slot)) {
            Some(at) => {
                queue.waiting.remove(at);
                true
            }
            None => false,
        }
    }
}

impl Drop for PlanQueue {
    fn drop(&mut self) {
        lock(&self.shared.queue).closed = true;
        self.shared.arrived.notify_all();
        // An idle writer ends at once; one writing ends with its batch.
        for thread in std::mem::take(&mut *lock(&self.threads)) {
            let _ = thread.join();
        }
    }
}

impl Shared {
    /// A writer thread: takes whatever is queued (up to the bound) as one
    /// batch, writes it, answers each plan, and again; ends with its queue.
    fn run_writer(&self) {
        loop {
            let Some(batch) = self.next_batch() else {
                return;
            };
            let written = catch_unwind(AssertUnwindSafe(|| self.write_batch(&batch)));
            match written {
                Ok(results) => {
                    // Readers waiting on the feed are woken here, whether or
                    // not the plans' requests are still waiting.
                    if results
                        .iter()
                        .any(|r| matches!(r, Some(Ok(Written::Created(_)))))
                    {
                        (self.created)();
                    }
                    // `None`: answered already (SQLite answers what reads
                    // settle before it writes the rest).
                    for (slot, result) in batch.iter().zip(results) {
                        if let Some(result) = result {
                            slot.answer(result);
                        }
                    }
                }
                Err(_) => {
                    // The statement may have committed before the panic:
                    // each plan is settled by its own re-read.
                    tracing::error!(
                        plans = batch.len(),
                        "a write batch panicked; each plan is re-read"
                    );
                    for slot in &batch {
                        slot.answer(Err(outcome_unknown(DieselError::QueryBuilderError(
                            "the write batch panicked".into(),
                        ))));
                    }
                }
            }
        }
    }

    /// The next batch: the plans queued first, those whose deadline passed
    /// answered and left out (looked at whenever a writer wakes, at least
    /// every `IDLE_CHECK`). `None` once the queue is closed.
    fn next_batch(&self) -> Option<Vec<Arc<Slot>>> {
        let mut queue = lock(&self.queue);
        loop {
            if queue.closed {
                return None;
            }
            // A plan whose deadline passed (or nearly) while queued is
            // never sent.
            queue.waiting.retain(|slot| {
                let late = slot.deadline.remaining() < TIME_TO_SEND;
                if late {
                    slot.answer(Err(batch_failed(BatchFailure::NotWrittenInTime)));
                }
                !late
            });
            if !queue.waiting.is_empty() && !gathering(&mut queue) {
                let take = self.max_batch.min(queue.waiting.len());
                let batch: Vec<_> = queue.waiting.drain(..take).collect();
                // More queued than this batch takes: another writer starts.
                if !queue.waiting.is_empty() {
                    self.arrived.notify_one();
                }
                return Some(batch);
            }
            queue = self
                .arrived
                .wait_timeout(queue, IDLE_CHECK)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Writes one batch on a connection of its own: every plan's answer,
    /// or `None` where it was answered already.
    fn write_batch(&self, batch: &[Arc<Slot>]) -> Vec<Option<WriteResult>> {
        if let Some(metrics) = self.metrics.get() {
            metrics.sizes.observe(batch.len() as f64);
        }
        // The batch waits for a connection no longer than its most urgent
        // plan may.
        let Some(earliest) = batch
            .iter()
            .map(|s| s.deadline)
            .min_by_key(Deadline::remaining)
        else {
            return Vec::new();
        };
        let mut conn = match (self.connect)(&earliest) {
            Ok(conn) => conn,
            Err(error) => {
                tracing::warn!(plans = batch.len(), %error, "no connection for a write batch");
                return batch
                    .iter()
                    .map(|slot| {
                        Some(Err(batch_failed(if slot.deadline.passed() {
                            BatchFailure::NotWrittenInTime
                        } else {
                            BatchFailure::NoConnection
                        })))
                    })
                    .collect();
            }
        };
        let pg = match &mut *conn {
            DbConn::Postgres(pg) => pg,
            DbConn::Sqlite(lite) => {
                let entries: Vec<Entry<'_>> = batch
                    .iter()
                    .map(|slot| Entry {
                        plan: &slot.plan,
                        key: &slot.key,
                        token_hash: Some(&slot.token_hash),
                        deadline: slot.deadline,
                    })
                    .collect();
                // A refusal or a replay settled by reads is answered at
                // once, before the batch waits for the write lock. A panic
                // anywhere in it writes nothing that is not rolled back:
                // each plan not yet answered gets 503 (counted), not a
                // re-read.
                let early = |at: usize, result: WriteResult| batch[at].answer(result);
                return match catch_unwind(AssertUnwindSafe(|| {
                    self.sqlite.write(lite, &entries, &early)
                })) {
                    Ok(results) => results,
                    Err(_) => {
                        tracing::error!(
                            plans = batch.len(),
                            "the SQLite batch's writer panicked; its batch is abandoned"
                        );
                        batch
                            .iter()
                            .map(|_| Some(Err(batch_failed(BatchFailure::LeaderPanicked))))
                            .collect()
                    }
                };
            }
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
        results.into_iter().map(Some).collect()
    }
}

#[cfg(feature = "test-seams")]
fn gathering(queue: &mut Queue) -> bool {
    if queue.gather == 0 {
        return false;
    }
    if queue.waiting.len() >= queue.gather {
        queue.gather = 0;
        return false;
    }
    true
}

#[cfg(not(feature = "test-seams"))]
fn gathering(_queue: &mut Queue) -> bool {
    false
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
    // Only an error the server raised proves the statement rolled back;
    // one after its answer came (rows that cannot be read) may follow a
    // commit: each plan then settles by its own re-read.
    let refused_by_server = !failure.connection_lost
        && matches!(
            &failure.error,
            DieselError::DatabaseError(kind, _)
                if !matches!(
                    kind,
                    DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand
                )
        );
    if !refused_by_server {
        tracing::warn!(plans = batch.len(), error = %failure.error, "a write batch's outcome is unknown; each plan is re-read");
        return batch
            .iter()
            .map(|_| Err(outcome_unknown(copy_error(&failure.error))))
            .collect();
    }
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

/// A failure whose statement may have committed: classified as an unknown
/// outcome, so the request settles it by its whole-row re-read.
fn outcome_unknown(error: DieselError) -> WriteFailure {
    let mut failure = WriteFailure::new(error, true);
    failure.connection_lost = true;
    failure
}

fn is_read_only(failure: &WriteFailure) -> bool {
    classify(&failure.error, failure.commit_sent, failure.connection_lost)
        == FailureClass::Transient(TransientCause::ReadOnlyNode)
}
