//! Every error reaches the caller as the answer its kind promises: the
//! status, the problem type, and the headers a client acts on. A pure
//! mapping, checked without a server.

use actix_web::ResponseError;
use actix_web::http::StatusCode;
use actix_web::http::header;
use plan_intake::http::ApiError;
use plan_intake::http::problem::PROBLEM_BASE;
use plan_intake::intake::{ReadError, SubmitError};
use plan_intake::storage::StorageError;

fn answer(error: ApiError) -> (StatusCode, String, actix_web::HttpResponse) {
    let response = error.error_response();
    let body = actix_web::rt::System::new()
        .block_on(actix_web::body::to_bytes(response.into_body()))
        .expect("body");
    let problem: serde_json::Value = serde_json::from_slice(&body).expect("problem+json");
    let kind = problem["type"]
        .as_str()
        .expect("type")
        .trim_start_matches(PROBLEM_BASE)
        .to_owned();
    assert_eq!(problem["status"], error.status_code().as_u16());
    (error.status_code(), kind, error.error_response())
}

fn unavailable() -> StorageError {
    StorageError::unavailable("no database connection", std::io::Error::other("refused"))
}

#[test]
fn reads_that_cannot_answer_are_503_with_retry_after_and_corrupt_rows_500() {
    let cases = [
        (
            ReadError::from(StorageError::DeadlineExceeded("reading")),
            503,
            "timeout",
        ),
        (ReadError::from(unavailable()), 503, "unavailable"),
        (
            ReadError::from(StorageError::PendingMigrations(vec!["m".to_owned()])),
            503,
            "migrations-pending",
        ),
        (
            ReadError::from(StorageError::MissingGrants {
                role: "svc".to_owned(),
                missing: vec!["INSERT on receipt_log".to_owned()],
            }),
            503,
            "missing-grants",
        ),
        (
            ReadError::Corrupt(Box::new(std::io::Error::other("bad json"))),
            500,
            "internal",
        ),
    ];
    for (error, status, kind) in cases {
        let (got_status, got_kind, response) = answer(error.into());
        assert_eq!((got_status.as_u16(), got_kind.as_str()), (status, kind));
        assert_eq!(
            response.headers().contains_key(header::RETRY_AFTER),
            status == 503,
            "{kind}: Retry-After only on a 503"
        );
    }
}

#[test]
fn a_failed_write_is_refused_only_when_the_request_is_at_fault() {
    let diesel_error = || diesel::result::Error::NotFound;
    let cases = [
        (SubmitError::KeyReused, 422, "idempotency-key-reused"),
        (
            SubmitError::Refused {
                constraint: Some("plans_qty_ck".to_owned()),
                source: diesel_error(),
            },
            422,
            "refused-by-database",
        ),
        (
            SubmitError::RetriesExhausted {
                attempts: 5,
                last: diesel_error(),
            },
            503,
            "unavailable",
        ),
        (
            SubmitError::CommitUnknown {
                commit_error: diesel_error(),
                reread_error: unavailable(),
            },
            503,
            "unavailable",
        ),
        (SubmitError::Unavailable(diesel_error()), 503, "unavailable"),
        (
            SubmitError::from(StorageError::DeadlineExceeded("writing")),
            503,
            "timeout",
        ),
        (SubmitError::from(unavailable()), 503, "unavailable"),
    ];
    for (error, status, kind) in cases {
        let (got_status, got_kind, _) = answer(error.into());
        assert_eq!((got_status.as_u16(), got_kind.as_str()), (status, kind));
    }
}

#[test]
fn the_door_s_own_refusals_keep_their_status() {
    let cases = [
        (
            ApiError::Unauthorized("unknown or revoked token"),
            401,
            "unauthorized",
        ),
        (ApiError::Forbidden("no".to_owned()), 403, "forbidden"),
        (ApiError::NotFound, 404, "not-found"),
        (
            ApiError::BadIdempotencyKey("missing".to_owned()),
            400,
            "invalid-idempotency-key",
        ),
        (
            ApiError::MalformedJson("x".to_owned()),
            400,
            "malformed-json",
        ),
        (ApiError::BadQuery("x".to_owned()), 400, "invalid-query"),
        (ApiError::Invalid(Vec::new()), 422, "validation-failed"),
        (ApiError::PayloadTooLarge(1), 413, "payload-too-large"),
        (
            ApiError::UnsupportedMediaType("x".to_owned()),
            415,
            "unsupported-media-type",
        ),
    ];
    for (error, status, kind) in cases {
        let (got_status, got_kind, response) = answer(error);
        assert_eq!((got_status.as_u16(), got_kind.as_str()), (status, kind));
        assert_eq!(
            response.headers().contains_key(header::WWW_AUTHENTICATE),
            status == 401
        );
    }
}
