//! The recovery sweep over a PEL of 1,000,000 idle entries (BENCH_PEL), and
//! as the baseline in the same run, one plain XAUTOCLAIM pass (cursor to
//! 0-0, COUNT 1000) over a PEL of the same size: what a claim-only recovery
//! costs. The sweep also checks every payload and leaves entries in place.

use anyhow::Result;
use std::time::{Duration, Instant};
use streamfleet_bench::{deliver_all, fill};
use streamfleet_streams::ensure_group;
use streamfleet_streams::sweep::{SweepSettings, sweep};
use streamfleet_testbed::RedisServer;

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("BENCH_PEL").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    for stream in ["base", "swept"] {
        ensure_group(&mut conn, stream, "g", "0").await?;
        fill(&mut conn, stream, n).await?;
        deliver_all(&mut conn, stream, "g", "dead-pod").await?;
    }

    let start = Instant::now();
    let mut cursor = "0-0".to_string();
    let mut claimed = 0usize;
    loop {
        let reply: redis::streams::StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg("base")
            .arg("g")
            .arg("claimer")
            .arg(0)
            .arg(&cursor)
            .arg("COUNT")
            .arg(1000)
            .arg("JUSTID")
            .query_async(&mut conn)
            .await?;
        claimed += reply.claimed.len();
        cursor = reply.next_stream_id;
        if cursor == "0-0" {
            break;
        }
    }
    let baseline = start.elapsed();

    let settings = SweepSettings {
        stream: "swept",
        group: "g",
        consumer: "sweep",
        dead_letter_stream: "{swept}:dead",
        min_idle: Duration::ZERO,
        max_deliveries: 5,
        batch: 1000,
    };
    let start = Instant::now();
    let report = sweep(&mut conn, &settings).await?;
    let took = start.elapsed();
    assert_eq!(report.scanned, u64::try_from(n)?);
    let rate = |k: usize, d: Duration| k as f64 / d.as_secs_f64();
    println!("recovery over a PEL of {n} entries");
    println!(
        "  XAUTOCLAIM pass (baseline): {claimed} entries in {baseline:?} = {:.0} entries/s",
        rate(claimed, baseline)
    );
    println!(
        "  streamfleet sweep:          {} entries in {took:?} = {:.0} entries/s ({:.2}x baseline time)",
        report.scanned,
        rate(n, took),
        took.as_secs_f64() / baseline.as_secs_f64()
    );
    Ok(())
}
