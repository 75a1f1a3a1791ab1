//! Operating it: metrics, readiness, request logs, OpenAPI and shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;

use actix_web::http::StatusCode;
use actix_web::test::TestRequest;
use plan_intake::intake::Permission;
use plan_intake::storage::migrations;
use serde_json::Value;

use crate::on_both_backends;
use crate::support::process::{ServeProcess, client, post_plan};
use crate::support::{TestApp, TestDb, plan_body, post_plan as post_request, send};

on_both_backends!(
    every_counter_is_present_from_the_start,
    metrics_count_each_outcome,
    readyz_is_503_with_a_pending_migration_and_200_after_migrate_run,
);

/// The value of one sample line in Prometheus text, 0 when absent.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(series)
                .and_then(|rest| rest.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// Alerts and dashboards can be written before the first event: every
/// counter's every label value is exposed at 0 by a fresh service.
async fn every_counter_is_present_from_the_start(db: TestDb) {
    let app = TestApp::new(db);
    let service = app.service().await;
    let text = send(&service, TestRequest::get().uri("/metrics"))
        .await
        .body;
    let text = text.as_str().unwrap_or_default();
    let mut expected: Vec<String> = Vec::new();
    for outcome in plan_intake::metrics::OUTCOMES {
        expected.push(format!(
            "plan_intake_outcomes_total{{outcome=\"{outcome}\"}} 0"
        ));
    }
    for cause in plan_intake::storage::errors::TransientCause::ALL {
        expected.push(format!(
            "plan_intake_retries_total{{class=\"{}\"}} 0",
            cause.as_str()
        ));
    }
    for branch in plan_intake::metrics::UnknownCommitBranch::ALL {
        expected.push(format!(
            "plan_intake_unknown_commit_total{{branch=\"{}\"}} 0",
            branch.as_str()
        ));
    }
    for answer in plan_intake::metrics::STRANGER_ANSWERS {
        expected.push(format!(
            "plan_intake_strangers_total{{answer=\"{answer}\"}} 0"
        ));
    }
    expected.push("plan_intake_stranger_lookups_total 0".to_owned());
    for route in plan_intake::metrics::TIMED_ROUTES {
        expected.push(format!(
            "plan_intake_request_timeouts_total{{route=\"{route}\"}} 0"
        ));
    }
    for reason in plan_intake::metrics::GROUP_COMMIT_FAILURES {
        expected.push(format!(
            "plan_intake_group_commit_failures_total{{reason=\"{reason}\"}} 0"
        ));
    }
    for line in &expected {
        assert!(
            text.lines().any(|l| l == line),
            "missing `{line}` in:\n{text}"
        );
    }
    assert!(expected.len() >= 25);
}

async fn metrics_count_each_outcome(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let read = |text: &str, outcome: &str| {
        sample(
            text,
            &format!("plan_intake_outcomes_total{{outcome=\"{outcome}\"}}"),
        )
    };
    let scrape = || async {
        String::from_utf8_lossy(
            &actix_web::test::read_body(
                actix_web::test::call_service(
                    &service,
                    TestRequest::get().uri("/metrics").to_request(),
                )
                .await,
            )
            .await,
        )
        .into_owned()
    };

    let before = scrape().await;
    send(
        &service,
        post_request(&token, "k1", &plan_body("run-1", "x")),
    )
    .await;
    send(
        &service,
        post_request(&token, "k1", &plan_body("run-1", "x")),
    )
    .await;
    send(&service, post_request(&token, "k2", r#"{"run_id":""}"#)).await;
    send(
        &service,
        post_request("pit_wrong", "k3", &plan_body("run-3", "x")),
    )
    .await;
    send(
        &service,
        post_request(&token, "k1", &plan_body("run-1", "other")),
    )
    .await;
    let after = scrape().await;

    for (outcome, moved) in [
        ("created", 1.0),
        ("replayed", 1.0),
        ("invalid", 1.0),
        ("unauthorized", 1.0),
        ("key_reused", 1.0),
    ] {
        assert_eq!(
            read(&after, outcome) - read(&before, outcome),
            moved,
            "{outcome}:\n{after}"
        );
    }
    assert_eq!(read(&after, "already_received"), 0.0);
    assert!(
        sample(
            &after,
            "plan_intake_http_request_duration_seconds_count{route=\"/v1/plans\",status=\"201\"}"
        ) >= 1.0,
        "{after}"
    );
    assert!(after.contains("plan_intake_db_pool_connections"), "{after}");
    assert!(after.contains("plan_intake_db_pool_waiters"), "{after}");
}

async fn readyz_is_503_with_a_pending_migration_and_200_after_migrate_run(db: TestDb) {
    let app = TestApp::new(db);
    let operator = app.login("operator", &[plan_intake::intake::Permission::ReceiptsRead]);
    let service = app.service().await;
    assert_eq!(
        send(&service, TestRequest::get().uri("/readyz"))
            .await
            .status,
        StatusCode::OK
    );

    migrations::revert_last(&mut app.conn()).expect("revert");
    // To a stranger the reason's type alone.
    let stranger = send(&service, TestRequest::get().uri("/readyz")).await;
    stranger.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "migrations-pending");
    let told = stranger.body["detail"].as_str().unwrap_or_default();
    assert!(!told.contains(crate::schema::LAST_MIGRATION), "{told}");
    let pending = send(
        &service,
        TestRequest::get()
            .uri("/readyz")
            .insert_header(("Authorization", format!("Bearer {operator}"))),
    )
    .await;
    // The reason named to a login: which migration, and the command that
    // applies it.
    pending.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "migrations-pending");
    let detail = pending.body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains(crate::schema::LAST_MIGRATION)
            && detail.contains("plan-intake migrate run"),
        "{detail}"
    );
    assert!(pending.header("retry-after").is_some());
    assert_eq!(
        send(&service, TestRequest::get().uri("/healthz"))
            .await
            .status,
        StatusCode::OK
    );

    migrations::run_pending(&mut app.conn()).expect("migrate run");
    assert_eq!(
        send(&service, TestRequest::get().uri("/readyz"))
            .await
            .status,
        StatusCode::OK
    );
}

