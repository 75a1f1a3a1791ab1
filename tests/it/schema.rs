//! The schema as DBAs see it: pinned names in the live catalog, a table that
//! refuses a blank run by itself, migrations that run in order and round-trip,
//! and `schema.rs` matching a fresh database.

use diesel::RunQueryDsl;
use diesel::sql_types::{Nullable, Text};
use plan_intake::storage::catalog::{self, TABLES};
use plan_intake::storage::{Backend, DbConn, MigrateOnOpen, migrations};
use plan_intake::with_conn;

use crate::on_both_backends;
use crate::support::{TestApp, TestDb, hand_written_plan_sql};

on_both_backends!(
    each_migration_reverts_to_the_schema_before_it,
    live_names_equal_the_pinned_names,
    the_table_refuses_a_blank_run_written_around_the_service,
    migrations_run_from_empty_in_order,
    up_down_up_leaves_the_same_schema,
    schema_rs_matches_a_fresh_database,
);

async fn live_names_equal_the_pinned_names(db: TestDb) {
    let app = TestApp::new(db);
    let live = catalog::live_names(&mut app.conn()).expect("read catalog");
    assert_eq!(live, catalog::pinned_names());
    for (_, name) in &live {
        assert!(name.len() < 63, "{name} is 63 bytes or longer");
    }
}

async fn the_table_refuses_a_blank_run_written_around_the_service(db: TestDb) {
    let backend = db.backend;
    let app = TestApp::new(db);
    let mut conn = app.conn();
    let tab_newline = match backend {
        Backend::Postgres => "chr(9) || chr(10) || chr(13) || ' '",
        Backend::Sqlite => "char(9, 10, 13) || ' '",
    };
    let insert =
        |run: &str| hand_written_plan_sql(&format!("rcpt_{}", run.len()), "writer", run, "h");
    for run in ["NULL", "''", "'   '", tab_newline] {
        let result = execute(&mut conn, &insert(run));
        assert!(result.is_err(), "the table stored run_id = {run}");
    }
    assert_eq!(app.count("plans"), 0);

    execute(&mut conn, &insert("'run-1'")).expect("a real run is stored");
    for run in ["NULL", "''", "'   '", tab_newline] {
        let result = execute(&mut conn, &format!("UPDATE plans SET run_id = {run}"));
        assert!(result.is_err(), "the table let run_id become {run}");
    }
}

async fn migrations_run_from_empty_in_order(db: TestDb) {
    let backend = db.backend;
    let database = db.open_with(MigrateOnOpen::Create);
    let mut conn = database.conn().expect("connection");
    let source = match backend {
        Backend::Postgres => migrations::POSTGRES,
        Backend::Sqlite => migrations::SQLITE,
    };
    let expected = migrations::embedded_names(source).expect("embedded");
    assert_eq!(migrations::pending(&mut conn).expect("pending"), expected);
    migrations::run_pending(&mut conn).expect("migrate from empty");
    assert_eq!(migrations::applied(&mut conn).expect("applied"), expected);
    assert!(migrations::pending(&mut conn).expect("pending").is_empty());
}

/// Each migration on its own, in order: its `down.sql` brings back exactly
/// the schema before its `up.sql`, and `up.sql` again the schema after; a
/// broken pair is named.
async fn each_migration_reverts_to_the_schema_before_it(db: TestDb) {
    use diesel_migrations::MigrationHarness;
    let database = db.open_with(MigrateOnOpen::Create);
    let mut conn = database.conn().expect("connection");
    let step = |conn: &mut DbConn, up: bool, name: &str| -> String {
        let done = match (&mut *conn, up) {
            (DbConn::Postgres(pg), true) => pg
                .run_next_migration(migrations::POSTGRES)
                .map(|v| v.to_string()),
            (DbConn::Postgres(pg), false) => pg
                .revert_last_migration(migrations::POSTGRES)
                .map(|v| v.to_string()),
            (DbConn::Sqlite(lite), true) => lite
                .run_next_migration(migrations::SQLITE)
                .map(|v| v.to_string()),
            (DbConn::Sqlite(lite), false) => lite
                .revert_last_migration(migrations::SQLITE)
                .map(|v| v.to_string()),
        };
        done.unwrap_or_else(|e| {
            panic!(
                "{name}: {} fails: {e}",
                if up { "up.sql" } else { "down.sql" }
            )
        })
    };
    for name in MIGRATION_HISTORY {
        let before = dump_schema(&mut conn);
        let version = step(&mut conn, true, name);
        assert!(
            name.replace('-', "").starts_with(&version),
            "{name} ran as {version}"
        );
        let after = dump_schema(&mut conn);
        step(&mut conn, false, name);
        assert_eq!(
            dump_schema(&mut conn),
            before,
            "{name}: down.sql does not undo up.sql"
        );
        step(&mut conn, true, name);
        assert_eq!(
            dump_schema(&mut conn),
            after,
            "{name}: up.sql run again differs"
        );
    }
}

