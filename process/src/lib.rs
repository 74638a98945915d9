//! What streamfleet's binaries (the operator and every worker) share as
//! processes: the shutdown signal, and the admin HTTP endpoints.

pub mod admin;

pub use admin::Readiness;

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
