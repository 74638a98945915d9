//! Handlers in flight per worker: one worker, an I/O-bound handler (10 ms of
//! waiting, like a call to a payment provider), at concurrency 1, 10 and 50,
//! three runs each, on one redis-server. The limit is concurrency ÷ handler
//! time; the result is the share of it reached. Writes
//! `docs/figures/concurrency.json` (see `scripts/docs-figures.sh`).

use anyhow::Result;
use std::collections::HashMap;
use std::time::Duration;
use streamfleet_bench::fill;
use streamfleet_contract as env;
use streamfleet_streams::ensure_group;
use streamfleet_testbed::RedisServer;
use streamfleet_worker::{Entry, Handler, Outcome, Worker, WorkerConfig};

const HANDLER: Duration = Duration::from_millis(10);

struct IoBound;
impl Handler for IoBound {
    fn business_key(&self, e: &Entry) -> Option<String> {
        e.field_str("order_id").map(str::to_string)
    }
    async fn handle(&self, _: &Entry) -> Outcome {
        tokio::time::sleep(HANDLER).await;
        Outcome::Done
    }
}

/// Entries per second of one worker at `concurrency` over `n` entries.
async fn run(server: &RedisServer, stream: &str, n: usize, concurrency: usize) -> Result<f64> {
    let vars: HashMap<&str, String> = HashMap::from([
        (env::REDIS_URL, server.url()),
        (env::STREAMS, stream.to_string()),
        (env::GROUP, "g".into()),
        (env::CONSUMER, "bench".into()),
        (env::BATCH_SIZE, "100".into()),
        (env::CONCURRENCY, concurrency.to_string()),
    ]);
    let worker = Worker::new(WorkerConfig::from_lookup(|k| vars.get(k).cloned())?, IoBound);
    let took = streamfleet_bench::run_until_processed(worker, n).await?;
    Ok(n as f64 / took.as_secs_f64())
}

#[tokio::main]
async fn main() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    for concurrency in [1usize, 10, 50] {
        let limit = concurrency as f64 / HANDLER.as_secs_f64();
        // About three seconds of work at the limit.
        let n = (limit * 3.0) as usize;
        let mut rates = Vec::new();
        for round in 0..3 {
            let stream = format!("s-{concurrency}-{round}");
            ensure_group(&mut conn, &stream, "g", "0").await?;
            fill(&mut conn, &stream, n).await?;
            rates.push(run(&server, &stream, n, concurrency).await?);
        }
        rates.sort_by(f64::total_cmp);
        let median = rates[1];
        println!(
            "concurrency {concurrency:>3}: {median:>7.0} entries/s (runs {:.0} / {:.0} / {:.0}), limit {limit:.0}, {:.0}%",
            rates[0],
            rates[1],
            rates[2],
            100.0 * median / limit
        );
        rows.push(serde_json::json!([
            concurrency,
            n,
            format!("{:.0} / {:.0} / {:.0}", rates[0], rates[1], rates[2]),
            format!("{median:.0}"),
            format!("{limit:.0}"),
            format!("{:.0}%", 100.0 * median / limit)
        ]));
        summary.push(format!("{concurrency}: {:.0}%", 100.0 * median / limit));
    }
    streamfleet_testbed::publish_figure(
        "concurrency",
        &serde_json::json!({
            "what": "One worker with an I/O-bound handler (10 ms) at several handlers in flight; limit = concurrency ÷ handler time",
            "settings": {"handlerMs": 10, "batchSize": 100, "guard": false, "runs": 3, "redis": "one local redis-server 7.0", "cpus": 2},
            "columns": ["concurrency", "entries per run", "entries/s (3 runs, sorted)", "median", "limit", "median ÷ limit"],
            "rows": rows,
            "summary": format!("Share of the limit reached (median), by concurrency: {}.", summary.join(", ")),
        }),
    )?;
    Ok(())
}
