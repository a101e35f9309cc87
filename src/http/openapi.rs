//! The OpenAPI 3.1 document of the HTTP API, generated from the handlers'
//! `#[utoipa::path]` attributes and the types' `ToSchema`, served at
//! `/openapi.json` and rendered at `/docs` by a page the service serves itself.

use axum::response::IntoResponse;
use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::error::ErrorBody;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "flashsale",
        description = "Flash-sale stock reservation: a 202 becomes an order; never oversold, one purchase per user within the limit.",
    ),
    paths(
        super::flash::status,
        super::flash::reserve,
        super::flash::reservation,
        super::flash::join_queue,
        super::flash::queue_status,
        super::orders::pay,
        super::admin::create,
        super::admin::list,
        super::admin::get,
        super::admin::preload,
        super::admin::pause,
        super::admin::resume,
        super::admin::reconcile,
        super::admin::top_up,
        super::audit::list,
        super::admin::ui,
        super::page::buyer,
        super::ops::healthz,
        super::ops::readyz,
        super::ops::metrics,
        openapi_json,
        docs,
    ),
    components(schemas(ErrorBody, super::ops::Role)),
    modifiers(&BearerTokens),
    tags(
        (name = "users", description = "Buyers, with a user JWT (HS256 with the service's secret, or RS256/ES256 from the identity provider; `sub` = user id, `exp` required)"),
        (name = "operators", description = "Operators: the shared admin token, a named operator's token (`auth.operators`) or a JWT with `role: \"operator\"`; every change is recorded in the audit trail"),
        (name = "operations", description = "Probes, metrics, documents and pages: no token"),
    )
)]
pub struct ApiDoc;

/// The two bearer schemes: a user's JWT, and the admin token.
struct BearerTokens;

impl Modify for BearerTokens {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "user",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("JWT")
                    .build(),
            ),
        );
        components.add_security_scheme(
            "admin",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// `GET /openapi.json`
#[utoipa::path(
    get,
    path = "/openapi.json",
    tag = "operations",
    responses((status = 200, description = "This document (OpenAPI 3.1)", body = Object))
)]
pub async fn openapi_json() -> impl IntoResponse {
    Json(ApiDoc::openapi())
}

/// `GET /docs`: the document rendered by the service's own page.
#[utoipa::path(
    get,
    path = "/docs",
    tag = "operations",
    responses((status = 200, description = "The API reference (HTML)", content_type = "text/html"))
)]
pub async fn docs() -> impl IntoResponse {
    super::page::own_page(include_str!("docs.html"))
}
