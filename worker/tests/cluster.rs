//! The worker on a real 3-master Redis Cluster: reads, guard, acks, dead
//! letters and claims all run their scripts in the stream's slot.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use std::collections::HashMap;
use std::time::Duration;
use streamfleet_contract as env;
use streamfleet_testbed::{RedisCluster, eventually};
use streamfleet_worker::{Worker, WorkerConfig};

mod common;
use common::*;

/// One cluster at a time: three clusters of three servers and their workers
/// at once on two cores made a 3 s test time out at 20 s (Valkey, once).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_a_cluster_handles_acks_and_dead_letters() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    // It timed out once in a while (20 s for a 3 s test): a failure shows
    // the worker's log and the last state seen.
    streamfleet_testbed::test_logs();
    let cluster = RedisCluster::start(3).await?;
    let mut conn = cluster.connection().await?;
    streamfleet_streams::ensure_group(&mut conn, "orders", "g", "0").await?;
    let mut ids = Vec::new();
    for i in 0..20 {
        let kind = if i == 7 { "refused" } else { "ok" };
        let id: String = redis::cmd("XADD")
            .arg("orders")
            .arg("*")
            .arg("kind")
            .arg(kind)
            .arg("key")
            .arg(format!("k{i}"))
            .query_async(&mut conn)
            .await?;
        ids.push(id);
    }
    let config = cluster_config(&cluster, 1000);
    let handler = Scripted::default();
    let (stop, run) = spawn(Worker::new(config, handler.clone()).with_idempotency_guard(Duration::from_secs(600)));
    let seen = std::sync::Mutex::new(String::new());
    let settled = eventually("all settled", T, || async {
        let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg("orders")
            .arg("g")
            .arg("-")
            .arg("+")
            .arg(100)
            .query_async(&mut conn.clone())
            .await?;
        let dead: usize = redis::cmd("XLEN").arg("{orders}:dead:g").query_async(&mut conn.clone()).await?;
        if let Ok(mut seen) = seen.lock() {
            *seen = format!(
                "handled {}, pending (id, owner, idle ms, deliveries) {pending:?}, dead letters {dead}",
                handler.total()
            );
        }
        Ok((handler.total() == 20 && pending.is_empty() && dead == 1).then_some(()))
    })
    .await;
    settled.map_err(|e| anyhow::anyhow!("{e:#}; last seen: {}", seen.lock().map(|s| s.clone()).unwrap_or_default()))?;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), run).await???;
    Ok(())
}

/// Three shards of one pipeline on the cluster: the worker reads each slot
/// with a read of its own (a multi-key read across slots is refused), and
/// handles, acks and dead-letters on every shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_reads_every_shard_across_the_cluster() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    use streamfleet_streams::shard::{send, shard_keys};
    let cluster = RedisCluster::start(3).await?;
    let mut conn = cluster.connection().await?;
    let shards = shard_keys("orders", 3);
    let mut masters = std::collections::BTreeSet::new();
    for shard in &shards {
        streamfleet_streams::ensure_group(&mut conn, shard, "g", "0").await?;
        let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(shard).query_async(&mut conn).await?;
        masters.insert(slot / 5462);
    }
    assert!(masters.len() >= 2, "shards spread over the masters: {masters:?}");
    for i in 0..60 {
        let key = format!("k{i}");
        let kind: &[u8] = if i == 7 { b"refused" } else { b"ok" };
        send(&mut conn, "orders", 3, &key, &[("kind", kind), ("key", key.as_bytes())]).await?;
    }
    let vars: HashMap<&str, String> = HashMap::from([
        (env::REDIS_URL, cluster.urls()[0].clone()),
        (env::REDIS_MODE, "Cluster".into()),
        (env::STREAMS, shards.join(",")),
        (env::GROUP, "g".into()),
        (env::CONSUMER, "c1".into()),
        (env::MIN_IDLE_MS, "1000".into()),
    ]);
    let config = WorkerConfig::from_lookup(|k| vars.get(k).cloned()).unwrap();
    let dead_letters = shards.iter().map(|s| streamfleet_streams::keys::dead_letter_stream(s, "g")).collect::<Vec<_>>();
    let handler = Scripted::default();
    let (stop, run) = spawn(Worker::new(config, handler.clone()).with_idempotency_guard(Duration::from_secs(600)));
    eventually("every shard settled", T, || async {
        let mut c = conn.clone();
        let mut pending = 0;
        for shard in &shards {
            let p: redis::streams::StreamPendingReply =
                redis::cmd("XPENDING").arg(shard).arg("g").query_async(&mut c).await?;
            pending += p.count();
        }
        let mut dead = 0;
        for dlq in &dead_letters {
            let n: usize = redis::cmd("XLEN").arg(dlq).query_async(&mut c).await?;
            dead += n;
        }
        Ok((handler.total() == 60 && pending == 0 && dead == 1).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), run).await???;
    Ok(())
}