/// Every route and status the service answers, and the headers that carry meaning.
const DOCUMENTED: &[(&str, &str, &[&str])] = &[
    (
        "/v1/plans",
        "post",
        &[
            "200", "201", "400", "401", "403", "413", "415", "422", "503",
        ],
    ),
    (
        "/v1/plans/{receipt_id}",
        "get",
        &["200", "401", "403", "404", "503"],
    ),
    ("/v1/receipts", "get", &["200", "400", "401", "403", "503"]),
    (
        "/v1/receipts/{receipt_id}",
        "get",
        &["200", "401", "403", "404", "503"],
    ),
    (
        "/v1/receipts/{receipt_id}/proof",
        "get",
        &["200", "401", "403", "404", "503"],
    ),
    ("/v1/signing-keys", "get", &["200", "503"]),
    ("/v1/checkpoint", "get", &["200", "404", "503"]),
    ("/v1/checkpoint/consistency", "get", &["200", "400", "503"]),
    (
        "/v1/checkpoint/extension",
        "get",
        &["200", "400", "404", "503"],
    ),
    (
        "/v1/checkpoint/start",
        "get",
        &["200", "400", "401", "403", "404", "503"],
    ),
    ("/v1/log/checkpoint", "get", &["200", "404", "503"]),
    (
        "/v1/log/tile/{tile}",
        "get",
        &["200", "400", "401", "403", "404", "503"],
    ),
    ("/healthz", "get", &["200"]),
    ("/readyz", "get", &["200", "503"]),
    ("/metrics", "get", &["200"]),
    ("/openapi.json", "get", &["200"]),
];

/// The service's OpenAPI document, as `GET /openapi.json` answers it.
async fn openapi_document() -> Value {
    let app = TestApp::new(TestDb::sqlite());
    let service = app.service().await;
    send(&service, TestRequest::get().uri("/openapi.json"))
        .await
        .body
}

/// The parameter `name` of the operation `method` on `path`.
fn parameter(doc: &Value, path: &str, method: &str, name: &str) -> Value {
    doc["paths"][path][method]["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("{method} {path} has no parameter `{name}`"))
}

/// The document's pattern for `Idempotency-Key` accepts exactly what the
/// service's parser accepts: the same strings fed to both.
#[actix_web::test]
async fn the_openapi_key_pattern_is_the_parser() {
    let doc = openapi_document().await;
    let key = parameter(&doc, "/v1/plans", "post", "Idempotency-Key");
    let pattern = key["schema"]["pattern"]
        .as_str()
        .expect("the key's pattern");
    let pattern = regex::Regex::new(pattern).expect("a regular expression");
    let mut keys: Vec<String> = [
        "k",
        "key-1",
        "a b",
        " k",
        "k ",
        "\"k\"",
        "\"a b\"",
        "\"\"",
        "\"",
        "\"k",
        "k\"",
        "\"a\\\"b\"",
        "\"a\\\\b\"",
        "\"a\\b\"",
        "\"a\"b\"",
        "\"a\"\"",
        "é",
        "\"é\"",
        "\t",
        "\"k\" ",
        "\"\\\"\"",
    ]
    .iter()
    .map(|k| k.to_string())
    .collect();
    for n in [254, 255, 256] {
        keys.push("k".repeat(n));
        keys.push(format!("\"{}\"", "k".repeat(n)));
        keys.push(format!("\"{}\"", "\\\"".repeat(n)));
    }
    // Every short string over the characters that matter.
    let alphabet = ['a', ' ', '"', '\\', '~', '\u{7f}'];
    let mut short = vec![String::new()];
    for _ in 0..4 {
        short = short
            .iter()
            .flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}")))
            .collect();
        keys.extend(short.iter().cloned());
    }
    for key in keys {
        assert_eq!(
            pattern.is_match(&key),
            plan_intake::intake::IdempotencyKey::parse(&key).is_ok(),
            "the pattern and the parser disagree on {key:?}"
        );
    }
}

