//! The replication barrier: proof that what this instance has read is on
//! the synchronous standby too, before it is acknowledged.
//!
//! A commit that waits for a synchronous standby and is cancelled or
//! terminated meanwhile stays committed on the primary, visible to every
//! reader, though the standby may never get it: a failover then loses it.
//! Its writer cannot tell (a terminated backend answers nothing), and a
//! replay that reads the plan later cannot either. What it can do is make
//! a commit of its own and wait for it: a commit that assigned an xid and
//! wrote WAL returns only once the standby has flushed the WAL up to its
//! commit record, and so everything committed before it began.
//!
//! One thread per instance makes such commits on demand, on a connection
//! of its own: `BEGIN; SELECT pg_logical_emit_message(true, …); COMMIT` (a
//! transactional WAL message: an xid and a WAL record, no table, no lock,
//! any role may call it). A caller that needs the proof asks for a round
//! that *begins* after its read and waits for it; every caller asking while
//! a round is on its way shares the next one, so under any load there is at
//! most one barrier commit in flight per instance, and none when nobody
//! asks. Where acknowledged commits do not wait for a standby at all
//! (`Durability::waits_for_standby`), nobody waits.
//!
//! A stalled standby stalls the round; callers give up at their deadline
//! (503: retry with the same key), never acknowledging meanwhile. A round
//! that fails (its connection dies at a restart or failover of the
//! primary) is begun again on a new connection every `RECONNECT` while
//! anyone waits: once the primary answers again, a caller's wait is at most
//! two rounds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use diesel::{Connection, PgConnection, RunQueryDsl};

use super::{Durability, StorageError};
use crate::deadline::Deadline;

/// How long the barrier thread sleeps with nothing asked before it checks
/// whether its database is gone.
const IDLE: Duration = Duration::from_secs(1);
/// How long it waits before connecting again after a failure.
const RECONNECT: Duration = Duration::from_millis(100);

/// Rounds are numbered from 1; a round counts once its commit returned.
#[derive(Default)]
struct Rounds {
    /// The last round begun.
    begun: u64,
    /// The last round whose commit returned.
    done: u64,
    /// The highest round anyone waits for.
    wanted: u64,
    /// Callers waiting now: a failed round is begun again while any do.
    waiting: usize,
}

struct Shared {
    rounds: Mutex<Rounds>,
    changed: Condvar,
    /// Whether acknowledged commits wait for a synchronous standby now (as
    /// of the last look: at open, every round, every readiness check).
    commits_wait: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Rounds> {
        self.rounds.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Clone)]
pub struct ReplicationBarrier {
    shared: Arc<Shared>,
}

impl ReplicationBarrier {
    /// Starts the barrier thread for the Postgres at `url`; `durability` is
    /// what the database said at open.
    pub fn start(url: String, durability: &Durability) -> Self {
        let shared = Arc::new(Shared {
            rounds: Mutex::default(),
            changed: Condvar::new(),
            commits_wait: AtomicBool::new(durability.waits_for_standby()),
        });
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("replication-barrier".to_owned())
            .spawn(move || barrier_rounds(&weak, &url))
            .map(|_| ())
            .unwrap_or_else(
                |e| tracing::error!(error = %e, "cannot start the replication barrier"),
            );
        Self { shared }
    }

    /// What a readiness check found.
    pub fn observe(&self, durability: &Durability) {
        self.shared
            .commits_wait
            .store(durability.waits_for_standby(), Ordering::Relaxed);
    }

    /// Callers waiting for a barrier round now.
    pub fn waiting(&self) -> usize {
        self.shared.lock().waiting
    }

    /// Whether [`ReplicationBarrier::wait`] waits at all now (commits wait
    /// for a synchronous standby).
    pub fn waits(&self) -> bool {
        self.shared.commits_wait.load(Ordering::Relaxed)
    }

