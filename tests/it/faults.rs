//! Failures caused on purpose, not raced for: a proxy that cuts the
//! connection around COMMIT, a statement timeout inside COMMIT, a real
//! deadlock, a real lock timeout and a real SQLITE_BUSY.

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::web;
use diesel::connection::SimpleConnection;
use diesel::{Connection, SqliteConnection};
use plan_intake::intake::{Intake, Permission, RetryPolicy};
use plan_intake::metrics::{Metrics, UnknownCommitBranch};
use plan_intake::storage::PoolOptions;

use crate::support::proxy::{Fault, FaultProxy, upstream_of};
use crate::support::{
    AppOptions, TestApp, TestDb, competing_plan, hand_written_plan_sql, hold_plan_and_key,
    plan_body, post_plan, scalar, send, wait_until,
};

const PLANNER: &[Permission] = &[Permission::PlansSubmit];

/// A Postgres scratch database whose service connections pass through a
/// fault proxy; `checkout_timeout` is short so a refused re-read fails fast.
fn behind_proxy() -> Option<(TestApp, FaultProxy, String)> {
    behind_proxy_with(PoolOptions {
        max_size: 4,
        checkout_timeout: Duration::from_millis(300),
        ..PoolOptions::default()
    })
}

/// [`behind_proxy`] with the service's pool as given.
pub(crate) fn behind_proxy_with(pool: PoolOptions) -> Option<(TestApp, FaultProxy, String)> {
    let scratch = TestDb::postgres()?;
    let upstream = upstream_of(&scratch.url);
    let proxy = FaultProxy::start(upstream.clone());
    let direct_url = scratch.url.clone();
    let url = proxy.url_for(&scratch.postgres_url_with(&[]), &upstream);
    let options = AppOptions {
        url: Some(url),
        pool,
        ..AppOptions::default()
    };
    Some((TestApp::with(scratch, options), proxy, direct_url))
}

#[actix_web::test]
async fn cut_before_commit_is_forwarded_ends_201_with_one_plan() {
    let Some((app, proxy, _)) = behind_proxy() else {
        return;
    };
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    proxy.arm(Fault::CutBeforeCommit, false, None);

    let answer = send(&service, post_plan(&token, "k", &plan_body("run-1", "x"))).await;
    assert_eq!(proxy.fired(), vec![Fault::CutBeforeCommit]);
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    app.assert_rows(1, 1);
    assert_eq!(
        app.metrics()
            .unknown_commit_count(UnknownCommitBranch::NotLanded),
        1
    );
    let stored = app.stored(answer.body["receipt_id"].as_str().unwrap_or_default());
    assert!(stored.is_some(), "the 201's receipt is the one kept");
}

#[actix_web::test]
async fn cut_after_commit_landed_answers_the_receipt_that_landed() {
    let Some((app, proxy, _)) = behind_proxy() else {
        return;
    };
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    proxy.arm(Fault::CutAfterCommit, false, None);

    let answer = send(&service, post_plan(&token, "k", &plan_body("run-1", "x"))).await;
    assert_eq!(proxy.fired(), vec![Fault::CutAfterCommit]);
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert_eq!(answer.body["outcome"], "created");
    assert_eq!(
        app.count("plans"),
        1,
        "a landed COMMIT must not be written twice"
    );
    assert_eq!(
        app.metrics()
            .unknown_commit_count(UnknownCommitBranch::Landed),
        1
    );
    assert_eq!(
        app.metrics()
            .unknown_commit_count(UnknownCommitBranch::NotLanded),
        0
    );
    let stored = app.stored(answer.body["receipt_id"].as_str().unwrap_or_default());
    assert!(stored.is_some(), "the answer names the row that landed");
}

