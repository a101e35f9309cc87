//! The pages the service serves itself: one HTML file each, with its own script
//! and style, nothing from elsewhere.

use axum::http::header;
use axum::response::IntoResponse;

/// A page of the service's own, with a policy that lets it load nothing else.
pub fn own_page(html: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; style-src 'self' 'unsafe-inline'; script-src 'self' 'unsafe-inline'",
            ),
        ],
        html,
    )
}