/// The feed's bounds in the OpenAPI document are the ones the service and
/// the client share (`plan_intake_wire::feed`).
#[actix_web::test]
async fn the_openapi_feed_bounds_are_the_wire_bounds() {
    use plan_intake_wire::feed::{DEFAULT_LIMIT, MAX_LIMIT, MAX_WAIT};
    let doc = openapi_document().await;
    let limit = parameter(&doc, "/v1/receipts", "get", "limit");
    let wait = parameter(&doc, "/v1/receipts", "get", "wait");
    assert_eq!(limit["schema"]["minimum"].as_f64(), Some(1.0));
    assert_eq!(
        limit["schema"]["maximum"].as_f64(),
        Some(f64::from(MAX_LIMIT))
    );
    let said = limit["description"].as_str().unwrap_or_default();
    assert!(
        said.contains(&format!("(default {DEFAULT_LIMIT})")),
        "{said}"
    );
    assert_eq!(wait["schema"]["minimum"].as_f64(), Some(0.0));
    assert_eq!(
        wait["schema"]["maximum"].as_f64(),
        Some(MAX_WAIT.as_secs() as f64)
    );
    let refused = doc["paths"]["/v1/receipts"]["get"]["responses"]["400"]["description"]
        .as_str()
        .unwrap_or_default();
    assert!(
        refused.contains(&format!("a limit outside 1-{MAX_LIMIT}"))
            && refused.contains(&format!("a wait outside 0-{}", MAX_WAIT.as_secs())),
        "{refused}"
    );
}

#[actix_web::test]
async fn the_openapi_document_covers_every_route_status_and_header() {
    let app = TestApp::new(TestDb::sqlite());
    let service = app.service().await;
    let answer = send(&service, TestRequest::get().uri("/openapi.json")).await;
    assert_eq!(answer.status, StatusCode::OK);
    let doc = answer.body;
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with('3')));
    // A licence is named or not claimed at all: never an empty name.
    let license = &doc["info"]["license"];
    assert!(
        license.is_null() || license["name"].as_str().is_some_and(|n| !n.is_empty()),
        "info.license: {license}"
    );

    let paths = doc["paths"].as_object().expect("paths");
    assert_eq!(
        paths.len(),
        DOCUMENTED.len(),
        "documented paths: {:?}",
        paths.keys().collect::<Vec<_>>()
    );
    for (path, method, statuses) in DOCUMENTED {
        let operation = &doc["paths"][path][method];
        assert!(operation.is_object(), "{method} {path} is missing");
        for status in *statuses {
            assert!(
                operation["responses"][status].is_object(),
                "{method} {path} lacks {status}"
            );
        }
        // And the route is really served.
        let probe = match *method {
            "post" => TestRequest::post(),
            _ => TestRequest::get(),
        };
        let path = path
            .replace("{receipt_id}", "rcpt_x")
            .replace("{tile}", "0/000");
        let served = send(&service, probe.uri(&path)).await;
        // Unauthenticated, a served route answers 401 (or its own answer), never the fallback 404.
        assert!(
            served.body["type"]
                .as_str()
                .is_none_or(|t| !t.ends_with("/not-found") && !t.ends_with("/method-not-allowed")),
            "{path} is documented but not served"
        );
    }
    let post = &doc["paths"]["/v1/plans"]["post"];
    let params: Vec<&str> = post["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert!(params.contains(&"Idempotency-Key"), "{params:?}");
    assert!(post["requestBody"]["content"]["application/json"].is_object());
    assert!(post["responses"]["201"]["headers"]["Location"].is_object());
    assert!(post["responses"]["200"]["headers"]["Idempotent-Replayed"].is_object());
    assert!(post["responses"]["401"]["headers"]["WWW-Authenticate"].is_object());
    assert!(post["responses"]["503"]["headers"]["Retry-After"].is_object());
    assert!(post["responses"]["422"]["content"]["application/problem+json"].is_object());
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
    for schema in [
        "Receipt",
        "PlanRequest",
        "Problem",
        "FieldError",
        "FeedPage",
        "PlanView",
    ] {
        assert!(
            doc["components"]["schemas"][schema].is_object(),
            "schema {schema} missing"
        );
    }
}

