//! `testbed up DIR`: brings up the local control plane, the kubelet stand-in
//! and one redis-server, writes `DIR/kubeconfig`, `DIR/redis-url` and
//! `DIR/ready`, and keeps them running until SIGINT or SIGTERM.
use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use streamfleet_testbed::{RedisServer, TestBed};

#[derive(Parser)]
#[command(about = "streamfleet's local test bed: real control plane and Redis, no containers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start everything and wait for a signal.
    Up {
        /// Folder for the kubeconfig, logs, etcd data and pod files.
        dir: PathBuf,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let Command::Up { dir } = Cli::parse().command;
    let dir = std::path::absolute(&dir)?;
    let bed = TestBed::start_detached(dir.clone()).context("starting the control plane")?;
    let redis = RedisServer::start_in(&dir, &[]).await.context("starting redis-server")?;
    std::fs::write(dir.join("redis-url"), redis.url())?;
    std::fs::write(dir.join("ready"), "")?;
    println!("control plane: {}  (KUBECONFIG={})", bed.server, bed.kubeconfig.display());
    println!("redis:         {}", redis.url());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    let _ = std::fs::remove_file(dir.join("ready"));
    println!("test bed stopping");
    // Exiting ends the test bed thread; the kernel then kills its servers and pods.
    std::process::exit(0)
}
