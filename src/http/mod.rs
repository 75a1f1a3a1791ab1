//! The HTTP door: routes, the bearer-token and Idempotency-Key extractors,
//! and problem+json errors. Handlers translate HTTP to a domain call and back;
//! every database call runs inside `web::block`.

mod auth;
mod plans;
pub mod problem;
mod receipts;

use actix_web::{HttpResponse, web};

use crate::config::HttpConfig;
use crate::intake::Intake;
pub use problem::ApiError;

/// What every handler shares. Cloned per worker; holds no request state.
#[derive(Clone)]
pub struct AppState {
    pub intake: Intake,
    pub http: HttpConfig,
}

impl AppState {
    /// Runs blocking database work off the async workers; a pool checkout
    /// that waits pins only a blocking thread.
    pub(crate) async fn blocking<T, E, F>(&self, work: F) -> Result<T, ApiError>
    where
        F: FnOnce(&Intake) -> Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: Into<ApiError> + Send + 'static,
    {
        let intake = self.intake.clone();
        match web::block(move || work(&intake)).await {
            Ok(result) => result.map_err(Into::into),
            Err(e) => Err(ApiError::Internal(format!("blocking task failed: {e}"))),
        }
    }
}

/// Registers every route on an `App` (the service and the tests share this).
pub fn configure(state: AppState) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(web::Data::new(state))
            .route("/v1/plans", web::post().to(plans::submit_plan))
            .route("/v1/plans/{receipt_id}", web::get().to(plans::get_plan))
            .route("/v1/receipts", web::get().to(receipts::list_receipts))
            .route(
                "/v1/receipts/{receipt_id}",
                web::get().to(receipts::get_receipt),
            )
            .route("/healthz", web::get().to(healthz))
            .route("/metrics", web::get().to(metrics))
            .default_service(web::to(not_found));
    }
}

async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.intake.metrics.render())
}

async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError::NotFound)
}
