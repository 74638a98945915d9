//! One worker's throughput against the limit, on one redis-server, the
//! same entries (BENCH_ENTRIES, default 50,000, per row and run) with a
//! trivial handler, three runs with the rows interleaved:
//!
//! * the ceiling: a library-free loop, `XREADGROUP COUNT 500` then one
//!   `XACK` carrying every ID of the batch, one connection;
//! * the streamfleet worker at the same batch size, guard off and guard on,
//!   and guard off with `concurrency` = the batch (one wave of handlers
//!   per batch: what the round trips of waves cost, apart from the work
//!   per entry);
//! * a naive loop (`XREADGROUP COUNT 1`, handle, `XACK`);
//! * Watermill's Redis Streams subscriber (Go, tests/bench/watermill), when
//!   Go is installed.
//!
//! Writes `docs/figures/worker.json`. `BENCH_CONCURRENCY=N` runs the
//! library rows at `STREAMFLEET_CONCURRENCY=N` (the figure's settings say so);
//! `BENCH_ONLY=<row>` runs one row and writes no figure (for profiling).

use anyhow::Result;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use streamfleet_bench::{Runs, Trivial, fill, own_cpu, redis_cpu, redis_version};
use streamfleet_contract as env;
use streamfleet_streams::ensure_group;
use streamfleet_testbed::RedisServer;
use streamfleet_testbed::redis_server::{calls_between, command_calls, command_micros};
use streamfleet_worker::{Worker, WorkerConfig};

const BATCH: usize = 500;
// The one-wave row's name says its concurrency, the batch size.
const _: () = assert!(BATCH == 500);
/// The index of the Watermill row (it fills its own stream).
const WATERMILL: usize = 5;
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

/// The library at the batch size, guard on or off; `concurrency` overrides
/// the library default (and `BENCH_CONCURRENCY`).
async fn library(
    server: &RedisServer,
    stream: &str,
    n: usize,
    guard: bool,
    concurrency: Option<usize>,
) -> Result<Duration> {
    let vars: HashMap<&str, String> = HashMap::from([
        (env::REDIS_URL, server.url()),
        (env::STREAMS, stream.to_string()),
        (env::GROUP, "g".into()),
        (env::CONSUMER, "lib".into()),
        (env::BATCH_SIZE, BATCH.to_string()),
    ]);
    let mut vars = vars;
    if let Ok(c) = std::env::var("BENCH_CONCURRENCY") {
        vars.insert(env::CONCURRENCY, c);
    }
    if let Some(c) = concurrency {
        vars.insert(env::CONCURRENCY, c.to_string());
    }
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
    /// Redis time by command over all runs, µs (a script's time includes
    /// the commands it calls, which are listed on their own too).
    redis_us: BTreeMap<String, u64>,
    /// The consumer's own CPU over all runs, s (in-process rows only).
    client_cpu: Option<f64>,
    /// Redis's CPU over all runs, s (`INFO cpu`; not for the Go peer,
    /// which fills its own stream).
    redis_cpu: Option<f64>,
}

impl Row {
    fn new(name: &'static str, batch: &str, acks: &'static str) -> Self {
        Self {
            name,
            batch: batch.into(),
            acks,
            runs: Runs::default(),
            redis_us: BTreeMap::new(),
            client_cpu: None,
            redis_cpu: None,
        }
    }

    /// Where the time per 1,000 entries went: Redis by command, then the consumer's CPU.
    fn profile(&self, entries: usize) -> String {
        let per_k = |us: u64| us as f64 * 1000.0 / entries as f64;
        let mut spent: Vec<(&String, &u64)> = self.redis_us.iter().filter(|(_, us)| per_k(**us) >= 1.0).collect();
        spent.sort_by_key(|(_, us)| std::cmp::Reverse(**us));
        let mut parts: Vec<String> = spent.iter().map(|(name, us)| format!("{name} {:.0}", per_k(**us))).collect();
        if let Some(cpu) = self.client_cpu {
            parts.push(format!("consumer CPU {:.0}", cpu * 1e6 * 1000.0 / entries as f64));
        }
        parts.join(", ")
    }