/// While our COMMIT is lost, another attempt under the same key commits.
/// The re-read finds its row: never claimed as ours, resolved by hash.
#[actix_web::test]
async fn reread_finding_another_attempts_row_resolves_it_by_hash() {
    for (other_body, expected) in [
        (plan_body("run-1", "x"), StatusCode::OK),
        (
            plan_body("run-1", "other"),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
    ] {
        let Some((app, proxy, direct_url)) = behind_proxy() else {
            return;
        };
        let token = app.login("planner-a", PLANNER);
        let service = app.service().await;
        let competitor = competing_plan("planner-a", &other_body);
        let competitor_receipt = competitor.receipt_id.clone();
        let token_hash = plan_intake::intake::login::token_hash(&token);
        let hook = Box::new(move || {
            let other = plan_intake::storage::Database::open(
                &direct_url,
                &PoolOptions::default(),
                plan_intake::storage::MigrateOnOpen::Skip,
            )
            .expect("open");
            let deadline = plan_intake::deadline::Deadline::after(Duration::from_secs(10));
            other
                .write_plan(
                    &std::sync::Arc::new(competitor),
                    "k",
                    &token_hash,
                    &deadline,
                )
                .expect("the other attempt commits");
        });
        proxy.arm(Fault::CutBeforeCommit, false, Some(hook));

        let answer = send(&service, post_plan(&token, "k", &plan_body("run-1", "x"))).await;
        assert_eq!(answer.status, expected, "{:?}", answer.body);
        if expected == StatusCode::OK {
            assert_eq!(answer.body["outcome"], "replayed");
            assert_eq!(
                answer.body["receipt_id"],
                competitor_receipt.as_str(),
                "the other attempt's receipt, not ours"
            );
        } else {
            answer.assert_key_reused();
        }
        assert_eq!(
            app.metrics()
                .unknown_commit_count(UnknownCommitBranch::OtherRow),
            1
        );
        app.assert_rows(1, 1);
    }
}

#[actix_web::test]
async fn failed_reread_answers_503_and_a_later_retry_gets_the_one_receipt() {
    let Some((app, proxy, _)) = behind_proxy() else {
        return;
    };
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let body = plan_body("run-1", "x");
    proxy.arm(Fault::CutAfterCommit, true, None);

    let answer = send(&service, post_plan(&token, "k", &body)).await;
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        answer.body
    );
    assert!(answer.header("retry-after").is_some());
    assert_eq!(
        app.metrics()
            .unknown_commit_count(UnknownCommitBranch::RereadFailed),
        1
    );
    assert_eq!(app.count("plans"), 1, "the landed plan, and no second one");

    proxy.heal();
    let retry = send(&service, post_plan(&token, "k", &body)).await;
    assert_eq!(retry.status, StatusCode::OK, "{:?}", retry.body);
    assert_eq!(retry.body["outcome"], "replayed");
    app.assert_rows(1, 1);
}

/// A deferred trigger holds the first commit of the write statement open
/// (it runs when the statement's implicit transaction commits); the server
/// then cancels it (57014, as a statement timeout would). That is an unknown
/// outcome to be re-read, not a rollback to be assumed. (PostgreSQL 15 does
/// not arm `statement_timeout` for an explicit COMMIT, checked by hand, so
/// the cancel comes from `pg_cancel_backend`, with the same SQLSTATE.)
#[actix_web::test]
async fn a_statement_cancelled_during_commit_is_an_unknown_outcome() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let (app, schema) = TestApp::named(scratch);
    crate::support::execute_batch(
        &mut app.conn(),
        "CREATE SEQUENCE slow_commit_seq;
         CREATE FUNCTION slow_commit_once() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('slow_commit_seq') = 1 THEN PERFORM pg_sleep(60); END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON intake_keys
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit_once();",
    );
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;

    let committing = format!(
        "SELECT COUNT(*) AS n FROM pg_stat_activity
          WHERE application_name = '{schema}' AND query LIKE '%plan_intake_write%' AND wait_event = 'PgSleep'"
    );
    let cancel = format!(
        "SELECT COUNT(pg_cancel_backend(pid)) AS n FROM pg_stat_activity
          WHERE application_name = '{schema}' AND query LIKE '%plan_intake_write%' AND wait_event = 'PgSleep'"
    );
    let cancel_the_commit = async {
        wait_until("the service sleeps inside its commit", || {
            scalar(&mut app.conn(), &committing) == 1
        })
        .await;
        assert_eq!(scalar(&mut app.conn(), &cancel), 1);
    };
    let (answer, ()) = futures_util::join!(
        send(&service, post_plan(&token, "k", &plan_body("run-1", "x"))),
        cancel_the_commit
    );

    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert_eq!(
        app.metrics()
            .unknown_commit_count(UnknownCommitBranch::NotLanded),
        1
    );
    assert_eq!(
        app.metrics().retry_count("statement_cancelled"),
        0,
        "a cancelled COMMIT is not a plain retry"
    );
    assert_eq!(app.count("plans"), 1);
}

