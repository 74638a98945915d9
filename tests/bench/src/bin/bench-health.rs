//! One health poll (`streams::health::inspect`, what the operator runs per
//! shard per poll) over a PEL of 10 entries and over a PEL of 1,000,000
//! (BENCH_PEL), on the same redis-server in one run. The commands a poll
//! costs are counted by the server (`INFO commandstats` before and after),
//! never by the client. Three runs of 200 polls per PEL size, alternating.
//! Writes `docs/figures/health.json`.

use anyhow::Result;
use std::collections::BTreeMap;
use std::time::Instant;
use streamfleet_bench::{Runs, deliver_all, fill, redis_version};
use streamfleet_streams::ensure_group;
use streamfleet_streams::health::inspect;
use streamfleet_testbed::RedisServer;
use streamfleet_testbed::redis_server::{calls_between, command_calls};

const POLLS: u32 = 200;
const RUNS: usize = 3;

#[tokio::main]
async fn main() -> Result<()> {
    let big: usize = std::env::var("BENCH_PEL").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    // INFO on its own connection, so it never queues behind a poll.
    let mut counter = server.connection().await?;
    let sizes = [("small", 10usize), ("big", big)];
    for (stream, size) in sizes {
        ensure_group(&mut conn, stream, "g", "0").await?;
        fill(&mut conn, stream, size).await?;
        deliver_all(&mut conn, stream, "g", "c").await?;
        let snap = inspect(&mut conn, streamfleet_streams::GroupRef::new(stream, "g"), "dead")
            .await?
            .ok_or_else(|| anyhow::anyhow!("no group"))?;
        anyhow::ensure!(snap.pending == u64::try_from(size)?, "PEL of {stream}: {} not {size}", snap.pending);
    }
    let mut micros: BTreeMap<usize, Runs> = BTreeMap::new();
    let mut per_poll: BTreeMap<usize, (Runs, BTreeMap<String, u64>)> = BTreeMap::new();
    for _ in 0..RUNS {
        for (stream, size) in sizes {
            let before = command_calls(&mut counter).await?;
            let start = Instant::now();
            for _ in 0..POLLS {
                inspect(&mut conn, streamfleet_streams::GroupRef::new(stream, "g"), "dead").await?;
            }
            let took = start.elapsed();
            let calls = calls_between(&before, &command_calls(&mut counter).await?);
            micros.entry(size).or_default().push(took.as_secs_f64() * 1e6 / f64::from(POLLS));
            let entry = per_poll.entry(size).or_default();
            entry.0.push(calls.values().sum::<u64>() as f64 / f64::from(POLLS));
            entry.1 = calls.into_iter().map(|(name, n)| (name, n / u64::from(POLLS))).collect();
        }
    }
    let mut rows = Vec::new();
    for (_, size) in sizes {
        let (commands, by_name) = &per_poll[&size];
        let by_name = by_name.iter().map(|(name, n)| format!("{name} ×{n}")).collect::<Vec<_>>().join(", ");
        rows.push(serde_json::json!([
            size,
            commands.listed(2),
            by_name,
            micros[&size].listed(0),
            format!("{:.0}", micros[&size].median()),
        ]));
    }
    let command_ratio = per_poll[&big].0.median() / per_poll[&10].0.median();
    let time_ratio = micros[&big].median() / micros[&10].median();
    let summary = format!(
        "PEL {big} vs 10: commands per poll ×{command_ratio:.2}, wall time ×{time_ratio:.2} (median of {RUNS} runs; target ≤ 1.2)"
    );
    println!("{summary}");
    streamfleet_testbed::publish_figure(
        "health",
        &serde_json::json!({
            "what": "One health poll (what the operator runs per shard per poll) over a small and a large PEL; commands counted by the server from INFO commandstats",
            "settings": {"polls per run": POLLS, "runs": RUNS, "redis": redis_version(&mut conn).await?, "connection": "one multiplexed connection, loopback"},
            "columns": ["PEL", "commands per poll (runs)", "by command", "µs per poll (runs)", "median µs"],
            "rows": rows,
            "summary": summary,
        }),
    )?;
    Ok(())
}
