//! Postgres group commit: plans queued together are written by one
//! statement and one commit, each with its own outcome. Each test forces
//! one batch (the `gather_next_batch` seam holds the writers until N plans
//! are queued) and checks that it was one batch of N.

use actix_web::http::StatusCode;
use futures_util::future::join_all;
use plan_intake::intake::Permission;
use plan_intake::storage::MigrateOnOpen;

use crate::support::proxy::Fault;
use crate::support::{
    Answer, AppOptions, TestApp, TestDb, execute_batch, get, instance, plan_body, post_plan, send,
    wait_until,
};

const PLANNER: &[Permission] = &[Permission::PlansSubmit];

fn batch_of(app: &TestApp) -> (u64, f64) {
    app.metrics().write_batch_totals("postgres")
}

fn statuses(answers: &[Answer]) -> Vec<(u16, String)> {
    answers
        .iter()
        .map(|a| (a.status.as_u16(), a.body.to_string()))
        .collect()
}

/// One batch of ten: new plans, a replay, a reused key, content already
/// kept under another key, the same key twice, the same content under two
/// keys, and a login revoked since the door last saw it. Each gets the
/// answer it would get alone, settled in the batch's order.
#[actix_web::test]
async fn one_batch_gives_each_plan_its_own_outcome() {
    let Some(db) = TestDb::postgres() else { return };
    let app = TestApp::new(db);
    let planner = app.login("planner-a", PLANNER);
    let leaving = app.login("planner-b", PLANNER);
    let service = app.service().await;
    let kept = send(
        &service,
        post_plan(&planner, "K-old", &plan_body("run-0", "x")),
    )
    .await;
    assert_eq!(kept.status, StatusCode::CREATED);
    // The door remembers planner-b for a few seconds; the write itself
    // checks the login again.
    let seen = send(
        &service,
        post_plan(&leaving, "b0", &plan_body("run-b", "x")),
    )
    .await;
    assert_eq!(seen.status, StatusCode::CREATED);
    plan_intake::intake::login::revoke(&mut app.conn(), "planner-b").expect("revoke");
    app.assert_rows(2, 2);
    let before = batch_of(&app);

    let requests = [
        (&planner, "k1", plan_body("run-1", "a")),
        (&planner, "k2", plan_body("run-2", "b")),
        (&planner, "K-old", plan_body("run-0", "x")),
        (&planner, "K-old", plan_body("run-0", "other")),
        (&planner, "k-new", plan_body("run-0", "x")),
        (&planner, "twice", plan_body("run-3", "c")),
        (&planner, "twice", plan_body("run-3", "c")),
        (&planner, "c1", plan_body("run-4", "d")),
        (&planner, "c2", plan_body("run-4", "d")),
        (&leaving, "b1", plan_body("run-5", "e")),
    ];
    app.intake.database().gather_next_batch(requests.len());
    let answers = join_all(
        requests
            .iter()
            .map(|(token, key, body)| send(&service, post_plan(token, key, body))),
    )
    .await;
    let after = batch_of(&app);
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, requests.len() as f64),
        "one batch of all of them: {:?}",
        statuses(&answers)
    );

    assert_eq!(answers[0].status, StatusCode::CREATED);
    assert_eq!(answers[1].status, StatusCode::CREATED);
    assert_eq!(answers[2].status, StatusCode::OK);
    assert_eq!(answers[2].body["outcome"], "replayed");
    assert_eq!(answers[2].body["receipt_id"], kept.body["receipt_id"]);
    answers[3].assert_key_reused();
    assert_eq!(answers[4].status, StatusCode::OK);
    assert_eq!(answers[4].body["outcome"], "already_received");
    assert_eq!(answers[4].body["receipt_id"], kept.body["receipt_id"]);
    // The same key twice: one writes, the other replays it.
    let mut twice =
        [&answers[5], &answers[6]].map(|a| (a.status.as_u16(), a.body["outcome"].clone()));
    twice.sort_by_key(|(status, _)| *status);
    assert_eq!(
        twice,
        [(200, "replayed".into()), (201, "created".into())],
        "{:?}",
        statuses(&answers)
    );
    assert_eq!(answers[5].body["receipt_id"], answers[6].body["receipt_id"]);
    // The same content under two keys: one plan, both keys bound to it.
    let mut content =
        [&answers[7], &answers[8]].map(|a| (a.status.as_u16(), a.body["outcome"].clone()));
    content.sort_by_key(|(status, _)| *status);
    assert_eq!(
        content,
        [(200, "already_received".into()), (201, "created".into())]
    );
    assert_eq!(answers[7].body["receipt_id"], answers[8].body["receipt_id"]);
    answers[9].assert_problem(StatusCode::UNAUTHORIZED, "unauthorized");
    assert_eq!(app.metrics().write_batches_split_count(), 0);
    app.assert_rows(6, 8);

    // Every key is bound to its first answer.
    for (key, body, outcome) in [
        ("twice", plan_body("run-3", "c"), "replayed"),
        ("c1", plan_body("run-4", "d"), "replayed"),
        ("c2", plan_body("run-4", "d"), "replayed"),
        ("k-new", plan_body("run-0", "x"), "replayed"),
    ] {
        let again = send(&service, post_plan(&planner, key, &body)).await;
        assert_eq!(again.body["outcome"], outcome, "{key}: {:?}", again.body);
    }
    app.assert_rows(6, 8);

    // Plans that share one transaction join the feed once each, page by page.
    let reader = app.login("ordering", &[Permission::ReceiptsRead]);
    let mut seen = Vec::new();
    let mut uri = "/v1/receipts?limit=2".to_owned();
    loop {
        let page = send(&service, get(&reader, &uri)).await;
        assert_eq!(page.status, StatusCode::OK, "{:?}", page.body);
        let receipts = page.body["receipts"].as_array().expect("receipts").clone();
        if receipts.is_empty() {
            break;
        }
        seen.extend(receipts.iter().map(|r| r["receipt_id"].to_string()));
        uri = format!(
            "/v1/receipts?limit=2&after={}",
            page.body["next"].as_str().expect("next")
        );
    }
    let unique: std::collections::HashSet<_> = seen.iter().collect();
    assert_eq!((seen.len(), unique.len()), (6, 6), "{seen:?}");
}