/// Our transaction holds plan X and waits for key K; the blocker holds K and
/// then asks for X. The victim is the session whose `deadlock_timeout`
/// expires first with the cycle in place: ours (2 s) rather than the
/// blocker's (60 s); the service retries the whole transaction.
#[actix_web::test]
async fn a_real_deadlock_is_retried_and_counted() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let schema = scratch.schema.clone().unwrap_or_default();
    let direct_url = scratch.url.clone();
    let url = scratch.postgres_url_with(&[("deadlock_timeout", "2000")]);
    let app = TestApp::with(
        scratch,
        AppOptions {
            url: Some(url),
            ..AppOptions::default()
        },
    );
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let body = plan_body("run-1", "x");
    let same_plan = competing_plan("planner-a", &body);

    let mut blocker = hold_plan_and_key(
        &direct_url,
        "SET deadlock_timeout = '60s';",
        "rcpt_blocker",
        "blocker-run",
        "k",
    );

    let waiting = format!(
        "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE application_name = '{schema}' AND wait_event_type = 'Lock'"
    );
    let close_the_cycle = async {
        wait_until("the service waits for the key", || {
            scalar(&mut app.conn(), &waiting) >= 1
        })
        .await;
        let sql = hand_written_plan_sql(
            "rcpt_blocker_2",
            "planner-a",
            "'run-1'",
            &same_plan.content_hash,
        );
        web::block(move || {
            let result = blocker.batch_execute(&sql);
            blocker.batch_execute("ROLLBACK").expect("rollback");
            result
        })
        .await
        .expect("blocking")
    };
    let (answer, blocker_insert) = futures_util::join!(
        send(&service, post_plan(&token, "k", &body)),
        close_the_cycle
    );

    assert!(
        blocker_insert.is_ok(),
        "Postgres chose the blocker as the victim: {blocker_insert:?}"
    );
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert!(
        app.metrics().retry_count("deadlock") >= 1,
        "the deadlock was not retried"
    );
    assert_eq!(app.count("plans"), 1);
}

/// A second connection holds SQLite's write lock: `BEGIN IMMEDIATE` meets
/// SQLITE_BUSY after the busy timeout, and the write is retried.
#[actix_web::test]
async fn sqlite_busy_is_retried_and_counted_then_503_when_the_lock_outlives_the_budget() {
    let scratch = TestDb::sqlite();
    let path = scratch.url.trim_start_matches("sqlite://").to_owned();
    let options = AppOptions {
        pool: PoolOptions {
            max_size: 4,
            sqlite_busy_timeout: Duration::from_millis(20),
            ..PoolOptions::default()
        },
        retry: RetryPolicy {
            max_attempts: 3,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(5),
        },
        ..AppOptions::default()
    };
    let app = TestApp::with(scratch, options);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;

    let mut holder = SqliteConnection::establish(&path).expect("open");
    holder
        .batch_execute("BEGIN IMMEDIATE")
        .expect("take the write lock");

    let answer = send(&service, post_plan(&token, "k1", &plan_body("run-1", "x"))).await;
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        answer.body
    );
    assert_eq!(app.metrics().retry_count("sqlite_busy"), 2);
    assert_eq!(app.count("plans"), 0);

    // A patient write path, and a lock released once it has been retried.
    let patient = Intake::new(
        app.intake.database().clone(),
        RetryPolicy {
            max_attempts: 1000,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(5),
        },
        Metrics::new(),
    );
    let metrics = patient.metrics.clone();
    let patient_service = app.service_with(patient).await;
    let release = async {
        wait_until("a busy write was retried", || {
            metrics.retry_count("sqlite_busy") >= 1
        })
        .await;
        holder.batch_execute("ROLLBACK").expect("release the lock");
    };
    let (answer, ()) = futures_util::join!(
        send(
            &patient_service,
            post_plan(&token, "k2", &plan_body("run-2", "y"))
        ),
        release
    );
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert!(metrics.retry_count("sqlite_busy") >= 1);
    assert_eq!(app.count("plans"), 1);
}

/// CI runs the suite against a server whose `lc_messages` is German
/// (`.ci/run` sets it on the test database); every class above and below is
/// then decided with German messages.
#[actix_web::test]
async fn the_server_answers_in_the_configured_language() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let Ok(expected) = std::env::var("PLAN_INTAKE_TEST_LC_MESSAGES") else {
        // Under CI (Postgres required) the German server is part of the
        // run: a missing setting fails it instead of passing silently.
        assert!(
            std::env::var_os(crate::support::REQUIRE_POSTGRES_VAR).is_none(),
            "PLAN_INTAKE_TEST_LC_MESSAGES is not set, so nothing checks that failures are classed without reading messages"
        );
        eprintln!("SKIPPING the server-language check: PLAN_INTAKE_TEST_LC_MESSAGES is not set");
        return;
    };
    let app = TestApp::new(scratch);
    let mut conn = app.conn();
    let failed = plan_intake::with_conn!(&mut *conn, c => c.batch_execute("SELECT 1/0"))
        .expect_err("division by zero");
    let message = failed.to_string();
    assert!(
        !message.contains("division by zero"),
        "the server answers in English, not {expected}: {message}"
    );
}

