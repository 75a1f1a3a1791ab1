//! Storage: the connection and pool, migrations, repositories and the
//! classification of database errors. Nothing here knows about HTTP.

#[path = "../../schema.rs"]
pub mod schema;

pub mod catalog;
pub mod errors;
pub mod feed;
mod group_commit;
pub mod logins;
pub mod migrations;
pub mod plans;
mod pool;
pub mod receipt_log;
mod replication;
mod scratch;
pub mod write_queue;

pub use errors::StorageError;
pub use feed::signal::{CHANNEL as FEED_CHANNEL_BASE, FeedSignal, channel as feed_channel};
pub use pool::{
    Backend, DatabaseTarget, DbConn, DbPool, Manager, PgPooler, PoolOptions, PooledConn,
    READ_COMMITTED, build_pool, default_isolation, redact,
};
pub use replication::ReplicationBarrier;
pub use scratch::ScratchSchema;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use diesel::r2d2::{ManageConnection, R2D2Connection};

use crate::with_conn;
use group_commit::SqliteBatches;
use write_queue::PlanQueue;

use crate::deadline::Deadline;

/// An opened database: the pool, and what it points at.
#[derive(Clone)]
pub struct Database {
    pool: DbPool,
    pub backend: Backend,
    checkout_timeout: std::time::Duration,
    /// Callers inside `conn()` right now (r2d2 does not count its waiters).
    waiting: Arc<AtomicI64>,
    /// SQLite only: writes the batches, gives the appender its turns.
    sqlite_batches: Arc<SqliteBatches>,
    /// This process's writers, written in batches.
    writers: Arc<PlanQueue>,
    /// Wakes readers waiting on the feed.
    feed: FeedSignal,
    /// The service on Postgres: proves a plan it read is on the standby.
    barrier: Option<ReplicationBarrier>,
}

/// Tells OpenSSL (which libpq uses for TLS) not to free its state when the
/// process exits. By default it does so in an atexit handler, which runs
/// while pool, batch and listener threads may still be inside libpq: a
/// stopping service then died of SIGSEGV in `OPENSSL_cleanup` instead of
/// exiting 0. Idempotent; it takes effect only before OpenSSL's first use,
/// so `main` calls it first, and every `Database::open` and scratch schema
/// again (the test suite and the benchmark call it before their first
/// connection).
pub fn keep_tls_state_past_exit() {
    openssl_sys::init();
}

