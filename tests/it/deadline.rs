//! Every request is answered within its deadline: a real lock held by
//! another session for longer than the deadline gives every waiting request
//! a 503 + `Retry-After` in time, frees its connection, writes nothing; the
//! same keys land exactly once after the lock is gone. Health and metrics
//! keep answering meanwhile.

use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use actix_web::test::TestRequest;
use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection, SqliteConnection};
use plan_intake::intake::Permission;
use plan_intake::storage::Backend;

use crate::on_both_backends;
use crate::support::{AppOptions, TestApp, TestDb, plan_body, post_plan, send};

on_both_backends!(a_lock_held_past_the_deadline_answers_503_in_time_then_each_key_lands_once);

const DEADLINE: Duration = Duration::from_millis(1500);
/// What "within the deadline" allows for scheduling on a loaded 2-core machine.
const MARGIN: Duration = Duration::from_millis(500);
const WRITERS: usize = 6;

/// Another session holding the write lock (Postgres: `LOCK TABLE plans` as a
/// DBA would; SQLite: `BEGIN IMMEDIATE` on its own connection).
enum Holder {
    Postgres(PgConnection),
    Sqlite(SqliteConnection),
}

impl Holder {
    fn take(backend: Backend, url: &str) -> Self {
        match backend {
            Backend::Postgres => {
                let mut session = PgConnection::establish(url).expect("connect");
                session
                    .batch_execute("BEGIN; LOCK TABLE plans IN ACCESS EXCLUSIVE MODE;")
                    .expect("lock plans");
                Holder::Postgres(session)
            }
            Backend::Sqlite => {
                let path = url.trim_start_matches("sqlite://");
                let mut session = SqliteConnection::establish(path).expect("open");
                session
                    .batch_execute("BEGIN IMMEDIATE")
                    .expect("take the write lock");
                Holder::Sqlite(session)
            }
        }
    }

    fn release(self) {
        match self {
            Holder::Postgres(mut c) => c.batch_execute("ROLLBACK"),
            Holder::Sqlite(mut c) => c.batch_execute("ROLLBACK"),
        }
        .expect("release the lock");
    }
}

async fn a_lock_held_past_the_deadline_answers_503_in_time_then_each_key_lands_once(db: TestDb) {
    let (backend, url) = (db.backend, db.url.clone());
    let app = TestApp::with(
        db,
        AppOptions {
            request_timeout: DEADLINE,
            ..AppOptions::default()
        },
    );
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let holder = Holder::take(backend, &url);

    let timed = |i: usize| {
        let service = &service;
        let token = &token;
        async move {
            let started = Instant::now();
            let body = plan_body(&format!("run-{i}"), "x");
            let answer = send(service, post_plan(token, &format!("k{i}"), &body)).await;
            (answer, started.elapsed())
        }
    };
    let health = async {
        // While every writer waits: the process answers for itself.
        let healthz = send(&service, TestRequest::get().uri("/healthz")).await;
        let metrics = send(&service, TestRequest::get().uri("/metrics")).await;
        (healthz.status, metrics.status)
    };
    let (answers, health) = futures_util::join!(
        futures_util::future::join_all((0..WRITERS).map(timed)),
        health
    );
    assert_eq!(health, (StatusCode::OK, StatusCode::OK));
    for (answer, took) in &answers {
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{:?}",
            answer.body
        );
        assert!(answer.header("retry-after").is_some());
        assert!(
            *took <= DEADLINE + MARGIN,
            "answered after {took:?}, deadline {DEADLINE:?}"
        );
    }
    assert_eq!(
        app.metrics().timeout_count("/v1/plans"),
        WRITERS as u64,
        "every late answer is counted as a timeout"
    );
    // The work behind each 503 goes on until its own database timeouts end
    // it; then it gives its connection back and has written nothing, even
    // before the lock is released.
    pool_settles(&app).await;
    holder.release();
    app.assert_rows(0, 0);

    for i in 0..WRITERS {
        let body = plan_body(&format!("run-{i}"), "x");
        let first = send(&service, post_plan(&token, &format!("k{i}"), &body)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
        let again = send(&service, post_plan(&token, &format!("k{i}"), &body)).await;
        assert_eq!(again.status, StatusCode::OK);
    }
    app.assert_rows(WRITERS as i64, WRITERS as i64);
}