/// Runs `sql` (a DBA's trigger or rule) in the scratch schema.
fn install(app: &TestApp, sql: &str) {
    crate::support::execute_batch(&mut app.conn(), sql);
}

/// The first insert into `plans` fails with `40001` raised by a trigger, as
/// a serializable DBA job or a replica conflict would: retried, then 201.
#[actix_web::test]
async fn a_serialization_failure_is_retried_and_counted() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let app = TestApp::new(scratch);
    install(
        &app,
        "CREATE SEQUENCE fail_once_seq;
         CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('fail_once_seq') = 1 THEN
                 RAISE EXCEPTION 'serialisierung' USING ERRCODE = '40001';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER fail_once BEFORE INSERT ON plans FOR EACH ROW EXECUTE FUNCTION fail_once();",
    );
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let answer = send(&service, post_plan(&token, "k", &plan_body("run-1", "x"))).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert_eq!(app.metrics().retry_count("serialization_failure"), 1);
    app.assert_rows(1, 1);
}

/// A CHECK rule a DBA added refuses the plan: the request itself is refused
/// (422 naming the rule), never retried, nothing written.
#[actix_web::test]
async fn a_check_rule_of_the_table_refuses_the_request_with_422() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let app = TestApp::new(scratch);
    install(
        &app,
        "ALTER TABLE plans ADD CONSTRAINT plans_run_id_short_ck CHECK (length(run_id) < 10)",
    );
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let answer = send(
        &service,
        post_plan(&token, "k", &plan_body("a-very-long-run-id", "x")),
    )
    .await;
    answer.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "refused-by-database");
    assert!(
        answer.body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("plans_run_id_short_ck")),
        "{:?}",
        answer.body
    );
    for cause in plan_intake::storage::errors::TransientCause::ALL {
        assert_eq!(app.metrics().retry_count(cause.as_str()), 0);
    }
    assert_eq!(app.metrics().outcome_count("refused"), 1);
    app.assert_rows(0, 0);
}

/// A trigger sleeps in the first write; the statement is cancelled (57014)
/// while it runs: the function's work rolled back, so the write is retried.
#[actix_web::test]
async fn a_statement_cancelled_while_writing_is_retried() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let (app, schema) = TestApp::named(scratch);
    install(
        &app,
        "CREATE SEQUENCE slow_once_seq;
         CREATE FUNCTION slow_once() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('slow_once_seq') = 1 THEN PERFORM pg_sleep(60); END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER slow_once BEFORE INSERT ON plans FOR EACH ROW EXECUTE FUNCTION slow_once();",
    );
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let sleeping = format!(
        "SELECT COUNT(pg_cancel_backend(pid)) AS n FROM pg_stat_activity
          WHERE application_name = '{schema}' AND wait_event = 'PgSleep'"
    );
    let cancel = async {
        wait_until("the write sleeps in its trigger", || {
            scalar(&mut app.conn(), &sleeping) == 1
        })
        .await;
    };
    let (answer, ()) = futures_util::join!(
        send(&service, post_plan(&token, "k", &plan_body("run-1", "x"))),
        cancel
    );
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert_eq!(app.metrics().retry_count("statement_cancelled"), 1);
    app.assert_rows(1, 1);
}

/// A write that runs past the deadline is ended by the session's
/// `statement_timeout` (derived from the deadline): 503 in time, counted as a
/// timeout, nothing written.
#[actix_web::test]
async fn a_statement_past_the_deadline_is_ended_by_the_server_and_answered_503() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let deadline = Duration::from_millis(1000);
    let app = TestApp::with(
        scratch,
        AppOptions {
            request_timeout: deadline,
            ..AppOptions::default()
        },
    );
    install(
        &app,
        "CREATE FUNCTION slow_always() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(30); RETURN NEW; END $$;
         CREATE TRIGGER slow_always BEFORE INSERT ON plans FOR EACH ROW EXECUTE FUNCTION slow_always();",
    );
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let started = std::time::Instant::now();
    let answer = send(&service, post_plan(&token, "k", &plan_body("run-1", "x"))).await;
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        answer.body
    );
    assert!(answer.header("retry-after").is_some());
    assert!(started.elapsed() < deadline + Duration::from_millis(500));
    assert_eq!(app.metrics().timeout_count("/v1/plans"), 1);
    // The server ended the statement: no session of the service still sleeps.
    let direct = &app.direct;
    wait_until("the server cancels the sleeping write", || {
        scalar(
            &mut direct.conn().expect("conn"),
            "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE '%plan_intake_write%'",
        ) == 0
    })
    .await;
    app.assert_rows(0, 0);
}