impl Database {
    /// Connects once outside the pool (so a failure shows the server's own
    /// words), optionally applies pending migrations on that connection, then
    /// builds the pool.
    pub fn open(
        url: &str,
        options: &PoolOptions,
        migrate: MigrateOnOpen,
    ) -> Result<Self, StorageError> {
        keep_tls_state_past_exit();
        let target = DatabaseTarget::parse(url)?;
        let backend = target.backend();
        if let DatabaseTarget::Sqlite(path) = &target
            && !matches!(migrate, MigrateOnOpen::Apply | MigrateOnOpen::Create)
            && !std::path::Path::new(path).exists()
        {
            return Err(StorageError::NoDatabase(path.clone()));
        }
        if migrate == MigrateOnOpen::Apply {
            migrations::refuse_through_pooler(options.pg_pooler)?;
        }
        let manager = Manager::new(target, options);
        let mut conn = manager.connect().map_err(|e| {
            StorageError::unavailable(format!("cannot connect to {backend} at {}", redact(url)), e)
        })?;
        match migrate {
            MigrateOnOpen::Apply => {
                for name in migrations::run_pending(&mut conn)? {
                    tracing::info!(migration = %name, "applied migration");
                }
            }
            MigrateOnOpen::RequireNonePending => {
                let pending = migrations::pending(&mut conn)?;
                if !pending.is_empty() {
                    return Err(StorageError::PendingMigrations(pending));
                }
            }
            MigrateOnOpen::Skip | MigrateOnOpen::Create => {}
        }
        // The service (which writes plans; not the command line tools, which
        // may run as a role that only reads) records this cluster's feed
        // base before its first write.
        let mut barrier = None;
        if let DbConn::Postgres(pg) = &mut conn
            && options.feed_listener
        {
            feed::record_feed_base(pg)?;
            if let DatabaseTarget::Postgres(url) = manager.target() {
                let durability = replication::commit_durability(pg)?;
                barrier = Some(ReplicationBarrier::start(url.clone(), &durability));
            }
        }
        drop(conn);
        let mut feed = FeedSignal::default();
        if let (true, DatabaseTarget::Postgres(url)) = (options.feed_listener, manager.target()) {
            // Any connection can notify, through a transaction pooler too.
            feed.notify_others(pool::with_libpq_defaults(
                options.feed_listen_url.as_deref().unwrap_or(url),
            ));
            match (&options.feed_listen_url, options.pg_pooler) {
                (Some(direct), _) => feed.listen(pool::with_libpq_defaults(direct)),
                (None, PgPooler::None) => feed.listen(pool::with_libpq_defaults(url)),
                (None, PgPooler::Transaction) => tracing::info!(
                    "no direct connection to LISTEN on behind a transaction-mode pooler (feed_listen_url): waiting feed readers wake on this instance's writes, and re-read every half second for other instances'"
                ),
            }
        }
        let pool = build_pool(manager, options);
        let waiting: Arc<AtomicI64> = Arc::default();
        let connect: write_queue::Connect = {
            let (pool, waiting) = (pool.clone(), Arc::clone(&waiting));
            let timeout = options.checkout_timeout;
            Box::new(move |deadline| checkout_within(&pool, &waiting, timeout, deadline))
        };
        // The writer threads wake the feed's readers after each batch that
        // created plans, whether or not their requests still wait.
        let wake_readers: Box<dyn Fn() + Send + Sync> = {
            let feed = feed.clone();
            Box::new(move || feed.bump())
        };
        let sqlite_batches = Arc::new(SqliteBatches::new(options.sqlite_busy_timeout));
        let (max_batch, writers) = match backend {
            // Two writers (one when the pool has room for no more than
            // two connections): fewer writers make larger batches, and on
            // the project's 2-core machine two wrote 1.1x the one-statement
            // ceiling at 16 clients where four wrote 0.7x (more round
            // trips, more CPU per plan); docs/PERFORMANCE.md.
            Backend::Postgres => (
                options.pg_write_batch.clamp(1, write_queue::MAX_PG_BATCH),
                PG_WRITERS.min((options.max_size as usize / 2).max(1)),
            ),
            // SQLite admits one writer at a time (`SqliteBatches` takes
            // turns); a second thread reads the next batch meanwhile, so a
            // replay is answered while the other waits for the lock.
            Backend::Sqlite => (
                write_queue::SQLITE_MAX_BATCH,
                SQLITE_WRITERS.min(options.max_size as usize).max(1),
            ),
        };
        Ok(Self {
            feed,
            barrier,
            pool,
            backend,
            checkout_timeout: options.checkout_timeout,
            waiting,
            sqlite_batches: Arc::clone(&sqlite_batches),
            writers: Arc::new(PlanQueue::new(
                max_batch,
                writers,
                connect,
                wake_readers,
                sqlite_batches,
            )),
        })
    }

    /// How many connections the pool holds, and how many are idle.
    pub fn pool_state(&self) -> diesel::r2d2::State {
        self.pool.state()
    }

    /// The pool itself: for the tests' seams only (`tests/it/layers.rs`
    /// holds every room to never call it).
    #[cfg(feature = "test-seams")]
    pub fn pool_for_tests(&self) -> &DbPool {
        &self.pool
    }

    /// Runs `write`, a writer outside the plans' write path (the receipt
    /// log's appender): on SQLite between two group-commit batches, so it
    /// is not starved by them; on Postgres as it is.
    pub fn between_batches<R>(&self, write: impl FnOnce() -> R) -> R {
        match self.backend {
            Backend::Sqlite => self.sqlite_batches.between_batches(write),
            Backend::Postgres => write(),
        }
    }

    /// A pooled connection, or `Unavailable` when none frees up within the
    /// checkout timeout. Call only from blocking code (`web::block`).
    pub fn conn(&self) -> Result<PooledConn, StorageError> {
        self.checkout(self.checkout_timeout)
    }

    /// A pooled connection within the checkout timeout and the deadline.
    pub fn conn_within(&self, deadline: &Deadline) -> Result<PooledConn, StorageError> {
        checkout_within(&self.pool, &self.waiting, self.checkout_timeout, deadline)
    }

    fn checkout(&self, timeout: std::time::Duration) -> Result<PooledConn, StorageError> {
        checkout(&self.pool, &self.waiting, timeout)
    }

