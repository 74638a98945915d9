//! The operator's admin endpoints: `/healthz` (process alive), `/readyz`
//! (leading and reconciling, or a ready standby) and `/metrics` (the
//! operator's Prometheus registry), served by the shared
//! [`streamfleet_process::admin`] helper.

use crate::metrics::Metrics;
use std::sync::Arc;
use tokio::net::TcpListener;

pub use streamfleet_process::admin::Readiness;

/// Serves the probes and `metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, readiness: Readiness, metrics: Arc<Metrics>) -> std::io::Result<()> {
    streamfleet_process::admin::serve(listener, readiness, move || metrics.render()).await
}