/// A CHECK rule refuses one plan of a batch: the batch is written again
/// one plan at a time, so that plan alone is refused (422) and the others
/// land.
#[actix_web::test]
async fn a_check_failure_inside_a_batch_fails_only_its_plan() {
    let Some(db) = TestDb::postgres() else { return };
    let app = TestApp::new(db);
    execute_batch(
        &mut app.conn(),
        "ALTER TABLE plans ADD CONSTRAINT no_forbidden_runs CHECK (run_id <> 'run-forbidden')",
    );
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let runs = ["run-1", "run-2", "run-forbidden", "run-3", "run-4", "run-5"];
    app.intake.database().gather_next_batch(runs.len());
    let answers = join_all(
        runs.iter()
            .map(|run| send(&service, post_plan(&token, run, &plan_body(run, "x")))),
    )
    .await;
    assert_eq!(batch_of(&app), (1, runs.len() as f64));
    for (run, answer) in runs.iter().zip(&answers) {
        if *run == "run-forbidden" {
            answer.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "refused-by-database");
        } else {
            assert_eq!(
                answer.status,
                StatusCode::CREATED,
                "{run}: {:?}",
                answer.body
            );
        }
    }
    assert_eq!(app.metrics().write_batches_split_count(), 1);
    app.assert_rows(5, 5);
}