    /// Runs a read `step` on a pooled connection. A connection found dead
    /// (the server restarted since it was pooled) is discarded and the step
    /// runs again on another, as often as the pool could hold stale ones,
    /// within the deadline.
    pub fn read<T>(
        &self,
        deadline: &Deadline,
        mut step: impl FnMut(&mut DbConn) -> diesel::QueryResult<T>,
    ) -> Result<T, StorageError> {
        let mut tries = self.pool.max_size() + 1;
        loop {
            let mut conn = self.conn_within(deadline)?;
            let error = match step(&mut conn) {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            let broken = !with_conn!(&mut *conn, c => is_alive(c));
            tries -= 1;
            if !broken
                && let Err(missing @ StorageError::MissingGrants { .. }) =
                    migrations::require_service_privileges(&mut conn, true)
            {
                // A failure the role's grants explain is told as such, asked
                // of the catalog (an error's words may be in any language).
                tracing::error!(%error, "{missing}");
                return Err(missing);
            }
            if !errors::is_connection_lost(&error, broken) || tries == 0 {
                return Err(error.into());
            }
            tracing::info!(%error, "a pooled connection was lost; trying another");
            drop(conn);
        }
    }

    /// Writes a plan and its key row, both or neither, waiting for locks no
    /// longer than the deadline allows, for the caller whose token hashes to
    /// `token_hash` — unless that token no longer names the plan's maker's
    /// active login with `plans:submit` (nothing read or written), or the
    /// key row is already committed, which is answered from a read with
    /// nothing written. The plan joins a group-commit batch (`write_queue`)
    /// written on one pooled connection: on Postgres by one statement, the
    /// login check and the key read included; on SQLite the batch's writer
    /// reads each plan's login and key first, with no write lock, then
    /// writes the rest in one `BEGIN IMMEDIATE` transaction, its turn taken
    /// among this process's writers of the file (`group_commit`), many
    /// plans to one fsync instead of leaving writers to SQLite's busy
    /// handler. A connection that finds the server read-only is discarded,
    /// so the next finds the primary.
    pub fn write_plan(
        &self,
        plan: &Arc<plans::NewPlan>,
        idempotency_key: &str,
        token_hash: &str,
        deadline: &Deadline,
    ) -> Result<plans::Written, plans::WriteFailure> {
        self.writers
            .write(plan, idempotency_key, token_hash, deadline)
    }

    /// [`Database::write_plan`], awaited with no thread of the caller's
    /// own: the plan joins the writers' queue.
    pub async fn write_plan_async(
        &self,
        plan: &Arc<plans::NewPlan>,
        idempotency_key: &str,
        token_hash: &str,
        deadline: &Deadline,
    ) -> Result<plans::Written, plans::WriteFailure> {
        self.writers
            .write_async(plan, idempotency_key, token_hash, deadline)
            .await
    }

    /// Answers waiting for the replication barrier now.
    pub fn replication_waiters(&self) -> usize {
        self.barrier.as_ref().map_or(0, ReplicationBarrier::waiting)
    }

    /// Whether answering a plan read back (a replay) waits for a
    /// synchronous standby now ([`Database::await_replicated`]).
    pub fn replays_wait_for_standby(&self) -> bool {
        self.barrier.as_ref().is_some_and(ReplicationBarrier::waits)
    }

    /// Where write batches are counted: their sizes (either backend) and,
    /// on Postgres, batches split into single writes by a failure.
    pub fn observe_batches(&self, metrics: crate::metrics::BatchMetrics) {
        self.writers.observe(metrics);
    }

    /// Test seam: the next write batch is taken only once `plans` writers
    /// are queued, so a test can make one batch of them.
    #[cfg(feature = "test-seams")]
    pub fn gather_next_batch(&self, plans: usize) {
        self.writers.gather(plans);
    }

    /// Test seam: writers queued, not yet in a batch.
    #[cfg(feature = "test-seams")]
    pub fn queued_writes(&self) -> usize {
        self.writers.queued()
    }

    /// The write step alone, as a concurrent writer whose read came before
    /// the key row was committed reaches it (SQLite; for tests of what the
    /// write leaves behind when the unique index refuses it).
    #[cfg(feature = "test-seams")]
    pub fn write_after_missed_read(
        &self,
        lite: &mut diesel::SqliteConnection,
        plan: &Arc<plans::NewPlan>,
        idempotency_key: &str,
        deadline: &Deadline,
    ) -> Result<plans::Written, plans::WriteFailure> {
        let entry = group_commit::Entry {
            plan,
            key: idempotency_key,
            token_hash: None,
            deadline: *deadline,
        };
        // The entry skips the reads, so its answer is returned, never early.
        self.sqlite_batches
            .write(lite, &[entry], &|_, _| {})
            .pop()
            .flatten()
            .unwrap_or_else(|| {
                Err(group_commit::batch_failed(
                    plans::BatchFailure::LeaderPanicked,
                ))
            })
    }

    /// The signal that wakes readers waiting on the feed.
    pub fn feed_signal(&self) -> &FeedSignal {
        &self.feed
    }

    /// Makes the next SQLite group-commit batch's leader panic inside its
    /// transaction: the seam for testing that failure path.
    #[cfg(feature = "test-seams")]
    pub fn panic_in_next_batch(&self) {
        self.sqlite_batches.panic_in_next_batch();
    }

    /// The most connections the pool holds at once.
    pub fn max_connections(&self) -> u32 {
        self.pool.max_size()
    }

    /// Callers waiting for a connection at this moment.
    pub fn waiters(&self) -> i64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Ready to serve: the database answers and no migration is pending.
    /// Reads only, so a role that may not create anything can ask. Also
    /// says whether an acknowledged commit has reached a standby, and (on
    /// Postgres) the database's or role's default isolation when it is not
    /// READ COMMITTED, which the service pins on each of its sessions: one
    /// connection for all of it.
    pub fn readiness(
        &self,
        deadline: &Deadline,
        signing: bool,
    ) -> Result<(Durability, Option<String>), StorageError> {
        let mut conn = self.conn_within(deadline)?;
        let pending = migrations::pending(&mut conn)?;
        if !pending.is_empty() {
            return Err(StorageError::PendingMigrations(pending));
        }
        migrations::require_service_privileges(&mut conn, signing)?;
        Ok(match &mut *conn {
            DbConn::Sqlite(_) => (Durability::LocalFile, None),
            DbConn::Postgres(pg) => {
                let durability = replication::commit_durability(pg)?;
                if let Some(barrier) = &self.barrier {
                    barrier.observe(&durability);
                }
                let isolation = Some(pool::default_isolation(pg)?)
                    .filter(|default| default != pool::READ_COMMITTED);
                (durability, isolation)
            }
        })
    }

    /// The grants the service's role lacks, told as an error, if any (asked
    /// after a write failed in a way nothing here mends).
    pub fn missing_grants(&self, deadline: &Deadline) -> Option<StorageError> {
        let mut conn = self.conn_within(deadline).ok()?;
        migrations::require_service_privileges(&mut conn, true).err()
    }

    /// Returns once everything committed before the call is on the
    /// synchronous standby (see `replication`). Called before anything is
    /// handed out (a new plan, a replay, the re-read after a lost COMMIT, a
    /// read by id, a feed page): a commit may have been cut short or its
    /// wait cancelled while it waited for the standby, and a failover would
    /// take it back. At once on SQLite, in the command line tools, and where
    /// commits do not wait for a standby.
    pub fn await_replicated(&self, deadline: &Deadline) -> Result<(), StorageError> {
        match &self.barrier {
            Some(barrier) => barrier.wait(deadline),
            None => Ok(()),
        }
    }
}

/// Where an acknowledged commit is, as the service's own sessions commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Durability {
    /// SQLite: on this machine's disk (`synchronous = FULL`), nowhere else.
    LocalFile,
    /// Postgres, by the settings that decide whether COMMIT waits for a
    /// synchronous standby.
    Postgres {
        synchronous_standby_names: String,
        synchronous_commit: String,
        /// Standbys streaming from this server now (`pg_stat_replication`).
        standbys: Standbys,
    },
}