async fn up_down_up_leaves_the_same_schema(db: TestDb) {
    let app = TestApp::new(db);
    let mut conn = app.conn();
    let migrated = dump_schema(&mut conn);
    assert!(
        migrated.iter().any(|line| line.contains("plans")),
        "{migrated:?}"
    );

    let count = migrations::applied(&mut conn).expect("applied").len();
    for _ in 0..count {
        migrations::revert_last(&mut conn).expect("down.sql runs");
    }
    assert_eq!(
        dump_schema(&mut conn),
        Vec::<String>::new(),
        "down.sql left objects behind"
    );
    migrations::run_pending(&mut conn).expect("up again");
    assert_eq!(dump_schema(&mut conn), migrated);
}

async fn schema_rs_matches_a_fresh_database(db: TestDb) {
    let app = TestApp::new(db);
    let mut conn = app.conn();
    let declared = declared_columns();
    assert_eq!(
        declared.len(),
        7 + 12 + 6 + 3 + 2 + 4 + 4 + 4,
        "schema.rs parsed: {declared:?}"
    );
    let mut live = Vec::new();
    for table in TABLES {
        live.extend(live_columns(&mut conn, table));
    }
    live.sort();
    let mut declared = declared;
    declared.sort();
    assert_eq!(live, declared);
}

fn execute(conn: &mut DbConn, sql: &str) -> diesel::QueryResult<usize> {
    with_conn!(conn, c => diesel::sql_query(sql).execute(c))
}

#[derive(diesel::QueryableByName)]
struct Line {
    #[diesel(sql_type = Nullable<Text>)]
    line: Option<String>,
}

/// Our tables, columns, indexes and constraints as text, diesel's own
/// bookkeeping left out.
fn dump_schema(conn: &mut DbConn) -> Vec<String> {
    let sql = match conn {
        DbConn::Postgres(_) => {
            "SELECT table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable
                    || ' ' || coalesce(column_default, '') || ' ' || coalesce(is_identity, '') AS line
               FROM information_schema.columns
              WHERE table_schema = current_schema() AND table_name <> '__diesel_schema_migrations'
             UNION ALL
             SELECT conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
              WHERE connamespace = current_schema()::regnamespace
                AND conrelid::regclass::text <> '__diesel_schema_migrations'
             UNION ALL
             SELECT 'function ' || proname || '(' || pg_get_function_identity_arguments(oid) || ')'
               FROM pg_proc WHERE pronamespace = current_schema()::regnamespace
             UNION ALL
             SELECT indexdef FROM pg_indexes
              WHERE schemaname = current_schema() AND tablename <> '__diesel_schema_migrations'
             UNION ALL
             SELECT 'trigger ' || pg_get_triggerdef(t.oid) FROM pg_trigger t
               JOIN pg_class c ON c.oid = t.tgrelid
              WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal"
        }
        DbConn::Sqlite(_) => {
            "SELECT type || ' ' || name || ' ' || coalesce(sql, '') AS line FROM sqlite_master
              WHERE name NOT LIKE '%diesel_schema_migrations%' AND name <> 'sqlite_sequence'"
        }
    };
    let mut lines: Vec<String> = with_conn!(conn, c => diesel::sql_query(sql).load::<Line>(c))
        .expect("dump schema")
        .into_iter()
        .filter_map(|l| l.line)
        .collect();
    lines.sort();
    lines
}

/// `(table, column, type, nullable)` as `schema.rs` declares them, in the
/// SQL type names each backend's catalog reports.
fn declared_columns() -> Vec<(String, String, String, bool)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/schema.rs"))
        .expect("read schema.rs");
    let mut table = String::new();
    let mut columns = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some((name, _)) = line.split_once(" (").filter(|_| line.ends_with('{')) {
            table = name.to_owned();
        } else if let Some((column, ty)) = line.strip_suffix(',').and_then(|l| l.split_once(" -> "))
        {
            let nullable = ty.starts_with("Nullable<");
            let ty = ty.trim_start_matches("Nullable<").trim_end_matches('>');
            columns.push((table.clone(), column.to_owned(), ty.to_owned(), nullable));
        }
    }
    columns
}

#[derive(diesel::QueryableByName)]
struct LiveColumn {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Text)]
    sql_type: String,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    nullable: bool,
}

