//! A sharded pipeline (`spec.shards`) on a real 3-master Redis Cluster:
//! orders sent by business key to their shard, example workers reading every
//! shard (one read per slot), the operator creating the group on each shard,
//! reporting totals and a per-shard breakdown, growing from 3 to 6 shards
//! under load without losing anything, and refusing to shrink; and the
//! failover drill on a 3 + 3 cluster.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use kube::Api;
use std::time::Duration;
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_e2e::*;
use streamfleet_streams::shard::{send, shard_keys};
use streamfleet_testbed::{RedisCluster, eventually};

const T: Duration = Duration::from_secs(180);

fn pipeline(shards: u32) -> String {
    pipeline_with(shards, "")
}

/// The pipeline with `extra` spec lines.
fn pipeline_with(shards: u32, extra: &str) -> String {
    let spec = format!(
        "  startId: \"0\"\n  shards: {shards}\n  scaling: {{minReplicas: 2, maxReplicas: 2, pollIntervalSeconds: 2}}\n  recovery: {{minIdleTimeMs: 60000, batchSize: 10}}{extra}"
    );
    manifest("p", "orders", "billing", "streamfleet/example-worker", &[("EXAMPLE_HANDLER_MS", "2")], &spec).replace(
        "    urlSecretRef: {name: redis, key: url}",
        "    urlSecretRef: {name: redis, key: url}\n    mode: Cluster",
    )
}

/// Sends orders `range` by their order ID to their shard among `shards`;
/// every hundredth (…42) is poison. Returns how many were poison.
async fn produce(
    conn: &mut redis::cluster_async::ClusterConnection,
    range: std::ops::Range<usize>,
    shards: u32,
) -> Result<usize> {
    let mut poison = 0;
    for i in range {
        let (order, amount) = (i.to_string(), (100 + i).to_string());
        let mut fields: Vec<(&str, &[u8])> = vec![("order_id", order.as_bytes()), ("amount_cents", amount.as_bytes())];
        if i % 100 == 42 {
            fields.push(("poison", b"1"));
            poison += 1;
        }
        send(conn, "orders", shards, &order, &fields).await?;
    }
    Ok(poison)
}