/// The standbys streaming from a Postgres server, as far as this role may
/// see them (their `sync_state` is hidden from a role without
/// `pg_read_all_stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Standbys {
    pub attached: i64,
    /// Of those, how many show their `sync_state` to this role.
    pub state_visible: i64,
    /// Of those, how many are synchronous (`sync` or `quorum`).
    pub synchronous: i64,
}

impl Durability {
    /// Commits wait for a synchronous standby and none can confirm them:
    /// no standby is attached, or (where this role sees their state) none
    /// is synchronous. No write can complete until one is (PostgreSQL holds
    /// every COMMIT; Patroni's `synchronous_mode_strict` with the leader
    /// alone does exactly this).
    pub fn commits_blocked(&self) -> bool {
        match self {
            Self::LocalFile => false,
            Self::Postgres { standbys, .. } => {
                self.waits_for_standby()
                    && (standbys.attached == 0
                        || (standbys.state_visible == standbys.attached
                            && standbys.synchronous == 0))
            }
        }
    }

    /// A COMMIT returns only once a synchronous standby has the commit
    /// (`remote_write`, `on` or `remote_apply`, with a standby named).
    pub fn waits_for_standby(&self) -> bool {
        match self {
            Self::LocalFile => false,
            Self::Postgres {
                synchronous_standby_names,
                synchronous_commit,
                ..
            } => {
                !synchronous_standby_names.trim().is_empty()
                    && matches!(
                        synchronous_commit.as_str(),
                        "on" | "remote_write" | "remote_apply"
                    )
            }
        }
    }
}