on_both_backends!(a_replay_is_answered_from_a_read_while_writes_are_locked_out);

/// A replay whose key row is committed costs a read, not a write: with the
/// write lock held elsewhere (Postgres: `LOCK TABLE plans IN EXCLUSIVE
/// MODE`, which lets reads through; SQLite: another connection's `BEGIN
/// IMMEDIATE`), the replay and the reused key are answered at once while a
/// new plan waits out its deadline.
async fn a_replay_is_answered_from_a_read_while_writes_are_locked_out(db: TestDb) {
    let (backend, url) = (db.backend, db.url.clone());
    let app = TestApp::with(
        db,
        AppOptions {
            request_timeout: DEADLINE,
            ..AppOptions::default()
        },
    );
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let body = plan_body("run-1", "x");
    let first = send(&service, post_plan(&token, "k", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED);

    let holder = match backend {
        Backend::Postgres => {
            let mut session = PgConnection::establish(&url).expect("connect");
            session
                .batch_execute("BEGIN; LOCK TABLE plans IN EXCLUSIVE MODE;")
                .expect("lock out writers");
            Holder::Postgres(session)
        }
        Backend::Sqlite => Holder::take(backend, &url),
    };
    let started = Instant::now();
    let replay = send(&service, post_plan(&token, "k", &body)).await;
    assert_eq!(replay.status, StatusCode::OK, "{:?}", replay.body);
    assert_eq!(replay.body["receipt_id"], first.body["receipt_id"]);
    let reused = send(
        &service,
        post_plan(&token, "k", &plan_body("run-1", "other")),
    )
    .await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        started.elapsed() < DEADLINE / 2,
        "the replay waited for the write lock"
    );
    // A new plan waits for the lock until its deadline; a replay sent while
    // its batch waits is still answered from a read at once (the batches'
    // writers do not all wait behind the locked-out one).
    let label = match backend {
        Backend::Postgres => "postgres",
        Backend::Sqlite => "sqlite",
    };
    let (batches_before, _) = app.metrics().write_batch_totals(label);
    let new = send(&service, post_plan(&token, "k2", &plan_body("run-2", "x")));
    let begun = Box::pin(crate::support::wait_until(
        "the new plan's batch began",
        || app.metrics().write_batch_totals(label).0 > batches_before,
    ));
    futures_util::pin_mut!(new);
    let new = match futures_util::future::select(new, begun).await {
        futures_util::future::Either::Left((new, _)) => {
            panic!(
                "the new plan was answered before its batch began: {:?}",
                new.body
            )
        }
        futures_util::future::Either::Right(((), new)) => new,
    };
    let replay_sent = Instant::now();
    let (new, again) = futures_util::join!(new, async {
        let again = send(&service, post_plan(&token, "k", &body)).await;
        (again, replay_sent.elapsed())
    });
    let (again, waited) = again;
    assert_eq!(again.status, StatusCode::OK, "{:?}", again.body);
    assert!(
        waited < DEADLINE / 2,
        "the replay waited {waited:?} behind the new plan's batch"
    );
    assert_eq!(
        new.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "a new plan needs the write lock"
    );
    // Had the write behind that 503 not been ended by its own timeout, it
    // would land once the lock is gone.
    pool_settles(&app).await;
    holder.release();
    app.assert_rows(1, 1);
}

/// Waits (bounded) until every pooled connection is idle again: the work a
/// deadline answered for has ended.
async fn pool_settles(app: &TestApp) {
    crate::support::wait_until("the timed-out work gave its connections back", || {
        let pool = app.intake.database().pool_state();
        pool.connections == pool.idle_connections
    })
    .await;
}
