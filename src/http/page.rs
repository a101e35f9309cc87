//! The pages the service serves itself: one HTML file each, with its own script
//! and style, nothing from elsewhere.

use axum::http::header;
use axum::response::IntoResponse;

/// A page of the service's own, with a policy that lets it load nothing else,
/// nor be shown inside another site's frame (where a page asking for a token,
/// or with a pause button, could be overlaid and clicked through: clickjacking).
/// `frame-ancestors` is the policy's word for it; `X-Frame-Options` says the same
/// to browsers that predate it.
pub fn own_page(html: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; style-src 'self' 'unsafe-inline'; script-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
            ),
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        html,
    )
}

#[utoipa::path(
    get,
    path = "/buy/{sku}",
    tag = "operations",
    params(("sku" = String, Path, description = "The SKU on sale")),
    responses((status = 200, description = "The buyer's page (HTML): the reference client of the sale endpoints; it takes the user's token from `#token=…` or asks for it", content_type = "text/html"))
)]
/// `GET /buy/{sku}`: the reference buyer's page. Like the operators' page it
/// holds no data: the SKU is read from the address by the page's script, which
/// then calls the user endpoints with the user's own token.
pub async fn buyer() -> impl IntoResponse {
    own_page(include_str!("buyer.html"))
}
