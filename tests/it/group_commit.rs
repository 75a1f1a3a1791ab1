//! SQLite group commit's failure paths: a batch's writer that panics
//! inside its transaction, and a COMMIT that fails. Every writer in that batch is
//! answered 503 (never 500), the failure is counted, nothing of the batch
//! lands, and each retry with its key lands once.

use actix_web::http::StatusCode;
use plan_intake::intake::Permission;

use crate::support::{TestApp, TestDb, execute_batch, plan_body, post_plan, send};

const WRITERS: usize = 8;

async fn burst_then_retry(app: &TestApp, reason: &str, heal: impl FnOnce()) {
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let body = |i: usize| plan_body(&format!("run-{i}"), "x");
    let answers = futures_util::future::join_all(
        (0..WRITERS).map(|i| send(&service, post_plan(&token, &format!("k{i}"), &body(i)))),
    )
    .await;
    let failed = answers
        .iter()
        .filter(|a| a.status == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    for answer in &answers {
        assert!(
            [StatusCode::CREATED, StatusCode::SERVICE_UNAVAILABLE].contains(&answer.status),
            "{:?}",
            answer.body
        );
        if answer.status == StatusCode::SERVICE_UNAVAILABLE {
            assert!(answer.header("retry-after").is_some());
        }
    }
    assert!(failed >= 1, "the failing batch answered nobody with 503");
    assert_eq!(
        app.metrics().group_commit_failure_count(reason),
        failed as u64
    );
    assert_eq!(app.metrics().outcome_count("error"), 0);
    let created = WRITERS - failed;
    app.assert_rows(created as i64, created as i64);

    heal();
    for i in 0..WRITERS {
        let again = send(&service, post_plan(&token, &format!("k{i}"), &body(i))).await;
        assert!(
            [StatusCode::CREATED, StatusCode::OK].contains(&again.status),
            "{:?}",
            again.body
        );
    }
    app.assert_rows(WRITERS as i64, WRITERS as i64);
}

#[actix_web::test]
async fn a_leader_that_panics_answers_its_batch_503() {
    let app = TestApp::new(TestDb::sqlite());
    app.intake.database().panic_in_next_batch();
    burst_then_retry(&app, "leader_panicked", || {}).await;
}

/// A deferred foreign key that a trigger breaks: SQLite checks it at COMMIT,
/// so the batch's COMMIT itself fails, for as long as the switch is on.
#[actix_web::test]
async fn a_failed_group_commit_answers_its_batch_503() {
    let app = TestApp::new(TestDb::sqlite());
    execute_batch(
        &mut app.conn(),
        "CREATE TABLE guard_parent (id INTEGER PRIMARY KEY);
         CREATE TABLE guard_child (parent INTEGER REFERENCES guard_parent (id) DEFERRABLE INITIALLY DEFERRED);
         CREATE TABLE guard_switch (on_ INTEGER NOT NULL);
         INSERT INTO guard_switch VALUES (1);
         CREATE TRIGGER break_commit AFTER INSERT ON plans WHEN (SELECT on_ FROM guard_switch) = 1
         BEGIN INSERT INTO guard_child VALUES (-1); END;",
    );
    let heal = || execute_batch(&mut app.conn(), "UPDATE guard_switch SET on_ = 0");
    burst_then_retry(&app, "commit_failed", heal).await;
}
