//! Broken clients and attackers: thousands of random and mutated requests,
//! then the database must hold exactly the rows of the valid ones.

use std::collections::HashSet;

use actix_web::http::StatusCode;
use actix_web::test::TestRequest;
use plan_intake::intake::Permission;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::on_both_backends;
use crate::support::{TestApp, TestDb, get, plan_body, send};

on_both_backends!(
    numbers_are_kept_exactly_or_refused_with_their_path,
    random_and_mutated_requests_write_exactly_the_valid_rows,
    tokens_are_random_hashed_and_scoped
);

const REQUESTS: usize = 2500;

fn mutate(body: &[u8], rng: &mut StdRng) -> Vec<u8> {
    let mut bytes = body.to_vec();
    for _ in 0..rng.random_range(1..4) {
        if bytes.is_empty() {
            break;
        }
        let at = rng.random_range(0..bytes.len());
        match rng.random_range(0..6) {
            0 => bytes[at] = rng.random(),
            1 => {
                let end = rng.random_range(at..=bytes.len());
                bytes.drain(at..end);
            }
            2 => bytes.insert(
                at,
                *b"{}[]\",:\\\0\x7f\xff"
                    .get(rng.random_range(0..13))
                    .unwrap_or(&b'x'),
            ),
            3 => bytes.truncate(at),
            4 => {
                let copy = bytes[at..].to_vec();
                bytes.extend_from_slice(&copy);
            }
            _ => bytes
                .splice(at..at, b"\"run_id\":\"\",".iter().copied())
                .for_each(drop),
        }
    }
    bytes
}

async fn random_and_mutated_requests_write_exactly_the_valid_rows(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut created = HashSet::new();
    let mut statuses = std::collections::BTreeMap::new();

    for i in 0..REQUESTS {
        let valid = plan_body(&format!("run-{i}"), "x");
        let mut request = TestRequest::post().uri("/v1/plans");
        let body: Vec<u8> = if rng.random_range(0..4) == 0 {
            valid.into_bytes()
        } else {
            mutate(valid.as_bytes(), &mut rng)
        };
        let body = if rng.random_range(0..100) == 0 {
            vec![b' '; 1024 * 1024 + 1]
        } else {
            body
        };
        // Headers: mostly right, sometimes wrong, missing or hostile.
        let key = match rng.random_range(0..10) {
            0 => None,
            1 => Some("k".repeat(rng.random_range(250..260))),
            2 => Some(format!("\"k-{i}\\")),
            3 => Some(format!("k {i}")),
            _ => Some(format!("k-{i}")),
        };
        if let Some(key) = key {
            request = request.insert_header(("Idempotency-Key", key));
        }
        match rng.random_range(0..12) {
            0 => {}
            1 => request = request.insert_header(("Authorization", "Bearer pit_forged")),
            2 => {
                request =
                    request.insert_header(("Authorization", format!("Bearer {}", "a".repeat(5000))))
            }
            _ => request = request.insert_header(("Authorization", format!("Bearer {token}"))),
        }
        let content_type = match rng.random_range(0..10) {
            0 => "text/plain",
            1 => "application/json; charset=utf-8",
            2 => "application/jsonx",
            _ => "application/json",
        };
        request = request.insert_header(("Content-Type", content_type));
        let answer = send(&service, request.set_payload(body)).await;
        *statuses.entry(answer.status.as_u16()).or_insert(0usize) += 1;
        assert!(
            answer.status.as_u16() < 500,
            "request {i} got {}: {:?}",
            answer.status,
            answer.body
        );
        if answer.status.is_client_error() {
            assert_eq!(
                answer.header("content-type"),
                Some("application/problem+json"),
                "request {i}"
            );
        }
        if answer.status == StatusCode::CREATED {
            let receipt = answer.body["receipt_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(
                created.insert(receipt),
                "request {i}: one receipt created twice"
            );
        }
    }
    assert!(
        created.len() > REQUESTS / 20,
        "too few valid requests to mean anything: {statuses:?}"
    );
    assert!(
        statuses.keys().filter(|s| **s >= 400).count() >= 5,
        "too few kinds of refusal: {statuses:?}"
    );

    let mut conn = app.conn();
    let stored = crate::support::stored_receipt_ids(&mut conn);
    assert_eq!(
        stored, created,
        "the database holds other rows than those of the 201s"
    );
    assert_eq!(app.count("intake_keys"), created.len() as i64);
}