/// Charged orders, dead letters over every shard, pending over every shard.
async fn settled(conn: &mut redis::cluster_async::ClusterConnection, shards: u32) -> Result<(usize, usize, usize)> {
    let charged: usize = redis::cmd("HLEN").arg("{ledger}:charges").query_async(conn).await?;
    let (mut dead, mut pending) = (0, 0);
    for shard in shard_keys("orders", shards) {
        let n: usize = redis::cmd("XLEN")
            .arg(streamfleet_streams::keys::dead_letter_stream(&shard, "billing"))
            .query_async(conn)
            .await?;
        dead += n;
        let p: redis::streams::StreamPendingReply =
            redis::cmd("XPENDING").arg(&shard).arg("billing").query_async(conn).await?;
        pending += p.count();
    }
    Ok((charged, dead, pending))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_pipeline_on_a_cluster_runs_every_shard_grows_under_load_and_never_shrinks() -> Result<()> {
    let f = Fixture::start("e2e-shards", &[]).await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    let cluster = RedisCluster::start(3).await?;
    let mut conn = cluster.connection().await?;
    create_redis_secret(&client, &ns, "redis", &cluster.urls()[0]).await?;

    // Orders sent before the pipeline exists: shards beyond the first get
    // their group at 0, so none of these is skipped.
    let poison = produce(&mut conn, 0..300, 3).await?;
    f.apply(&pipeline(3)).await?;
    let mut c = conn.clone();
    eventually("every order on every shard settled", T, || async {
        Ok((settled(&mut c.clone(), 3).await? == (300 - poison, poison, 0)).then_some(()))
    })
    .await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    let status = eventually("totals and a breakdown in the status", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        let at_rest = s.lag == Some(0) && s.pending == Some(0) && s.dead_letter_length == Some(poison as i64);
        Ok((at_rest && s.shards.len() == 3).then_some(s))
    })
    .await?;
    let streams: Vec<&str> = status.shards.iter().map(|s| s.stream.as_str()).collect();
    assert_eq!(streams, ["orders", "orders:1", "orders:2"]);
    assert_eq!(status.stream_length, Some(300));
    assert_eq!(status.shards.iter().map(|s| s.dead_letter_length).sum::<i64>(), poison as i64);
    assert!(status.shards.iter().all(|s| s.lag == Some(0) && s.pending == 0));

    // Grow 3 -> 6 under load: a producer keeps sending (with 3 shards, then
    // with 6 from the moment the resource says 6) while the operator creates
    // the new shards' groups and the workers roll over to read them.
    let producer = {
        let mut conn = conn.clone();
        tokio::spawn(async move {
            let mut more = produce(&mut conn, 300..1300, 3).await?;
            more += produce(&mut conn, 1300..2300, 6).await?;
            Ok::<_, anyhow::Error>(more)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    f.apply(&pipeline(6)).await?;
    let more = producer.await??;
    eventually("the grown pipeline settled", T, || async {
        Ok((settled(&mut c.clone(), 6).await? == (2300 - poison - more, poison + more, 0)).then_some(()))
    })
    .await?;
    eventually("six shards in the status", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        Ok((s.shards.len() == 6 && s.lag == Some(0) && s.pending == Some(0)).then_some(()))
    })
    .await?;
    assert!(event_count(&client, &ns, "p", "GroupCreated").await? >= 5, "a group created on each new shard");
    let ledger: std::collections::HashMap<String, u64> =
        redis::cmd("HGETALL").arg("{ledger}:charges").query_async(&mut c).await?;
    for i in (0..2300).filter(|i| i % 100 != 42) {
        assert_eq!(ledger.get(&i.to_string()), Some(&(100 + i as u64)), "order {i} charged once, right amount");
    }
    assert_eq!(ledger.len(), 2300 - poison - more);

    // A producer retrying orders it sent before the growth: a second event
    // of each key, now on its shard among 6, which for about half of them
    // is another shard with its own fence counter. The fenced ledger keeps
    // the largest fence per order and refuses a smaller one: fences must
    // only go up, or it refuses every new holder of a moved key until the
    // entry is dead-lettered. Each retry runs (another event), and the
    // ledger refuses it as a second charge, not as a stale holder.
    // (The last orders sent with 3 shards: their old shards' counters were
    // at their highest, the new shards' counters are far lower.)
    let resent: Vec<usize> = (1200..1300).filter(|i| i % 100 != 42).collect();
    let moved = resent
        .iter()
        .filter(|i| {
            let key = i.to_string();
            streamfleet_streams::shard::shard_of(&key, 3) != streamfleet_streams::shard::shard_of(&key, 6)
        })
        .count();
    assert!(moved > 0, "some retried orders moved to another shard");
    for &i in &resent {
        let (order, amount) = (i.to_string(), (100 + i).to_string());
        send(&mut conn, "orders", 6, &order, &[("order_id", order.as_bytes()), ("amount_cents", amount.as_bytes())])
            .await?;
    }
    // (Ends early on a refusal as a stale holder: it would repeat until
    // the entry is dead-lettered.)
    let stale_fences = eventually("the retried orders refused as second charges", T, || async {
        let faults: std::collections::HashMap<String, u64> =
            redis::cmd("HGETALL").arg("{ledger}:faults").query_async(&mut c.clone()).await?;
        let stale = faults.get("stale-fence").copied().unwrap_or(0);
        let refused: std::collections::HashMap<String, u64> =
            redis::cmd("HGETALL").arg("{ledger}:duplicates").query_async(&mut c.clone()).await?;
        let done = resent.iter().all(|i| refused.get(&i.to_string()).is_some_and(|n| *n >= 1));
        Ok((stale > 0 || (done && settled(&mut c.clone(), 6).await?.2 == 0)).then_some(stale))
    })
    .await?;
    assert_eq!(stale_fences, 0, "a fence went backwards after the growth ({moved} retried orders moved shard)");
    assert_eq!(
        settled(&mut c, 6).await?,
        (2300 - poison - more, poison + more, 0),
        "no retried order charged again or dead-lettered"
    );

    // The tools on the cluster, per shard: a sweep over every shard, and a
    // replay of one shard's dead letters back to that shard.
    let url = cluster.urls()[0].clone();
    let sweep = tokio::process::Command::new(streamfleet_testbed::tools::cargo_bin("streamfleet")?)
        .arg("sweep")
        .env("STREAMFLEET_REDIS_URL", &url)
        .env("STREAMFLEET_REDIS_MODE", "Cluster")
        .env("STREAMFLEET_STREAMS", shard_keys("orders", 6).join(","))
        .env("STREAMFLEET_GROUP", "billing")
        .env("STREAMFLEET_CONSUMER", "sweep-test")
        .env("STREAMFLEET_LOG_FORMAT", "text")
        .output()
        .await?;
    let said = String::from_utf8_lossy(&sweep.stdout);
    assert!(sweep.status.success(), "{}", String::from_utf8_lossy(&sweep.stderr));
    for shard in shard_keys("orders", 6) {
        assert!(said.contains(&format!("\"stream\":\"{shard}\"")), "sweep skipped {shard}: {said}");
    }
    let mut with_letters = None;
    for shard in shard_keys("orders", 6) {
        let dlq = streamfleet_streams::keys::dead_letter_stream(&shard, "billing");
        let n: usize = redis::cmd("XLEN").arg(&dlq).query_async(&mut c).await?;
        if n > 0 {
            with_letters = Some((shard, dlq, n));
            break;
        }
    }
    let (shard, dlq, letters) = with_letters.expect("a shard with dead letters");
    let replay = tokio::process::Command::new(streamfleet_testbed::tools::cargo_bin("streamfleet")?)
        .args(["dead-letters", "--cluster", "--dead-letter-stream", &dlq, "replay", "--all"])
        .env("STREAMFLEET_REDIS_URL", &url)
        .env("STREAMFLEET_LOG_FORMAT", "text")
        .output()
        .await?;
    let said = String::from_utf8_lossy(&replay.stdout);
    assert!(replay.status.success() && said.contains(&format!("-> {shard} ")), "{said}");
    // Poison still: the workers of its group dead-letter it again, on its shard.
    eventually("the replayed poison dead-lettered again on its shard", T, || async {
        let range: redis::streams::StreamRangeReply =
            redis::cmd("XRANGE").arg(&dlq).arg("-").arg("+").query_async(&mut c.clone()).await?;
        let replayed = range.ids.iter().filter(|e| e.map.contains_key("streamfleet.replay-of")).count();
        Ok((range.ids.len() == letters && replayed == letters).then_some(()))
    })
    .await?;
    // Retention on every shard, each within its own floor.
    f.apply(&pipeline_with(6, "\n  retention: {maxLength: 10}")).await?;
    eventually("every shard trimmed to 10", T, || async {
        let mut longest = 0;
        for shard in shard_keys("orders", 6) {
            let n: usize = redis::cmd("XLEN").arg(&shard).query_async(&mut c.clone()).await?;
            longest = longest.max(n);
        }
        Ok((longest <= 10).then_some(()))
    })
    .await?;

    // Shrinking is refused at admission, naming the field.
    let refused = run_tool(f.bed, "kubectl", &["apply", "-n", &ns, "-f", "-"], Some(&pipeline(2))).await?;
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains("spec.shards may grow, never shrink"), "{said}");
    Ok(())
}

/// The acceptance drill of sharding: 6 shards on 3 masters with a replica
/// each; orders (20,000 by default, `SHARD_DRILL_ORDERS`) produced by order ID
/// through the helper while the pipeline runs, 1% poison; mid-run a
/// coordinated failover of the master holding the most shards and a worker
/// SIGKILL. Every order is charged exactly once, every poison order is a dead
/// letter on its own shard's dead-letter stream, every shard ends with PEL
/// and lag 0, and the status totals equal the sums read from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_shards_survive_a_master_failover_and_a_worker_kill_with_every_order_charged_once() -> Result<()> {
    use k8s_openapi::api::core::v1::Pod;
    use kube::ResourceExt as _;
    use kube::api::ListParams;
    let orders: usize = std::env::var("SHARD_DRILL_ORDERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let f = Fixture::start("e2e-shard-drill", &[]).await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    let cluster = RedisCluster::start_replicated(3).await?;
    let mut conn = cluster.connection().await?;
    create_redis_secret(&client, &ns, "redis", &cluster.urls()[0]).await?;
    let shards = shard_keys("orders", 6);
    // The master holding the most shards is the one to fail over.
    let mut holders = std::collections::BTreeMap::new();
    for shard in &shards {
        *holders.entry(cluster.master_of(shard).await?).or_insert(0) += 1;
    }
    let (&busiest, &held) = holders.iter().max_by_key(|(_, n)| **n).unwrap();
    f.apply(&pipeline(6)).await?;
    wait_condition(&client, &ns, "p", "Ready", "True", None, T).await?;

    let started = std::time::Instant::now();
    let third = orders / 3;
    let mut poison = produce(&mut conn, 0..third, 6).await?;
    let failed_over_to = cluster.fail_over(busiest).await?;
    // The fault happened: the shards it held are now served by its replica.
    for shard in &shards {
        assert_ne!(cluster.master_of(shard).await?, busiest, "{shard} still on the failed-over master");
    }
    eventually("the old master a replica", T, || async {
        Ok(cluster.roles().await?.iter().any(|(port, kind, _)| *port == busiest && kind == "slave").then_some(()))
    })
    .await?;
    poison += produce(&mut conn, third..2 * third, 6).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let workers = pods.list(&ListParams::default().labels("app.kubernetes.io/component=worker")).await?.items;
    let victim = workers.first().map(|p| p.name_any()).expect("a worker");
    sigkill_container(&client, &ns, &victim).await?;
    poison += produce(&mut conn, 2 * third..orders, 6).await?;

    let mut c = conn.clone();
    let drained = eventually("every order on every shard settled", Duration::from_secs(600), || async {
        Ok((settled(&mut c.clone(), 6).await? == (orders - poison, poison, 0)).then_some(()))
    })
    .await;
    let figures = settled(&mut c, 6).await?;
    drained.map_err(|e| e.context(format!("(charged, dead, pending) = {figures:?}")))?;
    let took = started.elapsed();
    let ledger: std::collections::HashMap<String, u64> =
        redis::cmd("HGETALL").arg("{ledger}:charges").query_async(&mut c).await?;
    for i in (0..orders).filter(|i| i % 100 != 42) {
        assert_eq!(ledger.get(&i.to_string()), Some(&(100 + i as u64)), "order {i}");
    }
    assert_eq!(ledger.len(), orders - poison);
    // Each poison order on its own shard's dead-letter stream.
    for shard in &shards {
        let letters: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(streamfleet_streams::keys::dead_letter_stream(shard, "billing"))
            .arg("-")
            .arg("+")
            .query_async(&mut c)
            .await?;
        for letter in letters.ids {
            let order = match letter.map.get("order_id") {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                other => panic!("{other:?}"),
            };
            assert_eq!(
                &streamfleet_streams::shard::shard_key("orders", streamfleet_streams::shard::shard_of(&order, 6)),
                shard
            );
            assert!(order.ends_with("42"), "{order} is not poison");
        }
    }
    // Totals equal the sums read from Redis, every shard at rest.
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    let mut length = 0;
    for shard in &shards {
        let n: i64 = redis::cmd("XLEN").arg(shard).query_async(&mut c).await?;
        length += n;
    }
    let status = eventually("status totals at rest", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        let at_rest = s.lag == Some(0) && s.pending == Some(0) && s.shards.len() == 6;
        Ok((at_rest && s.dead_letter_length == Some(poison as i64) && s.stream_length == Some(length)).then_some(s))
    })
    .await?;
    assert!(status.shards.iter().all(|s| s.lag == Some(0) && s.pending == 0));
    let duplicates: usize = redis::cmd("HLEN").arg("{ledger}:duplicates").query_async(&mut c).await?;
    println!(
        "shard drill: {orders} orders over 6 shards ({poison} poison) settled in {took:?}; failover of the master on \
         port {busiest} (holding {held} shards) to {failed_over_to}; worker {victim} SIGKILLed; repeats absorbed by \
         the ledger: {duplicates}"
    );
    Ok(())
}
