//! The web console: one page, everything embedded (no external asset, so it
//! works offline and behind any proxy), served where a browser reached
//! through `kubectl proxy` asks for a namespace's pipelines as HTML. It calls
//! the same API as the CLI, as the same user.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use std::sync::LazyLock;

const PAGE: &str = include_str!("ui.html");

/// The text between `open` and `close` in the page.
fn between<'a>(open: &str, close: &str) -> &'a str {
    let start = PAGE.find(open).map_or(0, |i| i + open.len());
    let end = PAGE[start..].find(close).map_or(start, |i| start + i);
    &PAGE[start..end]
}

fn sha256(text: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    format!("'sha256-{}'", base64::engine::general_purpose::STANDARD.encode(digest.as_ref()))
}

/// The page runs only its own script and style (named by their hashes:
/// anything injected into it would not run), fetches only from where it
/// came from, and cannot be framed.
static POLICY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src data:; base-uri 'none'; \
         form-action 'none'; frame-ancestors 'none'; require-trusted-types-for 'script'",
        sha256(between("<script>", "</script>")),
        sha256(between("<style>", "</style>")),
    )
});

pub fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, POLICY.as_str()),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-store"),
            (header::VARY, "Accept"),
        ],
        PAGE,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_names_the_one_script_and_style_of_the_page() {
        assert_eq!(PAGE.matches("<script>").count(), 1, "one inline script, hashed");
        assert_eq!(PAGE.matches("<style>").count(), 1, "one inline style, hashed");
        assert!(!PAGE.contains("<script src") && !PAGE.contains("<link "), "no external asset");
        assert!(!PAGE.contains(".innerHTML") && !PAGE.contains("insertAdjacentHTML"), "data goes in as text");
        let script = between("<script>", "</script>");
        assert!(script.contains("loadPipelines") && POLICY.contains(&sha256(script)), "{}", *POLICY);
        assert!(!POLICY.contains("unsafe-inline"));
    }
}
