//! `plan-intake keys prune`: keys go, plans and receipts stay, and a retry
//! under a pruned key finds its plan by maker, run and content.

use std::collections::HashSet;

use actix_web::http::StatusCode;
use plan_intake::intake::Permission;

use crate::support::process::{ServeProcess, client, post_plan as post_to, run_cli};
use crate::support::{TestApp, TestDb, plan_body, post_plan, send};

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).trim().to_owned()
}

async fn a_retry_under_a_pruned_key_is_already_received(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let mut receipts = Vec::new();
    for i in 0..3 {
        let answer = send(
            &service,
            post_plan(
                &token,
                &format!("k{i}"),
                &plan_body(&format!("run-{i}"), "x"),
            ),
        )
        .await;
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
        receipts.push(answer.body["receipt_id"].clone());
    }
    let db = app.db_ref();

    // A dry run counts what the real run would be allowed to delete: below
    // the floor, nothing without --allow-short-retention.
    let floor = run_cli(db, &["keys", "prune", "--older-than", "1h", "--dry-run"]);
    assert_eq!(floor.status.code(), Some(2), "{}", stderr(&floor));
    assert!(
        stderr(&floor).contains("minimum retention of 48h"),
        "{}",
        stderr(&floor)
    );
    let dry = run_cli(
        db,
        &[
            "keys",
            "prune",
            "--older-than",
            "0s",
            "--allow-short-retention",
            "--dry-run",
        ],
    );
    assert!(dry.status.success(), "{}", stderr(&dry));
    assert_eq!(stderr(&dry), "would delete 3 idempotency keys");
    app.assert_rows(3, 3);

    let pruned = run_cli(
        db,
        &[
            "keys",
            "prune",
            "--older-than",
            "0s",
            "--allow-short-retention",
            "--batch-size",
            "2",
        ],
    );
    assert!(pruned.status.success(), "{}", stderr(&pruned));
    assert_eq!(stderr(&pruned), "deleted 3 idempotency keys");
    app.assert_rows(3, 0);
    let young = run_cli(db, &["keys", "prune", "--older-than", "30d"]);
    assert_eq!(stderr(&young), "deleted 0 idempotency keys");

    // The same request again: its plan, by maker, run and content.
    let retried = send(&service, post_plan(&token, "k0", &plan_body("run-0", "x"))).await;
    assert_eq!(retried.status, StatusCode::OK, "{:?}", retried.body);
    assert_eq!(retried.body["outcome"], "already_received");
    assert_eq!(retried.body["receipt_id"], receipts[0]);
    // Another body under an old key is a new plan.
    let other = send(&service, post_plan(&token, "k1", &plan_body("run-1", "y"))).await;
    assert_eq!(other.status, StatusCode::CREATED, "{:?}", other.body);
    app.assert_rows(4, 2);
    for receipt in &receipts {
        assert!(app.stored(receipt.as_str().unwrap_or_default()).is_some());
    }
}

/// Pruning every key, again and again, while 8 planners send each request
/// twice: no 5xx, and every plan and receipt stays, once.
fn pruning_under_load_keeps_every_plan(db: TestDb) {
    let url = db.url.clone();
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let server = ServeProcess::start(&url);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (answers, prunes) = std::thread::scope(|scope| {
        let planners: Vec<_> = (0..8)
            .map(|c| {
                let (addr, token) = (&server.addr, &token);
                scope.spawn(move || {
                    let agent = client();
                    let mut answers = Vec::new();
                    for i in 0..25 {
                        let key = format!("load-{c}-{i}");
                        let body = plan_body(&key, "x");
                        for _ in 0..2 {
                            answers.push(
                                post_to(&agent, addr, token, &key, &body).expect("an answer"),
                            );
                        }
                    }
                    answers
                })
            })
            .collect();
        let pruner = scope.spawn(|| {
            let mut runs = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) || runs == 0 {
                let out = crate::support::process::run_cli_at(
                    &url,
                    &[
                        "keys",
                        "prune",
                        "--older-than",
                        "0s",
                        "--allow-short-retention",
                        "--batch-size",
                        "7",
                    ],
                );
                assert!(out.status.success(), "{}", stderr(&out));
                runs += 1;
            }
            runs
        });
        let answers: Vec<_> = planners
            .into_iter()
            .flat_map(|p| p.join().expect("planner"))
            .collect();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (answers, pruner.join().expect("pruner"))
    });
    assert!(prunes > 0);
    for (status, body) in &answers {
        assert!(*status == 200 || *status == 201, "{status}: {body}");
    }
    let receipts: HashSet<&str> = answers
        .iter()
        .filter_map(|(_, body)| body["receipt_id"].as_str())
        .collect();
    assert_eq!(receipts.len(), 200, "one receipt per request");
    assert_eq!(app.count("plans"), 200);
    for receipt in receipts {
        assert!(app.stored(receipt).is_some(), "{receipt} is gone");
    }
}

crate::on_both_backends!(a_retry_under_a_pruned_key_is_already_received,);
crate::on_both_backends_sync!(pruning_under_load_keeps_every_plan,);

/// The minimum retention is twice the longest call `submit` takes: the
/// two are written in two crates (the domain may not use the client).
#[test]
fn the_minimum_retention_is_twice_the_longest_submit() {
    assert_eq!(
        plan_intake::intake::retention::MIN_RETENTION,
        2 * plan_intake_client::SubmitOptions::MAX_TIMEOUT
    );
}

/// A retention shorter than the clients' retry window is refused with one
/// line, exit 2, and deletes nothing, unless asked for explicitly.
#[test]
fn a_retention_below_the_minimum_is_refused() {
    let scratch = TestDb::sqlite();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let url = app.db_ref().url.clone();
    let server = ServeProcess::start(&url);
    for i in 0..2 {
        let (status, _) = post_to(
            &client(),
            &server.addr,
            &token,
            &format!("k{i}"),
            &plan_body(&format!("run-{i}"), "x"),
        )
        .expect("an answer");
        assert_eq!(status, 201);
    }
    for short in ["0s", "1h", "47h"] {
        let out = run_cli(app.db_ref(), &["keys", "prune", "--older-than", short]);
        assert_eq!(out.status.code(), Some(2), "{short}: {}", stderr(&out));
        assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
        assert!(
            stderr(&out).contains("minimum retention of 48h"),
            "{}",
            stderr(&out)
        );
        app.assert_rows(2, 2);
    }
    let out = run_cli(app.db_ref(), &["keys", "prune", "--older-than", "48h"]);
    assert!(out.status.success(), "{}", stderr(&out));
    app.assert_rows(2, 2);
    let out = run_cli(
        app.db_ref(),
        &[
            "keys",
            "prune",
            "--older-than",
            "0s",
            "--allow-short-retention",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    app.assert_rows(2, 0);
}
