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
//! A barrier commit can be fooled the same way: cancelled while it waits,
//! it returns as committed. Its session alone is told, by a WARNING, so
//! the barrier's connection is libpq's own with its notices read (diesel
//! drops them), and a round whose COMMIT was told a warning does not
//! count. And a round proves nothing about a read made on a primary that
//! has been failed over since: a caller whose request began before a
//! round first found the primary on a new timeline (a promotion; a
//! restart keeps the timeline, and the data) is refused, as is one whose
//! request began before commits stopped waiting for a standby (503: retry
//! with the same key; the retry reads again on the primary there is now).
//!
//! Every acknowledgement waits for a round where commits wait for a
//! standby, a new plan's too: its own COMMIT may have been such a
//! cancelled one.
//!
//! A stalled standby stalls the round; callers give up at their deadline
//! (503: retry with the same key), never acknowledging meanwhile. A round
//! that fails (its connection dies at a restart or failover of the
//! primary) is begun again on a new connection every `RECONNECT` while
//! anyone waits: once the primary answers again, a caller's wait is at most
//! two rounds.

use std::ffi::{CStr, CString, c_int, c_void};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use diesel::{PgConnection, RunQueryDsl};

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
    /// When commits were last found no longer waiting for a standby (a
    /// failover to a node that has none, or the settings changed): what a
    /// request read before then, a round can no longer prove.
    stopped_waiting_at: Option<Instant>,
    /// The primary's timeline as the last round found it (the first 8
    /// hex digits of its WAL file's name), and when a round first found
    /// another: a promotion begins a new one, a restart does not.
    timeline: Option<String>,
    timeline_changed_at: Option<Instant>,
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

    /// Whether commits wait for a standby, as just found; when they stop,
    /// when is kept.
    fn commits_wait_now(&self, wait: bool) {
        if self.commits_wait.swap(wait, Ordering::SeqCst) && !wait {
            self.lock().stopped_waiting_at = Some(Instant::now());
        }
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
        self.shared.commits_wait_now(durability.waits_for_standby());
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
        if !self.shared.commits_wait.load(Ordering::SeqCst) {
            // Nothing to wait for, unless this request read while commits
            // still waited: a cancelled wait of then is unproven.
            let stopped = self.shared.lock().stopped_waiting_at;
            if stopped.is_some_and(|at| at >= deadline.made()) {
                return Err(StorageError::Unavailable {
                    what: "commits stopped waiting for a standby while this request was answered (a failover, or the settings changed): what it read may not have reached one; retry".to_owned(),
                    source: None,
                });
            }
            return Ok(());
        }
        let mut rounds = self.shared.lock();
        let target = rounds.begun + 1;
        rounds.wanted = rounds.wanted.max(target);
        rounds.waiting += 1;
        self.shared.changed.notify_all();
        let outcome = loop {
            if rounds.done >= target {
                if rounds
                    .timeline_changed_at
                    .is_some_and(|at| at >= deadline.made())
                {
                    break Err(StorageError::Unavailable {
                        what: "the primary failed over while this request was answered: what it read may not be on the new primary; retry".to_owned(),
                        source: None,
                    });
                }
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
    let mut conn: Option<BarrierConn> = None;
    // Where commits wait for a standby, a first round, asked by nobody,
    // learns the primary's timeline before any request could need it
    // (until a round finds one, the first that does counts as a change).
    // Nowhere else: nothing is committed that nobody needs.
    let commits_wait = shared
        .upgrade()
        .is_some_and(|strong| strong.commits_wait.load(Ordering::SeqCst));
    if commits_wait {
        match commit_barrier(&mut conn, url) {
            Ok((_, timeline)) => {
                if let Some(strong) = shared.upgrade() {
                    strong.lock().timeline = Some(timeline);
                }
            }
            // Begun again, on a new connection, by the first round asked for.
            Err(_) => conn = None,
        }
    }
    loop {
        let Some(round) = next_round(shared) else {
            return;
        };
        let committed = commit_barrier(&mut conn, url);
        let Some(strong) = shared.upgrade() else {
            return;
        };
        match committed {
            Ok((durability, timeline)) => {
                strong.commits_wait_now(durability.waits_for_standby());
                let mut rounds = strong.lock();
                let changed = rounds.timeline.as_ref() != Some(&timeline);
                if changed {
                    rounds.timeline_changed_at = Some(Instant::now());
                }
                rounds.timeline = Some(timeline.clone());
                rounds.done = round;
                drop(rounds);
                strong.changed.notify_all();
                if changed {
                    tracing::warn!(timeline = %timeline, "the primary is on a timeline the barrier has not seen (a failover, or the first round failed): answers whose requests began before it are refused (503)");
                }
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

/// The settings that decide whether a session's COMMIT waits for a
/// standby, in this column order; with `barrier`, in the same statement, a
/// transactional WAL message that makes the enclosing transaction's commit
/// wait too.
fn durability_query(barrier: bool) -> String {
    let message = if barrier {
        ", pg_logical_emit_message(true, 'plan-intake', 'replication barrier') AS lsn, \
           substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS timeline"
    } else {
        ""
    };
    format!(
        "SELECT current_setting('synchronous_standby_names') AS synchronous_standby_names, \
                current_setting('synchronous_commit') AS synchronous_commit, \
                r.attached, r.state_visible, r.synchronous{message} \
           FROM (SELECT count(*) AS attached, count(sync_state) AS state_visible, \
                        count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')) AS synchronous \
                   FROM pg_stat_replication) r"
    )
}

impl From<CommitSettings> for Durability {
    fn from(settings: CommitSettings) -> Self {
        Durability::Postgres {
            synchronous_standby_names: settings.synchronous_standby_names,
            synchronous_commit: settings.synchronous_commit,
            standbys: super::Standbys {
                attached: settings.attached,
                state_visible: settings.state_visible,
                synchronous: settings.synchronous,
            },
        }
    }
}

/// The settings that decide whether this session's COMMIT waits for a
/// standby.
pub(super) fn commit_durability(pg: &mut PgConnection) -> diesel::QueryResult<Durability> {
    let settings: CommitSettings = diesel::sql_query(durability_query(false)).get_result(pg)?;
    Ok(settings.into())
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

/// One barrier commit; what it found the commit settings to be, and the
/// primary's timeline. A COMMIT told a warning (its wait for the standby
/// cancelled) is a failed round.
fn commit_barrier(
    conn: &mut Option<BarrierConn>,
    url: &str,
) -> Result<(Durability, String), StorageError> {
    let failed = |what: &str, said: String| StorageError::Unavailable {
        what: format!("replication barrier: {what}: {said}"),
        source: None,
    };
    if conn.is_none() {
        *conn = Some(
            BarrierConn::connect(&super::pool::with_libpq_defaults(&named(url)))
                .map_err(|said| failed("connecting", said))?,
        );
    }
    let Some(pg) = conn.as_mut() else {
        return Err(StorageError::Config("no barrier connection".to_owned()));
    };
    // A role's or database's `client_min_messages = error` would keep the
    // warning from being sent (and behind a pooler another client's SET
    // could): for this transaction, warnings are told.
    pg.exec("BEGIN")
        .and_then(|_| pg.exec("SET LOCAL client_min_messages = warning"))
        .map_err(|said| failed("BEGIN", said))?;
    let row = pg
        .exec(&durability_query(true))
        .map_err(|said| failed("the barrier's message", said))?;
    pg.warnings().store(0, Ordering::SeqCst);
    pg.exec("COMMIT").map_err(|said| failed("COMMIT", said))?;
    if pg.warnings().load(Ordering::SeqCst) > 0 {
        return Err(failed(
            "COMMIT",
            "told a warning (its wait for the synchronous standby cancelled): it proves nothing"
                .to_owned(),
        ));
    }
    let text = |i: usize| {
        row.get(i)
            .cloned()
            .flatten()
            .ok_or_else(|| failed("the barrier's message", format!("no column {i}")))
    };
    let number = |i: usize| {
        text(i)?
            .parse::<i64>()
            .map_err(|e| failed("the barrier's message", format!("column {i}: {e}")))
    };
    let settings = CommitSettings {
        synchronous_standby_names: text(0)?,
        synchronous_commit: text(1)?,
        attached: number(2)?,
        state_visible: number(3)?,
        synchronous: number(4)?,
    };
    let timeline = text(6)?;
    if timeline.len() != 8 {
        return Err(failed("the timeline", timeline));
    }
    Ok((settings.into(), timeline))
}

/// The barrier's connection: libpq's own, as diesel's are, with its
/// notices counted (diesel drops them): a COMMIT whose wait for the
/// standby was cancelled returns as committed, with a WARNING.
struct BarrierConn {
    conn: NonNull<pq_sys::PGconn>,
    /// WARNINGs told since last set to 0: a box's raw pointer, which libpq
    /// holds, freed after the connection.
    warnings: NonNull<AtomicUsize>,
}

impl BarrierConn {
    fn connect(url: &str) -> Result<Self, String> {
        let info = CString::new(url).map_err(|_| "the URL holds a NUL byte".to_owned())?;
        // SAFETY: PQconnectdb copies the string it is given; the connection
        // it returns is freed once, by Drop.
        let raw = unsafe { pq_sys::PQconnectdb(info.as_ptr()) };
        let conn = NonNull::new(raw).ok_or("libpq could not make a connection")?;
        let this = Self {
            conn,
            warnings: NonNull::from(Box::leak(Box::new(AtomicUsize::new(0)))),
        };
        // SAFETY: a connection PQconnectdb returned.
        if unsafe { pq_sys::PQstatus(this.conn.as_ptr()) } != pq_sys::ConnStatusType::CONNECTION_OK
        {
            return Err(this.error_message());
        }
        // SAFETY: the counter lives until Drop frees it after PQfinish; the
        // receiver only reads the result it is handed and adds to it.
        unsafe {
            pq_sys::PQsetNoticeReceiver(
                this.conn.as_ptr(),
                Some(count_warnings),
                this.warnings.as_ptr().cast::<c_void>(),
            );
        }
        Ok(this)
    }

    fn warnings(&self) -> &AtomicUsize {
        // SAFETY: allocated in `connect`, freed only in Drop.
        unsafe { self.warnings.as_ref() }
    }

    fn error_message(&self) -> String {
        // SAFETY: libpq's own message for a connection it made, valid until
        // the next call on it; copied at once.
        let said = unsafe { CStr::from_ptr(pq_sys::PQerrorMessage(self.conn.as_ptr())) };
        said.to_string_lossy().trim().to_owned()
    }

    /// Runs `sql` (one statement); the first row's values as text, if any.
    fn exec(&mut self, sql: &str) -> Result<Vec<Option<String>>, String> {
        let sql = CString::new(sql).map_err(|_| "the statement holds a NUL byte".to_owned())?;
        // SAFETY: the connection is open; the result is cleared below.
        let result = unsafe { pq_sys::PQexec(self.conn.as_ptr(), sql.as_ptr()) };
        if result.is_null() {
            return Err(self.error_message());
        }
        // SAFETY: `result` is the non-null result PQexec returned, read
        // before PQclear and never after.
        let answer = unsafe {
            match pq_sys::PQresultStatus(result) {
                pq_sys::ExecStatusType::PGRES_COMMAND_OK => Ok(Vec::new()),
                pq_sys::ExecStatusType::PGRES_TUPLES_OK => {
                    let mut row = Vec::new();
                    if pq_sys::PQntuples(result) > 0 {
                        for field in 0..pq_sys::PQnfields(result) {
                            row.push((pq_sys::PQgetisnull(result, 0, field) == 0).then(|| {
                                CStr::from_ptr(pq_sys::PQgetvalue(result, 0, field))
                                    .to_string_lossy()
                                    .into_owned()
                            }));
                        }
                    }
                    Ok(row)
                }
                _ => Err(self.error_message()),
            }
        };
        // SAFETY: the result PQexec returned, cleared once.
        unsafe { pq_sys::PQclear(result) };
        answer
    }
}

impl Drop for BarrierConn {
    fn drop(&mut self) {
        // SAFETY: the connection PQconnectdb returned, finished once; then
        // the counter it held, from the box `connect` leaked, freed once.
        unsafe {
            pq_sys::PQfinish(self.conn.as_ptr());
            drop(Box::from_raw(self.warnings.as_ptr()));
        }
    }
}

/// libpq's notice receiver: counts the WARNINGs told (by the severity
/// that is never translated, so a server speaking German counts too).
unsafe extern "C" fn count_warnings(counter: *mut c_void, result: *const pq_sys::PGresult) {
    // SAFETY: libpq hands the notice's result, valid during this call, and
    // the argument the connection was given: its boxed counter.
    unsafe {
        let mut severity =
            pq_sys::PQresultErrorField(result, c_int::from(pq_sys::PG_DIAG_SEVERITY_NONLOCALIZED));
        if severity.is_null() {
            // A server before 9.6 tells it only as translated.
            severity = pq_sys::PQresultErrorField(result, c_int::from(b'S'));
        }
        if !severity.is_null() && CStr::from_ptr(severity).to_bytes() == b"WARNING" {
            (*counter.cast::<AtomicUsize>()).fetch_add(1, Ordering::SeqCst);
        }
    }
}
