//! `POST /v1/plans`: sign-in before the body, admission, the body's read,
//! the domain's write, the answer.

use actix_web::http::{ConnectionType, header};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, ResponseError, web};

use super::admission::{BodyBytes, LoginSlot};
use super::observe::{LoggedKey, LoggedMaker};
use super::problem::{Problem, Refusals};
use super::{ApiError, AppState, auth};
use crate::config::BODY_BYTES_PATIENCE;
use crate::deadline::Deadline;
use crate::intake::body::PlanRequest;
use crate::intake::{Caller, IdempotencyKey, Outcome, Permission, Receipt, body};

pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";

/// In order: who (401), may they (403), which attempt (400), what format
/// (415), how big (413), what (400/422). Who comes first, before the body
/// is read: a stranger costs at most one indexed lookup. Nothing touches
/// the plan tables until all of it has passed.
#[utoipa::path(post, path = "/v1/plans", tag = "plans",
    request_body(content = PlanRequest, content_type = "application/json"),
    params(
        ("Idempotency-Key" = String, Header, pattern = r#"^([!#-~][!-~]{0,254}|"([!#-\[\]-~]|\\["\\]){1,255}")$"#, description = "1-255 visible ASCII characters, bare or as an RFC 8941 string; the same for every retry of one request"),
    ),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "The plan was kept by this request", body = Receipt,
            headers(("Location" = String, description = "/v1/receipts/{receipt_id}"))),
        (status = 200, description = "Replayed (same key, same request; `Idempotent-Replayed: true`) or already received (new key, same maker, run and content)", body = Receipt,
            headers(("Idempotent-Replayed" = String, description = "`true` on a replay"))),
        (status = 400, description = "Missing or malformed Idempotency-Key, or a body that is not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 408, description = "The body did not arrive within the client timeout; the connection is closed", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over the limit (default 1 MiB)", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Not application/json", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation failed (`errors` names each field; a plan whose receipt would pass 65,535 bytes in its signed form, the largest leaf of the receipt log's tiles, is refused under `approved_inputs`), the key was used for a different request (type …/idempotency-key-reused), or a rule of the table refuses the plan (type …/refused-by-database)", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "This login already has its share of submissions in flight: retry after Retry-After with the same key", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u64, description = "Seconds to wait"))),
        Refusals,
    ))]
pub async fn submit_plan(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let mut payload = Some(payload);
    let answer = submit(&req, &mut payload, &state).await;
    let label = match &answer {
        Ok((outcome, _)) => outcome.as_str(),
        Err(e) => e.outcome_label(),
    };
    state.intake.metrics.outcome(label);
    match (answer, payload) {
        (Ok((_, response)), _) => Ok(response),
        // A body left unread, or refused part way (too large, too slow), is
        // not drained: the connection goes with it, chunked or not. The unread payload is kept with the answer until
        // it is sent: actix then closes the connection after a short linger
        // (`client_disconnect_timeout`), where a payload already dropped
        // would be read to its end, for as long as the client sends.
        (Err(error), Some(unread)) => {
            let mut response = error.error_response();
            response
                .head_mut()
                .set_connection_type(ConnectionType::Close);
            Ok(response.map_body(|_, body| {
                actix_web::body::BoxBody::new(WithUnreadPayload {
                    body,
                    _unread: unread,
                })
            }))
        }
        (Err(error), None) => Err(error),
    }
}

/// An answer's body, holding the request's unread payload until it is sent.
struct WithUnreadPayload {
    body: actix_web::body::BoxBody,
    _unread: web::Payload,
}

impl actix_web::body::MessageBody for WithUnreadPayload {
    type Error = Box<dyn std::error::Error>;

    fn size(&self) -> actix_web::body::BodySize {
        self.body.size()
    }

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<web::Bytes, Self::Error>>> {
        std::pin::Pin::new(&mut self.get_mut().body).poll_next(cx)
    }
}

/// What the door checked and reserved before a body is read (steps 1–2 of
/// ARCHITECTURE.md's request): held by the request until it is answered.
pub(crate) struct Admitted {
    caller: Caller,
    key: IdempotencyKey,
    /// This request's place among its login's submissions in flight.
    _slot: LoginSlot,
    /// Room for its body among the bodies in flight.
    room: BodyBytes,
}