    /// Returns once every commit visible to a read made before this call is
    /// on the synchronous standby: a barrier round begun after the call has
    /// returned. At once when commits do not wait for a standby.
    pub fn wait(&self, deadline: &Deadline) -> Result<(), StorageError> {
        if !self.shared.commits_wait.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut rounds = self.shared.lock();
        let target = rounds.begun + 1;
        rounds.wanted = rounds.wanted.max(target);
        rounds.waiting += 1;
        self.shared.changed.notify_all();
        let outcome = loop {
            if rounds.done >= target {
                break Ok(());
            }
            let left = deadline.remaining();
            if left.is_zero() {
                break Err(StorageError::DeadlineExceeded(
                    "waiting for the synchronous standby to confirm the plan",
                ));
            }
            rounds = self
                .shared
                .changed
                .wait_timeout(rounds, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        rounds.waiting -= 1;
        outcome
    }
}

/// The barrier thread: a round whenever one is wanted, until the barrier is
/// dropped.
fn barrier_rounds(shared: &Weak<Shared>, url: &str) {
    let mut conn: Option<PgConnection> = None;
    loop {
        let Some(round) = next_round(shared) else {
            return;
        };
        let committed = commit_barrier(&mut conn, url);
        let Some(strong) = shared.upgrade() else {
            return;
        };
        match committed {
            Ok(durability) => {
                strong
                    .commits_wait
                    .store(durability.waits_for_standby(), Ordering::Relaxed);
                strong.lock().done = round;
                strong.changed.notify_all();
            }
            Err(error) => {
                // The round did not count: it is begun again, on a new
                // connection (after a failover, to the new primary), for as
                // long as anyone still waits for it.
                tracing::warn!(%error, "replication barrier failed; connecting again");
                conn = None;
                {
                    let mut rounds = strong.lock();
                    rounds.begun = rounds.done;
                }
                drop(strong);
                std::thread::sleep(RECONNECT);
            }
        }
    }
}

/// Waits until a round is wanted by someone still waiting and begins it;
/// `None` once the barrier is gone. A round begun now begins after the read
/// of everyone who has asked so far, so it is every wanted round at once.
fn next_round(shared: &Weak<Shared>) -> Option<u64> {
    loop {
        let strong = shared.upgrade()?;
        let mut rounds = strong.lock();
        if rounds.wanted > rounds.begun && rounds.waiting == 0 {
            // Everyone who wanted it gave up (a failed round, deadlines
            // passed): nothing to prove to anyone.
            rounds.wanted = rounds.begun;
        }
        if rounds.wanted > rounds.begun {
            rounds.begun = rounds.wanted;
            return Some(rounds.begun);
        }
        // Let go of the barrier now and then, so that its drop ends us.
        let _ = strong
            .changed
            .wait_timeout(rounds, IDLE)
            .unwrap_or_else(PoisonError::into_inner);
    }
}

#[derive(diesel::QueryableByName)]
struct CommitSettings {
    #[diesel(sql_type = diesel::sql_types::Text)]
    synchronous_standby_names: String,
    #[diesel(sql_type = diesel::sql_types::Text)]
    synchronous_commit: String,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    attached: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    state_visible: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    synchronous: i64,
}

/// The settings that decide whether this session's COMMIT waits for a
/// standby; with `barrier`, in the same statement, a transactional WAL
/// message that makes the enclosing transaction's commit wait too.
pub(super) fn commit_durability(
    pg: &mut PgConnection,
    barrier: bool,
) -> diesel::QueryResult<Durability> {
    let message = if barrier {
        ", pg_logical_emit_message(true, 'plan-intake', 'replication barrier') AS lsn"
    } else {
        ""
    };
    let settings: CommitSettings = diesel::sql_query(format!(
        "SELECT current_setting('synchronous_standby_names') AS synchronous_standby_names, \
                current_setting('synchronous_commit') AS synchronous_commit, \
                r.attached, r.state_visible, r.synchronous{message} \
           FROM (SELECT count(*) AS attached, count(sync_state) AS state_visible, \
                        count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) AS synchronous \
                   FROM pg_stat_replication) r"
    ))
    .get_result(pg)?;
    Ok(Durability::Postgres {
        synchronous_standby_names: settings.synchronous_standby_names,
        synchronous_commit: settings.synchronous_commit,
        standbys: super::Standbys {
            attached: settings.attached,
            state_visible: settings.state_visible,
            synchronous: settings.synchronous,
        },
    })
}

/// The barrier's sessions go by a name of their own in `pg_stat_activity`
/// (unless the URL names its sessions already), so an operator can tell
/// them from the pool's.
const APPLICATION_NAME: &str = "plan-intake-replication-barrier";

fn named(url: &str) -> String {
    let query = url.split_once('?').map_or("", |(_, query)| query);
    if query
        .split('&')
        .any(|pair| pair.starts_with("application_name="))
    {
        return url.to_owned();
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={APPLICATION_NAME}")
}

/// One barrier commit; what it found the commit settings to be.
fn commit_barrier(conn: &mut Option<PgConnection>, url: &str) -> Result<Durability, StorageError> {
    if conn.is_none() {
        *conn = Some(
            PgConnection::establish(&super::pool::with_libpq_defaults(&named(url)))
                .map_err(|e| StorageError::unavailable("replication barrier connection", e))?,
        );
    }
    let Some(pg) = conn.as_mut() else {
        return Err(StorageError::Config("no barrier connection".to_owned()));
    };
    Ok(pg.transaction(|pg| commit_durability(pg, true))?)
}