fn live_columns(conn: &mut DbConn, table: &str) -> Vec<(String, String, String, bool)> {
    let backend = conn.backend();
    let rows = match conn {
        DbConn::Postgres(pg) => diesel::sql_query(
            "SELECT column_name::text AS name, data_type::text AS sql_type, is_nullable = 'YES' AS nullable
               FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = $1",
        )
        .bind::<Text, _>(table)
        .load::<LiveColumn>(pg),
        DbConn::Sqlite(lite) => diesel::sql_query(
            "SELECT name, type AS sql_type, \"notnull\" = 0 AS nullable FROM pragma_table_info(?)",
        )
        .bind::<Text, _>(table)
        .load::<LiveColumn>(lite),
    }
    .expect("read columns");
    rows.into_iter()
        .map(|c| {
            (
                table.to_owned(),
                c.name,
                diesel_type(backend, &c.sql_type),
                c.nullable,
            )
        })
        .collect()
}

/// The diesel type `print-schema` would write for a catalog type.
fn diesel_type(backend: Backend, sql_type: &str) -> String {
    let ty = match (backend, sql_type.to_ascii_lowercase().as_str()) {
        (_, "bigint") => "BigInt",
        // SQLite's rowid alias must be declared INTEGER; it holds 64 bits.
        (Backend::Sqlite, "integer") => "BigInt",
        (_, "text") => "Text",
        (Backend::Postgres, "bytea") | (Backend::Sqlite, "blob") => "Binary",
        (_, "timestamp" | "timestamp without time zone") => "Timestamp",
        (_, other) => return format!("unmapped({other})"),
    };
    ty.to_owned()
}

/// Every migration ever added, in the order it was added. Append only: a
/// new migration is added here last and must also sort last.
pub const MIGRATION_HISTORY: [&str; 19] = [
    "2026-11-30-000001_create_logins",
    "2026-11-30-000002_create_plans",
    "2026-11-30-000003_create_intake_keys",
    "2026-11-30-000004_add_plans_feed_position",
    "2026-11-30-000005_add_plan_intake_write",
    "2026-11-30-000006_plan_intake_write_timed",
    "2026-11-30-000007_add_logins_previous_token",
    "2026-11-30-000008_feed_positions_by_cluster",
    "2026-11-30-000009_plan_intake_write_reads_first",
    "2026-11-30-000010_plan_intake_write_records_keys",
    "2026-11-30-000011_feed_notify_after_commit",
    "2026-11-30-000012_plan_intake_write_checks_login",
    "2026-12-01-000013_feed_positions_by_timeline",
    "2026-12-02-000014_feed_bases_record_their_start",
    "2026-12-02-000015_signed_receipts_and_their_log",
    "2026-12-03-000016_plan_intake_write_holds_the_horizon",
    "2026-12-04-000017_feed_horizon_counts_writers_newer_than_its_snapshot",
    "2026-12-04-000018_feed_base_past_every_writer",
    "2026-12-05-000019_plan_intake_write_batch_set_based",
];
pub const LAST_MIGRATION: &str = MIGRATION_HISTORY[MIGRATION_HISTORY.len() - 1];

/// Lexical order must be creation order (diesel sorts versions as strings,
/// and silently runs a late-added migration with an older date), and both
/// backends must carry the same migrations under the same names.
#[test]
fn migration_folders_are_dated_identical_and_complete() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let folders = |backend: &str| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(root.join(backend))
            .expect("read migrations")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        names.sort();
        names
    };
    let postgres = folders("postgres");
    assert_eq!(
        postgres,
        folders("sqlite"),
        "the backends' migration folders differ"
    );
    assert_eq!(
        postgres, MIGRATION_HISTORY,
        "a migration sorts before an older one, or is missing from MIGRATION_HISTORY"
    );
    for name in &postgres {
        assert!(is_dated_name(name), "{name} is not YYYY-MM-DD-HHMMSS_name");
        for backend in ["postgres", "sqlite"] {
            for file in ["up.sql", "down.sql"] {
                let path = root.join(backend).join(name).join(file);
                let sql = std::fs::read_to_string(&path).unwrap_or_default();
                assert!(
                    !sql.trim().is_empty(),
                    "{} is missing or empty",
                    path.display()
                );
            }
        }
    }
}

fn is_dated_name(name: &str) -> bool {
    let Some((stamp, rest)) = name.split_once('_') else {
        return false;
    };
    let shape_ok = stamp.len() == 17
        && stamp.char_indices().all(|(i, c)| match i {
            4 | 7 | 10 => c == '-',
            _ => c.is_ascii_digit(),
        });
    shape_ok
        && !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}