/// [`admit`]'s answer, made before the body was asked for (`http::expect`,
/// for `Expect: 100-continue`): in the request's extensions, taken by
/// [`submit`] so that nothing is checked or reserved twice.
pub(crate) struct Decided(pub(crate) Result<Admitted, ApiError>);

/// This route's path.
pub(crate) const PATH: &str = "/v1/plans";

/// Bodies up to this size are parsed on the async worker that read them (a
/// few tens of microseconds); larger ones on a blocking thread, in turn.
const INLINE_PARSE_BYTES: usize = 16 * 1024;

/// Whether `method` and `path` (as the router sees it) are this route's.
pub(crate) fn is_submission(method: &actix_web::http::Method, path: &str) -> bool {
    *method == actix_web::http::Method::POST && path == PATH
}

/// Everything asked before the body is read, in order: who (401), may they
/// (403), their share (429), which attempt (400), what format (415), how
/// big (413), room for the body (503). Works on the head alone: the route's
/// `HttpRequest` or, before a `100 Continue`, actix's `Request`.
pub(crate) async fn admit<R: HttpMessage>(
    req: &R,
    state: &AppState,
    deadline: Deadline,
) -> Result<Admitted, ApiError> {
    let token = auth::bearer_token(req.headers())?;
    let caller = signed_in(state, token, deadline).await?;
    // The login was found: the log line names its maker, whatever comes next.
    req.extensions_mut()
        .insert(LoggedMaker(caller.login.name.clone()));
    auth::require(&caller.login, Permission::PlansSubmit)?;
    // Held until this request is answered.
    let slot = state
        .admission
        .enter(&caller.login.name)
        .ok_or_else(|| ApiError::Throttled(caller.login.name.clone()))?;
    let key = idempotency_key(req)?;
    require_json(req)?;
    let limit = state.http.body_limit;
    let declared = declared_length(req.headers());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    // Room for the body (what it declares, else the most it may be) among
    // the bodies in flight, held until this request is answered.
    let room = declared.map_or(limit, |len| usize::try_from(len).unwrap_or(limit));
    let room = state
        .admission
        .reserve_body(room, BODY_BYTES_PATIENCE.min(deadline.remaining()))
        .await
        .ok_or(ApiError::BodiesInFlight)?;
    Ok(Admitted {
        caller,
        key,
        _slot: slot,
        room,
    })
}

/// `payload` is given up only once the body is read whole: an answer made
/// before, or a body refused part way, leaves it for [`submit_plan`] to
/// close the connection with.
async fn submit(
    req: &HttpRequest,
    payload: &mut Option<web::Payload>,
    state: &AppState,
) -> Result<(Outcome, HttpResponse), ApiError> {
    let deadline = super::deadline::of(req, state);
    // Decided before a `100 Continue` was sent, or else now.
    let decided = req.extensions_mut().remove::<Decided>();
    let admitted = match decided {
        Some(Decided(decided)) => decided?,
        None => admit(req, state, deadline).await?,
    };
    let Admitted {
        caller,
        key,
        _slot,
        room,
    } = admitted;
    let limit = state.http.body_limit;
    let client_timeout = state.http.client_timeout;
    let unread = payload
        .as_mut()
        .ok_or_else(|| ApiError::Internal("the body was already taken".into()))?;
    // Read in place: a body refused part way (too large, too slow) leaves
    // its payload with `submit_plan`, which closes the connection.
    let declared = declared_length(req.headers()).map_or(0, |len| len.min(limit as u64) as usize);
    let bytes = actix_web::rt::time::timeout(client_timeout, read_body(unread, limit, declared))
        .await
        .map_err(|_| ApiError::SlowClient(client_timeout.as_millis()))??;
    *payload = None;
    // A large body waits for its turn, so that few are parsed and held
    // at once; past the deadline, 503.
    let turn = state
        .admission
        .parse_turn(bytes.len(), deadline.remaining())
        .await
        .map_err(|()| ApiError::Timeout("no turn to parse a large body in time".into()))?;
    let accepted = if bytes.len() <= INLINE_PARSE_BYTES {
        // A small body is parsed here, and the write awaited on the
        // writers' queue: no thread hop of this request's own.
        let (_room, _turn) = (room, turn);
        let submission = body::parse(&bytes)?;
        drop(bytes);
        let first = actix_web::rt::time::timeout(
            deadline.remaining(),
            state
                .intake
                .submit_queued(&caller, &key, &submission, &deadline),
        )
        .await
        .map_err(|_| ApiError::Timeout("the write batch had not answered".into()))?;
        match first {
            Ok(answer) => answer?,
            Err(first) => {
                state
                    .blocking(deadline, move |intake| {
                        intake.submit_after(&caller, &key, &submission, &deadline, first)
                    })
                    .await?
            }
        }
    } else {
        // Parsed off the async workers, in the same blocking task as the
        // write. The body's room and the parse turn go with the work: a
        // request answered 503 at its deadline holds them until its work
        // is done.
        state
            .blocking(deadline, move |intake| -> Result<_, ApiError> {
                let (_room, _turn) = (room, turn);
                let submission = body::parse(&bytes)?;
                Ok(intake.submit(&caller, &key, &submission, &deadline)?)
            })
            .await?
    };
    let receipt = accepted.receipt;
    let response = match accepted.outcome {
        Outcome::Created => HttpResponse::Created()
            .insert_header((
                header::LOCATION,
                format!("/v1/receipts/{}", receipt.receipt_id),
            ))
            .json(receipt),
        Outcome::Replayed => HttpResponse::Ok()
            .insert_header((IDEMPOTENT_REPLAYED, "true"))
            .json(receipt),
        Outcome::AlreadyReceived => HttpResponse::Ok().json(receipt),
    };
    Ok((accepted.outcome, response))
}

