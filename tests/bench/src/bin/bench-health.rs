//! One health poll (`streams::health::inspect`) over a PEL of 10 entries and
//! over a PEL of 1,000,000 (BENCH_PEL), on the same redis-server in one run:
//! Redis commands and mean wall time of each, and their ratio.

use anyhow::Result;
use streamfleet_bench::{deliver_all, fill, mean};
use streamfleet_streams::ensure_group;
use streamfleet_streams::health::inspect;
use streamfleet_testbed::RedisServer;

#[tokio::main]
async fn main() -> Result<()> {
    let big: usize = std::env::var("BENCH_PEL").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let mut rows = Vec::new();
    for (stream, size) in [("small", 10usize), ("big", big)] {
        ensure_group(&mut conn, stream, "g", "0").await?;
        fill(&mut conn, stream, size).await?;
        deliver_all(&mut conn, stream, "g", "c").await?;
        let snap = inspect(&mut conn, stream, "g", "dead").await?.ok_or_else(|| anyhow::anyhow!("no group"))?;
        assert_eq!(snap.pending, u64::try_from(size)?);
        let polls = 200;
        let took = mean(polls, || {
            let mut c = conn.clone();
            async move {
                inspect(&mut c, stream, "g", "dead").await?;
                Ok(())
            }
        })
        .await?;
        rows.push((size, snap.commands, took));
    }
    println!("health poll, PEL size -> Redis commands, mean wall time (200 polls each)");
    for (size, commands, took) in &rows {
        println!("  PEL {size:>9}: {commands} commands, {took:?}");
    }
    let ratio = rows[1].2.as_secs_f64() / rows[0].2.as_secs_f64();
    println!("ratio big/small wall time: {ratio:.2}  (commands: {} vs {})", rows[1].1, rows[0].1);
    Ok(())
}
