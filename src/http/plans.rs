//! `POST /v1/plans` and `GET /v1/plans/{receipt_id}`.

use actix_web::http::header;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};

use super::receipts::readable_plan;
use super::{ApiError, AppState, auth};
use crate::intake::{IdempotencyKey, Outcome, Permission, PlanView, Receipt, body};

pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";

/// The door, in order: who (401), may they (403), which attempt (400), what
/// format (415), how big (413), what (400/422). Nothing touches the plan
/// tables until all of it has passed.
pub async fn submit_plan(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let login = auth::authenticate(&req, &state).await?;
    auth::require(&login, Permission::PlansSubmit)?;
    let key = idempotency_key(&req)?;
    require_json(&req)?;
    let bytes = read_body(&req, payload, state.http.body_limit).await?;
    let submission = body::parse(&bytes)?;

    let accepted = state
        .blocking(move |intake| intake.submit(&login, &key, &submission))
        .await?;
    let receipt = Receipt::from_row(&accepted.plan, Some(accepted.outcome.as_str()))?;
    Ok(match accepted.outcome {
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
    })
}

pub async fn get_plan(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let row = readable_plan(&req, &state, path.into_inner()).await?;
    Ok(HttpResponse::Ok().json(PlanView::from_row(&row)?))
}

fn idempotency_key(req: &HttpRequest) -> Result<IdempotencyKey, ApiError> {
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
    IdempotencyKey::parse(text).map_err(ApiError::BadIdempotencyKey)
}

fn require_json(req: &HttpRequest) -> Result<(), ApiError> {
    match req.mime_type() {
        Ok(Some(mime)) if mime.essence_str() == "application/json" => Ok(()),
        _ => Err(ApiError::UnsupportedMediaType(
            "Content-Type must be application/json".to_owned(),
        )),
    }
}

async fn read_body(
    req: &HttpRequest,
    payload: web::Payload,
    limit: usize,
) -> Result<web::Bytes, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    match payload.to_bytes_limited(limit).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => Err(ApiError::MalformedJson(format!(
            "could not read the body: {e}"
        ))),
        Err(_) => Err(ApiError::PayloadTooLarge(limit)),
    }
}
