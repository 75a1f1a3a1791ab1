//! Storage: the connection and pool, migrations, repositories and the
//! classification of database errors. Nothing here knows about HTTP.

#[path = "../../schema.rs"]
pub mod schema;

pub mod catalog;
pub mod errors;
mod group_commit;
pub mod logins;
pub mod migrations;
pub mod plans;
mod pool;

pub use errors::StorageError;
pub use pool::{
    Backend, DatabaseTarget, DbConn, DbPool, Manager, PoolOptions, PooledConn, build_pool, redact,
};

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use diesel::r2d2::ManageConnection;
use group_commit::WriteQueue;

/// An opened database: the pool, and what it points at.
#[derive(Clone)]
pub struct Database {
    pub pool: DbPool,
    pub backend: Backend,
    /// Callers inside `conn()` right now (r2d2 does not count its waiters).
    waiting: Arc<AtomicI64>,
    /// SQLite only: this process's writers, committed in groups.
    writers: Arc<WriteQueue>,
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
        let target = DatabaseTarget::parse(url)?;
        let backend = target.backend();
        let manager = Manager::new(target, options.sqlite_busy_timeout);
        let mut conn = manager
            .connect()
            .map_err(|e| StorageError::Unavailable(format!("cannot connect to {backend}: {e}")))?;
        match migrate {
            MigrateOnOpen::Apply => {
                migrations::run_pending(&mut conn)?;
            }
            MigrateOnOpen::RequireNonePending => {
                let pending = migrations::pending(&mut conn)?;
                if !pending.is_empty() {
                    return Err(StorageError::PendingMigrations(pending));
                }
            }
            MigrateOnOpen::Skip => {}
        }
        drop(conn);
        Ok(Self {
            pool: build_pool(manager, options),
            backend,
            waiting: Arc::default(),
            writers: Arc::default(),
        })
    }

    /// A pooled connection, or `Unavailable` when none frees up within the
    /// checkout timeout. Call only from blocking code (`web::block`).
    pub fn conn(&self) -> Result<PooledConn, StorageError> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let conn = self.pool.get();
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        conn.map_err(|e| StorageError::Unavailable(format!("no database connection: {e}")))
    }

    /// Writes a plan and its key row, both or neither. Postgres: one
    /// statement on `conn`. SQLite: through the group-commit queue, which
    /// hands the write lock on at once and commits many plans with one fsync
    /// instead of leaving writers to SQLite's busy handler (see
    /// `group_commit`).
    pub fn write_plan(
        &self,
        conn: &mut DbConn,
        plan: &plans::NewPlan,
        idempotency_key: &str,
    ) -> Result<plans::PlanRow, plans::WriteFailure> {
        match conn {
            DbConn::Sqlite(lite) => self.writers.write(lite, plan, idempotency_key),
            DbConn::Postgres(_) => plans::insert_plan_with_key(conn, plan, idempotency_key),
        }
    }

    /// Callers waiting for a connection at this moment.
    pub fn waiters(&self) -> i64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Ready to serve: the database answers and no migration is pending.
    pub fn readiness(&self) -> Result<(), StorageError> {
        let mut conn = self.conn()?;
        let pending = migrations::pending(&mut conn)?;
        if pending.is_empty() {
            Ok(())
        } else {
            Err(StorageError::PendingMigrations(pending))
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrateOnOpen {
    Apply,
    RequireNonePending,
    Skip,
}
