//! Reads by receipt id: `GET /v1/receipts/{receipt_id}` and
//! `GET /v1/plans/{receipt_id}`, with the access check they share.

use actix_web::{HttpRequest, HttpResponse, web};

use super::problem::{NotYours, Refusals};
use super::{ApiError, AppState, auth};
use crate::deadline::Deadline;
use crate::intake::{Intake, Login, Permission, PlanView, ReadError, Receipt};

#[utoipa::path(get, path = "/v1/receipts/{receipt_id}", tag = "reading",
    params(("receipt_id" = String, Path, description = "The receipt id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The receipt as stored", body = Receipt),
        NotYours, Refusals,
    ))]
pub async fn get_receipt(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let receipt = readable(
        &req,
        &state,
        path.into_inner(),
        |intake, login, id, deadline| intake.read_by_id::<Receipt>(login, id, deadline),
    )
    .await?;
    Ok(HttpResponse::Ok().json(receipt))
}

#[utoipa::path(get, path = "/v1/plans/{receipt_id}", tag = "reading",
    params(("receipt_id" = String, Path, description = "The receipt id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The plan with its receipt", body = PlanView),
        NotYours, Refusals,
    ))]
pub async fn get_plan(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let login = signed_in_reader(&req, &state).await?;
    let deadline = super::deadline::of(&req, &state);
    let receipt_id = path.into_inner();
    // How much the plan holds first, then room for it among the bytes in
    // flight, then the plan: a read never holds more than it was given.
    let (sized, sizer) = (receipt_id.clone(), login.clone());
    let bytes = state
        .blocking(deadline, move |intake| {
            intake.plan_bytes(&sizer, &sized, &deadline)
        })
        .await?
        .ok_or(ApiError::NotFound)?;
    let room = state.room_to_read(bytes, 1, &deadline).await?;
    let plan = state
        .blocking(deadline, move |intake| {
            intake.read_by_id::<PlanView>(&login, &receipt_id, &deadline)
        })
        .await?
        .ok_or(ApiError::NotFound)?;
    super::held_json(&plan, room)
}

/// The caller, signed in and allowed to read receipts at all.
async fn signed_in_reader(req: &HttpRequest, state: &AppState) -> Result<Login, ApiError> {
    let login = auth::authenticate(req, state).await?;
    if !login.has(Permission::ReceiptsRead) && !login.has(Permission::PlansSubmit) {
        return Err(ApiError::Forbidden(format!(
            "login `{}` may not read receipts",
            login.name
        )));
    }
    Ok(login)
}

/// Reads something by receipt id for an authenticated caller who may read
/// receipts at all; what it may see is the domain's rule. Not visible: 404,
/// the same as not there.
pub(super) async fn readable<T: Send + 'static>(
    req: &HttpRequest,
    state: &AppState,
    receipt_id: String,
    read: impl FnOnce(&Intake, &Login, &str, &Deadline) -> Result<Option<T>, ReadError> + Send + 'static,
) -> Result<T, ApiError> {
    let login = signed_in_reader(req, state).await?;
    let deadline = super::deadline::of(req, state);
    state
        .blocking(deadline, move |intake| {
            read(intake, &login, &receipt_id, &deadline)
        })
        .await?
        .ok_or(ApiError::NotFound)
}
