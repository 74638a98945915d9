//! What streamfleet's binaries (the operator and every worker) share as
//! processes: the shutdown signal, readiness, and (feature `admin`, on by
//! default) the admin HTTP endpoints on axum.

#[cfg(feature = "admin")]
pub mod admin;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// What `/readyz` answers: a cheap, cloneable handle the process flips.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// A handle that starts out ready (`true`) or not.
    pub fn new(ready: bool) -> Self {
        Self(Arc::new(AtomicBool::new(ready)))
    }

    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Resolves on SIGTERM or SIGINT: the pod is being stopped.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}
