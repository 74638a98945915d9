//! `streamfleet`: the operator binary.
//!
//! * `streamfleet run`: the controller (leader-elected).
//! * `streamfleet crd`: prints the CRD (JSON).
//! * `streamfleet sweep`: the recovery sweep (run by the recovery CronJob).
//! * `streamfleet dead-letters list|show|stats|replay|purge`: dead-letter
//!   tools (`kubectl streamfleet dlq …` as a kubectl plugin).
//! * `streamfleet pending`: a pipeline's in-flight entries.
//! * `streamfleet pause|resume`: a pipeline's workers off and on again.
//! * `streamfleet console`: the console API (see `console`).

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand, ValueEnum};
use kube::CustomResourceExt as _;
use std::sync::Arc;
use std::time::Duration;
use streamfleet_operator::controller;
use streamfleet_operator::leader::LeaseLock;
use streamfleet_operator::metrics::Metrics;
use streamfleet_operator::objects::ObjectSettings;
use streamfleet_operator::probes::{self, Readiness};

#[derive(Parser)]
#[command(name = "streamfleet", version, about = "Runs job pipelines on Redis Streams consumer groups")]
struct Cli {
    /// Log format.
    #[arg(long, env = "STREAMFLEET_LOG_FORMAT", default_value = "json", global = true)]
    log_format: LogFormat,
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `streamfleet_operator=debug`.
    #[arg(long, env = "STREAMFLEET_LOG", default_value = "info", global = true)]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controller.
    Run(RunArgs),
    /// Print the StreamConsumerGroup CRD (JSON: `streamfleet crd | kubectl apply --server-side -f -`).
    Crd,
    /// One recovery sweep over the PEL (what the recovery CronJob runs):
    /// dead-letter entries past maxDeliveries, record lost payloads, leave the
    /// rest to the workers. Configured by the STREAMFLEET_* env contract.
    Sweep,
    /// Inspect, count, replay and purge a pipeline's dead letters.
    DeadLetters(streamfleet_operator::cli::dead_letters::DeadLetterArgs),
    /// A pipeline's pending (in-flight) entries: holder, idle time, deliveries, last error.
    Pending(streamfleet_operator::cli::pending::PendingArgs),
    /// A pipeline's shards live from Redis: lag, pending, delay, the worker pods reading each, retries.
    Shards(streamfleet_operator::cli::shards::ShardsArgs),
    /// Pause a pipeline: no workers, no recovery runs (spec.suspend), through the console.
    Pause(streamfleet_operator::cli::suspend::SuspendArgs),
    /// Resume a paused pipeline.
    Resume(streamfleet_operator::cli::suspend::SuspendArgs),
    /// Serve the console API (an aggregated API of the Kubernetes API server).
    Console(streamfleet_operator::console::ConsoleArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "STREAMFLEET_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// The operator's own image, run by recovery sweeps.
    #[arg(long, env = "STREAMFLEET_OPERATOR_IMAGE", default_value = "streamfleet/streamfleet:latest")]
    operator_image: String,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "STREAMFLEET_HEALTH_ADDR", default_value = "0.0.0.0:8080")]
    health_addr: String,
    /// Lease used for leader election; disable with --leader-election=false.
    #[arg(long, env = "STREAMFLEET_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the lease (the operator's own namespace).
    #[arg(long, env = "STREAMFLEET_LEASE_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// The Lease's name (the chart makes it unique per release).
    #[arg(long, env = "STREAMFLEET_LEASE_NAME", default_value = "streamfleet-leader")]
    lease_name: String,
    /// The Secret, in the lease's namespace, holding the key of the Secrets
    /// digest on worker pod templates (made when missing; the chart names
    /// one per release).
    #[arg(long, env = "STREAMFLEET_DIGEST_KEY_SECRET", default_value = "streamfleet-digest-key")]
    digest_key_secret: String,
    /// Pull secrets of the operator image, for the sweep Jobs that run it (comma-separated names).
    #[arg(long, env = "STREAMFLEET_IMAGE_PULL_SECRETS", value_delimiter = ',')]
    image_pull_secrets: Vec<String>,
    /// The sweep container's resources, as a JSON ResourceRequirements.
    #[arg(long, env = "STREAMFLEET_SWEEP_RESOURCES")]
    sweep_resources: Option<String>,
    /// A recovery Job (sweep or `Worker` mode) still running after this many seconds is stopped.
    #[arg(long, env = "STREAMFLEET_SWEEP_DEADLINE_SECONDS")]
    sweep_deadline_seconds: Option<i64>,
    /// The sweep pods' annotations, node selector and tolerations, as JSON
    /// (`{"annotations": {}, "nodeSelector": {}, "tolerations": []}`).
    #[arg(long, env = "STREAMFLEET_SWEEP_POD")]
    sweep_pod: Option<String>,
    /// This replica's identity (the pod name).
    #[arg(long, env = "STREAMFLEET_POD_NAME")]
    identity: Option<String>,
    /// At most this many resources reconciled at once; the others wait
    /// (in no set order). Unbounded, a fleet created at once means
    /// thousands of reconciles in flight, each holding its state and, while
    /// it writes, a connection to the API server. An unreachable Redis is
    /// connected to once at a time, and its failure is every other
    /// resource's answer for 5 s; but once connected, a Redis that stops
    /// answering holds each of its resources' places until their commands
    /// time out (10 s): many resources on one Redis gone silent slow
    /// everyone's polls; raise this then.
    #[arg(long, env = "STREAMFLEET_MAX_CONCURRENT_RECONCILES", default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    max_concurrent_reconciles: u16,
}

