//! Embedded migrations, one folder per backend with identical names.

use diesel::RunQueryDsl;
use diesel::migration::MigrationSource;
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
        DbConn::Sqlite(lite) => lite.run_pending_migrations(SQLITE).map(names),
    };
    result.map_err(|e| StorageError::Migration(e.to_string()))
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
    let result = match conn {
        DbConn::Postgres(pg) => pg.revert_last_migration(POSTGRES),
        DbConn::Sqlite(lite) => lite.revert_last_migration(SQLITE),
    };
    result
        .map(|v| v.to_string())
        .map_err(|e| StorageError::Migration(e.to_string()))
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
