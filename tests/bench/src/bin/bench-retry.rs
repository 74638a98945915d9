//! Claims when most of the PEL waits for a retry (`streams::retry`): a PEL
//! of 1,000,000 entries (BENCH_PEL) of which 99% are parked and not due,
//! against a PEL of only the 1% that is not, on the same redis-server in
//! one run. Per step: one due claim (`claim::claim_due`, finding nothing
//! due) and one idle claim of 100 entries (`claim::autoclaim`), what a
//! worker's claim cycle runs. The limit, in the same run: a bare `XPENDING
//! IDLE 0 - + 100` and `XCLAIM` of those 100, library-free, on the small
//! PEL. Commands are counted by the server. Three runs of 200 steps each,
//! alternating. Writes `docs/figures/retry.json`.

use anyhow::{Result, ensure};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use streamfleet_bench::{Runs, deliver_all, fill, redis_version};
use streamfleet_streams::claim::{LossRecord, autoclaim, claim_due};
use streamfleet_streams::ensure_group;
use streamfleet_streams::retry::{Schedule, parked_consumer};
use streamfleet_testbed::RedisServer;
use streamfleet_testbed::redis_server::{calls_between, command_calls};

type Conn = redis::aio::MultiplexedConnection;
const STEPS: u32 = 200;
const RUNS: usize = 3;
const PAGE: usize = 100;
const LOSS: LossRecord<'static> = LossRecord { dead_letter_stream: "dead", consumer: "x", why: "gone" };

/// `n` entries delivered to a consumer; all but every 100th parked (after
/// failing their first delivery) for an hour, as `retry::park` leaves them:
/// held by the parking consumer (idle 0, so due in an hour), in the
/// due-time index (delivery 1's range, idle since now).
async fn arrange(conn: &mut Conn, stream: &str, n: usize, park: bool) -> Result<usize> {
    ensure_group(conn, stream, "g", "0").await?;
    fill(conn, stream, n).await?;
    deliver_all(conn, stream, "g", "w").await?;
    if !park {
        return Ok(0);
    }
    let (secs, _): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    let score = streamfleet_streams::retry::INDEX_SPAN_MS + secs * 1000;
    let index = streamfleet_streams::keys::retry_due_key(stream, "g");
    let mut start = "-".to_string();
    let mut parked = 0;
    loop {
        let page: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(stream)
            .arg("g")
            .arg(&start)
            .arg("+")
            .arg(10_000)
            .arg("w")
            .query_async(conn)
            .await?;
        let Some((last, ..)) = page.last() else { break };
        start = format!("({last}");
        let ids: Vec<&str> =
            page.iter().enumerate().filter(|(i, _)| i % 100 != 0).map(|(_, (id, ..))| id.as_str()).collect();
        for chunk in ids.chunks(1000) {
            let _: Vec<String> = redis::cmd("XCLAIM")
                .arg(stream)
                .arg("g")
                .arg(parked_consumer(1))
                .arg(0)
                .arg(chunk)
                .arg("IDLE")
                .arg(0)
                .arg("JUSTID")
                .query_async(conn)
                .await?;
            let members: Vec<(u64, &str)> = chunk.iter().map(|id| (score, *id)).collect();
            let _: u64 = redis::AsyncCommands::zadd_multiple(conn, &index, &members).await?;
            parked += chunk.len();
        }
    }
    Ok(parked)
}

/// One worker claim step: due retries, then one page of idle entries.
async fn library_step(conn: &mut Conn, stream: &str, schedule: &Schedule) -> Result<usize> {
    let due =
        claim_due(conn, streamfleet_streams::ConsumerRef::new(stream, "g", "x"), &LOSS, schedule, 5, PAGE).await?;
    ensure!(due.entries.is_empty(), "nothing is due");
    ensure!(due.indexed || stream != "big", "the due-time index serves the claim, no scan");
    let claimed =
        autoclaim(conn, streamfleet_streams::ConsumerRef::new(stream, "g", "x"), &LOSS, Duration::ZERO, "0-0", PAGE)
            .await?;
    Ok(claimed.entries.len())
}

