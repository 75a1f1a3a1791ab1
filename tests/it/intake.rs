//! `POST /v1/plans`: every outcome (created, replayed, already received,
//! key reused, refused), on both backends.

use actix_web::http::StatusCode;
use futures_util::future::join_all;
use plan_intake::intake::Permission;
use serde_json::{Value, json};

use crate::on_both_backends;
use crate::support::{TestApp, TestDb, get, plan_body, post_plan, send};

on_both_backends!(
    create_then_replay_returns_the_same_receipt,
    same_key_with_other_body_is_refused,
    new_key_for_a_kept_plan_is_already_received,
    keys_are_scoped_per_maker,
    concurrent_requests_with_one_key_keep_one_plan,
    concurrent_requests_with_new_keys_and_one_content_keep_one_plan,
    every_blank_run_is_refused_and_nothing_is_written,
    claimed_permissions_and_maker_are_ignored,
    a_key_conflict_leaves_no_plan_row_behind,
    a_key_first_answered_already_received_is_bound_to_that_request,
    after_a_race_of_new_keys_every_key_is_bound_to_its_request,
    two_requests_racing_under_one_new_key_for_a_kept_plan_record_it_once,
    a_new_plan_racing_a_kept_one_for_one_new_key_gets_it_or_is_refused,
);

const PLANNER: &[Permission] = &[Permission::PlansSubmit];

async fn create_then_replay_returns_the_same_receipt(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let body = plan_body("run-1", "x");

    let created = send(&service, post_plan(&token, "key-1", &body)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{:?}", created.body);
    let receipt_id = created.body["receipt_id"]
        .as_str()
        .expect("receipt id")
        .to_owned();
    assert_eq!(created.body["outcome"], "created");
    assert_eq!(created.body["maker"], "planner-a");
    assert_eq!(created.body["run_id"], "run-1");
    assert_eq!(
        created.body["approved_inputs"],
        json!(["forecast-v12", "prices-v3"])
    );
    assert_eq!(created.body["permissions"], json!(["plans:submit"]));
    assert!(
        created.body["content_hash"]
            .as_str()
            .is_some_and(|h| h.starts_with("blake3:") && h.len() == 71)
    );
    assert_eq!(
        created.header("location"),
        Some(format!("/v1/receipts/{receipt_id}").as_str())
    );
    assert_eq!(created.header("idempotent-replayed"), None);

    let replayed = send(&service, post_plan(&token, "key-1", &body)).await;
    assert_eq!(replayed.status, StatusCode::OK);
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(replayed.body["outcome"], "replayed");
    assert_eq!(
        without_outcome(&replayed.body),
        without_outcome(&created.body)
    );

    // Other key order, other white space, the key as an RFC 8941 string.
    let reordered = r#"{ "content" : {"lines":[{"qty":3,"sku":"A-1"},{"qty":1.5,"sku":"B-2"}], "marker":"x"},
        "approved_inputs": [ {"digest":"blake3:00ff","id":"forecast-v12"}, {"id":"prices-v3"} ],
        "run_id": "run-1" }"#;
    let again = send(&service, post_plan(&token, "\"key-1\"", reordered)).await;
    assert_eq!(again.status, StatusCode::OK, "{:?}", again.body);
    assert_eq!(again.body["outcome"], "replayed");
    assert_eq!(again.body["receipt_id"], receipt_id.as_str());

    app.assert_rows(1, 1);
}

async fn same_key_with_other_body_is_refused(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;

    let first = send(
        &service,
        post_plan(&token, "key-1", &plan_body("run-1", "x")),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    for other in [plan_body("run-1", "y"), plan_body("run-2", "x")] {
        let reused = send(&service, post_plan(&token, "key-1", &other)).await;
        reused.assert_key_reused();
    }
    app.assert_rows(1, 1);
}

async fn new_key_for_a_kept_plan_is_already_received(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let body = plan_body("run-1", "x");

    let created = send(&service, post_plan(&token, "key-1", &body)).await;
    let again = send(&service, post_plan(&token, "key-2", &body)).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.body["outcome"], "already_received");
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(without_outcome(&again.body), without_outcome(&created.body));

    // The same content for another run is another plan.
    let other_run = send(
        &service,
        post_plan(&token, "key-3", &plan_body("run-2", "x")),
    )
    .await;
    assert_eq!(other_run.status, StatusCode::CREATED);
    assert_eq!(other_run.body["content_hash"], created.body["content_hash"]);
    assert_ne!(other_run.body["request_hash"], created.body["request_hash"]);
    assert_eq!(app.count("plans"), 2);
}