/// Every pooled connection is terminated by the server (as a restart or a
/// DBA's `pg_terminate_backend` would) between two requests: the next
/// request's login lookup meets a dead connection, which is discarded, and
/// the step is made again on a fresh one.
#[actix_web::test]
async fn connections_the_server_closed_are_replaced_without_a_failed_request() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let (app, schema) = TestApp::named(scratch);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    // Fill the pool with several open connections.
    let answers = futures_util::future::join_all((0..4).map(|i| {
        send(
            &service,
            post_plan(
                &token,
                &format!("warm-{i}"),
                &plan_body(&format!("warm-{i}"), "x"),
            ),
        )
    }))
    .await;
    assert!(answers.iter().all(|a| a.status == StatusCode::CREATED));
    let terminated = scalar(
        &mut app.conn(),
        &format!(
            "SELECT COUNT(pg_terminate_backend(pid)) AS n FROM pg_stat_activity WHERE application_name = '{schema}'"
        ),
    );
    assert!(terminated >= 1, "no pooled connection to terminate");

    let answer = send(&service, post_plan(&token, "k", &plan_body("run-1", "x"))).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    let receipt = answer.body["receipt_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let read = send(
        &service,
        crate::support::get(&token, &format!("/v1/receipts/{receipt}")),
    )
    .await;
    assert_eq!(read.status, StatusCode::OK);
    app.assert_rows(5, 5);
}

/// The log's proofs too: every pooled connection terminated by the server
/// between two reads, the next extension read meets a dead connection,
/// which is discarded, and the read made again, never a 500 (the soak
/// found one: PgBouncer killed under a verifying reader's wait).
#[actix_web::test]
async fn a_proof_read_on_a_connection_the_server_closed_is_made_again() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let (app, schema) = TestApp::named(scratch);
    let token = app.login("planner-a", PLANNER);
    let (key, _) = plan_intake::intake::signing::SigningKey::generate("faults").expect("a key");
    let intake = app.intake.clone().signing_with(std::sync::Arc::new(key));
    let service = app.service_with(intake.clone()).await;
    for i in 0..3 {
        let run = format!("run-{i}");
        let answer = send(&service, post_plan(&token, &run, &plan_body(&run, "x"))).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    }
    intake
        .append_receipts("plan-intake.test/faults", 100, None, None)
        .expect("a round of the log");
    let extension = "/v1/checkpoint/extension?size=3";
    // Fill the pool with several open connections.
    let warm = futures_util::future::join_all(
        (0..4).map(|_| send(&service, crate::support::get(&token, extension))),
    )
    .await;
    assert!(
        warm.iter().all(|a| a.status == StatusCode::OK),
        "{:?}",
        warm[0].body
    );
    let terminated = scalar(
        &mut app.conn(),
        &format!(
            "SELECT COUNT(pg_terminate_backend(pid)) AS n FROM pg_stat_activity WHERE application_name = '{schema}'"
        ),
    );
    assert!(terminated >= 1, "no pooled connection to terminate");
    let answer = send(&service, crate::support::get(&token, extension)).await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
}