/// The limit: one page of idle entries, bare.
async fn bare_step(conn: &mut Conn, stream: &str) -> Result<usize> {
    let page: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg("g")
        .arg("IDLE")
        .arg(0)
        .arg("-")
        .arg("+")
        .arg(PAGE)
        .query_async(conn)
        .await?;
    let ids: Vec<&str> = page.iter().map(|(id, ..)| id.as_str()).collect();
    let claimed: redis::Value =
        redis::cmd("XCLAIM").arg(stream).arg("g").arg("x").arg(0).arg(&ids).query_async(conn).await?;
    let redis::Value::Array(claimed) = claimed else { anyhow::bail!("XCLAIM: {claimed:?}") };
    Ok(claimed.len())
}

#[tokio::main]
async fn main() -> Result<()> {
    let big: usize = std::env::var("BENCH_PEL").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let mut counter = server.connection().await?;
    let parked = arrange(&mut conn, "big", big, true).await?;
    arrange(&mut conn, "small", big - parked, false).await?;
    arrange(&mut conn, "bare", big - parked, false).await?;
    let schedule = Schedule::fixed(Duration::from_secs(3600));
    let cases = ["big", "small", "bare"];
    let mut micros: BTreeMap<&str, Runs> = BTreeMap::new();
    let mut commands: BTreeMap<&str, Runs> = BTreeMap::new();
    for _ in 0..RUNS {
        for case in cases {
            let before = command_calls(&mut counter).await?;
            let start = Instant::now();
            for _ in 0..STEPS {
                let claimed = match case {
                    "bare" => bare_step(&mut conn, case).await?,
                    _ => library_step(&mut conn, case, &schedule).await?,
                };
                ensure!(claimed == PAGE, "{case}: a step claimed {claimed}, not {PAGE}");
            }
            let took = start.elapsed();
            let calls = calls_between(&before, &command_calls(&mut counter).await?);
            micros.entry(case).or_default().push(took.as_secs_f64() * 1e6 / f64::from(STEPS));
            commands.entry(case).or_default().push(calls.values().sum::<u64>() as f64 / f64::from(STEPS));
        }
    }
    let label = |case: &str| match case {
        "big" => format!("{big} pending, {parked} parked (not due): due claim + idle claim of {PAGE}"),
        "small" => format!("{} pending, none parked: due claim + idle claim of {PAGE}", big - parked),
        _ => format!("{} pending: bare XPENDING IDLE + XCLAIM of {PAGE} (the limit)", big - parked),
    };
    let rows: Vec<serde_json::Value> = cases
        .iter()
        .map(|case| {
            serde_json::json!([
                label(case),
                commands[case].listed(1),
                micros[case].listed(0),
                format!("{:.0}", micros[case].median())
            ])
        })
        .collect();
    let parked_ratio = micros["big"].median() / micros["small"].median();
    let limit_share = 100.0 * micros["bare"].median() / micros["big"].median();
    let summary = format!(
        "With 99% of a {big}-entry PEL waiting for a retry, a claim step costs ×{parked_ratio:.2} what it costs with none waiting (target ≤ 1.2), and runs at {limit_share:.0}% of the bare limit's speed (median of {RUNS} runs)"
    );
    println!("{summary}");
    streamfleet_testbed::publish_figure(
        "retry",
        &serde_json::json!({
            "what": "A worker's claim step (due retries, then a page of idle entries) when most of the PEL waits for a retry, against the same step with none waiting and a bare library-free claim; commands counted by the server",
            "settings": {"steps per run": STEPS, "runs": RUNS, "page": PAGE, "redis": redis_version(&mut conn).await?, "connection": "one multiplexed connection, loopback"},
            "columns": ["case", "commands per step (runs)", "µs per step (runs)", "median µs"],
            "rows": rows,
            "summary": summary,
        }),
    )?;
    Ok(())
}
