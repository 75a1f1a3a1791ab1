//! Every error answer: an RFC 9457 `application/problem+json` body, mapped
//! from one enum by one `match`. Causes are logged, never sent.

use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

use crate::intake::body::{BodyError, FieldError};
use crate::intake::receipt::CorruptRow;
use crate::intake::{ReadError, SubmitError};

pub const PROBLEM_BASE: &str = "https://plan-intake.dev/problems/";
pub const PROBLEM_JSON: &str = "application/problem+json";
/// Seconds a 503 asks the caller to wait before retrying with the same key.
pub const RETRY_AFTER_SECS: u64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("{0}")]
    Forbidden(String),
    #[error("not found")]
    NotFound,
    /// A receipt not yet under a signed checkpoint, or a log with none yet:
    /// 404 with `Retry-After`.
    #[error("{0}")]
    NotLoggedYet(&'static str),
    /// A known path asked with a method it does not serve: 405 + `Allow`.
    #[error("this path takes only {0}")]
    MethodNotAllowed(&'static str),
    #[error("{0}")]
    BadIdempotencyKey(String),
    #[error("{0}")]
    MalformedJson(String),
    #[error("{0}")]
    BadQuery(String),
    /// A feed cursor from another deployment, a restored database or past
    /// the end: 400, start again from `after=now` or the start.
    #[error("{0}")]
    CursorNotInFeed(String),
    #[error("the request body failed validation")]
    Invalid(Vec<FieldError>),
    #[error("idempotency key reused for a different request")]
    KeyReused,
    #[error("body larger than {0} bytes")]
    PayloadTooLarge(usize),
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// A rule of the table refuses the plan (a CHECK constraint).
    #[error("the database's rule {} refuses this plan", .0.as_deref().unwrap_or("(unnamed)"))]
    Refused(Option<String>),
    /// The login has its share of requests in flight: 429, retry later.
    #[error(
        "login `{0}` already has its share of requests in flight; retry after the Retry-After delay with the same Idempotency-Key"
    )]
    Throttled(String),
    /// The bodies of other requests and expanded reads fill the memory set
    /// aside for them: 503.
    #[error(
        "too many request bodies and plan reads are being handled; retry after the Retry-After delay (a submission with the same Idempotency-Key)"
    )]
    BodiesInFlight,
    /// Too many sign-ins with tokens no login has shown lately this second:
    /// 503, retry (a new token is looked up on its retry).
    #[error(
        "too many sign-ins with unfamiliar tokens right now; retry after the Retry-After delay"
    )]
    StrangersTurnedAway,
    /// The client sent its body too slowly: 408, the connection is closed.
    #[error("the request body did not arrive within {0} ms")]
    SlowClient(u128),
    /// The request head did not arrive in time (answered by actix itself,
    /// given its body by `own_answers`): 408, the connection is closed.
    #[error("the request head did not arrive within {0} ms")]
    SlowHead(u128),
    /// A malformed request head (actix's own answer): 400.
    #[error("the request head is malformed")]
    MalformedHead,
    /// A request head over actix's limits (actix's own answer): 431.
    #[error("the request head has more than 96 header fields or more than 128 KiB")]
    HeadTooLarge,
    /// Commits wait for a synchronous standby and none is attached
    /// (`/readyz`): 503.
    #[error(
        "commits wait for a synchronous standby and none is attached: no write can complete until one is"
    )]
    CommitsBlocked,
    /// The cause is logged; the caller is told to retry with the same key.
    #[error("service unavailable")]
    Unavailable(#[source] Cause),
    /// The request's deadline passed: 503, retry with the same key.
    #[error("the request's deadline passed")]
    Timeout(#[source] Cause),
    /// The cause is logged; the caller sees a generic 500.
    #[error("internal error")]
    Internal(#[source] Cause),
}

/// What went wrong underneath, kept whole for the log.
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

/// Marks a response that answers a request whose deadline passed, so the
/// deadline middleware counts it.
#[derive(Clone, Copy)]
pub struct TimedOut;

/// An RFC 9457 problem: every error answer's body.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Problem {
    /// A URI naming the kind of problem, under `https://plan-intake.dev/problems/`.
    #[serde(rename = "type")]
    #[schema(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// Present on validation failures: one entry per refused field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<FieldError>>,
}

/// What every route behind a login can answer besides its own results:
/// documented once, listed by each route's `responses(...)`.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // ok: a documentation type, never built
pub enum Refusals {
    /// Missing, unknown or revoked token
    #[response(status = 401, content_type = "application/problem+json",
        headers(("WWW-Authenticate" = String, description = "Bearer")))]
    Unauthorized(Problem),
    /// The login lacks the permission this route needs
    #[response(status = 403, content_type = "application/problem+json")]
    Forbidden(Problem),
    /// Database unavailable, retries exhausted, COMMIT outcome unknown, the request's deadline passed, too many request bodies or plan reads in flight, or too many sign-ins with unfamiliar tokens at once: retry (with the same key)
    #[response(status = 503, content_type = "application/problem+json",
        headers(("Retry-After" = u64, description = "Seconds to wait")))]
    Unavailable(Problem),
}

