//! One worker's throughput against the limit, on one redis-server, the
//! same entries (BENCH_ENTRIES, default 50,000, per row and run) with a
//! trivial handler, three runs with the rows interleaved:
//!
//! * the ceiling: a library-free loop, `XREADGROUP COUNT 500` then one
//!   `XACK` carrying every ID of the batch, one connection;
//! * the streamfleet worker at the same batch size, guard off and guard on;
//! * a naive loop (`XREADGROUP COUNT 1`, handle, `XACK`);
//! * Watermill's Redis Streams subscriber (Go, tests/bench/watermill), when
//!   Go is installed.
//!
//! Writes `docs/figures/worker.json`.

use anyhow::Result;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use streamfleet_bench::{Runs, Trivial, fill, redis_version};
use streamfleet_contract as env;
use streamfleet_streams::ensure_group;
use streamfleet_testbed::RedisServer;
use streamfleet_testbed::redis_server::{calls_between, command_calls, command_micros};
use streamfleet_worker::{Worker, WorkerConfig};

const BATCH: usize = 500;
const RUNS: usize = 3;
type Conn = redis::aio::MultiplexedConnection;

/// Reads `count` at a time and acks each read with one XACK; returns when
/// `n` entries are acked.
async fn raw_loop(conn: &mut Conn, stream: &str, n: usize, count: usize) -> Result<Duration> {
    let start = Instant::now();
    let mut done = 0;
    while done < n {
        let reply: Option<redis::streams::StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("raw")
            .arg("COUNT")
            .arg(count)
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(conn)
            .await?;
        let ids: Vec<String> =
            reply.map(|r| r.keys.into_iter().flat_map(|k| k.ids).map(|e| e.id).collect()).unwrap_or_default();
        if ids.is_empty() {
            continue;
        }
        let acked: usize = redis::cmd("XACK").arg(stream).arg("g").arg(&ids).query_async(conn).await?;
        done += acked;
    }
    Ok(start.elapsed())
}

async fn library(server: &RedisServer, stream: &str, n: usize, guard: bool) -> Result<Duration> {
    let vars: HashMap<&str, String> = HashMap::from([
        (env::REDIS_URL, server.url()),
        (env::STREAMS, stream.to_string()),
        (env::GROUP, "g".into()),
        (env::CONSUMER, "lib".into()),
        (env::BATCH_SIZE, BATCH.to_string()),
    ]);
    let config = WorkerConfig::from_lookup(|k| vars.get(k).cloned())?;
    let mut worker = Worker::new(config, Trivial);
    if guard {
        worker = worker.with_idempotency_guard(Duration::from_secs(3600));
    }
    streamfleet_bench::run_until_processed(worker, n).await
}

/// Builds the Watermill peer program once.
async fn build_watermill() -> Result<std::path::PathBuf> {
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
    Ok(bin)
}

/// Runs the Watermill peer over its own fresh stream; returns its time.
async fn watermill(bin: &std::path::Path, server: &RedisServer, n: usize) -> Result<Duration> {
    let out = tokio::process::Command::new(bin)
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

struct Row {
    name: &'static str,
    batch: String,
    acks: &'static str,
    runs: Runs,
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("BENCH_ENTRIES").ok().and_then(|v| v.parse().ok()).unwrap_or(50_000);
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let watermill_bin = build_watermill().await.inspect_err(|e| println!("(watermill skipped: {e:#})")).ok();
    let mut rows = vec![
        Row {
            name: "ceiling: library-free loop",
            batch: BATCH.to_string(),
            acks: "one XACK per read, carrying every ID",
            runs: Runs::default(),
        },
        Row {
            name: "streamfleet, guard off",
            batch: BATCH.to_string(),
            acks: "one script per flush of settled entries: ownership check, then XACK",
            runs: Runs::default(),
        },
        Row {
            name: "streamfleet, guard on",
            batch: BATCH.to_string(),
            acks: "one script per flush: completion marks, then acks",
            runs: Runs::default(),
        },
        Row { name: "naive loop", batch: "1".into(), acks: "one XACK per entry", runs: Runs::default() },
    ];
    if watermill_bin.is_some() {
        rows.push(Row {
            name: "Watermill redisstream subscriber (Go)",
            batch: "library default".into(),
            acks: "one XACK per message",
            runs: Runs::default(),
        });
    }
    // BENCH_ONLY=<row index>: that row alone (to profile it); no figure.
    let only: Option<usize> = std::env::var("BENCH_ONLY").ok().and_then(|v| v.parse().ok());
    for run in 0..RUNS {
        for (i, row) in rows.iter_mut().enumerate() {
            if only.is_some_and(|o| o != i) {
                continue;
            }
            let (before, calls_before) = (command_micros(&mut conn).await?, command_calls(&mut conn).await?);
            let stream = format!("s-{i}-{run}");
            let took = if i == 4 {
                match &watermill_bin {
                    Some(bin) => watermill(bin, &server, n).await?,
                    None => continue,
                }
            } else {
                ensure_group(&mut conn, &stream, "g", "0").await?;
                fill(&mut conn, &stream, n).await?;
                match i {
                    0 => raw_loop(&mut conn, &stream, n, BATCH).await?,
                    1 => library(&server, &stream, n, false).await?,
                    2 => library(&server, &stream, n, true).await?,
                    _ => raw_loop(&mut conn, &stream, n, 1).await?,
                }
            };
            row.runs.push(n as f64 / took.as_secs_f64());
            let mut spent: Vec<(String, u64)> =
                calls_between(&before, &command_micros(&mut conn).await?).into_iter().collect();
            spent.sort_by_key(|(_, us)| std::cmp::Reverse(*us));
            let calls = calls_between(&calls_before, &command_calls(&mut conn).await?);
            let spent: Vec<String> = spent
                .iter()
                .take(4)
                .map(|(name, us)| format!("{name} {:.2} s/{} calls", *us as f64 / 1e6, calls.get(name).unwrap_or(&0)))
                .collect();
            println!(
                "run {run}: {:<40} {:>9.0} entries/s in {took:.2?}; Redis time: {}",
                row.name,
                n as f64 / took.as_secs_f64(),
                spent.join(", ")
            );
            let _: () = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await?;
        }
    }
    if only.is_some() {
        return Ok(());
    }
    let ceiling = rows[0].runs.median();
    let share = |row: &Row| 100.0 * row.runs.median() / ceiling;
    let summary = format!(
        "Of the ceiling (median): guard off {:.0}% (target ≥ 80%), guard on {:.0}% (target ≥ 50%); naive loop {:.1}%",
        share(&rows[1]),
        share(&rows[2]),
        share(&rows[3])
    );
    println!("{summary}");
    let table: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| {
            serde_json::json!([
                row.name,
                row.batch,
                row.acks,
                row.runs.listed(0),
                format!("{:.0}", row.runs.median()),
                format!("{:.0}%", row.runs.spread_percent()),
                format!("{:.0}%", share(row)),
            ])
        })
        .collect();
    streamfleet_testbed::publish_figure(
        "worker",
        &serde_json::json!({
            "what": "One consumer's throughput with a trivial handler against the ceiling (a library-free loop at the same batch size), same server, same entries, rows interleaved",
            "settings": {"entries per run": n, "runs": RUNS, "handler": "returns Done", "concurrency": "library default (10)", "redis": redis_version(&mut conn).await?, "connection": "loopback"},
            "columns": ["consumer", "batch", "acks", "entries/s (runs, sorted)", "median", "spread", "of the ceiling"],
            "rows": table,
            "summary": summary,
        }),
    )?;
    Ok(())
}
