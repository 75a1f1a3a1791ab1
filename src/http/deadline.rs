//! Every request that touches the database is answered within its deadline.
//! The deadline is made here when the request arrives and handed down: the
//! database steps stop waiting at it, and `AppState::blocking` answers 503 +
//! `Retry-After` itself if the work has still not answered when it passes.
//! Such answers are counted here. `/healthz`, `/metrics` and `/openapi.json`
//! touch no database and are not timed, so they keep answering while the
//! database is locked.

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{Error, HttpMessage, HttpRequest, web};

use super::AppState;
use super::problem::TimedOut;
use crate::deadline::Deadline;

const UNTIMED: [&str; 3] = ["/healthz", "/metrics", "/openapi.json"];

pub async fn enforce(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, Error> {
    let Some(state) = req.app_data::<web::Data<AppState>>().cloned() else {
        return Ok(next.call(req).await?.map_into_boxed_body());
    };
    if UNTIMED.contains(&req.path()) {
        return Ok(next.call(req).await?.map_into_boxed_body());
    }
    // A request whose head was judged before its `100 Continue`
    // (`http::expect`) has had its deadline since then.
    if !req.extensions().contains::<Deadline>() {
        req.extensions_mut()
            .insert(Deadline::after(state.http.request_timeout));
    }
    let response = next.call(req).await?.map_into_boxed_body();
    if response.response().extensions().get::<TimedOut>().is_some() {
        let route = response
            .request()
            .match_pattern()
            .unwrap_or_else(|| "unmatched".to_owned());
        state.intake.metrics.timeout(&route);
    }
    Ok(response)
}

/// The deadline of the request being handled.
pub fn of(req: &HttpRequest, state: &AppState) -> Deadline {
    req.extensions()
        .get::<Deadline>()
        .copied()
        .unwrap_or_else(|| Deadline::after(state.http.request_timeout))
}