/// A receipt that does not exist, or is another maker's: the same answer.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // ok: a documentation type, never built
pub enum NotYours {
    /// Unknown, or another maker's
    #[response(status = 404, content_type = "application/problem+json")]
    NotFound(Problem),
}

impl ApiError {
    /// The label under which a refused `POST /v1/plans` is counted.
    pub fn outcome_label(&self) -> &'static str {
        match self {
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::KeyReused => "key_reused",
            ApiError::Unavailable(_)
            | ApiError::Timeout(_)
            | ApiError::BodiesInFlight
            | ApiError::StrangersTurnedAway
            | ApiError::CommitsBlocked => "unavailable",
            ApiError::Throttled(_) => "throttled",
            ApiError::Refused(_) => "refused",
            ApiError::Internal(_) => "error",
            ApiError::NotFound
            | ApiError::NotLoggedYet(_)
            | ApiError::MethodNotAllowed(_)
            | ApiError::BadIdempotencyKey(_)
            | ApiError::MalformedJson(_)
            | ApiError::BadQuery(_)
            | ApiError::CursorNotInFeed(_)
            | ApiError::Invalid(_)
            | ApiError::PayloadTooLarge(_)
            | ApiError::UnsupportedMediaType(_)
            | ApiError::SlowClient(_)
            | ApiError::SlowHead(_)
            | ApiError::MalformedHead
            | ApiError::HeadTooLarge => "invalid",
        }
    }

    fn slug_and_title(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::Unauthorized(_) => ("unauthorized", "Unauthorized"),
            ApiError::Forbidden(_) => ("forbidden", "Forbidden"),
            ApiError::NotFound => ("not-found", "Not Found"),
            ApiError::NotLoggedYet(_) => ("not-logged-yet", "Not In A Checkpoint Yet"),
            ApiError::MethodNotAllowed(_) => ("method-not-allowed", "Method Not Allowed"),
            ApiError::BadIdempotencyKey(_) => {
                ("invalid-idempotency-key", "Invalid Idempotency-Key")
            }
            ApiError::MalformedJson(_) => ("malformed-json", "Malformed JSON"),
            ApiError::BadQuery(_) => ("invalid-query", "Invalid Query Parameters"),
            ApiError::CursorNotInFeed(_) => ("cursor-not-in-feed", "Cursor Not In This Feed"),
            ApiError::Invalid(_) => ("validation-failed", "Validation Failed"),
            ApiError::KeyReused => ("idempotency-key-reused", "Idempotency Key Reused"),
            ApiError::PayloadTooLarge(_) => ("payload-too-large", "Payload Too Large"),
            ApiError::UnsupportedMediaType(_) => {
                ("unsupported-media-type", "Unsupported Media Type")
            }
            ApiError::Refused(_) => ("refused-by-database", "Refused by a Database Rule"),
            ApiError::Throttled(_) => ("throttled", "Too Many Requests"),
            ApiError::BodiesInFlight | ApiError::StrangersTurnedAway => {
                ("busy", "Service Unavailable")
            }
            ApiError::SlowClient(_) | ApiError::SlowHead(_) => {
                ("request-timeout", "Request Timeout")
            }
            ApiError::MalformedHead => ("malformed-request", "Bad Request"),
            ApiError::HeadTooLarge => (
                "request-header-fields-too-large",
                "Request Header Fields Too Large",
            ),
            ApiError::Unavailable(_) => ("unavailable", "Service Unavailable"),
            ApiError::CommitsBlocked => ("commits-blocked", "Service Unavailable"),
            ApiError::Timeout(_) => ("timeout", "Service Unavailable"),
            ApiError::Internal(_) => ("internal", "Internal Server Error"),
        }
    }

    fn detail(&self) -> String {
        match self {
            ApiError::Unavailable(_) => {
                "the database is unavailable; retry later with the same Idempotency-Key".to_owned()
            }
            ApiError::Timeout(_) => {
                "the request could not finish in time; retry later with the same Idempotency-Key"
                    .to_owned()
            }
            ApiError::Internal(_) => "an internal error occurred; it has been logged".to_owned(),
            ApiError::KeyReused => {
                "this Idempotency-Key was already used by this login for a different request"
                    .to_owned()
            }
            other => other.to_string(),
        }
    }
}