    /// The most entries per second Redis's own CPU per entry allows (were
    /// the consumer free and every round trip overlapped).
    fn redis_bound(&self, entries: usize) -> Option<f64> {
        self.redis_cpu.filter(|cpu| *cpu > 0.0).map(|cpu| entries as f64 / cpu)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("BENCH_ENTRIES").ok().and_then(|v| v.parse().ok()).unwrap_or(50_000);
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let watermill_bin = build_watermill().await.inspect_err(|e| println!("(watermill skipped: {e:#})")).ok();
    let mut rows = vec![
        Row::new("ceiling: library-free loop", &BATCH.to_string(), "one XACK per read, carrying every ID"),
        Row::new(
            "streamfleet, guard off",
            &BATCH.to_string(),
            "one script per flush of settled entries: ownership check, then XACK",
        ),
        Row::new("streamfleet, guard on", &BATCH.to_string(), "one script per flush: completion marks, then acks"),
        Row::new("streamfleet, guard off, concurrency 500 (one wave per batch)", &BATCH.to_string(), "as guard off"),
        Row::new("naive loop", "1", "one XACK per entry"),
    ];
    if watermill_bin.is_some() {
        rows.push(Row::new("Watermill redisstream subscriber (Go)", "library default", "one XACK per message"));
    }
    // BENCH_ONLY=<row index>: that row alone (to profile it); no figure.
    let only: Option<usize> = std::env::var("BENCH_ONLY").ok().and_then(|v| v.parse().ok());
    for run in 0..RUNS {
        for (i, row) in rows.iter_mut().enumerate() {
            if only.is_some_and(|o| o != i) {
                continue;
            }
            let stream = format!("s-{i}-{run}");
            if i != WATERMILL {
                ensure_group(&mut conn, &stream, "g", "0").await?;
                fill(&mut conn, &stream, n).await?;
            }
            let (before, calls_before, cpu_before, redis_before) = (
                command_micros(&mut conn).await?,
                command_calls(&mut conn).await?,
                own_cpu(),
                redis_cpu(&mut conn).await?,
            );
            let took = match i {
                0 => raw_loop(&mut conn, &stream, n, BATCH).await?,
                1 => library(&server, &stream, n, false, None).await?,
                2 => library(&server, &stream, n, true, None).await?,
                3 => library(&server, &stream, n, false, Some(BATCH)).await?,
                4 => raw_loop(&mut conn, &stream, n, 1).await?,
                _ => match &watermill_bin {
                    Some(bin) => watermill(bin, &server, n).await?,
                    None => continue,
                },
            };
            if i != WATERMILL {
                *row.client_cpu.get_or_insert(0.0) += own_cpu() - cpu_before;
                *row.redis_cpu.get_or_insert(0.0) += redis_cpu(&mut conn).await? - redis_before;
            }
            row.runs.push(n as f64 / took.as_secs_f64());
            let spent = calls_between(&before, &command_micros(&mut conn).await?);
            let calls = calls_between(&calls_before, &command_calls(&mut conn).await?);
            for (name, us) in &spent {
                // The Watermill peer fills its own stream.
                let filling = i == WATERMILL && name == "xadd";
                if !filling && !name.starts_with("info") {
                    *row.redis_us.entry(name.clone()).or_default() += us;
                }
            }
            let mut spent: Vec<(String, u64)> = spent.into_iter().collect();
            spent.sort_by_key(|(_, us)| std::cmp::Reverse(*us));
            let spent: Vec<String> = spent
                .iter()
                .take(6)
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
    let bound = |row: &Row| row.redis_bound(n * RUNS).map_or(f64::NAN, |b| 100.0 * b / ceiling);
    let summary = format!(
        "Of the ceiling (median): guard off {:.0}% (target ≥ 80%), guard on {:.0}% (target ≥ 50%); guard off in one wave per batch {:.0}%; naive loop {:.1}%. Redis's own CPU per entry alone would cap guard off at {:.0}%, guard on at {:.0}% and one wave per batch at {:.0}% of the ceiling",
        share(&rows[1]),
        share(&rows[2]),
        share(&rows[3]),
        share(&rows[4]),
        bound(&rows[1]),
        bound(&rows[2]),
        bound(&rows[3])
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
                row.redis_cpu.map_or("-".to_string(), |cpu| format!("{:.0}", cpu * 1e6 * 1000.0 / (n * RUNS) as f64)),
                row.redis_bound(n * RUNS).map_or("-".to_string(), |b| format!("{:.0}%", 100.0 * b / ceiling)),
                row.profile(n * RUNS),
            ])
        })
        .collect();
    streamfleet_testbed::publish_figure(
        "worker",
        &serde_json::json!({
            "what": "One consumer's throughput with a trivial handler against the ceiling (a library-free loop at the same batch size), same server, same entries, rows interleaved",
            "settings": {"entries per run": n, "runs": RUNS, "handler": "returns Done", "concurrency": std::env::var("BENCH_CONCURRENCY").unwrap_or_else(|_| "library default (10)".into()), "redis": redis_version(&mut conn).await?, "connection": "loopback"},
            "columns": ["consumer", "batch", "acks", "entries/s (runs, sorted)", "median", "spread", "of the ceiling", "Redis CPU per 1,000 entries (µs)", "the most Redis's CPU allows (share of the ceiling)", "where the time goes: µs per 1,000 entries (Redis by command; a script includes the commands it calls)"],
            "rows": table,
            "summary": summary,
        }),
    )?;
    Ok(())
}
