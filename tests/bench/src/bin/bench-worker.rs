//! Worker throughput with a trivial handler, on one redis-server in one run:
//! a naive one-entry-at-a-time loop (XREADGROUP COUNT 1, handle, XACK) as the
//! baseline, then the streamfleet worker without and with the idempotency
//! guard; and, when Go is installed, Watermill's Redis Streams subscriber
//! (tests/bench/watermill) on the same server. BENCH_ENTRIES (default
//! 50,000) entries each.

use anyhow::Result;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use streamfleet_bench::{Trivial, fill};
use streamfleet_contract as env;
use streamfleet_streams::ensure_group;
use streamfleet_testbed::RedisServer;
use streamfleet_worker::{Worker, WorkerConfig};

async fn naive(conn: &mut redis::aio::MultiplexedConnection, stream: &str, n: usize) -> Result<Duration> {
    let start = Instant::now();
    let mut done = 0;
    while done < n {
        let reply: Option<redis::streams::StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("naive")
            .arg("COUNT")
            .arg(1)
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(conn)
            .await?;
        for key in reply.map(|r| r.keys).unwrap_or_default() {
            for e in key.ids {
                let _: i64 = redis::cmd("XACK").arg(stream).arg("g").arg(&e.id).query_async(conn).await?;
                done += 1;
            }
        }
    }
    Ok(start.elapsed())
}

async fn library(server: &RedisServer, stream: &str, n: usize, guard: bool) -> Result<Duration> {
    let vars: HashMap<&str, String> = HashMap::from([
        (env::REDIS_URL, server.url()),
        (env::STREAMS, stream.to_string()),
        (env::GROUP, "g".into()),
        (env::CONSUMER, "lib".into()),
        (env::BATCH_SIZE, "500".into()),
    ]);
    let config = WorkerConfig::from_lookup(|k| vars.get(k).cloned())?;
    let mut worker = Worker::new(config, Trivial);
    if guard {
        worker = worker.with_idempotency_guard(Duration::from_secs(3600));
    }
    streamfleet_bench::run_until_processed(worker, n).await
}

/// Builds and runs the Watermill peer program; returns its consumption time.
async fn watermill(server: &RedisServer, n: usize) -> Result<Duration> {
    let root = streamfleet_testbed::tools::workspace_root();
    let bin = root.join("target/bench/watermill");
    let built = tokio::process::Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(root.join("tests/bench/watermill"))
        .env("GOFLAGS", "-mod=mod")
        .status()
        .await?;
    anyhow::ensure!(built.success(), "go build failed");
    let out = tokio::process::Command::new(&bin)
        .args(["-addr", &format!("127.0.0.1:{}", server.port), "-n", &n.to_string()])
        .output()
        .await?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "watermill redisstream: N messages in 3.1s = R msg/s"
    let rate: f64 = text
        .rsplit('=')
        .next()
        .and_then(|r| r.split_whitespace().next())
        .and_then(|r| r.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("unexpected output: {text}{}", String::from_utf8_lossy(&out.stderr)))?;
    Ok(Duration::from_secs_f64(n as f64 / rate))
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("BENCH_ENTRIES").ok().and_then(|v| v.parse().ok()).unwrap_or(50_000);
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let mut results = Vec::new();
    for (name, stream) in [
        ("naive loop (baseline)", "s-naive"),
        ("streamfleet, guard off", "s-lib"),
        ("streamfleet, guard on", "s-guard"),
    ] {
        ensure_group(&mut conn, stream, "g", "0").await?;
        fill(&mut conn, stream, n).await?;
        let took = match stream {
            "s-naive" => naive(&mut conn, stream, n).await?,
            "s-lib" => library(&server, stream, n, false).await?,
            _ => library(&server, stream, n, true).await?,
        };
        results.push((name, took));
    }
    match watermill(&server, n).await {
        Ok(took) => results.push(("watermill redisstream", took)),
        Err(e) => println!("(watermill skipped: {e:#})"),
    }
    let base = n as f64 / results[0].1.as_secs_f64();
    println!("worker throughput, {n} entries, trivial handler");
    for (name, took) in &results {
        let rate = n as f64 / took.as_secs_f64();
        println!("  {name:<24} {rate:>10.0} entries/s  ({:.2}x baseline)", rate / base);
    }
    Ok(())
}