// glibc's malloc kept what a ramp of thousands of new resources had
// grown, whatever its tuning; jemalloc returns freed pages to the kernel
// (the chart's `_RJEM_MALLOC_CONF`) and costs less CPU per poll
// (docs/benchmarks.md, the fleet).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse_from(streamfleet_operator::cli::plugin_args(std::env::args_os()));
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).context("--log")?;
    match cli.log_format {
        LogFormat::Json => tracing_subscriber::fmt().json().with_env_filter(filter).init(),
        // Colours only for a person at a terminal, never in a pod's log.
        LogFormat::Text => tracing_subscriber::fmt()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .with_env_filter(filter)
            .init(),
    }
    match cli.command {
        Command::Crd => {
            // JSON, which `kubectl apply -f -` takes as it takes YAML.
            println!("{}", serde_json::to_string_pretty(&streamfleet_crd::StreamConsumerGroup::crd())?);
            Ok(())
        }
        Command::Run(args) => run(args).await,
        Command::Sweep => streamfleet_operator::sweep_command::run_sweep().await,
        Command::DeadLetters(args) => streamfleet_operator::cli::dead_letters::run(args).await,
        Command::Pending(args) => streamfleet_operator::cli::pending::run(args).await,
        Command::Shards(args) => streamfleet_operator::cli::shards::run(args).await,
        Command::Pause(args) => streamfleet_operator::cli::suspend::run(args, true).await,
        Command::Resume(args) => streamfleet_operator::cli::suspend::run(args, false).await,
        Command::Console(args) => streamfleet_operator::console::run(args).await,
    }
}

async fn run(args: RunArgs) -> Result<()> {
    let client = kube::Client::try_default().await.context("connecting to the Kubernetes API")?;
    // Without a pod name, a random one: a pid is 1 in every container.
    let identity = args.identity.clone().unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        format!("streamfleet-{}-{nanos:08x}", std::process::id())
    });
    let readiness = Readiness::default();
    let listener = tokio::net::TcpListener::bind(&args.health_addr)
        .await
        .with_context(|| format!("binding {}", args.health_addr))?;
    let metrics = Arc::new(Metrics::default());
    let admin = probes::serve(listener, readiness.clone(), metrics.clone());
    tokio::spawn(async move {
        if let Err(e) = admin.await {
            tracing::error!(error = %e, "probes and metrics server");
        }
    });

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        streamfleet_process::shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // Before any Deployment is written (each carries a digest under this
    // key), and before a standby says it is ready: a replica that cannot
    // read the key fails its rollout, not its turn to lead.
    let digest_key = streamfleet_operator::digest_key::load_or_create(
        client.clone(),
        &args.lease_namespace,
        &args.digest_key_secret,
    )
    .await?;
    let mut lease = args.leader_election.then(|| {
        LeaseLock::new(client.clone(), &args.lease_namespace, &args.lease_name, &identity, Duration::from_secs(15))
    });
    if let Some(lease) = &mut lease {
        // A standby is healthy and ready: it serves probes and waits its turn.
        readiness.set(true);
        tracing::info!(%identity, "waiting for leadership");
        tokio::select! {
            () = lease.acquire() => {}
            () = stopped(stop_rx.clone()) => return Ok(()),
        }
        tracing::info!(%identity, "leading");
    }
    readiness.set(true);
    metrics.leading(true);

    let sweep_resources = match &args.sweep_resources {
        Some(json) => {
            Some(serde_json::from_str(json).context("STREAMFLEET_SWEEP_RESOURCES: not a ResourceRequirements")?)
        }
        None => None,
    };
    let settings = ObjectSettings {
        digest_key,
        operator_image: args.operator_image.clone(),
        image_pull_secrets: args.image_pull_secrets.iter().filter(|n| !n.is_empty()).cloned().collect(),
        sweep_resources,
        sweep_deadline_seconds: args.sweep_deadline_seconds,
        sweep_pod: match &args.sweep_pod {
            Some(json) => serde_json::from_str(json)
                .context("STREAMFLEET_SWEEP_POD: not {annotations, nodeSelector, tolerations}")?,
            None => Default::default(),
        },
    };
    let controller = controller::run(
        client,
        args.max_concurrent_reconciles,
        settings,
        metrics,
        Some(identity.clone()),
        args.watch_namespace.clone(),
        stopped(stop_rx.clone()),
    );
    match &mut lease {
        Some(lease) => {
            tokio::select! {
                () = controller => {}
                () = lease.hold() => {
                    // Lost the lease: stop writing at once; the pod restarts as a standby.
                    anyhow::bail!("lost leadership");
                }
            }
            lease.release().await;
        }
        None => controller.await,
    }
    tracing::info!("stopped");
    Ok(())
}
