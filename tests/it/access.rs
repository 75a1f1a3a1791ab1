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