impl ApiError {
    /// The problem+json body of this answer.
    pub fn problem(&self, status: StatusCode) -> Problem {
        let (slug, title) = self.slug_and_title();
        Problem {
            kind: format!("{PROBLEM_BASE}{slug}"),
            title: title.to_owned(),
            status: status.as_u16(),
            detail: self.detail(),
            errors: match self {
                ApiError::Invalid(errors) => Some(errors.clone()),
                _ => None,
            },
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound | ApiError::NotLoggedYet(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BadIdempotencyKey(_)
            | ApiError::MalformedJson(_)
            | ApiError::BadQuery(_)
            | ApiError::CursorNotInFeed(_)
            | ApiError::MalformedHead => StatusCode::BAD_REQUEST,
            ApiError::Invalid(_) | ApiError::KeyReused | ApiError::Refused(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Unavailable(_)
            | ApiError::Timeout(_)
            | ApiError::BodiesInFlight
            | ApiError::StrangersTurnedAway
            | ApiError::CommitsBlocked => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Throttled(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::SlowClient(_) | ApiError::SlowHead(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let status = self.status_code();
        match self {
            ApiError::Unavailable(cause) | ApiError::Timeout(cause) => {
                tracing::warn!(cause = %crate::report::chain(cause.as_ref()), "answering 503")
            }
            ApiError::Internal(cause) => {
                tracing::error!(cause = %crate::report::chain(cause.as_ref()), "answering 500")
            }
            _ => {}
        }
        let problem = self.problem(status);
        let mut response = HttpResponse::build(status);
        response.content_type(PROBLEM_JSON);
        match self {
            ApiError::Unauthorized(_) => {
                response
                    .insert_header((header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")));
            }
            ApiError::Unavailable(_)
            | ApiError::Timeout(_)
            | ApiError::BodiesInFlight
            | ApiError::StrangersTurnedAway
            | ApiError::CommitsBlocked
            | ApiError::NotLoggedYet(_)
            | ApiError::Throttled(_) => {
                response.insert_header((header::RETRY_AFTER, RETRY_AFTER_SECS.to_string()));
            }
            ApiError::MethodNotAllowed(allow) => {
                response.insert_header((header::ALLOW, *allow));
            }
            _ => {}
        }
        let mut response = response.json(problem);
        if let ApiError::Timeout(_) = self {
            response.extensions_mut().insert(TimedOut);
        }
        response
    }
}

/// A read that could not answer is a 503 (retry), never with its text; a
/// stored row that cannot be read back is a 500.
impl From<ReadError> for ApiError {
    fn from(error: ReadError) -> Self {
        match error {
            ReadError::TimedOut(_) => ApiError::Timeout(Box::new(error)),
            ReadError::Unavailable(_) => ApiError::Unavailable(Box::new(error)),
            ReadError::Corrupt(_) => ApiError::Internal(Box::new(error)),
            ReadError::CursorNotInFeed(refused) => ApiError::CursorNotInFeed(refused.to_string()),
        }
    }
}

/// A failed write is a 503 unless the request itself is refused.
impl From<SubmitError> for ApiError {
    fn from(error: SubmitError) -> Self {
        match error {
            SubmitError::KeyReused => ApiError::KeyReused,
            SubmitError::Unauthorized => ApiError::Unauthorized("unknown or revoked token"),
            SubmitError::Refused { constraint, .. } => ApiError::Refused(constraint),
            e if e.deadline_passed() => ApiError::Timeout(Box::new(e)),
            e @ SubmitError::Corrupt(_) => ApiError::Internal(Box::new(e)),
            e => ApiError::Unavailable(Box::new(e)),
        }
    }
}

impl From<BodyError> for ApiError {
    fn from(error: BodyError) -> Self {
        match error {
            BodyError::Malformed(message) => ApiError::MalformedJson(message),
            BodyError::Invalid(errors) => ApiError::Invalid(errors),
        }
    }
}

impl From<CorruptRow> for ApiError {
    fn from(error: CorruptRow) -> Self {
        ApiError::Internal(Box::new(error))
    }
}