/// A proof's hash reads too: the connection dies while the tree code
/// reads stored hashes (the soak found it: PgBouncer's "server conn
/// crashed?" in the middle of an extension's proof after the primary
/// restarted). The database's error was taken for the tree's, a 500
/// ("does not make a tree"); it is the database's, and the read is made
/// again on another connection.
#[actix_web::test]
async fn a_connection_lost_while_a_proof_reads_its_hashes_is_read_again() {
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let (app, schema) = TestApp::named(scratch);
    let token = app.login("planner-a", PLANNER);
    let (key, _) = plan_intake::intake::signing::SigningKey::generate("faults").expect("a key");
    let intake = app.intake.clone().signing_with(std::sync::Arc::new(key));
    let service = app.service_with(intake.clone()).await;
    for i in 0..3 {
        let run = format!("run-{i}");
        let answer = send(&service, post_plan(&token, &run, &plan_body(&run, "x"))).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    }
    intake
        .append_receipts("plan-intake.test/faults", 100, None, None)
        .expect("a round of the log");
    // From 1 leaf to the newest 3: a proof read from the stored hashes,
    // which wait behind a lock the test holds.
    let holder = lock_the_stored_hashes(&app);
    let read = send(
        &service,
        crate::support::get(&token, "/v1/checkpoint/extension?size=1"),
    );
    // The connection dies under the waiting read; then the lock goes.
    let kill = kill_the_hash_read(&app, &schema, holder);
    let (answer, ()) = futures_util::future::join(read, kill).await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
}

/// An append round's hash reads too: the connection lost while the tree
/// code reads stored hashes is the database's failure, which the appender
/// retries, never "the stored hashes do not make a tree" or "not an
/// extension of what was signed", which mark the log stuck until an
/// operator looks.
#[actix_web::test]
async fn a_connection_lost_while_an_append_reads_its_hashes_is_no_verdict_on_the_log() {
    use plan_intake::storage::receipt_log::AppendError;
    let Some(scratch) = TestDb::postgres() else {
        return;
    };
    let (app, schema) = TestApp::named(scratch);
    let token = app.login("planner-a", PLANNER);
    let (key, _) = plan_intake::intake::signing::SigningKey::generate("faults").expect("a key");
    let intake = app.intake.clone().signing_with(std::sync::Arc::new(key));
    let service = app.service_with(intake.clone()).await;
    let origin = "plan-intake.test/faults";
    for run in ["a", "b", "c", "d", "e"] {
        let answer = send(&service, post_plan(&token, run, &plan_body(run, "x"))).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
        if run == "c" {
            intake
                .append_receipts(origin, 100, None, None)
                .expect("a first round of the log");
        }
    }
    // The next round's new leaves need the stored hashes of the first
    // three, which wait behind a lock the test holds.
    let holder = lock_the_stored_hashes(&app);
    let appending = {
        let intake = intake.clone();
        std::thread::spawn(move || {
            intake
                .append_receipts(origin, 100, None, None)
                .map(|_| ())
                .map_err(|e| {
                    let verdict = match e.downcast_ref::<AppendError>() {
                        Some(AppendError::Database(_)) => "database",
                        Some(AppendError::Tree(_)) => "tree",
                        Some(AppendError::Inconsistent { .. }) => "inconsistent",
                        _ => "other",
                    };
                    format!("{verdict}: {e}")
                })
        })
    };
    kill_the_hash_read(&app, &schema, holder).await;
    let round = appending.join().expect("the round's thread");
    let error = round.expect_err("the round's connection was terminated");
    assert!(error.starts_with("database: "), "{error}");
    // The next round, on another connection, appends the two.
    let appended = intake
        .append_receipts(origin, 100, None, None)
        .expect("the next round")
        .expect("appended");
    assert_eq!(appended.to, 5);
}

/// A connection of the test's own holding `receipt_log_hashes` locked
/// (until [`kill_the_hash_read`] lets it go).
fn lock_the_stored_hashes(app: &TestApp) -> plan_intake::storage::PooledConn {
    let mut holder = app.conn();
    plan_intake::with_conn!(&mut *holder, c => c.batch_execute(
        "BEGIN; LOCK TABLE receipt_log_hashes IN ACCESS EXCLUSIVE MODE"
    ))
    .expect("the hashes locked");
    holder
}

/// Once one of the service's sessions waits for the lock `holder` keeps,
/// that session is terminated, then the lock let go.
async fn kill_the_hash_read(
    app: &TestApp,
    schema: &str,
    mut holder: plan_intake::storage::PooledConn,
) {
    let waiting = format!(
        "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE application_name = '{schema}' \
         AND wait_event_type = 'Lock' AND query LIKE '%receipt_log_hashes%'"
    );
    wait_until("a hash read waits for the lock", || {
        scalar(&mut app.conn(), &waiting) == 1
    })
    .await;
    let terminated = scalar(
        &mut app.conn(),
        &format!(
            "SELECT COUNT(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
             WHERE application_name = '{schema}' AND wait_event_type = 'Lock'"
        ),
    );
    assert_eq!(terminated, 1);
    plan_intake::with_conn!(&mut *holder, c => c.batch_execute("COMMIT")).expect("released");
}
