//! `/healthz` (process alive), `/readyz` (leading and reconciling, or a
//! ready standby) and `/metrics` (Prometheus text) over plain HTTP.

use crate::metrics::Metrics;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

#[derive(Clone, Default)]
pub struct Probes {
    ready: Arc<AtomicBool>,
}

impl Probes {
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Serves the probes and metrics on `listener` forever.
    pub async fn serve(self, listener: TcpListener, metrics: Arc<Metrics>) {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let ready = self.ready.load(Ordering::Relaxed);
            let metrics = metrics.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let n = match tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut buf)).await {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
                let request = String::from_utf8_lossy(&buf[..n]);
                let path = request.split_whitespace().nth(1).unwrap_or("/");
                let (code, body) = match path {
                    "/healthz" => ("200 OK", "ok".to_string()),
                    "/readyz" if ready => ("200 OK", "ok".to_string()),
                    "/readyz" => ("503 Service Unavailable", "not ready".to_string()),
                    "/metrics" => ("200 OK", metrics.render()),
                    _ => ("404 Not Found", "not found".to_string()),
                };
                let response = format!(
                    "HTTP/1.1 {code}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    }
}
