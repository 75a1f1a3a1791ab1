//! `GET /v1/receipts/{receipt_id}` and the access rule shared with plans.

use actix_web::{HttpRequest, HttpResponse, web};

use super::{ApiError, AppState, auth};
use crate::intake::{Login, Permission, Receipt};
use crate::storage::plans::{self, PlanRow};

pub async fn get_receipt(
    req: HttpRequest,
    path: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let row = readable_plan(&req, &state, path.into_inner()).await?;
    Ok(HttpResponse::Ok().json(Receipt::from_row(&row, None)?))
}

/// The plan behind `receipt_id` if the caller may see it: `receipts:read`
/// sees every plan, a planner only its own. Anything else is a 404, so a
/// planner cannot learn that another maker's receipt exists.
pub(super) async fn readable_plan(
    req: &HttpRequest,
    state: &AppState,
    receipt_id: String,
) -> Result<PlanRow, ApiError> {
    let login = auth::authenticate(req, state).await?;
    if !login.has(Permission::ReceiptsRead) && !login.has(Permission::PlansSubmit) {
        return Err(ApiError::Forbidden(format!(
            "login `{}` may not read receipts",
            login.name
        )));
    }
    let row = state
        .blocking(
            move |intake| -> Result<Option<PlanRow>, crate::storage::StorageError> {
                let mut conn = intake.db.conn()?;
                Ok(plans::find_by_receipt(&mut conn, &receipt_id)?)
            },
        )
        .await?;
    match row {
        Some(row) if may_read(&login, &row) => Ok(row),
        _ => Err(ApiError::NotFound),
    }
}

fn may_read(login: &Login, row: &PlanRow) -> bool {
    login.has(Permission::ReceiptsRead)
        || (login.has(Permission::PlansSubmit) && row.maker == login.name)
}