/// Runs `work` in one transaction on `conn`: committed when it returns
/// `Ok`, rolled back when it returns `Err`.
pub fn in_transaction<T, E>(
    conn: &mut DbConn,
    work: impl FnOnce(&mut DbConn) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<diesel::result::Error>,
{
    use diesel::connection::{AnsiTransactionManager, TransactionManager};
    with_conn!(conn, c => AnsiTransactionManager::begin_transaction(c))?;
    match work(conn) {
        Ok(value) => {
            with_conn!(conn, c => AnsiTransactionManager::commit_transaction(c))?;
            Ok(value)
        }
        Err(error) => {
            // The work's own error says what went wrong; a failed rollback
            // leaves a connection diesel marks broken.
            let _ = with_conn!(conn, c => AnsiTransactionManager::rollback_transaction(c));
            Err(error)
        }
    }
}

/// Marks `conn` so that the pool discards it when it comes back instead of
/// handing it out again: its server is read-only now, and only a new
/// connection (libpq's `target_session_attrs=read-write`) finds the primary.
pub fn discard(conn: &mut DbConn) {
    use diesel::connection::{AnsiTransactionManager, TransactionManager};
    with_conn!(conn, c => AnsiTransactionManager::transaction_manager_status_mut(c).set_in_error());
}

/// Writer threads of the Postgres group commit.
const PG_WRITERS: usize = 2;
/// Writer threads on SQLite: one writes while the other reads.
const SQLITE_WRITERS: usize = 2;

/// A pooled connection within `timeout` and the deadline.
fn checkout_within(
    pool: &DbPool,
    waiting: &AtomicI64,
    timeout: std::time::Duration,
    deadline: &Deadline,
) -> Result<PooledConn, StorageError> {
    if deadline.passed() {
        return Err(StorageError::DeadlineExceeded("waiting for a connection"));
    }
    checkout(pool, waiting, timeout.min(deadline.wait_budget()))
}

/// A pooled connection within `timeout`, counted among the waiters meanwhile
/// (r2d2 does not count them).
fn checkout(
    pool: &DbPool,
    waiting: &AtomicI64,
    timeout: std::time::Duration,
) -> Result<PooledConn, StorageError> {
    waiting.fetch_add(1, Ordering::Relaxed);
    let conn = pool.get_timeout(timeout);
    waiting.fetch_sub(1, Ordering::Relaxed);
    conn.map_err(|e| StorageError::unavailable("no database connection", e))
}

/// Whether a connection still reaches its server, asked after a failure: by
/// the state diesel recorded, else by one round trip. Language-independent,
/// unlike the text of the error that came before.
pub fn is_alive<C: R2D2Connection>(conn: &mut C) -> bool {
    !conn.is_broken() && conn.ping().is_ok()
}

/// What opening a database does about its migrations. Only `Apply` (the
/// service) and `Create` (`migrate run`) may create a SQLite file that is
/// not there: every other command refuses a missing one
/// ([`StorageError::NoDatabase`]), so a typo never leaves a new database
/// behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrateOnOpen {
    /// Apply every pending migration (creating a missing SQLite file).
    Apply,
    /// Refuse a database with pending migrations.
    RequireNonePending,
    /// Leave the migrations alone.
    Skip,
    /// Leave the migrations alone, creating a missing SQLite file (for
    /// `migrate run`, which applies them next).
    Create,
}
