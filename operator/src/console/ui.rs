//! The web console: one page, everything embedded (no external asset, so it
//! works offline and behind any proxy), served where a browser reached
//! through `kubectl proxy` asks for a namespace's pipelines as HTML. It calls
//! the same API as the CLI, as the same user.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const PAGE: &str = include_str!("ui.html");

/// The page, with a policy that lets it run only its own inline code and
/// talk only to where it came from.
pub fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; \
                 img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}