/// The caller that owns `token`: a login found recently is taken from
/// memory (the write checks the token again), any other costs one lookup
/// (a stranger's, within the strangers' budget: `auth::admit_lookup`).
async fn signed_in(state: &AppState, token: &str, deadline: Deadline) -> Result<Caller, ApiError> {
    if let Some(caller) = state.intake.known_caller(token) {
        return Ok(caller);
    }
    auth::admit_lookup(state, token, deadline).await?;
    let token = token.to_owned();
    state
        .blocking(deadline, move |intake| intake.sign_in(&deadline, &token))
        .await?
        .ok_or(ApiError::Unauthorized("unknown or revoked token"))
}

fn idempotency_key<R: HttpMessage>(req: &R) -> Result<IdempotencyKey, ApiError> {
    let mut values = req.headers().get_all(IDEMPOTENCY_KEY);
    let value = values.next().ok_or_else(|| {
        ApiError::BadIdempotencyKey(format!("the {IDEMPOTENCY_KEY} header is required"))
    })?;
    if values.next().is_some() {
        return Err(ApiError::BadIdempotencyKey(format!(
            "send exactly one {IDEMPOTENCY_KEY} header"
        )));
    }
    let text = value.to_str().map_err(|_| {
        ApiError::BadIdempotencyKey(format!("{IDEMPOTENCY_KEY} must be visible ASCII"))
    })?;
    let key = IdempotencyKey::parse(text).map_err(ApiError::BadIdempotencyKey)?;
    req.extensions_mut()
        .insert(LoggedKey(key.as_str().to_owned()));
    Ok(key)
}

fn require_json<R: HttpMessage>(req: &R) -> Result<(), ApiError> {
    match req.mime_type() {
        Ok(Some(mime)) if mime.essence_str() == "application/json" => Ok(()),
        _ => Err(ApiError::UnsupportedMediaType(
            "Content-Type must be application/json".to_owned(),
        )),
    }
}

/// The body's length as its `Content-Length` declares it, if it does.
fn declared_length(headers: &header::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The whole body, at most `limit` bytes, read through `payload` (which
/// stays the caller's, read or not), into room for the `declared` bytes
/// made once (admission has reserved them), not grown copy by copy.
async fn read_body(
    payload: &mut web::Payload,
    limit: usize,
    declared: usize,
) -> Result<web::Bytes, ApiError> {
    use futures_core::Stream;
    let mut body = web::BytesMut::with_capacity(declared);
    loop {
        let chunk =
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut *payload).poll_next(cx)).await;
        match chunk {
            None => return Ok(body.freeze()),
            Some(Ok(chunk)) => {
                if body.len() + chunk.len() > limit {
                    return Err(ApiError::PayloadTooLarge(limit));
                }
                body.extend_from_slice(&chunk);
            }
            Some(Err(e)) => {
                return Err(ApiError::MalformedJson(format!(
                    "could not read the body: {e}"
                )));
            }
        }
    }
}
