//! Embedded migrations, one folder per backend with identical names.
//!
//! Everything that only asks (pending, applied, readiness) reads the
//! bookkeeping table and creates nothing: a missing table means every
//! migration is pending. Only `run` and `revert` change the schema, and they
//! check first that the role may, so a service role is refused in one line.

use std::sync::{Arc, Mutex};

use diesel::backend::Backend;
use diesel::connection::{BoxableConnection, InstrumentationEvent};
use diesel::migration::{Migration, MigrationSource};
use diesel::sql_types::{BigInt, Bool, Text};
use diesel::{Connection, RunQueryDsl};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

use super::{DbConn, StorageError};
use crate::with_conn;

pub const POSTGRES: EmbeddedMigrations = embed_migrations!("migrations/postgres");
pub const SQLITE: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

/// diesel's bookkeeping table.
const HISTORY_TABLE: &str = "__diesel_schema_migrations";

/// Any fixed number: the session-level advisory lock that keeps two
/// processes from migrating one Postgres database at once.
const MIGRATION_LOCK_KEY: i64 = 0x706c_616e_5f69_6e74;

#[derive(diesel::QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

#[derive(diesel::QueryableByName)]
struct Flag {
    #[diesel(sql_type = Bool)]
    flag: bool,
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn source_for(conn: &DbConn) -> EmbeddedMigrations {
    match conn {
        DbConn::Postgres(_) => POSTGRES,
        DbConn::Sqlite(_) => SQLITE,
    }
}

/// The versions recorded as applied, read without creating anything.
fn applied_versions(conn: &mut DbConn) -> Result<Vec<String>, StorageError> {
    let present = match conn {
        DbConn::Postgres(pg) => diesel::sql_query(format!(
            "SELECT to_regclass('{HISTORY_TABLE}') IS NOT NULL AS flag"
        ))
        .get_result::<Flag>(pg)?
        .flag,
        DbConn::Sqlite(lite) => diesel::sql_query(format!(
            "SELECT COUNT(*) > 0 AS flag FROM sqlite_master WHERE type = 'table' AND name = '{HISTORY_TABLE}'"
        ))
        .get_result::<Flag>(lite)?
        .flag,
    };
    if !present {
        return Ok(Vec::new());
    }
    let sql = format!("SELECT version FROM {HISTORY_TABLE} ORDER BY version");
    let versions: Vec<Version> = with_conn!(conn, c => diesel::sql_query(&sql).load(c))?;
    Ok(versions.into_iter().map(|v| v.version).collect())
}

/// Names of the migrations not yet applied, in the order they would run.
pub fn pending(conn: &mut DbConn) -> Result<Vec<String>, StorageError> {
    let applied = applied_versions(conn)?;
    Ok(embedded_names(source_for(conn))?
        .into_iter()
        .filter(|name| !applied.contains(&version_of(name)))
        .collect())
}

/// Refuses to migrate through a transaction-mode pooler (the one place
/// this is decided: `Database::open` and the migrate commands ask here).
pub fn refuse_through_pooler(pooler: super::PgPooler) -> Result<(), StorageError> {
    match pooler {
        super::PgPooler::Transaction => Err(StorageError::MigratingThroughPooler),
        super::PgPooler::None => Ok(()),
    }
}

/// Names of the applied migrations, oldest first.
pub fn applied(conn: &mut DbConn) -> Result<Vec<String>, StorageError> {
    let versions = applied_versions(conn)?;
    named(versions, source_for(conn))
}

/// Refuses, in one line, a role that may not change the schema (Postgres:
/// it cannot create in the schema, or does not own the tables).
pub fn require_owner(conn: &mut DbConn) -> Result<(), StorageError> {
    let DbConn::Postgres(pg) = conn else {
        return Ok(());
    };
    require(
        pg,
        "changing the schema",
        "SELECT COALESCE(has_schema_privilege(current_schema(), 'CREATE'), false)
            AND COALESCE((SELECT pg_has_role(current_user, c.relowner, 'USAGE')
                            FROM pg_class c WHERE c.oid = to_regclass('plans')), true) AS flag",
    )
}

/// Runs `may_sql` (one boolean column `flag`); false refuses `change` in
/// one line naming the role.
pub(super) fn require(
    pg: &mut diesel::PgConnection,
    change: &'static str,
    may_sql: &str,
) -> Result<(), StorageError> {
    if diesel::sql_query(may_sql).get_result::<Flag>(pg)?.flag {
        Ok(())
    } else {
        Err(StorageError::NeedsOwner {
            change,
            role: current_role(pg)?,
        })
    }
}

/// Refuses, naming the `migrate grants` line that fixes it, a role that
/// lacks `privilege` (an SQL privilege name: `DELETE`, `INSERT`, …) on
/// `table`; `grants_flag`: what that line needs besides the role (` --pruner`).
/// SQLite has no roles.
pub fn require_table_privilege(
    conn: &mut DbConn,
    table: &'static str,
    privilege: &'static str,
    grants_flag: &'static str,
) -> Result<(), StorageError> {
    let DbConn::Postgres(pg) = conn else {
        return Ok(());
    };
    let may = diesel::sql_query(
        "SELECT COALESCE(has_table_privilege(to_regclass($1), $2), true) AS flag",
    )
    .bind::<Text, _>(table)
    .bind::<Text, _>(privilege)
    .get_result::<Flag>(pg)?
    .flag;
    if may {
        return Ok(());
    }
    Err(StorageError::MissingPrivilege {
        role: current_role(pg)?,
        privilege: match privilege {
            "DELETE" => "delete from",
            "INSERT" => "insert into",
            "UPDATE" => "update",
            _ => "read",
        },
        table,
        grants_flag,
    })
}

pub(super) fn current_role(pg: &mut diesel::PgConnection) -> Result<String, StorageError> {
    #[derive(diesel::QueryableByName)]
    struct Role {
        #[diesel(sql_type = Text)]
        role: String,
    }
    Ok(diesel::sql_query("SELECT current_user::text AS role")
        .get_result::<Role>(pg)?
        .role)
}

/// Applies every pending migration in version order; returns their names.
/// With nothing pending it changes nothing (not even diesel's table).
pub fn run_pending(conn: &mut DbConn) -> Result<Vec<String>, StorageError> {
    if pending(conn)?.is_empty() {
        return Ok(Vec::new());
    }
    require_owner(conn)?;
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
    let versions = result.map_err(|e| StorageError::migration("applying pending migrations", e))?;
    named(versions, source_for(conn))
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

/// Which way [`capture_sql`] runs the migrations it is given.
#[derive(Clone, Copy)]
enum Direction {
    Up,
    Down,
}

/// The SQL each migration runs (`up.sql`, or `down.sql` for `Down`), by
/// name, captured by running them inside a transaction that is then rolled
/// back (DDL is transactional on both backends): nothing is applied, not
/// even diesel's bookkeeping.
fn capture_sql<C, DB>(
    conn: &mut C,
    migrations: Vec<Box<dyn Migration<DB>>>,
    direction: Direction,
) -> Result<Vec<(String, String)>, StorageError>
where
    DB: Backend,
    C: Connection<Backend = DB> + BoxableConnection<DB>,
{
    let captured: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = Arc::clone(&captured);
    let mut planned = Vec::new();
    let mut failure = None;
    let outcome = conn.transaction::<(), diesel::result::Error, _>(|c| {
        c.set_instrumentation(move |event: InstrumentationEvent<'_>| {
            if let InstrumentationEvent::StartQuery { query, .. } = event
                && let Ok(mut queries) = sink.lock()
            {
                queries.push(query.to_string());
            }
        });
        for migration in &migrations {
            let before = captured.lock().map(|q| q.len()).unwrap_or(0);
            let ran = match direction {
                Direction::Up => migration.run(c),
                Direction::Down => migration.revert(c),
            };
            if let Err(e) = ran {
                failure = Some(StorageError::migration(
                    format!("running {}", migration.name()),
                    e,
                ));
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
    match (failure, outcome) {
        (Some(e), _) => Err(e),
        (None, Err(diesel::result::Error::RollbackTransaction) | Ok(())) => Ok(planned),
        (None, Err(e)) => Err(StorageError::migration("capturing the migrations' SQL", e)),
    }
}

/// The SQL each pending migration would run, by name, in order; nothing is
/// applied.
pub fn pending_sql(conn: &mut DbConn) -> Result<Vec<(String, String)>, StorageError> {
    let pending = pending(conn)?;
    match conn {
        DbConn::Postgres(pg) => capture_sql(pg, select(POSTGRES, &pending)?, Direction::Up),
        DbConn::Sqlite(lite) => capture_sql(lite, select(SQLITE, &pending)?, Direction::Up),
    }
}

/// What `migrate revert` would run: the most recent migration's name and
/// its `down.sql` as executed; nothing is reverted. `None`: nothing applied.
pub fn revert_sql(conn: &mut DbConn) -> Result<Option<(String, String)>, StorageError> {
    let Some(last) = applied(conn)?.pop() else {
        return Ok(None);
    };
    let only = std::slice::from_ref(&last);
    let planned = match conn {
        DbConn::Postgres(pg) => capture_sql(pg, select(POSTGRES, only)?, Direction::Down)?,
        DbConn::Sqlite(lite) => capture_sql(lite, select(SQLITE, only)?, Direction::Down)?,
    };
    Ok(planned.into_iter().next())
}

/// The product's tables (`logins`, `plans`, `intake_keys`, the receipt
/// log's and `signing_keys`) that `sql`
/// drops while they hold rows, with their row counts. (Bookkeeping such as
/// `feed_bases` is recomputed, not kept.)
pub fn tables_with_rows_dropped_by(
    conn: &mut DbConn,
    sql: &str,
) -> Result<Vec<(String, i64)>, StorageError> {
    let mut found = Vec::new();
    for table in dropped_tables(sql)
        .into_iter()
        .filter(|t| super::catalog::TABLES.contains(&t.as_str()))
        // Its one row is always there; the log's rows are `receipt_log`'s.
        .filter(|t| t != "receipt_log_state")
    {
        let query = format!("SELECT COUNT(*) AS n FROM {table}");
        let rows = with_conn!(conn, c => diesel::sql_query(&query).get_result::<Count>(c))?.n;
        if rows > 0 {
            found.push((table, rows));
        }
    }
    Ok(found)
}

/// Table names after `DROP TABLE [IF EXISTS]` in `sql`.
fn dropped_tables(sql: &str) -> Vec<String> {
    let words: Vec<&str> = sql
        .split(|c: char| c.is_whitespace() || c == ';' || c == ',')
        .filter(|w| !w.is_empty())
        .collect();
    let mut tables = Vec::new();
    for (i, pair) in words.windows(2).enumerate() {
        if pair[0].eq_ignore_ascii_case("DROP") && pair[1].eq_ignore_ascii_case("TABLE") {
            let mut at = i + 2;
            if words.get(at).is_some_and(|w| w.eq_ignore_ascii_case("IF"))
                && words
                    .get(at + 1)
                    .is_some_and(|w| w.eq_ignore_ascii_case("EXISTS"))
            {
                at += 2;
            }
            if let Some(name) = words.get(at) {
                tables.push(name.trim_matches('"').to_owned());
            }
        }
    }
    tables
}

/// The embedded migrations named in `names`, in that order.
fn select<DB: Backend>(
    source: EmbeddedMigrations,
    names: &[String],
) -> Result<Vec<Box<dyn Migration<DB>>>, StorageError>
where
    EmbeddedMigrations: MigrationSource<DB>,
{
    let all = MigrationSource::<DB>::migrations(&source)
        .map_err(|e| StorageError::migration("reading the embedded migrations", e))?;
    let mut by_name: Vec<Option<Box<dyn Migration<DB>>>> = all.into_iter().map(Some).collect();
    names
        .iter()
        .map(|name| {
            by_name
                .iter_mut()
                .find(|m| m.as_ref().is_some_and(|m| m.name().to_string() == *name))
                .and_then(Option::take)
                .ok_or_else(|| {
                    StorageError::Config(format!("migration {name} is not in this binary"))
                })
        })
        .collect()
}

/// Reverts the most recent migration; returns its name.
pub fn revert_last(conn: &mut DbConn) -> Result<String, StorageError> {
    require_owner(conn)?;
    let (result, source) = match conn {
        DbConn::Postgres(pg) => (pg.revert_last_migration(POSTGRES), POSTGRES),
        DbConn::Sqlite(lite) => (lite.revert_last_migration(SQLITE), SQLITE),
    };
    let version = result
        .map(|v| v.to_string())
        .map_err(|e| StorageError::migration("reverting the most recent migration", e))?;
    Ok(named(vec![version.clone()], source)?
        .into_iter()
        .next()
        .unwrap_or(version))
}

fn names(versions: Vec<diesel::migration::MigrationVersion<'_>>) -> Vec<String> {
    versions.into_iter().map(|v| v.to_string()).collect()
}

/// Every migration this binary carries for a backend, by folder name, in order.
pub fn embedded_names(source: EmbeddedMigrations) -> Result<Vec<String>, StorageError> {
    let migrations = MigrationSource::<diesel::pg::Pg>::migrations(&source)
        .map_err(|e| StorageError::migration("reading the embedded migrations", e))?;
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

/// One SQL statement, as a query made it.
#[derive(diesel::QueryableByName)]
struct Statement {
    #[diesel(sql_type = Text)]
    sql: String,
}

/// The `GRANT` statements that let `role` run the service and nothing more:
/// read the schema's objects, add rows to `plans`, `intake_keys` and
/// `feed_bases` (a new cluster's feed base), append to the receipt log
/// (add its rows, move its one state row on; never change or delete a
/// leaf, a hash or a checkpoint), record the signing keys' use (a new
/// key, and when a key was last used: never another key's public half), call the
/// functions. Postgres only; names are quoted by the server.
pub fn grants_for(conn: &mut DbConn, role: &str) -> Result<Vec<String>, StorageError> {
    let DbConn::Postgres(pg) = conn else {
        return Err(no_roles());
    };
    let statements: Vec<Statement> = diesel::sql_query(
        "WITH s AS (SELECT current_schema() AS name)
         SELECT format('GRANT USAGE ON SCHEMA %I TO %I;', s.name, $1) AS sql FROM s
         UNION ALL
         SELECT format('GRANT SELECT ON TABLE %I.logins, %I.__diesel_schema_migrations TO %I;', s.name, s.name, $1) FROM s
         UNION ALL
         SELECT format('GRANT SELECT, INSERT ON TABLE %I.plans, %I.intake_keys, %I.feed_bases TO %I;', s.name, s.name, s.name, $1) FROM s
         UNION ALL
         SELECT format('GRANT SELECT, INSERT ON TABLE %I.receipt_log, %I.receipt_log_hashes, %I.receipt_log_checkpoints TO %I;', s.name, s.name, s.name, $1) FROM s
         UNION ALL
         SELECT format('GRANT SELECT, UPDATE ON TABLE %I.receipt_log_state TO %I;', s.name, $1) FROM s
         UNION ALL
         SELECT format('GRANT SELECT, INSERT, UPDATE (last_used_at) ON TABLE %I.signing_keys TO %I;', s.name, $1) FROM s
         UNION ALL
         SELECT format('GRANT USAGE, SELECT ON SEQUENCE %s, %s TO %I;',
                       pg_get_serial_sequence(format('%I.plans', s.name), 'id'),
                       pg_get_serial_sequence(format('%I.intake_keys', s.name), 'id'), $1) FROM s
         UNION ALL
         SELECT format('GRANT EXECUTE ON FUNCTION %I.%I(%s) TO %I;', s.name, p.proname,
                       pg_get_function_identity_arguments(p.oid), $1)
           FROM s JOIN pg_proc p ON p.pronamespace = to_regnamespace(s.name)
          WHERE p.proname LIKE 'plan\\_intake\\_%'",
    )
    .bind::<Text, _>(role)
    .load(pg)?;
    let statements: Vec<String> = statements.into_iter().map(|s| s.sql).collect();
    if statements.len() < 8 || statements.iter().any(|s| s.contains("ON SEQUENCE  ")) {
        return Err(StorageError::Config(
            "the schema is not migrated yet: apply its migrations as its owner first".to_owned(),
        ));
    }
    Ok(statements)
}

/// What the service's role lacks of the grants [`grants_for`] prints, as
/// `PRIVILEGE on TABLE` lines (empty when it lacks nothing, and on SQLite):
/// the tables every instance uses, and with `signing` the receipt log's and
/// the signing keys'. Asked of the catalog (`has_*_privilege`), never read
/// from an error's words. A table not there yet is a pending migration's
/// business, not a grant's.
pub fn missing_privileges(conn: &mut DbConn, signing: bool) -> Result<Vec<String>, StorageError> {
    let DbConn::Postgres(pg) = conn else {
        return Ok(Vec::new());
    };
    #[derive(diesel::QueryableByName)]
    struct Missing {
        #[diesel(sql_type = Text)]
        missing: String,
    }
    let rows: Vec<Missing> = diesel::sql_query(
        "WITH needed (tbl, priv, for_signing) AS (VALUES
             ('logins', 'SELECT', false), ('__diesel_schema_migrations', 'SELECT', false),
             ('plans', 'SELECT', false), ('plans', 'INSERT', false),
             ('intake_keys', 'SELECT', false), ('intake_keys', 'INSERT', false),
             ('feed_bases', 'SELECT', false), ('feed_bases', 'INSERT', false),
             ('receipt_log', 'SELECT', true), ('receipt_log', 'INSERT', true),
             ('receipt_log_hashes', 'SELECT', true), ('receipt_log_hashes', 'INSERT', true),
             ('receipt_log_checkpoints', 'SELECT', true), ('receipt_log_checkpoints', 'INSERT', true),
             ('receipt_log_state', 'SELECT', true), ('receipt_log_state', 'UPDATE', true),
             ('signing_keys', 'SELECT', true), ('signing_keys', 'INSERT', true))
         SELECT priv || ' on ' || tbl AS missing FROM needed
          WHERE (NOT for_signing OR $1) AND to_regclass(tbl) IS NOT NULL
            AND NOT has_table_privilege(to_regclass(tbl), priv)
         UNION ALL
         SELECT 'UPDATE (last_used_at) on signing_keys'
          WHERE $1 AND to_regclass('signing_keys') IS NOT NULL
            AND NOT has_column_privilege(to_regclass('signing_keys'), 'last_used_at', 'UPDATE')
         UNION ALL
         SELECT 'USAGE on sequence ' || seq FROM (VALUES
                (pg_get_serial_sequence(to_regclass('plans')::text, 'id')),
                (pg_get_serial_sequence(to_regclass('intake_keys')::text, 'id'))) AS s(seq)
          WHERE seq IS NOT NULL AND NOT has_sequence_privilege(seq, 'USAGE')
         UNION ALL
         SELECT 'EXECUTE on function ' || p.oid::regprocedure::text
           FROM pg_proc p
          WHERE p.pronamespace = to_regnamespace(current_schema())
            AND p.proname LIKE 'plan\\_intake\\_%'
            AND NOT has_function_privilege(p.oid, 'EXECUTE')",
    )
    .bind::<diesel::sql_types::Bool, _>(signing)
    .load(pg)?;
    Ok(rows.into_iter().map(|row| row.missing).collect())
}

/// Refuses, with what is missing and the line that grants it, a role that
/// lacks any privilege the service needs ([`missing_privileges`]).
pub fn require_service_privileges(conn: &mut DbConn, signing: bool) -> Result<(), StorageError> {
    let missing = missing_privileges(conn, signing)?;
    if missing.is_empty() {
        return Ok(());
    }
    let DbConn::Postgres(pg) = conn else {
        return Ok(());
    };
    Err(StorageError::MissingGrants {
        role: current_role(pg)?,
        missing,
    })
}

fn no_roles() -> StorageError {
    StorageError::Config(
        "SQLite has no roles: the file's permissions decide who may use it".to_owned(),
    )
}

/// The one grant a role holding the service's grants ([`grants_for`]) needs
/// besides to run `plan-intake keys prune`: deleting key rows.
pub fn pruner_grant_for(conn: &mut DbConn, role: &str) -> Result<String, StorageError> {
    let DbConn::Postgres(pg) = conn else {
        return Err(no_roles());
    };
    Ok(diesel::sql_query(
        "SELECT format('GRANT DELETE ON TABLE %I.intake_keys TO %I;', current_schema(), $1) AS sql",
    )
    .bind::<Text, _>(role)
    .get_result::<Statement>(pg)?
    .sql)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_tables_are_found_in_down_sql() {
        let sql = "DROP INDEX x_ix;\nDROP TABLE intake_keys;\ndrop table if exists \"plans\";";
        assert_eq!(dropped_tables(sql), vec!["intake_keys", "plans"]);
        assert!(dropped_tables("ALTER TABLE plans DROP COLUMN feed_xid;").is_empty());
    }
}
