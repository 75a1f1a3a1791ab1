//! Who may do what: 401, 403 and 404 as the HTTP contract sets them, and nothing
//! written for any 4xx.

use actix_web::http::StatusCode;
use actix_web::test::TestRequest;
use plan_intake::intake::Permission;

use crate::on_both_backends;
use crate::support::{TestApp, TestDb, get, plan_body, post_plan, send};

on_both_backends!(
    tokens_must_be_known_and_active,
    submitting_needs_plans_submit,
    receipts_are_readable_by_their_maker_and_the_ordering_system,
    nothing_is_written_for_any_client_error,
    a_revocation_is_refused_at_once_by_every_instance,
    a_rotated_token_is_refused_once_its_grace_ends,
    a_stranger_is_answered_before_the_body_is_sent,
);

async fn tokens_must_be_known_and_active(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let body = plan_body("run-1", "x");

    let no_header = TestRequest::post()
        .uri("/v1/plans")
        .insert_header(("Idempotency-Key", "k"))
        .insert_header(("Content-Type", "application/json"))
        .set_payload(body.clone());
    for (request, why) in [
        (no_header, "no Authorization header"),
        (
            post_plan("pit_not-a-real-token", "k", &body),
            "unknown token",
        ),
        (
            post_plan(&token, "k", &body)
                .insert_header(("Authorization", format!("Basic {token}"))),
            "not Bearer",
        ),
    ] {
        let answer = send(&service, request).await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{why}");
        assert_eq!(answer.header("www-authenticate"), Some("Bearer"), "{why}");
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json"),
            "{why}"
        );
    }

    let mut conn = app.conn();
    plan_intake::intake::login::revoke(&mut conn, "planner-a").expect("revoke");
    let revoked = send(&service, post_plan(&token, "k", &body)).await;
    assert_eq!(revoked.status, StatusCode::UNAUTHORIZED);
    assert_eq!(app.count("plans"), 0);
}

async fn submitting_needs_plans_submit(db: TestDb) {
    let app = TestApp::new(db);
    let reader = app.login("ordering", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    let answer = send(&service, post_plan(&reader, "k", &plan_body("run-1", "x"))).await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN);
    assert_eq!(answer.body["status"], 403);
    assert_eq!(app.count("plans"), 0);
}