async fn tokens_are_random_hashed_and_scoped(db: TestDb) {
    let app = TestApp::new(db);
    let tokens: Vec<String> = (0..50)
        .map(|i| app.login(&format!("login-{i}"), &[Permission::PlansSubmit]))
        .collect();
    let unique: HashSet<&String> = tokens.iter().collect();
    assert_eq!(unique.len(), tokens.len());
    for token in &tokens {
        let hex = token.strip_prefix("pit_").expect("prefix");
        assert_eq!(hex.len(), 64, "256 bits");
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    }
    let mut conn = app.conn();
    let rows = plan_intake::storage::logins::list(&mut conn).expect("list");
    for row in &rows {
        assert!(
            tokens
                .iter()
                .all(|t| !row.token_hash.contains(&t[4..]) && row.token_hash != *t),
            "a token is stored"
        );
        assert!(
            tokens
                .iter()
                .any(|t| plan_intake::intake::login::token_hash(t) == row.token_hash)
        );
    }
    // Found by its hash: the same token with one character changed finds nothing.
    let mut near = tokens[0].clone();
    let last = if near.ends_with('0') { "1" } else { "0" };
    near.replace_range(near.len() - 1.., last);
    assert_eq!(
        plan_intake::intake::login::login_for_token(&app.direct, &near).expect("lookup"),
        None
    );

    // Another maker's receipt and key are out of reach.
    let service = app.service().await;
    let body = plan_body("run-1", "x");
    let theirs = send(
        &service,
        crate::support::post_plan(&tokens[0], "shared", &body),
    )
    .await;
    let mine = send(
        &service,
        crate::support::post_plan(&tokens[1], "shared", &body),
    )
    .await;
    assert_eq!(
        mine.status,
        StatusCode::CREATED,
        "a key is never another maker's replay"
    );
    assert_ne!(mine.body["receipt_id"], theirs.body["receipt_id"]);
    let peek = send(
        &service,
        get(
            &tokens[1],
            &format!(
                "/v1/plans/{}",
                theirs.body["receipt_id"].as_str().unwrap_or_default()
            ),
        ),
    )
    .await;
    assert_eq!(peek.status, StatusCode::NOT_FOUND);
}

/// A number is kept with exactly the value sent (in its RFC 8785 form) or
/// refused with 422 naming its path; nothing is written for a refusal, and
/// a plan differing only in a number past double precision is never
/// answered as "already received".
async fn numbers_are_kept_exactly_or_refused_with_their_path(db: TestDb) {
    let app = TestApp::new(db);
    let token = app.login("planner-a", &[Permission::PlansSubmit]);
    let service = app.service().await;
    let body = |n: &str| {
        format!(
            r#"{{"run_id":"run-1","approved_inputs":[{{"id":"in"}}],"content":{{"lines":[{{"qty":1}},{{"qty":{n}}}]}}}}"#
        )
    };
    for (i, (sent, kept)) in [
        ("1.0", "1"),
        ("1e2", "100"),
        ("0.5", "0.5"),
        ("-0.0", "0"),
        ("123.456", "123.456"),
    ]
    .into_iter()
    .enumerate()
    {
        let answer = send(
            &service,
            crate::support::post_plan(&token, &format!("ok-{i}"), &body(sent)),
        )
        .await;
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{sent}: {:?}",
            answer.body
        );
        let id = answer.body["receipt_id"].as_str().unwrap_or_default();
        let stored = app.stored(id).expect("stored");
        assert_eq!(
            stored.content,
            format!(r#"{{"lines":[{{"qty":1}},{{"qty":{kept}}}]}}"#),
            "{sent}"
        );
    }
    let before = app.count("plans");
    for (i, sent) in [
        "18446744073709551617",
        "18446744073709551616",
        "9007199254740993.0",
        "0.10000000000000000555",
        "100000000000000000000.5",
        "1e400",
    ]
    .into_iter()
    .enumerate()
    {
        let answer = send(
            &service,
            crate::support::post_plan(&token, &format!("no-{i}"), &body(sent)),
        )
        .await;
        assert_eq!(
            answer.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{sent}: {:?}",
            answer.body
        );
        assert_eq!(
            answer.body["errors"][0]["field"], "content.lines[1].qty",
            "{sent}"
        );
    }
    assert_eq!(
        app.count("plans"),
        before,
        "nothing written for a refused number"
    );
}
