//! `streamfleet console`: an aggregated API (`console.streamfleet.io`)
//! over the pipelines, reached through the Kubernetes API server with the
//! user's own identity and RBAC. No Redis URL or password leaves the
//! cluster: the console reads the pipelines' Secrets, the user never does.
//!
//! It runs as its own Deployment, apart from the controller: it serves
//! people (a different exposure, and every replica serves, where the
//! controller elects one), and a console fault never stops reconciling.

pub mod api;
pub mod auth;
pub mod in_flight;
pub mod letters;
pub mod overview;
pub mod pipeline;
pub mod shards;
pub mod tls;
pub mod ui;
pub mod wire;

use crate::events::EventPublisher;
use crate::metrics::Metrics;
use crate::probes::{self, Readiness};
use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct ConsoleArgs {
    /// Address of the API (HTTPS).
    #[arg(long, env = "STREAMFLEET_CONSOLE_ADDR", default_value = "0.0.0.0:8443")]
    addr: String,
    /// Address of /healthz and /readyz.
    #[arg(long, env = "STREAMFLEET_HEALTH_ADDR", default_value = "0.0.0.0:8080")]
    health_addr: String,
    /// The Secret (`tls.crt`, `tls.key`) with the serving certificate the
    /// APIService's caBundle trusts, in the console's namespace.
    #[arg(long, env = "STREAMFLEET_CONSOLE_TLS_SECRET")]
    tls_secret: String,
    /// The console's own namespace.
    #[arg(long, env = "STREAMFLEET_POD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// Show only this namespace's pipelines (the release's watchNamespace);
    /// default: every namespace.
    #[arg(long, env = "STREAMFLEET_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// This replica's name (Events say which replica recorded them).
    #[arg(long, env = "STREAMFLEET_POD_NAME")]
    identity: Option<String>,
}

pub async fn run(args: ConsoleArgs) -> Result<()> {
    let client = kube::Client::try_default().await.context("connecting to the Kubernetes API")?;
    let readiness = Readiness::default();
    let health = tokio::net::TcpListener::bind(&args.health_addr)
        .await
        .with_context(|| format!("binding {}", args.health_addr))?;
    let admin = probes::serve(health, readiness.clone(), Arc::new(Metrics::default()));
    tokio::spawn(async move {
        if let Err(e) = admin.await {
            tracing::error!(error = %e, "probes server");
        }
    });

    // Both are needed before the first request; retried, since the console
    // may start before its Secret or RBAC exist (a fresh install).
    let front_proxy = retry("reading how the API server proxies identities", || auth::FrontProxy::load(&client)).await;
    let secrets = Api::<Secret>::namespaced(client.clone(), &args.namespace);
    let (cert, key) = retry("reading the serving certificate", || async {
        let secret = secrets.get(&args.tls_secret).await.with_context(|| format!("Secret {}", args.tls_secret))?;
        let mut data = secret.data.unwrap_or_default();
        let mut take =
            |k: &str| data.remove(k).map(|v| v.0).with_context(|| format!("Secret {} has no {k}", args.tls_secret));
        Ok((take("tls.crt")?, take("tls.key")?))
    })
    .await;
    let config = tls::server_config(&cert, &key, &front_proxy.client_ca_pem)?;
    let listener = tls::TlsListener::bind(&args.addr, config).await?;
    let console = Arc::new(api::Console {
        overview: overview::Overview::start(client.clone(), args.watch_namespace.as_deref()),
        events: EventPublisher::new(client.clone(), "streamfleet-console", args.identity.clone()),
        client,
        front_proxy,
        connections: streamfleet_streams::Connections::default(),
    });
    readiness.set(true);
    tracing::info!(addr = %args.addr, "console serving");
    let app = api::router(console).into_make_service_with_connect_info::<tls::Peer>();
    axum::serve(listener, app).with_graceful_shutdown(streamfleet_process::shutdown_signal()).await?;
    Ok(())
}

async fn retry<T, F, Fut>(what: &str, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut wait = Duration::from_millis(500);
    loop {
        match attempt().await {
            Ok(v) => return v,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "{what}; retrying in {wait:?}");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(10));
            }
        }
    }
}
