//! One pipeline over 1, 3 and 6 shards on a 3-master Redis Cluster (on this
//! machine's loopback): three workers (tasks of this process, 10 handlers in
//! flight each, batch 100, a handler that only returns Done, guard off)
//! drain the same number of entries, sent by business key to their shards;
//! three runs per shard count. Reports entries/s and the CPU this process
//! and the Redis nodes used, in cores: on two cores, scale-out is bounded by
//! the CPU, and the figures say so. Writes `docs/figures/shards.json`.

use anyhow::Result;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use streamfleet_bench::Trivial;
use streamfleet_contract as env;
use streamfleet_streams::shard::{shard_key, shard_keys, shard_of};
use streamfleet_testbed::RedisCluster;
use streamfleet_worker::{Stats, Worker, WorkerConfig};

/// CPU seconds the cluster's nodes have used.
async fn redis_cpu(cluster: &RedisCluster) -> Result<f64> {
    let mut total = 0.0;
    for node in &cluster.nodes {
        total += streamfleet_bench::redis_cpu(&mut node.connection().await?).await?;
    }
    Ok(total)
}

struct Run {
    rate: f64,
    own_cores: f64,
    redis_cores: f64,
}

async fn run(cluster: &RedisCluster, stream: &str, shards: u32, n: usize) -> Result<Run> {
    let mut conn = cluster.connection().await?;
    let mut by_shard: HashMap<u32, Vec<usize>> = HashMap::new();
    for i in 0..n {
        by_shard.entry(shard_of(&i.to_string(), shards)).or_default().push(i);
    }
    for key in shard_keys(stream, shards) {
        streamfleet_streams::ensure_group(&mut conn, &key, "g", "0").await?;
    }
    for (shard, orders) in by_shard {
        for chunk in orders.chunks(5000) {
            let mut pipe = redis::pipe();
            for i in chunk {
                pipe.cmd("XADD").arg(shard_key(stream, shard)).arg("*").arg("order_id").arg(i).ignore();
            }
            let () = pipe.query_async(&mut conn).await?;
        }
    }
    let streams = shard_keys(stream, shards).join(",");
    let mut stats = Vec::new();
    let mut stops = Vec::new();
    let mut running = Vec::new();
    let (cpu0, redis0, start) = (streamfleet_bench::own_cpu(), redis_cpu(cluster).await?, Instant::now());
    for w in 0..3 {
        let vars: HashMap<&str, String> = HashMap::from([
            (env::REDIS_URL, cluster.urls()[0].clone()),
            (env::REDIS_MODE, "Cluster".into()),
            (env::STREAMS, streams.clone()),
            (env::GROUP, "g".into()),
            (env::CONSUMER, format!("w{w}")),
            (env::BATCH_SIZE, "100".into()),
            (env::CONCURRENCY, "10".into()),
        ]);
        let worker = Worker::new(WorkerConfig::from_lookup(|k| vars.get(k).cloned())?, Trivial);
        stats.push(worker.stats());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        stops.push(tx);
        running.push(tokio::spawn(worker.run(async move {
            let _ = rx.await;
        })));
    }
    while stats.iter().map(|s| Stats::get(&s.processed)).sum::<u64>() < u64::try_from(n)? {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = start.elapsed().as_secs_f64();
    let (cpu1, redis1) = (streamfleet_bench::own_cpu(), redis_cpu(cluster).await?);
    for stop in stops {
        let _ = stop.send(());
    }
    for r in running {
        r.await??;
    }
    Ok(Run { rate: n as f64 / took, own_cores: (cpu1 - cpu0) / took, redis_cores: (redis1 - redis0) / took })
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("BENCH_ENTRIES").ok().and_then(|v| v.parse().ok()).unwrap_or(30_000);
    let cluster = RedisCluster::start(3).await?;
    let mut rows = Vec::new();
    let mut medians = Vec::new();
    for shards in [1u32, 3, 6] {
        let mut runs = Vec::new();
        for round in 0..3 {
            runs.push(run(&cluster, &format!("s{shards}r{round}"), shards, n).await?);
        }
        runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        let median = &runs[1];
        println!(
            "{shards} shard(s): {:.0} entries/s (runs {:.0} / {:.0} / {:.0}); CPU: bench {:.2} cores, Redis {:.2} cores",
            median.rate, runs[0].rate, runs[1].rate, runs[2].rate, median.own_cores, median.redis_cores
        );
        rows.push(serde_json::json!([
            shards,
            n,
            format!("{:.0} / {:.0} / {:.0}", runs[0].rate, runs[1].rate, runs[2].rate),
            format!("{:.0}", median.rate),
            format!("{:.2}", median.own_cores),
            format!("{:.2}", median.redis_cores),
        ]));
        medians.push((shards, median.rate));
    }
    let base = medians[0].1;
    let ratios: Vec<String> = medians.iter().map(|(s, r)| format!("{s}: ×{:.2}", r / base)).collect();
    streamfleet_testbed::publish_figure(
        "shards",
        &serde_json::json!({
            "what": "One pipeline over 1, 3 and 6 shards on a 3-master Redis Cluster on this machine: three workers drain the same entries; CPU in cores (of 2) for the bench process (workers) and for the Redis nodes",
            "settings": {"workers": 3, "concurrency": 10, "batchSize": 100, "guard": false, "handler": "returns Done", "runs": 3, "entries": n, "cpus": 2, "redis": "3 masters, redis-server 7.0, loopback"},
            "columns": ["shards", "entries per run", "entries/s (3 runs, sorted)", "median", "bench CPU (cores)", "Redis CPU (cores)"],
            "rows": rows,
            "summary": format!("Throughput relative to one shard (median): {}. On two cores the workers and three Redis nodes share the CPU, so more shards cannot scale out here; the ratio is reported as measured.", ratios.join(", ")),
        }),
    )?;
    Ok(())
}
