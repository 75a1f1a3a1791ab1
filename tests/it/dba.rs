//! The DBA's tools, through the real binary: migrate print / revert / run,
//! concurrent migrations, and verify.

use std::process::{Command, Output};

use diesel::RunQueryDsl;
use diesel::sql_types::Text;
use plan_intake::storage::{DbConn, MigrateOnOpen};
use plan_intake::with_conn;

use crate::support::process::{BIN, run_cli as plan_intake};
use crate::support::{TestDb, hand_written_plan_sql};

/// verify's report failed, and by exactly one check: that check's line and
/// the whole report.
#[track_caller]
fn the_one_failing_check(out: &Output) -> (String, String) {
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "verify passed: {report}");
    let failing: Vec<&str> = report.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert_eq!(failing.len(), 1, "{report}");
    (failing[0].to_owned(), report)
}

fn succeeded(out: &Output) -> bool {
    if !out.status.success() {
        eprintln!(
            "stdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out.status.success()
}

#[derive(diesel::QueryableByName)]
struct Line {
    #[diesel(sql_type = Text)]
    line: String,
}

/// Every object in the scratch database, diesel's bookkeeping included.
fn objects(db: &TestDb) -> Vec<String> {
    let database = db.open_with(MigrateOnOpen::Skip);
    let mut conn = database.conn().expect("connection");
    let sql = match &*conn {
        DbConn::Postgres(_) => {
            "SELECT relname::text || ' ' || relkind::text AS line FROM pg_class
              WHERE relnamespace = current_schema()::regnamespace
             UNION ALL
             SELECT conname::text AS line FROM pg_constraint WHERE connamespace = current_schema()::regnamespace
             UNION ALL
             SELECT 'function ' || proname::text AS line FROM pg_proc WHERE pronamespace = current_schema()::regnamespace"
        }
        DbConn::Sqlite(_) => "SELECT type || ' ' || name || ' ' || coalesce(sql, '') AS line FROM sqlite_master",
    };
    let mut lines: Vec<String> =
        with_conn!(&mut *conn, c => diesel::sql_query(sql).load::<Line>(c))
            .expect("list objects")
            .into_iter()
            .map(|l| l.line)
            .collect();
    lines.sort();
    lines
}

fn migrate_print_shows_the_sql_and_changes_nothing(db: TestDb) {
    db.create_empty();
    let before = objects(&db);
    let out = plan_intake(&db, &["migrate", "print"]);
    assert!(succeeded(&out));
    let sql = String::from_utf8_lossy(&out.stdout);
    assert!(
        sql.contains("-- 2026-11-30-000002_create_plans") && sql.contains("CREATE TABLE plans"),
        "{sql}"
    );
    assert!(sql.contains("plans_run_id_not_blank_ck"), "{sql}");
    assert_eq!(objects(&db), before, "migrate print changed the database");

    assert!(succeeded(&plan_intake(&db, &["migrate", "run"])));
    assert!(succeeded(&plan_intake(&db, &["migrate", "revert"])));
    let out = plan_intake(&db, &["migrate", "print"]);
    let sql = String::from_utf8_lossy(&out.stdout);
    assert!(
        sql.contains(&format!("-- {}", crate::schema::LAST_MIGRATION)),
        "{sql}"
    );
    assert!(
        !sql.contains("CREATE TABLE plans"),
        "only the pending migration: {sql}"
    );
}

fn revert_then_run_returns_to_the_same_schema(db: TestDb) {
    assert!(succeeded(&plan_intake(&db, &["migrate", "run"])));
    let migrated = objects(&db);
    let out = plan_intake(&db, &["migrate", "revert"]);
    assert!(succeeded(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains(&format!("reverted {}", crate::schema::LAST_MIGRATION))
    );
    let status = plan_intake(&db, &["migrate", "status"]);
    let listed = String::from_utf8_lossy(&status.stdout);
    assert!(
        listed.contains(&format!("pending  {}", crate::schema::LAST_MIGRATION)),
        "{listed}"
    );

    let refused = plan_intake(&db, &["serve", "--no-migrate", "--bind", "127.0.0.1:0"]);
    assert!(
        !refused.status.success(),
        "serve --no-migrate started with a pending migration"
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(crate::schema::LAST_MIGRATION), "{stderr}");

    assert!(succeeded(&plan_intake(&db, &["migrate", "run"])));
    assert_eq!(objects(&db), migrated);
}

fn two_concurrent_migrate_runs_apply_each_migration_once(db: TestDb) {
    let start = || {
        Command::new(BIN)
            .args(["migrate", "run"])
            .env("DATABASE_URL", &db.url)
            .env("PLAN_INTAKE_LOG", "warn")
            .output()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(start);
        let b = s.spawn(start);
        (a.join().expect("thread"), b.join().expect("thread"))
    });
    assert!(succeeded(&a.expect("run a")));
    assert!(succeeded(&b.expect("run b")));
    let database = db.open_with(MigrateOnOpen::Skip);
    let mut conn = database.conn().expect("connection");
    assert_eq!(
        crate::support::count_rows(&mut conn, "__diesel_schema_migrations"),
        crate::schema::MIGRATION_HISTORY.len() as i64
    );
    assert!(
        plan_intake::storage::migrations::pending(&mut conn)
            .expect("pending")
            .is_empty()
    );
}

fn verify_passes_and_names_a_renamed_index(db: TestDb) {
    assert!(succeeded(&plan_intake(&db, &["migrate", "run"])));
    let out = plan_intake(&db, &["verify"]);
    assert!(
        succeeded(&out),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(report.lines().count(), 7, "{report}");
    assert!(report.lines().all(|l| l.starts_with("ok ")), "{report}");
    assert!(report.contains("1 created, 7 replayed"), "{report}");

    let database = db.open_with(MigrateOnOpen::Skip);
    let mut conn = database.conn().expect("connection");
    let rename = match &*conn {
        DbConn::Postgres(_) => "ALTER INDEX plans_feed_ix RENAME TO plans_feed_renamed",
        DbConn::Sqlite(_) => {
            "DROP INDEX plans_feed_ix; CREATE INDEX plans_feed_renamed ON plans (feed_xid, id)"
        }
    };
    crate::support::execute_batch(&mut conn, rename);
    let out = plan_intake(&db, &["verify"]);
    assert!(!out.status.success(), "verify passed with a renamed index");
    let (failing, report) = the_one_failing_check(&out);
    assert!(
        failing.contains("pinned names")
            && failing.contains("plans_feed_ix")
            && failing.contains("plans_feed_renamed"),
        "{report}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 verify check(s) failed"));
}

/// A feed position ahead of the cluster's transaction ids (what a dump
/// restored into a younger cluster leaves) fails verify with one line.
#[test]
fn verify_fails_when_a_feed_position_is_ahead_of_the_next_write() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    assert!(succeeded(&plan_intake(&db, &["migrate", "run"])));
    let database = db.open_with(MigrateOnOpen::Skip);
    crate::support::execute_batch(
        &mut database.conn().expect("connection"),
        &format!(
            "{};
             UPDATE plans SET feed_xid = pg_current_xact_id()::text::bigint + 1000000000
              WHERE receipt_id = 'rcpt_restored'",
            hand_written_plan_sql("rcpt_restored", "planner-a", "'run-1'", "h")
        ),
    );
    let out = plan_intake(&db, &["verify"]);
    let (failing, report) = the_one_failing_check(&out);
    assert!(failing.contains("feed positions"), "{report}");
}

/// A key row whose request hash is not its plan's (written around the
/// service) would replay a receipt for a request it never kept: verify
/// names it in one line.
fn verify_fails_when_a_key_row_holds_another_request_hash(db: TestDb) {
    assert!(succeeded(&plan_intake(&db, &["migrate", "run"])));
    let database = db.open_with(MigrateOnOpen::Skip);
    crate::support::execute_batch(
        &mut database.conn().expect("connection"),
        &format!(
            "{};
             INSERT INTO intake_keys (maker, idempotency_key, request_hash, plan_id, created_at)
                  SELECT 'planner-a', 'key-1', 'blake3:another', id, '2026-11-30 10:00:00'
                    FROM plans WHERE receipt_id = 'rcpt_by_hand'",
            hand_written_plan_sql("rcpt_by_hand", "planner-a", "'run-1'", "blake3:kept")
        ),
    );
    let out = plan_intake(&db, &["verify"]);
    let (failing, report) = the_one_failing_check(&out);
    assert!(
        failing.contains("key rows match their plans") && failing.contains("1 key row"),
        "{report}"
    );
}

/// `migrate print --revert` shows the down SQL and changes nothing;
/// `migrate revert` shows it too, and refuses to drop a table holding rows
/// unless told `--yes`.
fn revert_previews_its_sql_and_keeps_tables_with_rows_unless_told(db: TestDb) {
    assert!(succeeded(&plan_intake(&db, &["migrate", "run"])));
    let app_db = db.open_with(MigrateOnOpen::Skip);
    plan_intake::intake::login::create(
        &mut app_db.conn().expect("conn"),
        "planner-a",
        &[plan_intake::intake::Permission::PlansSubmit],
    )
    .expect("a login row");
    let before = objects(&db);
    let preview = plan_intake(&db, &["migrate", "print", "--revert"]);
    assert!(succeeded(&preview));
    let sql = String::from_utf8_lossy(&preview.stdout);
    assert!(
        sql.contains(&format!("-- revert {}", crate::schema::LAST_MIGRATION))
            && sql.lines().count() > 1,
        "{sql}"
    );
    assert_eq!(objects(&db), before, "print --revert changed the database");

    // Revert down to the migration that drops `logins`, which holds a row.
    let mut refused = None;
    for _ in 0..crate::schema::MIGRATION_HISTORY.len() {
        let out = plan_intake(&db, &["migrate", "revert"]);
        if !out.status.success() {
            refused = Some(out);
            break;
        }
        assert!(String::from_utf8_lossy(&out.stderr).contains("-- reverting"));
    }
    let refused = refused.expect("a revert that would drop logins was refused");
    let line = String::from_utf8_lossy(&refused.stderr);
    assert!(
        line.contains("logins (1 rows)") && line.contains("--yes"),
        "{line}"
    );
    let status = plan_intake(&db, &["migrate", "status"]);
    assert!(
        String::from_utf8_lossy(&status.stdout)
            .contains("applied  2026-11-30-000001_create_logins"),
        "the refused revert changed nothing"
    );
    assert!(succeeded(&plan_intake(
        &db,
        &["migrate", "revert", "--yes"]
    )));
}

crate::on_both_backends_sync!(
    revert_previews_its_sql_and_keeps_tables_with_rows_unless_told,
    migrate_print_shows_the_sql_and_changes_nothing,
    revert_then_run_returns_to_the_same_schema,
    two_concurrent_migrate_runs_apply_each_migration_once,
    verify_passes_and_names_a_renamed_index,
    verify_fails_when_a_key_row_holds_another_request_hash,
);