async fn receipts_are_readable_by_their_maker_and_the_ordering_system(db: TestDb) {
    let app = TestApp::new(db);
    let maker = app.login("planner-a", &[Permission::PlansSubmit]);
    let stranger = app.login("planner-b", &[Permission::PlansSubmit]);
    let reader = app.login("ordering", &[Permission::ReceiptsRead]);
    let service = app.service().await;
    let created = send(&service, post_plan(&maker, "k", &plan_body("run-1", "x"))).await;
    let receipt_id = created.body["receipt_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let mut expected = created.body.clone();
    expected.as_object_mut().map(|m| m.remove("outcome"));

    for token in [&maker, &reader] {
        let receipt = send(&service, get(token, &format!("/v1/receipts/{receipt_id}"))).await;
        assert_eq!(receipt.status, StatusCode::OK);
        assert_eq!(
            receipt.body, expected,
            "the receipt as stored, without outcome"
        );
        let plan = send(&service, get(token, &format!("/v1/plans/{receipt_id}"))).await;
        assert_eq!(plan.status, StatusCode::OK);
        assert_eq!(plan.body["receipt"], expected);
        assert_eq!(plan.body["content"]["marker"], "x");
        assert_eq!(plan.body["approved_inputs"][0]["digest"], "blake3:00ff");
    }
    for uri in [
        format!("/v1/receipts/{receipt_id}"),
        format!("/v1/plans/{receipt_id}"),
    ] {
        let hidden = send(&service, get(&stranger, &uri)).await;
        assert_eq!(
            hidden.status,
            StatusCode::NOT_FOUND,
            "another maker's receipt is a 404: {uri}"
        );
    }
    let unknown = send(&service, get(&reader, "/v1/receipts/rcpt_0000")).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    let anonymous = send(
        &service,
        TestRequest::get().uri(&format!("/v1/receipts/{receipt_id}")),
    )
    .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
}

async fn nothing_is_written_for_any_client_error(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let body = plan_body("run-1", "x");
    let big = format!(
        r#"{{"run_id":"r","approved_inputs":[{{"id":"a"}}],"content":{{"pad":"{}"}}}}"#,
        "x".repeat(1024 * 1024)
    );

    let cases = [
        (
            post_plan(&token, "", &body),
            StatusCode::BAD_REQUEST,
            "empty key",
        ),
        (
            post_plan(&token, "has space", &body),
            StatusCode::BAD_REQUEST,
            "bad key",
        ),
        (
            TestRequest::post()
                .uri("/v1/plans")
                .insert_header(("Authorization", format!("Bearer {token}")))
                .insert_header(("Content-Type", "application/json"))
                .set_payload(body.clone()),
            StatusCode::BAD_REQUEST,
            "missing key",
        ),
        (
            post_plan(&token, "k", "{not json"),
            StatusCode::BAD_REQUEST,
            "not JSON",
        ),
        (
            post_plan(&token, "k", &body).insert_header(("Content-Type", "text/plain")),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "text/plain",
        ),
        (
            post_plan(&token, "k", &big),
            StatusCode::PAYLOAD_TOO_LARGE,
            "over 1 MiB",
        ),
        (
            post_plan(
                &token,
                "k",
                r#"{"run_id":"r","run_id":"s","approved_inputs":[{"id":"a"}],"content":{}}"#,
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "duplicate member",
        ),
        (
            post_plan(
                &token,
                "k",
                r#"{"run_id":"r","approved_inputs":[],"content":{}}"#,
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "no inputs",
        ),
        (
            post_plan(
                &token,
                "k",
                r#"{"run_id":"r","approved_inputs":[{"id":"a"}],"content":"text"}"#,
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "content not an object",
        ),
        (
            post_plan(
                &token,
                "k",
                r#"{"run_id":"r","approved_inputs":[{"id":"a"}],"content":{"n":9007199254740993}}"#,
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "inexact number",
        ),
        (
            post_plan(&token, "k", "[1,2]"),
            StatusCode::UNPROCESSABLE_ENTITY,
            "not an object",
        ),
    ];
    for (request, status, why) in cases {
        let answer = send(&service, request).await;
        assert_eq!(answer.status, status, "{why}: {:?}", answer.body);
        assert_eq!(
            answer.header("content-type"),
            Some("application/problem+json"),
            "{why}"
        );
        assert_eq!(answer.body["status"], status.as_u16(), "{why}");
    }
    app.assert_rows(0, 0);
}

/// Each instance remembers logins it found (to refuse strangers before
/// reading a body), yet a request made after `logins revoke` returned is
/// refused by every instance: the write checks the token itself.
async fn a_revocation_is_refused_at_once_by_every_instance(db: TestDb) {
    let url = db.url.clone();
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let first = app.service_with(app.intake.clone()).await;
    let second = app
        .service_with(crate::support::instance(
            &url,
            plan_intake::storage::MigrateOnOpen::Skip,
        ))
        .await;
    let body = plan_body("run-1", "x");
    for (service, key) in [(&first, "k1"), (&second, "k2")] {
        // Twice each: the second is answered with the login remembered.
        for _ in 0..2 {
            let answer = send(service, post_plan(&token, key, &body)).await;
            assert!(answer.status.is_success(), "{:?}", answer.body);
        }
    }
    app.assert_rows(1, 2);

    plan_intake::intake::login::revoke(&mut app.conn(), "planner-a").expect("revoke");
    for service in [&first, &second] {
        for (key, body) in [
            ("k1", plan_body("run-1", "x")),
            ("k3", plan_body("run-2", "y")),
        ] {
            let answer = send(service, post_plan(&token, key, &body)).await;
            assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{:?}", answer.body);
            assert_eq!(answer.header("www-authenticate"), Some("Bearer"));
        }
    }
    app.assert_rows(1, 2);
}

/// Rotated with no grace period, the old token is refused at once by an
/// instance that remembers it; the new one works.
async fn a_rotated_token_is_refused_once_its_grace_ends(db: TestDb) {
    let app = TestApp::new(db);
    let old = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let created = send(&service, post_plan(&old, "k1", &plan_body("run-1", "x"))).await;
    assert_eq!(created.status, StatusCode::CREATED, "{:?}", created.body);

    let new =
        plan_intake::intake::login::rotate(&mut app.conn(), "planner-a", std::time::Duration::ZERO)
            .expect("rotate");
    let refused = send(&service, post_plan(&old, "k2", &plan_body("run-2", "x"))).await;
    assert_eq!(
        refused.status,
        StatusCode::UNAUTHORIZED,
        "{:?}",
        refused.body
    );
    app.assert_rows(1, 1);
    let replayed = send(&service, post_plan(&new, "k1", &plan_body("run-1", "x"))).await;
    assert_eq!(replayed.body["outcome"], "replayed", "{:?}", replayed.body);
}

/// A request with an unknown token is answered 401 before any of its body
/// is sent, within the limit or over it (401, not 413), and the connection
/// is closed, since the body was never drained.
async fn a_stranger_is_answered_before_the_body_is_sent(db: TestDb) {
    let url = db.url.clone();
    let _app = TestApp::new(db);
    let server = crate::support::process::ServeProcess::start(&url);
    for declared in [500_000, 5_000_000] {
        let text = answer_to_head_only(&server.addr, declared);
        assert!(text.starts_with("http/1.1 401"), "{declared}: {text}");
        assert!(
            text.contains("\r\nconnection: close\r\n"),
            "{declared}: {text}"
        );
        assert!(
            text.contains("www-authenticate: bearer"),
            "{declared}: {text}"
        );
    }
}

/// Sends a POST's head declaring `content_length` bytes and none of them,
/// and reads until the server closes: a server that waited for the body
/// would never answer (the read times out and fails the test).
fn answer_to_head_only(addr: &str, content_length: usize) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "POST /v1/plans HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer pit_unknown\r\n\
         Idempotency-Key: k\r\nContent-Type: application/json\r\n\
         Content-Length: {content_length}\r\n\r\n"
    )
    .expect("send the head");
    let mut answer = Vec::new();
    let read = stream.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(read.is_ok(), "no answer and close: {read:?} {text}");
    text
}

/// A reader revoked while its long poll waits: the poll does not hand out
/// the plan that arrives after the revocation; it ends with 401.
#[test]
fn a_reader_revoked_during_its_long_poll_is_handed_nothing() {
    use crate::support::process::{ServeProcess, client, keep_plan, login_via_cli, run_cli_at};
    let db = TestDb::sqlite();
    let service = ServeProcess::start(&db.url);
    let planner = login_via_cli(&db.url, "planner-a", "plans:submit");
    let reader = login_via_cli(&db.url, "orders", "receipts:read");
    let url = format!(
        "http://{}/v1/receipts?after=now&wait=30&expand=plan",
        service.addr
    );
    let poll = std::thread::spawn(move || {
        match client()
            .get(&url)
            .set("Authorization", &format!("Bearer {reader}"))
            .call()
        {
            Ok(answer) => (answer.status(), answer.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(status, answer)) => {
                (status, answer.into_string().unwrap_or_default())
            }
            Err(e) => panic!("the poll: {e}"),
        }
    });
    let waiting = std::time::Instant::now();
    while !service
        .metrics_text()
        .lines()
        .any(|l| l == "plan_intake_feed_waiting_readers 1")
    {
        assert!(
            waiting.elapsed() < std::time::Duration::from_secs(20),
            "the reader never waited"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let revoked = run_cli_at(&db.url, &["logins", "revoke", "orders"]);
    assert!(revoked.status.success(), "{revoked:?}");
    let kept = keep_plan(
        &client(),
        &service.addr,
        &planner,
        "after-revoke",
        &plan_body("after-revoke", "x"),
    );
    let (status, body) = poll.join().expect("the poll");
    assert_eq!(status, 401, "{body}");
    let id = kept["receipt_id"].as_str().expect("an id");
    assert!(!body.contains(id), "{body}");
}
