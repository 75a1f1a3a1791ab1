//! One log line and one latency observation per request, with a request id
//! that the caller may supply (`X-Request-Id`) and always gets back. Tokens
//! and bodies are never logged.

use std::time::Instant;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, web};

use super::AppState;

pub const REQUEST_ID: &str = "x-request-id";
const MAX_REQUEST_ID: usize = 64;

/// The request's id, in its extensions.
#[derive(Clone)]
pub struct RequestId(pub String);

/// Set by handlers once known, for the log line.
#[derive(Clone)]
pub struct LoggedMaker(pub String);
#[derive(Clone)]
pub struct LoggedKey(pub String);

/// When the request's head was handled, if before it reached the routes
/// (`http::expect`, ahead of a `100 Continue`): its latency counts from then.
#[derive(Clone, Copy)]
pub struct Arrived(pub Instant);

pub async fn observe(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    let arrived = req.extensions().get::<Arrived>().map(|a| a.0);
    let started = arrived.unwrap_or_else(Instant::now);
    let request_id = req
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| {
            !id.is_empty()
                && id.len() <= MAX_REQUEST_ID
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        })
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
    req.extensions_mut().insert(RequestId(request_id.clone()));
    let method = req.method().to_string();
    let state = req.app_data::<web::Data<AppState>>().cloned();

    let mut res = next.call(req).await?.map_into_boxed_body();

    let elapsed = started.elapsed();
    let route = res
        .request()
        .match_pattern()
        .unwrap_or_else(|| "unmatched".to_owned());
    let status = res.status().as_u16();
    let (maker, key) = {
        let extensions = res.request().extensions();
        (
            extensions.get::<LoggedMaker>().map(|m| m.0.clone()),
            extensions.get::<LoggedKey>().map(|k| k.0.clone()),
        )
    };
    // What the caller was told to wait: a 503 or 429 without it is a
    // defect the soak looks for in these lines.
    let retry_after = res
        .headers()
        .get(actix_web::http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    tracing::info!(
        request_id = %request_id,
        method = %method,
        route = %route,
        status,
        latency_ms = elapsed.as_secs_f64() * 1000.0,
        maker = maker.as_deref().unwrap_or("-"),
        idempotency_key = key.as_deref().unwrap_or("-"),
        retry_after = %retry_after,
        "request"
    );
    if let Some(state) = state {
        state
            .intake
            .metrics
            .observe_request(&route, status, elapsed.as_secs_f64());
    }
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        res.headers_mut()
            .insert(HeaderName::from_static(REQUEST_ID), value);
    }
    Ok(res)
}
