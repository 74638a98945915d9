//! The admin HTTP endpoints of every streamfleet process, on axum (hyper):
//!
//! * `GET /healthz`: `200 ok` while the process serves at all (liveness).
//! * `GET /readyz`: `200 ok` when the [`Readiness`] handle says so, else
//!   `503 not ready`.
//! * `GET /metrics`: the OpenMetrics text the caller renders, as
//!   [`METRICS_CONTENT_TYPE`].
//! * anything else: `404 not found`.
//!
//! Accept errors (a full file table, say) back off instead of spinning, and
//! each connection is served on its own task.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use std::sync::Arc;
use tokio::net::TcpListener;

/// The content type of what `prometheus-client` renders: OpenMetrics text
/// (counters end in `_total`, the exposition in `# EOF`).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub use crate::Readiness;

type Render = Arc<dyn Fn() -> String + Send + Sync>;

#[derive(Clone)]
struct Admin {
    readiness: Readiness,
    metrics: Render,
}

/// The admin routes, for embedding or testing; [`serve`] serves them.
pub fn router(readiness: Readiness, metrics: impl Fn() -> String + Send + Sync + 'static) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found") })
        .with_state(Admin { readiness, metrics: Arc::new(metrics) })
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until the task
/// is dropped. `metrics` renders the exposition afresh for every scrape.
pub async fn serve(
    listener: TcpListener,
    readiness: Readiness,
    metrics: impl Fn() -> String + Send + Sync + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(readiness, metrics)).await
}

async fn readyz(State(admin): State<Admin>) -> impl IntoResponse {
    if admin.readiness.is_ready() { (StatusCode::OK, "ok") } else { (StatusCode::SERVICE_UNAVAILABLE, "not ready") }
}

async fn render_metrics(State(admin): State<Admin>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], (admin.metrics)())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpStream;

    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
        }
    }

    /// A minimal HTTP/1.1 client: one request, `Connection: close`, read to EOF.
    async fn request(addr: SocketAddr, method: &str, path: &str) -> Reply {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw)).await.unwrap().unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let mut lines = head.split("\r\n");
        let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
        let headers = lines
            .map(|l| l.split_once(':').unwrap())
            .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
            .collect::<Vec<_>>();
        let reply = Reply { status, headers, body: body.to_string() };
        if let Some(length) = reply.header("content-length") {
            assert_eq!(length.parse::<usize>().unwrap(), reply.body.len(), "content-length");
        }
        reply
    }

    async fn get(addr: SocketAddr, path: &str) -> Reply {
        request(addr, "GET", path).await
    }

    /// Serves on an ephemeral loopback port; returns its address.
    async fn start(readiness: Readiness, metrics: impl Fn() -> String + Send + Sync + 'static) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, readiness, metrics));
        addr
    }

    #[tokio::test]
    async fn healthz_is_ok_whatever_the_readiness() {
        let addr = start(Readiness::new(false), String::new).await;
        let reply = get(addr, "/healthz").await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.body, "ok");
        assert!(reply.header("content-type").is_some_and(|t| t.starts_with("text/plain")));
    }

    #[tokio::test]
    async fn readyz_follows_the_handle() {
        let readiness = Readiness::default();
        let addr = start(readiness.clone(), String::new).await;
        let reply = get(addr, "/readyz").await;
        assert_eq!((reply.status, reply.body.as_str()), (503, "not ready"));
        readiness.set(true);
        let reply = get(addr, "/readyz").await;
        assert_eq!((reply.status, reply.body.as_str()), (200, "ok"));
        readiness.set(false);
        assert_eq!(get(addr, "/readyz").await.status, 503);
    }

    #[tokio::test]
    async fn metrics_are_rendered_for_every_scrape_as_prometheus_text() {
        let scrapes = Arc::new(AtomicU64::new(0));
        let counter = scrapes.clone();
        let render = move || {
            let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
            format!("# HELP scrapes Scrapes\n# TYPE scrapes counter\nscrapes_total {n}\n")
        };
        let addr = start(Readiness::default(), render).await;
        let reply = get(addr, "/metrics").await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("content-type"), Some(METRICS_CONTENT_TYPE));
        assert!(reply.body.ends_with("scrapes_total 1\n"), "{}", reply.body);
        assert!(get(addr, "/metrics").await.body.ends_with("scrapes_total 2\n"));
        assert_eq!(scrapes.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn unknown_paths_are_not_found_and_writes_not_allowed() {
        let addr = start(Readiness::new(true), || "x 1\n".to_string()).await;
        for path in ["/", "/metricsz", "/healthz/x", "/readyz?verbose"] {
            let reply = get(addr, path).await;
            if path == "/readyz?verbose" {
                assert_eq!(reply.status, 200, "a query string does not change the route");
            } else {
                assert_eq!((reply.status, reply.body.as_str()), (404, "not found"), "{path}");
            }
        }
        assert_eq!(request(addr, "POST", "/metrics").await.status, 405);
    }

    #[tokio::test]
    async fn keep_alive_serves_several_requests_on_one_connection() {
        let addr = start(Readiness::new(true), || "x 1\n".to_string()).await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n").await.unwrap();
        stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut raw = String::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut raw)).await.unwrap().unwrap();
        assert_eq!(raw.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{raw}");
        assert!(raw.ends_with("x 1\n"), "{raw}");
    }

    #[tokio::test]
    async fn a_silent_client_does_not_hold_up_the_others() {
        let addr = start(Readiness::new(true), String::new).await;
        let _silent = TcpStream::connect(addr).await.unwrap();
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /healthz HTTP/1.1\r\nHo").await.unwrap();
        assert_eq!(get(addr, "/healthz").await.status, 200);
    }
}