/// Two instances write batches of the same 16 plans, queued in opposite
/// orders. Both lock rows in the order of the conflict keys, so neither
/// waits on the other in a cycle: no deadlock, no batch split, and every
/// key ends with one plan that both instances answer with.
#[actix_web::test]
async fn two_instances_batches_over_the_same_keys_do_not_deadlock() {
    let Some(db) = TestDb::postgres() else { return };
    let url = db.url.clone();
    let app = TestApp::new(db);
    // Each plan's insert takes 20 ms, so the two batches (320 ms each)
    // surely overlap.
    execute_batch(
        &mut app.conn(),
        "CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN PERFORM pg_sleep(0.02); RETURN NEW; END $$;
         CREATE TRIGGER slow_insert BEFORE INSERT ON plans
           FOR EACH ROW EXECUTE FUNCTION slow_insert();",
    );
    let other = instance(&url, MigrateOnOpen::Skip);
    let token = app.login("planner-a", PLANNER);
    let here = app.service().await;
    let there = app.service_with(other.clone()).await;
    let plans: Vec<(String, String)> = (0..16)
        .map(|i| (format!("k{i:02}"), plan_body(&format!("run-{i}"), "x")))
        .collect();
    app.intake.database().gather_next_batch(plans.len());
    other.database().gather_next_batch(plans.len());
    let forward = join_all(
        plans
            .iter()
            .map(|(k, b)| send(&here, post_plan(&token, k, b))),
    );
    let backward = join_all(
        plans
            .iter()
            .rev()
            .map(|(k, b)| send(&there, post_plan(&token, k, b))),
    );
    let (forward, mut backward) = futures_util::join!(forward, backward);
    backward.reverse();
    for ((key, _), (a, b)) in plans.iter().zip(forward.iter().zip(&backward)) {
        for answer in [a, b] {
            assert!(
                [StatusCode::CREATED, StatusCode::OK].contains(&answer.status),
                "{key}: {:?}",
                answer.body
            );
        }
        assert_eq!(a.body["receipt_id"], b.body["receipt_id"], "{key}");
    }
    assert_eq!(batch_of(&app), (1, 16.0));
    assert_eq!(other.metrics.write_batch_totals("postgres"), (1, 16.0));
    assert_eq!(
        app.metrics().write_batches_split_count() + other.metrics.write_batches_split_count(),
        0,
        "a batch failed (a deadlock?) and was split"
    );
    app.assert_rows(16, 16);
}

/// The connection drops while a batch's statement commits (the server
/// committed; the answer is lost) or before it reaches the server: every
/// plan of the batch settles by its own re-read, each exactly once.
#[actix_web::test]
async fn a_connection_cut_during_a_batch_settles_every_plan_once() {
    for fault in [Fault::CutAfterCommit, Fault::CutBeforeCommit] {
        let Some((app, proxy, _)) = crate::faults::behind_proxy_with(AppOptions::default().pool)
        else {
            return;
        };
        let token = app.login("planner-a", PLANNER);
        let service = app.service().await;
        proxy.arm(fault, false, None);
        app.intake.database().gather_next_batch(6);
        let numbered = |i: usize| {
            post_plan(
                &token,
                &format!("k{i}"),
                &plan_body(&format!("run-{i}"), "x"),
            )
        };
        let answers = join_all((0..6).map(|i| send(&service, numbered(i)))).await;
        assert_eq!(proxy.fired(), vec![fault]);
        for answer in &answers {
            assert_eq!(
                answer.status,
                StatusCode::CREATED,
                "{fault:?}: {:?}",
                answer.body
            );
        }
        app.assert_rows(6, 6);
        // Each resend replays its own receipt.
        for (i, answer) in answers.iter().enumerate() {
            let again = send(&service, numbered(i)).await;
            assert_eq!(again.body["outcome"], "replayed");
            assert_eq!(again.body["receipt_id"], answer.body["receipt_id"]);
        }
        app.assert_rows(6, 6);
    }
}

