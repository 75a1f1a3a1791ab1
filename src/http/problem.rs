//! Every error answer: an RFC 9457 `application/problem+json` body, mapped
//! from one enum by one `match`. Causes are logged, never sent.

use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, ResponseError};

use crate::intake::body::{BodyError, FieldError};
use crate::intake::read::NotSetUp;
use crate::intake::receipt::CorruptRow;
use crate::intake::{ReadError, SubmitError};

pub use crate::intake::PROBLEM_BASE;
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
    /// A checkpoint size the caller verified that the log no longer
    /// reaches: 409, no retry mends it.
    #[error("{0}")]
    LogRolledBack(String),
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
    /// The public evidence routes' reads of this second are spent (for
    /// callers that are not familiar logins): 503, before any connection.
    #[error("too many reads of the public evidence right now; retry after the Retry-After delay")]
    PublicReadsSpent,
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
    /// The database is not set up for the service (migrations pending,
    /// grants its role lacks): 503 naming which, retry later; an operator
    /// must act.
    #[error(transparent)]
    NotSetUp(NotSetUp),
    /// `/readyz` not ready, its reason named (`problem`) and told whole
    /// (`detail`): the operator's answer, not a caller's.
    #[error("{detail}")]
    NotReady {
        problem: &'static str,
        detail: String,
    },
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

pub use crate::intake::Problem;

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

/// What an answer's kind decides, all in one place: its status, its
/// problem type (the slug under `PROBLEM_BASE`) and title, the label a
/// refused `POST /v1/plans` is counted under, and whether it says when to
/// retry (`Retry-After`).
struct Kind {
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
    label: &'static str,
    retry_after: bool,
}

const fn kind(
    status: StatusCode,
    slug: &'static str,
    title: &'static str,
    label: &'static str,
    retry_after: bool,
) -> Kind {
    Kind {
        status,
        slug,
        title,
        label,
        retry_after,
    }
}

/// The problem type of a database not set up for the service.
pub(crate) fn not_set_up(error: &NotSetUp) -> &'static str {
    match error {
        NotSetUp::MigrationsPending(_) => "migrations-pending",
        NotSetUp::MissingGrants { .. } => "missing-grants",
        NotSetUp::ReceiptLogStuck(_) => "receipt-log-stuck",
        NotSetUp::SigningKeyUnpublished(_) => "signing-key-unpublished",
        NotSetUp::UnsignedOnSignedLog(_) => "unsigned-on-a-signed-log",
        NotSetUp::StorageFull => "storage-full",
    }
}

