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

/// The server's version (`INFO server`), for a figure's settings.
pub async fn redis_version(conn: &mut redis::aio::MultiplexedConnection) -> Result<String> {
    let info: String = redis::cmd("INFO").arg("server").query_async(conn).await?;
    Ok(info.lines().find_map(|l| l.strip_prefix("redis_version:")).unwrap_or("unknown").trim().to_string())
}

/// CPU seconds (user + system) process `pid` has used ("self": this one).
pub fn process_cpu(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime is the 12th, stime the 13th.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds this process has used.
pub fn own_cpu() -> f64 {
    process_cpu("self")
}

/// CPU seconds a Redis server has used (`INFO cpu`).
pub async fn redis_cpu<C: redis::aio::ConnectionLike + Send>(conn: &mut C) -> Result<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    Ok(info
        .lines()
        .filter_map(|l| l.strip_prefix("used_cpu_sys:").or_else(|| l.strip_prefix("used_cpu_user:")))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum())
}

/// Several runs of one measurement.
#[derive(Clone, Debug, Default)]
pub struct Runs(pub Vec<f64>);

impl Runs {
    pub fn push(&mut self, value: f64) {
        self.0.push(value);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    /// The middle run (the mean of the two middle ones for an even count).
    pub fn median(&self) -> f64 {
        let v = self.sorted();
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    /// Every run, sorted, `/`-separated, with `decimals` decimals.
    pub fn listed(&self, decimals: usize) -> String {
        self.sorted().iter().map(|v| format!("{v:.decimals$}")).collect::<Vec<_>>().join(" / ")
    }

    /// (max - min) / median, as a percentage: how much the runs disagree.
    pub fn spread_percent(&self) -> f64 {
        let v = self.sorted();
        match (v.first(), v.last()) {
            (Some(min), Some(max)) => 100.0 * (max - min) / self.median(),
            _ => f64::NAN,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Runs;

    #[test]
    fn runs_give_median_listing_and_spread() {
        let runs = Runs(vec![3.0, 1.0, 2.0]);
        assert_eq!(runs.median(), 2.0);
        assert_eq!(runs.listed(1), "1.0 / 2.0 / 3.0");
        assert_eq!(runs.spread_percent(), 100.0);
        assert_eq!(Runs(vec![4.0, 1.0, 2.0, 3.0]).median(), 2.5);
    }
}
