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
        super::evidence::receipt_proof,
        super::evidence::signing_keys,
        super::evidence::checkpoint,
        super::evidence::consistency,
        super::evidence::extension,
        super::evidence::start,
        super::evidence::log_checkpoint,
        super::evidence::log_tile,
        super::healthz,
        super::readyz,
        super::metrics,
        document,
    ),
    modifiers(&BearerAuth, &NoLicenseClaimed, &HeadWhereGet)
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

/// HEAD is answered wherever GET is (`http::app`): each GET operation has
/// its HEAD twin, with the same answers and headers and no body.
struct HeadWhereGet;

impl Modify for HeadWhereGet {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::RefOr;
        for item in openapi.paths.paths.values_mut() {
            let Some(get) = &item.get else { continue };
            let mut head = get.clone();
            head.operation_id = get.operation_id.as_ref().map(|id| format!("{id}_head"));
            head.summary = Some(format!(
                "{} (HEAD: the same answer without its body)",
                get.summary.as_deref().unwrap_or("As GET")
            ));
            for response in head.responses.responses.values_mut() {
                if let RefOr::T(response) = response {
                    response.content.clear();
                }
            }
            item.head = Some(head);
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
