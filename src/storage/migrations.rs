//! Embedded migrations, one folder per backend with identical names.

use std::sync::{Arc, Mutex};

use diesel::connection::InstrumentationEvent;
use diesel::migration::MigrationSource;
use diesel::{Connection, RunQueryDsl};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use super::{DbConn, StorageError};

pub const POSTGRES: EmbeddedMigrations = embed_migrations!("migrations/postgres");
pub const SQLITE: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

/// Any fixed number: the session-level advisory lock that keeps two
/// processes from migrating one Postgres database at once.
const MIGRATION_LOCK_KEY: i64 = 0x706c_616e_5f69_6e74;

/// Applies every pending migration in version order; returns their names.
pub fn run_pending(conn: &mut DbConn) -> Result<Vec<String>, StorageError> {
    let result = match conn {
        DbConn::Postgres(pg) => {
            diesel::sql_query(format!("SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})"))
                .execute(pg)?;
            let applied = pg.run_pending_migrations(POSTGRES).map(names);
            diesel::sql_query(format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"))
                .execute(pg)?;
            applied
        }
        // One write transaction around the whole run: a second process
        // waits for the write lock, then finds nothing pending.
        DbConn::Sqlite(lite) => {
            let mut outcome = Ok(Vec::new());
            lite.immediate_transaction(|c| {
                outcome = c.run_pending_migrations(SQLITE).map(names);
                match outcome {
                    Ok(_) => Ok(()),
                    Err(_) => Err(diesel::result::Error::RollbackTransaction),
                }
            })
            .or_else(|e| match e {
                diesel::result::Error::RollbackTransaction => Ok(()),
                other => Err(other),
            })?;
            outcome
        }
    };
    let versions = result.map_err(|e| StorageError::Migration(e.to_string()))?;
    let source = match conn {
        DbConn::Postgres(_) => POSTGRES,
        DbConn::Sqlite(_) => SQLITE,
    };
    named(versions, source)
}

/// Folder names for diesel's version numbers (`20261130000001`).
fn named(versions: Vec<String>, source: EmbeddedMigrations) -> Result<Vec<String>, StorageError> {
    let known = embedded_names(source)?;
    Ok(versions
        .into_iter()
        .map(|version| {
            known
                .iter()
                .find(|name| version_of(name) == version)
                .cloned()
                .unwrap_or(version)
        })
        .collect())
}

/// The SQL each pending migration would run, by name, in order. It is
/// captured by running them inside a transaction that is then rolled back
/// (DDL is transactional on both backends), so nothing is applied, not even
/// diesel's bookkeeping table.
pub fn pending_sql(conn: &mut DbConn) -> Result<Vec<(String, String)>, StorageError> {
    let captured: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = Arc::clone(&captured);
    let record = move |event: InstrumentationEvent<'_>| {
        if let InstrumentationEvent::StartQuery { query, .. } = event
            && let Ok(mut queries) = sink.lock()
        {
            queries.push(query.to_string());
        }
    };
    let mut planned = Vec::new();
    let mut failure = None;
    macro_rules! capture {
        ($conn:expr, $source:expr) => {{
            let conn = $conn;
            let outcome = conn.transaction::<(), diesel::result::Error, _>(|c| {
                let pending = match c.pending_migrations($source) {
                    Ok(pending) => pending,
                    Err(e) => {
                        failure = Some(e.to_string());
                        return Err(diesel::result::Error::RollbackTransaction);
                    }
                };
                c.set_instrumentation(record.clone());
                for migration in pending {
                    let before = captured.lock().map(|q| q.len()).unwrap_or(0);
                    if let Err(e) = migration.run(c) {
                        failure = Some(format!("{}: {e}", migration.name()));
                        break;
                    }
                    let sql = captured
                        .lock()
                        .map(|q| q[before..].join("\n"))
                        .unwrap_or_default();
                    planned.push((migration.name().to_string(), sql));
                }
                c.set_instrumentation(|_: InstrumentationEvent<'_>| {});
                Err(diesel::result::Error::RollbackTransaction)
            });
            match outcome {
                Err(diesel::result::Error::RollbackTransaction) | Ok(()) => {}
                Err(e) => failure = Some(e.to_string()),
            }
        }};
    }
    match conn {
        DbConn::Postgres(pg) => capture!(pg, POSTGRES),
        DbConn::Sqlite(lite) => capture!(lite, SQLITE),
    }
    match failure {
        Some(e) => Err(StorageError::Migration(e)),
        None => Ok(planned),
    }
}

/// Names of the migrations not yet applied, in the order they would run.
pub fn pending(conn: &mut DbConn) -> Result<Vec<String>, StorageError> {
    let result = match conn {
        DbConn::Postgres(pg) => pg
            .pending_migrations(POSTGRES)
            .map(|ms| ms.iter().map(|m| m.name().to_string()).collect()),
        DbConn::Sqlite(lite) => lite
            .pending_migrations(SQLITE)
            .map(|ms| ms.iter().map(|m| m.name().to_string()).collect()),
    };
    result.map_err(|e| StorageError::Migration(e.to_string()))
}

/// Reverts the most recent migration; returns its name.
pub fn revert_last(conn: &mut DbConn) -> Result<String, StorageError> {
    let (result, source) = match conn {
        DbConn::Postgres(pg) => (pg.revert_last_migration(POSTGRES), POSTGRES),
        DbConn::Sqlite(lite) => (lite.revert_last_migration(SQLITE), SQLITE),
    };
    let version = result
        .map(|v| v.to_string())
        .map_err(|e| StorageError::Migration(e.to_string()))?;
    Ok(named(vec![version.clone()], source)?
        .into_iter()
        .next()
        .unwrap_or(version))
}

fn names(versions: Vec<diesel::migration::MigrationVersion<'_>>) -> Vec<String> {
    versions.into_iter().map(|v| v.to_string()).collect()
}

/// Names of the applied migrations, oldest first.
pub fn applied(conn: &mut DbConn) -> Result<Vec<String>, StorageError> {
    let (result, source) = match conn {
        DbConn::Postgres(pg) => (pg.applied_migrations(), POSTGRES),
        DbConn::Sqlite(lite) => (lite.applied_migrations(), SQLITE),
    };
    let mut versions = result
        .map(names)
        .map_err(|e| StorageError::Migration(e.to_string()))?;
    versions.sort();
    named(versions, source)
}

/// Every migration this binary carries for a backend, by folder name, in order.
pub fn embedded_names(source: EmbeddedMigrations) -> Result<Vec<String>, StorageError> {
    let migrations = MigrationSource::<diesel::pg::Pg>::migrations(&source)
        .map_err(|e| StorageError::Migration(e.to_string()))?;
    let mut names: Vec<String> = migrations.iter().map(|m| m.name().to_string()).collect();
    names.sort();
    Ok(names)
}

/// `2026-11-30-000001_create_logins` → `20261130000001`, as diesel records it.
fn version_of(name: &str) -> String {
    name.split('_')
        .next()
        .unwrap_or(name)
        .chars()
        .filter(char::is_ascii_digit)
        .collect()
}