async fn keys_are_scoped_per_maker(db: TestDb) {
    let app = TestApp::new(db);
    let a = app.login("planner-a", PLANNER);
    let b = app.login("planner-b", PLANNER);
    let service = app.service().await;
    let body = plan_body("run-1", "x");

    let from_a = send(&service, post_plan(&a, "shared-key", &body)).await;
    let from_b = send(&service, post_plan(&b, "shared-key", &body)).await;
    assert_eq!(from_a.status, StatusCode::CREATED);
    assert_eq!(from_b.status, StatusCode::CREATED, "{:?}", from_b.body);
    assert_eq!(from_b.body["maker"], "planner-b");
    assert_ne!(from_a.body["receipt_id"], from_b.body["receipt_id"]);
    app.assert_rows(2, 2);
}

async fn concurrent_requests_with_one_key_keep_one_plan(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let body = plan_body("run-1", "x");

    let answers =
        join_all((0..32).map(|_| send(&service, post_plan(&token, "one-key", &body)))).await;
    let created: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .collect();
    assert_eq!(
        created.len(),
        1,
        "statuses: {:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    let receipt_id = &created[0].body["receipt_id"];
    for answer in answers.iter().filter(|a| a.status != StatusCode::CREATED) {
        assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
        assert_eq!(answer.body["outcome"], "replayed");
        assert_eq!(&answer.body["receipt_id"], receipt_id);
    }
    app.assert_rows(1, 1);
}

async fn concurrent_requests_with_new_keys_and_one_content_keep_one_plan(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let body = plan_body("run-1", "x");

    let answers =
        join_all((0..32).map(|i| send(&service, post_plan(&token, &format!("key-{i}"), &body))))
            .await;
    let outcomes: Vec<_> = answers
        .iter()
        .map(|a| a.body["outcome"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(
        outcomes.iter().filter(|o| **o == "created").count(),
        1,
        "{outcomes:?}"
    );
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == "already_received")
            .count(),
        31,
        "{outcomes:?}"
    );
    let receipt_ids: std::collections::HashSet<_> = answers
        .iter()
        .map(|a| a.body["receipt_id"].to_string())
        .collect();
    assert_eq!(receipt_ids.len(), 1);
    // One plan; every key recorded, each bound by its first answer.
    app.assert_rows(1, 32);
}

async fn every_blank_run_is_refused_and_nothing_is_written(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let rest = r#""approved_inputs":[{"id":"forecast-v12"}],"content":{"a":1}"#;
    let bodies = [
        format!("{{{rest}}}"),
        format!(r#"{{"run_id":null,{rest}}}"#),
        format!(r#"{{"run_id":"",{rest}}}"#),
        format!(r#"{{"run_id":"   ",{rest}}}"#),
        format!(r#"{{"run_id":"\t\n\u3000",{rest}}}"#),
    ];
    for (i, body) in bodies.iter().enumerate() {
        let answer = send(&service, post_plan(&token, &format!("blank-{i}"), body)).await;
        assert_eq!(answer.status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert_eq!(
            answer.body["errors"][0]["field"], "run_id",
            "{body}: {:?}",
            answer.body
        );
    }
    app.assert_rows(0, 0);
}

async fn claimed_permissions_and_maker_are_ignored(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let body = r#"{"run_id":"run-1","approved_inputs":[{"id":"in-1"}],"content":{"k":1},
                   "permissions":["receipts:read","admin"],"maker":"planner-z"}"#;

    let created = send(&service, post_plan(&token, "key-1", body)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{:?}", created.body);
    assert_eq!(created.body["maker"], "planner-a");
    assert_eq!(created.body["permissions"], json!(["plans:submit"]));

    let row = app
        .stored(created.body["receipt_id"].as_str().unwrap_or_default())
        .expect("row");
    assert_eq!(row.maker, "planner-a");
    assert_eq!(row.permissions, r#"["plans:submit"]"#);
    // The claims are not part of what was kept either.
    assert_eq!(row.content, r#"{"k":1}"#);

    // The planner still cannot read what the claimed permission would allow.
    let other = app.login("planner-b", PLANNER);
    let theirs = send(
        &service,
        post_plan(&other, "key-b", &plan_body("run-b", "b")),
    )
    .await;
    let peek = send(
        &service,
        get(
            &token,
            &format!(
                "/v1/receipts/{}",
                theirs.body["receipt_id"].as_str().unwrap_or_default()
            ),
        ),
    )
    .await;
    assert_eq!(peek.status, StatusCode::NOT_FOUND);
}

/// Were the key row's unique violation swallowed inside the transaction,
/// Postgres would turn COMMIT into ROLLBACK and diesel would still report
/// success: the call would return a plan that was never kept, or (SQLite)
/// keep a plan without its key. The write is reached here as a concurrent
/// writer reaches it: its read missed a key row committed just after.
async fn a_key_conflict_leaves_no_plan_row_behind(db: TestDb) {
    match db.backend {
        plan_intake::storage::Backend::Sqlite => key_conflict_on_sqlite(db).await,
        plan_intake::storage::Backend::Postgres => key_conflict_on_postgres(db).await,
    }
}

async fn key_conflict_on_sqlite(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let first = send(
        &service,
        post_plan(&token, "key-1", &plan_body("run-1", "x")),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let mut plan = crate::support::competing_plan("planner-a", &plan_body("run-2", "x"));
    plan.request_hash = "blake3:other".to_owned();
    let deadline = plan_intake::deadline::Deadline::after(std::time::Duration::from_secs(10));
    let mut conn = app.conn();
    let plan_intake::storage::DbConn::Sqlite(lite) = &mut *conn else {
        unreachable!("a SQLite scratch database")
    };
    let result = app.direct.write_after_missed_read(
        lite,
        &std::sync::Arc::new(plan.clone()),
        "key-1",
        &deadline,
    );
    // Resolved inside the batch after the savepoint rolled back: the key
    // row that won is reported, and this plan row is gone with it.
    assert!(
        matches!(&result, Ok(plan_intake::storage::plans::Written::KeyHeld { request_hash, .. })
            if *request_hash != plan.request_hash),
        "the key conflict must come back as the key row that won, got {result:?}"
    );
    app.assert_rows(1, 1);
}

async fn key_conflict_on_postgres(db: TestDb) {
    let direct_url = db.url.clone();
    let (app, schema) = TestApp::named(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    // Another transaction holds key-1 (uncommitted): our read misses it, our
    // plan row goes in, and our key row waits on the unique index.
    let answer = crate::support::answer_to_a_key_committed_while_waiting(
        &app,
        &service,
        &token,
        &direct_url,
        &schema,
    )
    .await;
    assert_eq!(
        answer.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{:?}",
        answer.body
    );
    app.assert_rows(1, 1);
}

/// The four steps: a key first answered `already_received` is recorded, so
/// the same request under it replays and other content is refused.
async fn a_key_first_answered_already_received_is_bound_to_that_request(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let plan_x = plan_body("run-1", "x");

    let created = send(&service, post_plan(&token, "K1", &plan_x)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{:?}", created.body);
    let received = send(&service, post_plan(&token, "K2", &plan_x)).await;
    assert_eq!(received.status, StatusCode::OK, "{:?}", received.body);
    assert_eq!(received.body["outcome"], "already_received");
    assert_eq!(received.header("idempotent-replayed"), None);
    app.assert_rows(1, 2);

    let replayed = send(&service, post_plan(&token, "K2", &plan_x)).await;
    assert_eq!(replayed.status, StatusCode::OK, "{:?}", replayed.body);
    assert_eq!(replayed.body["outcome"], "replayed");
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        without_outcome(&replayed.body),
        without_outcome(&created.body)
    );

    let reused = send(&service, post_plan(&token, "K2", &plan_body("run-1", "y"))).await;
    reused.assert_key_reused();
    app.assert_rows(1, 2);
}

/// 16 keys race for one new plan; afterwards each key replays its own
/// request with the one receipt and refuses other content.
async fn after_a_race_of_new_keys_every_key_is_bound_to_its_request(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let plan_x = plan_body("run-1", "x");
    let keys: Vec<String> = (0..16).map(|i| format!("race-{i}")).collect();

    let answers = join_all(
        keys.iter()
            .map(|k| send(&service, post_plan(&token, k, &plan_x))),
    )
    .await;
    let created: Vec<_> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED)
        .collect();
    assert_eq!(
        created.len(),
        1,
        "{:?}",
        answers.iter().map(|a| &a.body).collect::<Vec<_>>()
    );
    let receipt_id = created[0].body["receipt_id"].clone();
    for answer in &answers {
        assert!(answer.status.is_success(), "{:?}", answer.body);
        assert_eq!(answer.body["receipt_id"], receipt_id);
    }
    app.assert_rows(1, 16);

    for key in &keys {
        let replayed = send(&service, post_plan(&token, key, &plan_x)).await;
        assert_eq!(
            replayed.status,
            StatusCode::OK,
            "{key}: {:?}",
            replayed.body
        );
        assert_eq!(replayed.body["outcome"], "replayed", "{key}");
        assert_eq!(replayed.body["receipt_id"], receipt_id, "{key}");
        let other = send(&service, post_plan(&token, key, &plan_body("run-1", "y"))).await;
        other.assert_key_reused();
    }
    app.assert_rows(1, 16);
}

/// Two identical requests race under one new key for a plan already kept:
/// one records the key (`already_received`), the other replays it, and
/// nothing else is written. Repeated, so both orders get their chance.
async fn two_requests_racing_under_one_new_key_for_a_kept_plan_record_it_once(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let plan_x = plan_body("run-1", "x");
    let created = send(&service, post_plan(&token, "K1", &plan_x)).await;
    assert_eq!(created.status, StatusCode::CREATED);

    const ROUNDS: i64 = 8;
    for round in 0..ROUNDS {
        let key = format!("new-{round}");
        let (a, b) = futures_util::join!(
            send(&service, post_plan(&token, &key, &plan_x)),
            send(&service, post_plan(&token, &key, &plan_x))
        );
        let mut outcomes = [
            a.body["outcome"].as_str().unwrap_or("?"),
            b.body["outcome"].as_str().unwrap_or("?"),
        ];
        outcomes.sort_unstable();
        assert_eq!(outcomes, ["already_received", "replayed"], "{a:?} {b:?}");
        assert_eq!(a.body["receipt_id"], created.body["receipt_id"]);
        assert_eq!(b.body["receipt_id"], created.body["receipt_id"]);
        app.assert_rows(1, 2 + round);
    }
}

/// Under one new key, a request for the kept plan races a request for a new
/// plan: whichever records the key first keeps it (`already_received` or
/// `created`), the other is refused, and nothing else is written.
async fn a_new_plan_racing_a_kept_one_for_one_new_key_gets_it_or_is_refused(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", PLANNER);
    let service = app.service().await;
    let plan_x = plan_body("run-1", "x");
    let created = send(&service, post_plan(&token, "K1", &plan_x)).await;
    assert_eq!(created.status, StatusCode::CREATED);

    let mut plans = 1;
    for round in 0..8 {
        let key = format!("new-{round}");
        let plan_y = plan_body("run-1", &format!("y-{round}"));
        let (kept, new) = futures_util::join!(
            send(&service, post_plan(&token, &key, &plan_x)),
            send(&service, post_plan(&token, &key, &plan_y))
        );
        if kept.status == StatusCode::OK {
            assert_eq!(kept.body["outcome"], "already_received", "{kept:?}");
            new.assert_key_reused();
        } else {
            assert_eq!(new.status, StatusCode::CREATED, "{new:?}");
            kept.assert_key_reused();
            plans += 1;
        }
        app.assert_rows(plans, 2 + round);
    }
}

fn without_outcome(receipt: &Value) -> Value {
    let mut receipt = receipt.clone();
    if let Some(map) = receipt.as_object_mut() {
        map.remove("outcome");
    }
    receipt
}
