//! A pipeline on a real 3-master Redis Cluster (`redis.mode: Cluster`):
//! the operator creates and inspects the group, example workers read, charge,
//! ack and dead-letter on the cluster, a worker is SIGKILLed and its entries
//! are recovered, and the status equals what Redis holds.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt as _};
use redis::AsyncCommands as _;
use std::time::Duration;
use streamfleet_crd::{Health, StreamConsumerGroup};
use streamfleet_e2e::*;
use streamfleet_testbed::{RedisCluster, eventually};

const T: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_workers_on_a_redis_cluster_charge_every_order_once() -> Result<()> {
    let f = Fixture::start("e2e-rcluster", &[]).await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    let cluster = RedisCluster::start(3).await?;
    let mut conn = cluster.connection().await?;
    // The pipeline's Secret now names a cluster node.
    create_redis_secret(&client, &ns, "redis", &cluster.urls()[0]).await?;

    let orders = 600;
    let mut poison = 0;
    for i in 0..orders {
        let mut fields = vec![("order_id", i.to_string()), ("amount_cents", (100 + i).to_string())];
        if i % 100 == 42 {
            fields.push(("poison", "1".into()));
            poison += 1;
        }
        let _: String = conn.xadd("orders", "*", &fields).await?;
    }
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 2, maxReplicas: 2, pollIntervalSeconds: 2}\n  recovery: {minIdleTimeMs: 60000, batchSize: 10}";
    let manifest =
        manifest("p", "orders", "billing", "streamfleet/example-worker", &[("EXAMPLE_HANDLER_MS", "5")], spec).replace(
            "    urlSecretRef: {name: redis, key: url}",
            "    urlSecretRef: {name: redis, key: url}\n    mode: Cluster",
        );
    f.apply(&manifest).await?;

    // Kill one worker while the orders flow; the other recovers its entries.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let victim = eventually("a worker holding entries", T, || async {
        let consumers: redis::streams::StreamInfoConsumersReply =
            conn.clone().xinfo_consumers("orders", "billing").await?;
        Ok(consumers.consumers.iter().find(|c| c.pending > 0).map(|c| c.name.clone()))
    })
    .await?;
    // Consumer names are `<pod name>.<pod UID>`.
    let pod = victim.split_once('.').map_or(victim.as_str(), |(pod, _)| pod).to_string();
    sigkill_container(&client, &ns, &pod).await?;

    let expected = orders - poison;
    eventually("every order settled on the cluster", T, || async {
        let mut c = conn.clone();
        let charged: usize = c.hlen("{ledger}:charges").await?;
        let dead: usize = c.xlen("{orders}:dead:billing").await?;
        let pending: redis::streams::StreamPendingReply = c.xpending("orders", "billing").await?;
        Ok((charged == expected && dead == poison && pending.count() == 0).then_some(()))
    })
    .await?;
    let ledger: std::collections::HashMap<String, u64> = conn.hgetall("{ledger}:charges").await?;
    for i in (0..orders).filter(|i| i % 100 != 42) {
        assert_eq!(ledger.get(&i.to_string()), Some(&(100 + u64::try_from(i)?)), "order {i}");
    }

    // The status says what the cluster holds.
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    let status = eventually("status at rest", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        let at_rest = s.lag == Some(0) && s.pending == Some(0) && s.dead_letter_length == Some(poison as i64);
        Ok(at_rest.then_some(s))
    })
    .await?;
    let length: i64 = conn.xlen("orders").await?;
    assert_eq!(status.stream_length, Some(length));
    assert!(matches!(status.health, Some(Health::Healthy | Health::PoisonForming)), "{:?}", status.health);
    let live = pods.list(&ListParams::default().labels("app.kubernetes.io/component=worker")).await?.items;
    // The killed process was restarted in its pod, as a kubelet does.
    let restarts = |p: &Pod| p.status.as_ref()?.container_statuses.as_ref()?.first().map(|s| s.restart_count);
    assert!(live.iter().any(|p| p.name_any() == pod && restarts(p) >= Some(1)), "{pod} not restarted in place");
    Ok(())
}