impl ApiError {
    /// Every kind of answer, one row each.
    #[rustfmt::skip]
    fn kind(&self) -> Kind {
        use StatusCode as S;
        const UNAVAILABLE: &str = "Service Unavailable";
        match self {
            ApiError::Unauthorized(_) => kind(S::UNAUTHORIZED, "unauthorized", "Unauthorized", "unauthorized", false),
            ApiError::Forbidden(_) => kind(S::FORBIDDEN, "forbidden", "Forbidden", "forbidden", false),
            ApiError::NotFound => kind(S::NOT_FOUND, "not-found", "Not Found", "invalid", false),
            ApiError::NotLoggedYet(_) => kind(S::NOT_FOUND, "not-logged-yet", "Not In A Checkpoint Yet", "invalid", true),
            ApiError::MethodNotAllowed(_) => kind(S::METHOD_NOT_ALLOWED, "method-not-allowed", "Method Not Allowed", "invalid", false),
            ApiError::BadIdempotencyKey(_) => kind(S::BAD_REQUEST, "invalid-idempotency-key", "Invalid Idempotency-Key", "invalid", false),
            ApiError::MalformedJson(_) => kind(S::BAD_REQUEST, "malformed-json", "Malformed JSON", "invalid", false),
            ApiError::BadQuery(_) => kind(S::BAD_REQUEST, "invalid-query", "Invalid Query Parameters", "invalid", false),
            ApiError::CursorNotInFeed(_) => kind(S::BAD_REQUEST, crate::intake::feed::CURSOR_NOT_IN_FEED, "Cursor Not In This Feed", "invalid", false),
            ApiError::LogRolledBack(_) => kind(S::CONFLICT, "log-rolled-back", "The Log Holds Fewer Leaves", "invalid", false),
            ApiError::MalformedHead => kind(S::BAD_REQUEST, "malformed-request", "Bad Request", "invalid", false),
            ApiError::Invalid(_) => kind(S::UNPROCESSABLE_ENTITY, "validation-failed", "Validation Failed", "invalid", false),
            ApiError::KeyReused => kind(S::UNPROCESSABLE_ENTITY, "idempotency-key-reused", "Idempotency Key Reused", "key_reused", false),
            ApiError::Refused(_) => kind(S::UNPROCESSABLE_ENTITY, "refused-by-database", "Refused by a Database Rule", "refused", false),
            ApiError::PayloadTooLarge(_) => kind(S::PAYLOAD_TOO_LARGE, "payload-too-large", "Payload Too Large", "invalid", false),
            ApiError::UnsupportedMediaType(_) => kind(S::UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type", "Unsupported Media Type", "invalid", false),
            ApiError::SlowClient(_) | ApiError::SlowHead(_) => kind(S::REQUEST_TIMEOUT, "request-timeout", "Request Timeout", "invalid", false),
            ApiError::HeadTooLarge => kind(S::REQUEST_HEADER_FIELDS_TOO_LARGE, "request-header-fields-too-large", "Request Header Fields Too Large", "invalid", false),
            ApiError::Throttled(_) => kind(S::TOO_MANY_REQUESTS, "throttled", "Too Many Requests", "throttled", true),
            ApiError::BodiesInFlight | ApiError::StrangersTurnedAway | ApiError::PublicReadsSpent => kind(S::SERVICE_UNAVAILABLE, "busy", UNAVAILABLE, "unavailable", true),
            ApiError::CommitsBlocked => kind(S::SERVICE_UNAVAILABLE, "commits-blocked", UNAVAILABLE, "unavailable", true),
            ApiError::NotSetUp(e) => kind(S::SERVICE_UNAVAILABLE, not_set_up(e), UNAVAILABLE, "unavailable", true),
            ApiError::NotReady { problem, .. } => kind(S::SERVICE_UNAVAILABLE, problem, UNAVAILABLE, "unavailable", true),
            ApiError::Unavailable(_) => kind(S::SERVICE_UNAVAILABLE, "unavailable", UNAVAILABLE, "unavailable", true),
            ApiError::Timeout(_) => kind(S::SERVICE_UNAVAILABLE, "timeout", UNAVAILABLE, "unavailable", true),
            ApiError::Internal(_) => kind(S::INTERNAL_SERVER_ERROR, "internal", "Internal Server Error", "error", false),
        }
    }

    /// The label under which a refused `POST /v1/plans` is counted.
    pub fn outcome_label(&self) -> &'static str {
        self.kind().label
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
            ApiError::NotSetUp(NotSetUp::MigrationsPending(_)) => {
                "the service's database has migrations pending: an operator must run `plan-intake migrate run`; retry later with the same Idempotency-Key".to_owned()
            }
            ApiError::NotSetUp(NotSetUp::StorageFull) => {
                "the service's storage is full: nothing was written; retry later with the same Idempotency-Key (an operator must free space)".to_owned()
            }
            ApiError::NotSetUp(NotSetUp::ReceiptLogStuck(_) | NotSetUp::SigningKeyUnpublished(_) | NotSetUp::UnsignedOnSignedLog(_)) => {
                "the service is not ready; an operator must look".to_owned()
            }
            ApiError::NotSetUp(_) => {
                "permission denied: the service's database role lacks grants it needs, and an operator must run `plan-intake migrate grants ROLE`; retry later with the same Idempotency-Key".to_owned()
            }
            ApiError::KeyReused => {
                "this Idempotency-Key was already used by this login for a different request; nothing was stored: send the new content under a new Idempotency-Key (a retry of the first request keeps this key)"
                    .to_owned()
            }
            other => other.to_string(),
        }
    }
}

impl ApiError {
    /// The problem+json body of this answer.
    pub fn problem(&self, status: StatusCode) -> Problem {
        let Kind { slug, title, .. } = self.kind();
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
        self.kind().status
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
        if self.kind().retry_after {
            response.insert_header((header::RETRY_AFTER, RETRY_AFTER_SECS.to_string()));
        }
        match self {
            ApiError::Unauthorized(_) => {
                response
                    .insert_header((header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")));
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
            ReadError::NotSetUp(e) => ApiError::NotSetUp(e),
            ReadError::Corrupt(_) => ApiError::Internal(Box::new(error)),
            ReadError::CursorNotInFeed(refused) => ApiError::CursorNotInFeed(refused.to_string()),
            ReadError::RolledBack(why) => ApiError::LogRolledBack(why),
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
            SubmitError::StorageFull(_) => ApiError::NotSetUp(NotSetUp::StorageFull),
            e @ SubmitError::ReceiptTooLarge { .. } => ApiError::Invalid(vec![FieldError {
                field: "approved_inputs".to_owned(),
                message: e.to_string(),
            }]),
            e if e.deadline_passed() => ApiError::Timeout(Box::new(e)),
            e @ SubmitError::Corrupt(_) => ApiError::Internal(Box::new(e)),
            SubmitError::NotSetUp(e) => ApiError::NotSetUp(e),
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
