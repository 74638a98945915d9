//! Shared pieces of the benchmark programs.

use anyhow::Result;
use std::time::{Duration, Instant};

/// A handler that only returns `Done`, keyed by `order_id`: the library's
/// own cost, with nothing of a handler's.
pub struct Trivial;

impl streamfleet_worker::Handler for Trivial {
    fn business_key(&self, e: &streamfleet_worker::Entry) -> Option<String> {
        e.field_str("order_id").map(str::to_string)
    }
    async fn handle(&self, _: &streamfleet_worker::Entry) -> streamfleet_worker::Outcome {
        streamfleet_worker::Outcome::Done
    }
}

/// Appends `n` entries to `stream` in pipelined chunks.
pub async fn fill(conn: &mut redis::aio::MultiplexedConnection, stream: &str, n: usize) -> Result<()> {
    let mut left = n;
    while left > 0 {
        let chunk = left.min(10_000);
        let mut pipe = redis::pipe();
        for i in 0..chunk {
            pipe.cmd("XADD")
                .arg(stream)
                .arg("*")
                .arg("order_id")
                .arg(n - left + i)
                .arg("amount_cents")
                .arg(100)
                .ignore();
        }
        let () = pipe.query_async(conn).await?;
        left -= chunk;
    }
    Ok(())
}

/// Delivers every entry of `stream` to `consumer` without acking: a PEL of
/// the stream's length.
pub async fn deliver_all(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    group: &str,
    consumer: &str,
) -> Result<()> {
    loop {
        let reply: Option<redis::Value> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg(consumer)
            .arg("COUNT")
            .arg(50_000)
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(conn)
            .await?;
        if reply.is_none() {
            return Ok(());
        }
    }
}

/// Runs `f` `n` times and returns the mean duration.
pub async fn mean<F, Fut>(n: u32, mut f: F) -> Result<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let start = Instant::now();
    for _ in 0..n {
        f().await?;
    }
    Ok(start.elapsed() / n)
}

/// Used memory of a Redis server, in MiB.
pub async fn redis_used_mib(conn: &mut redis::aio::MultiplexedConnection) -> Result<f64> {
    let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await?;
    let bytes: f64 =
        info.lines().find_map(|l| l.strip_prefix("used_memory:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0);
    Ok(bytes / 1024.0 / 1024.0)
}

/// Runs `worker` until it has processed `n` entries; returns how long that took.
pub async fn run_until_processed<H: streamfleet_worker::Handler>(
    worker: streamfleet_worker::Worker<H>,
    n: usize,
) -> Result<Duration> {
    let stats = worker.stats();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let start = Instant::now();
    let running = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    while streamfleet_worker::Stats::get(&stats.processed) < u64::try_from(n)? {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = start.elapsed();
    let _ = tx.send(());
    running.await??;
    Ok(took)
}