/// A writer whose deadline passes while it is queued leaves unwritten: it
/// is answered 503, and nothing of it is written when the queue moves on.
#[actix_web::test]
async fn a_writer_queued_past_its_deadline_is_not_written() {
    let Some(db) = TestDb::postgres() else { return };
    let app = TestApp::with(
        db,
        AppOptions {
            request_timeout: std::time::Duration::from_millis(500),
            ..AppOptions::default()
        },
    );
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    app.intake.database().gather_next_batch(2);
    let late = send(
        &service,
        post_plan(&token, "late", &plan_body("run-1", "x")),
    )
    .await;
    late.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "timeout");
    wait_until("the late writer leaves the queue", || {
        app.intake.database().queued_writes() == 0
    })
    .await;
    app.intake.database().gather_next_batch(0);
    let next = send(
        &service,
        post_plan(&token, "next", &plan_body("run-2", "x")),
    )
    .await;
    assert_eq!(next.status, StatusCode::CREATED, "{:?}", next.body);
    app.assert_rows(1, 1);
    assert_eq!(batch_of(&app), (1, 1.0), "only the next plan was sent");
}

/// The 16-key race inside one batch: sixteen keys for one new plan, all
/// queued together. One is created; every other key is bound to that plan
/// (already_received), and afterwards each key replays its own request.
#[actix_web::test]
async fn sixteen_keys_for_one_plan_in_one_batch() {
    let Some(db) = TestDb::postgres() else {
        return;
    };
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let body = plan_body("run-1", "x");
    let keys: Vec<String> = (0..16).map(|i| format!("race-{i}")).collect();
    app.intake.database().gather_next_batch(keys.len());
    let answers = join_all(
        keys.iter()
            .map(|k| send(&service, post_plan(&token, k, &body))),
    )
    .await;
    assert_eq!(batch_of(&app), (1, 16.0), "{:?}", statuses(&answers));
    let created: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .collect();
    assert_eq!(created.len(), 1, "{:?}", statuses(&answers));
    for answer in &answers {
        assert!(answer.status.is_success(), "{:?}", answer.body);
        assert_eq!(answer.body["receipt_id"], created[0].body["receipt_id"]);
    }
    app.assert_rows(1, 16);
    for key in &keys {
        let again = send(&service, post_plan(&token, key, &body)).await;
        assert_eq!(again.body["outcome"], "replayed", "{key}: {:?}", again.body);
    }
    app.assert_rows(1, 16);
}

/// A key row of the batch's set-based write meets a conflict: another
/// session holds planner-a's `held` key (uncommitted), the batch's INSERT
/// waits on it, and the session commits. Both of the set-based INSERTs are
/// undone (no plan may stay without its key) and every plan goes one by
/// one: the four new plans are created, each with its key, and the fifth,
/// other content under the held key, is refused as a reused key. Nothing
/// else lands.
#[actix_web::test]
async fn a_key_row_met_by_a_conflict_sends_its_batch_one_by_one() {
    let Some(db) = TestDb::postgres() else { return };
    let app = TestApp::new(db);
    let planner = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let mut session = crate::support::hold_plan_and_key(
        &app.db_ref().url,
        "",
        "rcpt_held_by_another_session",
        "run-held",
        "held",
    );
    let before = batch_of(&app);
    let mut requests: Vec<(String, String)> = (0..4)
        .map(|i| (format!("k{i}"), plan_body(&format!("run-{i}"), "a")))
        .collect();
    requests.push(("held".to_owned(), plan_body("run-other", "a")));
    app.intake.database().gather_next_batch(requests.len());
    let sent = join_all(
        requests
            .iter()
            .map(|(key, body)| send(&service, post_plan(&planner, key, body))),
    );
    let commit = async {
        wait_until("the batch waits for the held key", || {
            crate::support::scalar(
                &mut app.conn(),
                "SELECT count(*) AS n FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND query LIKE '%plan_intake_write_batch%'",
            ) > 0
        })
        .await;
        use diesel::connection::SimpleConnection;
        session
            .batch_execute("COMMIT")
            .expect("the session commits");
    };
    let (answers, ()) = futures_util::join!(sent, commit);
    let after = batch_of(&app);
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, 5.0),
        "one batch of five"
    );
    for answer in &answers[..4] {
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{:?}",
            statuses(&answers)
        );
    }
    answers[4].assert_key_reused();
    // The session's plan and key, and the four with theirs: no plan
    // without its key.
    app.assert_rows(5, 5);
}