#[test]
fn a_request_log_line_carries_the_request_id_and_never_the_token_or_body() {
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let server = ServeProcess::start_with(&url, &["--log-format", "json"]);
    let body = plan_body("run-1", "BODY-SECRET-MARKER");
    let response = client()
        .post(&format!("http://{}/v1/plans", server.addr))
        .set("Authorization", &format!("Bearer {token}"))
        .set("Idempotency-Key", "key-for-the-log")
        .set("Content-Type", "application/json")
        .set("X-Request-Id", "req-log-test-1")
        .send_string(&body)
        .expect("201");
    assert_eq!(response.header("x-request-id"), Some("req-log-test-1"));
    let log = Arc::clone(&server.log);
    assert!(server.terminate().success());

    let lines = log.lock().expect("log").clone();
    let line = lines
        .iter()
        .find(|l| l.contains("req-log-test-1"))
        .expect("a log line with the request id");
    let fields: Value = serde_json::from_str(line).expect("JSON log line");
    assert_eq!(fields["status"], 201);
    assert_eq!(fields["route"], "/v1/plans");
    assert_eq!(fields["maker"], "planner-a");
    assert_eq!(fields["idempotency_key"], "key-for-the-log");
    assert!(fields["latency_ms"].is_number());
    for line in &lines {
        assert!(!line.contains(&token[4..]), "a token was logged: {line}");
        assert!(
            !line.contains("BODY-SECRET-MARKER"),
            "a body was logged: {line}"
        );
    }
}

#[test]
fn sigterm_during_a_burst_answers_every_request_completely_and_exits_0() {
    let scratch = TestDb::sqlite();
    let url = scratch.url.clone();
    let app = TestApp::new(scratch);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let server = ServeProcess::start(&url);

    let answered = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let (addr, token, answered, stop) = (
                server.addr.clone(),
                token.clone(),
                Arc::clone(&answered),
                Arc::clone(&stop),
            );
            thread::spawn(move || {
                let agent = client();
                let mut created = Vec::new();
                for i in 0.. {
                    let body = plan_body(&format!("run-{c}-{i}"), "x");
                    match post_plan(&agent, &addr, &token, &format!("k-{c}-{i}"), &body) {
                        Ok((status, receipt)) => {
                            // A response that arrived is a whole one: it parsed, and it is a receipt.
                            assert_eq!(status, 201, "{receipt}");
                            created.push(
                                receipt["receipt_id"]
                                    .as_str()
                                    .expect("complete receipt")
                                    .to_owned(),
                            );
                            answered.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(_) if stop.load(Ordering::SeqCst) => break,
                        Err(e) => panic!("refused before shutdown: {e}"),
                    }
                }
                created
            })
        })
        .collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while answered.load(Ordering::SeqCst) < 40 {
        assert!(
            std::time::Instant::now() < deadline && !clients.iter().all(|c| c.is_finished()),
            "40 answers never came"
        );
        thread::sleep(std::time::Duration::from_millis(2));
    }
    stop.store(true, Ordering::SeqCst);
    let status = server.terminate();
    let created: Vec<String> = clients
        .into_iter()
        .flat_map(|c| c.join().expect("client"))
        .collect();
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    for receipt in &created {
        assert!(
            app.stored(receipt).is_some(),
            "{receipt} was answered 201 but is not kept"
        );
    }
    assert_eq!(
        app.count("plans"),
        created.len() as i64,
        "a plan was kept but its answer lost"
    );
}

/// `serve` on a new database logs each migration it applies, by name.
#[test]
fn serve_logs_each_migration_it_applies() {
    let scratch = TestDb::sqlite();
    let server = ServeProcess::start(&scratch.url);
    let log = server.log.lock().expect("log").join("\n");
    for name in crate::schema::MIGRATION_HISTORY {
        assert!(
            log.lines()
                .any(|l| l.contains("applied migration") && l.contains(name)),
            "no log line for {name}:\n{log}"
        );
    }
}
