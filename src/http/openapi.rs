//! The OpenAPI document, generated from the handlers' annotations and the
//! types they send and receive (utoipa), never written by hand.

use actix_web::HttpResponse;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "plan-intake",
        description = "Takes plans from planner services and keeps each one exactly once."
    ),
    paths(
        super::plans::submit_plan,
        super::reads::get_plan,
        super::feed::list_receipts,
        super::reads::get_receipt,
        super::healthz,
        super::readyz,
        super::metrics,
        document,
    ),
    modifiers(&BearerAuth, &NoLicenseClaimed)
)]
pub struct ApiDoc;

/// utoipa copies the licence from Cargo.toml, which names none (choosing
/// one is the owners' decision): the document then claims no licence,
/// rather than one with an empty name.
struct NoLicenseClaimed;

impl Modify for NoLicenseClaimed {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if openapi
            .info
            .license
            .as_ref()
            .is_some_and(|license| license.name.trim().is_empty())
        {
            openapi.info.license = None;
        }
    }
}

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("A login's token, from `plan-intake logins add`"))
                    .build(),
            ),
        );
    }
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json")))]
pub async fn document() -> HttpResponse {
    HttpResponse::Ok().json(ApiDoc::openapi())
}
