//! The recovery sweep doing its work: a PEL of 1,000,000 idle entries
//! (BENCH_PEL) of which 10% were delivered `maxDeliveries` times (poison) and
//! 5% lost their payload (deleted while pending). The sweep must dead-letter
//! every poison entry and record every lost payload; its counts are checked
//! against what was arranged. Baseline in the same run: one bare XAUTOCLAIM
//! pass (cursor to 0-0, COUNT 1000, JUSTID) over a PEL of the same size.
//! Three runs. Writes `docs/figures/sweep.json`.

use anyhow::{Result, ensure};
use std::time::{Duration, Instant};
use streamfleet_bench::{Runs, deliver_all, fill, own_cpu, redis_version};
use streamfleet_streams::ensure_group;
use streamfleet_streams::sweep::{SweepSettings, sweep};
use streamfleet_testbed::RedisServer;
use streamfleet_testbed::redis_server::{calls_between, command_micros};

type Conn = redis::aio::MultiplexedConnection;
const MAX_DELIVERIES: u64 = 5;
const RUNS: usize = 3;

/// A PEL of `n` entries held by a dead consumer; every 10th delivered
/// `MAX_DELIVERIES` times, every 20th (offset by one) deleted. Returns
/// (poison, lost) counts.
async fn arrange(conn: &mut Conn, stream: &str, n: usize, faults: bool) -> Result<(u64, u64)> {
    ensure_group(conn, stream, "g", "0").await?;
    fill(conn, stream, n).await?;
    deliver_all(conn, stream, "g", "dead-pod").await?;
    if !faults {
        return Ok((0, 0));
    }
    let ids: Vec<String> = {
        let mut ids = Vec::with_capacity(n);
        let mut start = "-".to_string();
        loop {
            let page: Vec<(String, String, u64, u64)> =
                redis::cmd("XPENDING").arg(stream).arg("g").arg(&start).arg("+").arg(10_000).query_async(conn).await?;
            let Some((last, ..)) = page.last() else { break };
            start = format!("({last}");
            ids.extend(page.into_iter().map(|(id, ..)| id));
        }
        ids
    };
    let poison: Vec<&String> = ids.iter().step_by(10).collect();
    let lost: Vec<&String> = ids.iter().skip(1).step_by(20).collect();
    for chunk in poison.chunks(1000) {
        // Same owner, delivery count set: as if delivered MAX_DELIVERIES times.
        let mut claim = redis::cmd("XCLAIM");
        claim
            .arg(stream)
            .arg("g")
            .arg("dead-pod")
            .arg(0)
            .arg(chunk)
            .arg("RETRYCOUNT")
            .arg(MAX_DELIVERIES)
            .arg("JUSTID");
        let _: Vec<String> = claim.query_async(conn).await?;
    }
    for chunk in lost.chunks(1000) {
        let _: u64 = redis::cmd("XDEL").arg(stream).arg(chunk).query_async(conn).await?;
    }
    Ok((u64::try_from(poison.len())?, u64::try_from(lost.len())?))
}