/// The stream's slot migrates to another master while a worker holds a
/// batch of it: the ten running handlers' commits and the holds' renewals
/// meet `TRYAGAIN` (the stream has moved, its companion keys have not) and
/// are retried, the done entries held. Then it migrates back while new
/// orders arrive: the worker's reads and claims are refused (`ASK`,
/// `TRYAGAIN`) until it ends. Every entry runs once, at its first
/// delivery; all are acked; nothing is dead-lettered. (A batch whose
/// guard is refused is handed back unstarted:
/// `timelines.rs::a_batch_whose_guard_cannot_be_taken_is_handed_back_uncounted`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migrating_mid_batch_runs_every_entry_once_and_settles_on_the_new_master() -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    const N: usize = 10;
    let cluster = RedisCluster::start(3).await?;
    let mut conn = cluster.connection().await?;
    streamfleet_streams::ensure_group(&mut conn, "orders", "g", "0").await?;
    add_orders(&mut conn, 0..N).await?;
    let mut config = cluster_config(&cluster, 3000);
    config.batch_size = N;
    config.concurrency = N;
    let (gate, open) = tokio::sync::watch::channel(false);
    let handler = Gated { open, runs: Default::default() };
    let runs = handler.runs.clone();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let worker = Worker::new(config, handler).with_idempotency_guard(Duration::from_secs(600));
    let run = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    let watcher = conn.clone();
    let settled = |n: usize| {
        let (runs, conn) = (runs.clone(), watcher.clone());
        move || {
            let (runs, mut conn) = (runs.clone(), conn.clone());
            async move {
                let p: redis::streams::StreamPendingReply =
                    redis::cmd("XPENDING").arg("orders").arg("g").query_async(&mut conn).await?;
                Ok((p.count() == 0 && runs.lock().unwrap().len() >= n).then_some(()))
            }
        }
    };
    eventually("the first batch running", T, || async { Ok((runs.lock().unwrap().len() == N).then_some(())) }).await?;

    // Out, while the batch runs: its commits meet the half-moved slot.
    let from = cluster.master_of("orders").await?;
    let to = cluster.nodes.iter().map(|n| n.port).find(|p| *p != from).expect("another master");
    let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg("orders").query_async(&mut conn).await?;
    begin_migration(&cluster, slot, from, to).await?;
    let refused = half_moved_refusals(&cluster, from).await?;
    gate.send(true)?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(half_moved_refusals(&cluster, from).await? > refused, "the commits met the half-moved slot (TRYAGAIN)");
    finish_migration(&cluster, slot, from, to).await?;
    eventually("the first batch acked on the new master", T, settled(N)).await?;

    // Back, while new orders arrive: the worker's reads meet the half-moved slot.
    begin_migration(&cluster, slot, to, from).await?;
    let refused = half_moved_refusals(&cluster, to).await?;
    add_orders(&mut conn, N..2 * N).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(half_moved_refusals(&cluster, to).await? > refused, "the worker met the half-moved slot (TRYAGAIN, ASK)");
    finish_migration(&cluster, slot, to, from).await?;
    eventually("every entry acked", T, settled(2 * N)).await?;

    // Past min-idle-time: nothing runs again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), run).await???;
    let mut per_entry: HashMap<String, Vec<u64>> = HashMap::new();
    for (id, deliveries) in runs.lock().unwrap().iter() {
        per_entry.entry(id.clone()).or_default().push(*deliveries);
    }
    assert_eq!(per_entry.len(), 2 * N, "every entry ran");
    assert!(per_entry.values().all(|d| d == &[1]), "each ran once, at its first delivery: {per_entry:?}");
    let dead: usize = redis::cmd("XLEN").arg("{orders}:dead:g").query_async(&mut conn).await?;
    assert_eq!(dead, 0, "nothing dead-lettered");
    Ok(())
}