async fn autoclaim_pass(conn: &mut Conn, stream: &str) -> Result<(usize, Duration)> {
    let start = Instant::now();
    let mut cursor = "0-0".to_string();
    let mut claimed = 0usize;
    loop {
        let reply: redis::streams::StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(stream)
            .arg("g")
            .arg("claimer")
            .arg(0)
            .arg(&cursor)
            .arg("COUNT")
            .arg(1000)
            .arg("JUSTID")
            .query_async(conn)
            .await?;
        claimed += reply.claimed.len();
        cursor = reply.next_stream_id;
        if cursor == "0-0" {
            return Ok((claimed, start.elapsed()));
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("BENCH_PEL").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let (mut baseline, mut swept) = (Runs::default(), Runs::default());
    let (mut sweep_cores, mut redis_cores) = (Runs::default(), Runs::default());
    let mut arranged = (0, 0);
    let mut profiles = Vec::new();
    for run in 0..RUNS {
        let base = format!("base-{run}");
        arrange(&mut conn, &base, n, false).await?;
        let (claimed, took) = autoclaim_pass(&mut conn, &base).await?;
        ensure!(claimed == n, "XAUTOCLAIM took {claimed} of {n}");
        baseline.push(n as f64 / took.as_secs_f64());
        let _: () = redis::cmd("DEL").arg(&base).query_async(&mut conn).await?;

        let stream = format!("swept-{run}");
        let dead = streamfleet_streams::keys::dead_letter_stream(&stream, "g");
        arranged = arrange(&mut conn, &stream, n, true).await?;
        let settings = SweepSettings {
            stream: &stream,
            group: "g",
            consumer: "sweep",
            dead_letter_stream: &dead,
            min_idle: Duration::ZERO,
            max_deliveries: MAX_DELIVERIES,
            batch: 1000,
        };
        let micros = command_micros(&mut conn).await?;
        let (cpu, redis_cpu) = (own_cpu(), streamfleet_bench::redis_cpu(&mut conn).await?);
        let start = Instant::now();
        let report = sweep(&mut conn, &settings).await?;
        let took = start.elapsed();
        sweep_cores.push((own_cpu() - cpu) / took.as_secs_f64());
        redis_cores.push((streamfleet_bench::redis_cpu(&mut conn).await? - redis_cpu) / took.as_secs_f64());
        // Where the server's time went, by command (the profile).
        let mut spent: Vec<(String, u64)> =
            calls_between(&micros, &command_micros(&mut conn).await?).into_iter().collect();
        spent.sort_by_key(|(_, us)| std::cmp::Reverse(*us));
        let profile = spent
            .iter()
            .take(5)
            .map(|(name, us)| format!("{name} {:.2} s", *us as f64 / 1e6))
            .collect::<Vec<_>>()
            .join(", ");
        // The work, not a proxy: every fault arranged is found and handled.
        ensure!(report.scanned == u64::try_from(n)?, "scanned {} of {n}", report.scanned);
        ensure!(report.dead_lettered == arranged.0, "dead-lettered {} of {} poison", report.dead_lettered, arranged.0);
        ensure!(report.payload_lost == arranged.1, "recorded {} of {} lost", report.payload_lost, arranged.1);
        let dead_letters: u64 = redis::cmd("XLEN").arg(&dead).query_async(&mut conn).await?;
        ensure!(dead_letters == arranged.0 + arranged.1, "{dead_letters} dead letters");
        swept.push(n as f64 / took.as_secs_f64());
        println!(
            "run {run}: XAUTOCLAIM {:.0} entries/s, sweep {:.0} entries/s in {took:.2?} ({} poison dead-lettered, {} lost recorded); CPU: sweep {:.2} cores, Redis {:.2} cores; Redis time by command: {profile}",
            baseline.0[run],
            swept.0[run],
            report.dead_lettered,
            report.payload_lost,
            sweep_cores.0[run],
            redis_cores.0[run]
        );
        profiles.push(profile);
        let _: () = redis::cmd("DEL").arg(&stream).arg(&dead).query_async(&mut conn).await?;
    }
    let summary = format!(
        "Sweep {:.0} entries/s (median; target ≥ 100,000), {:.0}% of a bare XAUTOCLAIM pass, while dead-lettering {} and recording {} lost payloads per run. Where Redis spent its time in the last run: {}",
        swept.median(),
        100.0 * swept.median() / baseline.median(),
        arranged.0,
        arranged.1,
        profiles.last().map_or("", String::as_str)
    );
    println!("{summary}");
    streamfleet_testbed::publish_figure(
        "sweep",
        &serde_json::json!({
            "what": format!("One recovery pass over a PEL of {n} idle entries: 10% delivered maxDeliveries times, 5% with their payload deleted; every one is checked to be dead-lettered or recorded"),
            "settings": {"pel": n, "maxDeliveries": MAX_DELIVERIES, "page": 1000, "runs": RUNS, "redis": redis_version(&mut conn).await?},
            "columns": ["pass", "entries/s (runs, sorted)", "median", "spread", "client CPU (cores)", "Redis CPU (cores)"],
            "rows": [
                ["bare XAUTOCLAIM … COUNT 1000 JUSTID (baseline: moves ownership, no other work)", baseline.listed(0), format!("{:.0}", baseline.median()), format!("{:.0}%", baseline.spread_percent()), "", ""],
                ["streamfleet sweep (payload check, dead letters, loss record)", swept.listed(0), format!("{:.0}", swept.median()), format!("{:.0}%", swept.spread_percent()), format!("{:.2}", sweep_cores.median()), format!("{:.2}", redis_cores.median())],
            ],
            "summary": summary,
        }),
    )?;
    Ok(())
}
