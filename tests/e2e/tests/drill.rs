//! The crash drill: 10,000 orders (DRILL_ORDERS) through the example
//! pipeline while workers crash between charge and ack, are SIGKILLed from
//! outside, hit transient gateway failures, and one slow but alive worker
//! shares the group; 1% of orders are poison; and an outside `XTRIM` deletes
//! the payloads of entries pending in a vanished consumer's hands. At the end
//! every other order is charged exactly once, every entry is acked or
//! dead-lettered, each poison order is a dead letter with its metadata, the
//! status counts exactly the trimmed pending entries as lost, the PEL is
//! empty, and every injected fault is shown to have happened.
//!
//! By hand: `cargo test -p streamfleet-e2e --test drill -- --nocapture`.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, ResourceExt as _};
use rand::Rng as _;
use redis::AsyncCommands as _;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use streamfleet_e2e::*;
use streamfleet_streams::deadletter as dl;
use streamfleet_testbed::eventually;

const MIN_IDLE_MS: u64 = 3000;
/// Pending entries whose payloads the outside trim deletes.
const TRIMMED: usize = 25;

fn pipeline(guard: bool) -> String {
    let spec = format!(
        "  startId: \"0\"\n  scaling: {{minReplicas: 3, maxReplicas: 3, pollIntervalSeconds: 2}}\n  recovery: {{minIdleTimeMs: {MIN_IDLE_MS}, maxDeliveries: 4, batchSize: 50}}"
    );
    manifest(
        "orders",
        "orders",
        "billing",
        "streamfleet/example-worker",
        &[
            ("EXAMPLE_TRANSIENT_PERCENT", "3"),
            ("EXAMPLE_CRASH_PERCENT", "0.1"),
            ("EXAMPLE_GUARD", if guard { "on" } else { "off" }),
        ],
        &spec,
    )
}

/// A worker outside the operator's Deployment, in the same group: slow, but
/// alive, holding at most two entries for well under min-idle-time.
fn slow_worker(redis_url: &str, guard: bool) -> Result<Deployment> {
    let env: Vec<serde_json::Value> = [
        ("STREAMFLEET_REDIS_URL", redis_url.to_string()),
        ("STREAMFLEET_STREAMS", "orders".into()),
        ("STREAMFLEET_GROUP", "billing".into()),
        ("STREAMFLEET_MIN_IDLE_MS", MIN_IDLE_MS.to_string()),
        ("STREAMFLEET_MAX_DELIVERIES", "4".into()),
        ("STREAMFLEET_DEAD_LETTER_STREAM", "{orders}:dead".into()),
        ("STREAMFLEET_BATCH_SIZE", "2".into()),
        ("EXAMPLE_HANDLER_MS", "400".into()),
        ("EXAMPLE_GUARD", if guard { "on" } else { "off" }.into()),
    ]
    .into_iter()
    .map(|(k, v)| serde_json::json!({"name": k, "value": v}))
    .chain([
        serde_json::json!({"name": "STREAMFLEET_CONSUMER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
    ])
    .collect();
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {"name": "slow-worker"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "slow-worker"}},
            "template": {
                "metadata": {"labels": {"app": "slow-worker"}},
                "spec": {"containers": [{"name": "worker", "image": "streamfleet/example-worker", "env": env}]}
            }
        }
    }))?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_drill_every_order_charged_exactly_once() -> Result<()> {
    drill("e2e-drill", true).await
}

/// The same drill without the idempotency guard: the ledger's own
/// idempotency (one charge per order) alone keeps every order charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_drill_without_the_guard_the_handlers_idempotency_holds_alone() -> Result<()> {
    drill("e2e-drill-noguard", false).await
}

async fn drill(namespace: &str, guard: bool) -> Result<()> {
    let orders: usize = std::env::var("DRILL_ORDERS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
    let f = Fixture::start(namespace, &[]).await?;
    let (client, ns, mut conn) = (f.client.clone(), &f.ns, f.conn.clone());
    streamfleet_streams::ensure_group(&mut conn, "orders", "billing", "0").await?;

    // 1% poison, spread through the stream.
    let started = Instant::now();
    let mut poison = Vec::new();
    let mut ids: Vec<String> = Vec::new();
    for chunk in (0..orders).collect::<Vec<_>>().chunks(1000) {
        let mut pipe = redis::pipe();
        for &i in chunk {
            pipe.cmd("XADD").arg("orders").arg("*").arg("order_id").arg(i).arg("amount_cents").arg(100 + i);
            if i % 100 == 42 {
                pipe.arg("poison").arg("1");
                poison.push(i.to_string());
            }
        }
        ids.extend(pipe.query_async::<Vec<String>>(&mut conn).await?);
    }
    // A consumer outside the pipeline takes the first orders and vanishes;
    // then an outside trim deletes exactly those pending entries' payloads.
    let opts = redis::streams::StreamReadOptions::default().group("billing", "vanished").count(TRIMMED);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let trimmed: u64 = redis::cmd("XTRIM").arg("orders").arg("MINID").arg(&ids[TRIMMED]).query_async(&mut conn).await?;
    assert_eq!(trimmed, TRIMMED as u64, "the trim deleted exactly the vanished consumer's pending entries");
    let lost_orders: Vec<String> = (0..TRIMMED).map(|i| i.to_string()).collect();

    f.apply(&pipeline(guard)).await?;
    Api::<Deployment>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &slow_worker(&f.redis.url(), guard)?)
        .await?;
    wait_condition(&client, &ns.name, "orders", "Ready", "True", None, Duration::from_secs(120)).await?;

    // SIGKILL random workers from outside while they work; note what each
    // held and how much of it was charged but not yet acked.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let (mut kills, mut held_at_kill, mut charged_unacked_at_kill) = (0, 0, 0);
    let mut killed_consumers: Vec<String> = Vec::new();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let workers = pods.list(&ListParams::default().labels("app.kubernetes.io/component=worker")).await?.items;
        // Consumer names are `<pod name>.<pod UID>`.
        let running: Vec<(String, String)> = workers
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| (p.name_any(), format!("{}.{}", p.name_any(), p.metadata.uid.clone().unwrap_or_default())))
            .collect();
        if running.is_empty() {
            continue;
        }
        let (victim, victim_consumer) = &running[rand::rng().random_range(0..running.len())];
        // One atomic look right before the kill: what it holds, and how much
        // of that is already charged but not acked.
        let (held, charged_unacked): (usize, usize) = redis::Script::new(
            r"
            local held = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000, ARGV[2])
            local charged = 0
            for _, p in ipairs(held) do
                local e = redis.call('XRANGE', KEYS[1], p[1], p[1])[1]
                if e then
                    for i = 1, #e[2], 2 do
                        if e[2][i] == 'order_id' and redis.call('HEXISTS', KEYS[2], e[2][i + 1]) == 1 then
                            charged = charged + 1
                        end
                    end
                end
            end
            return {#held, charged}",
        )
        .key("orders")
        .key("{ledger}:charges")
        .arg("billing")
        .arg(victim_consumer)
        .invoke_async(&mut conn)
        .await?;
        charged_unacked_at_kill += charged_unacked;
        pods.delete(victim, &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() }).await?;
        kills += 1;
        held_at_kill += held;
        killed_consumers.push(victim_consumer.clone());
    }

    let expected = orders - poison.len() - TRIMMED;
    let settled = eventually("every order settled", Duration::from_secs(600), || async {
        let mut c = conn.clone();
        let charged: usize = c.hlen("{ledger}:charges").await?;
        let dead: usize = c.xlen("{orders}:dead").await?;
        let dead = dead.saturating_sub(TRIMMED);
        let pending: redis::streams::StreamPendingReply = c.xpending("orders", "billing").await?;
        Ok((charged == expected && dead == poison.len() && pending.count() == 0).then_some(()))
    })
    .await;
    let charged: usize = conn.hlen("{ledger}:charges").await?;
    let dead: usize = conn.xlen("{orders}:dead").await?;
    let dead = dead.saturating_sub(TRIMMED);
    let pending: redis::streams::StreamPendingReply = conn.xpending("orders", "billing").await?;
    settled
        .map_err(|e| e.context(format!("charged {charged}/{expected}, dead {dead}, pending {}", pending.count())))?;

    // Exactly once in the ledger: every order, the right amount, no extras.
    let ledger: HashMap<String, u64> = conn.hgetall("{ledger}:charges").await?;
    for i in (TRIMMED..orders).filter(|i| i % 100 != 42) {
        assert_eq!(ledger.get(&i.to_string()), Some(&(100 + u64::try_from(i)?)), "order {i}");
    }
    for order in &lost_orders {
        assert!(!ledger.contains_key(order), "order {order} had no payload left to charge");
    }
    assert_eq!(ledger.len(), expected);
    // Every entry acked or dead-lettered: nothing pending, nothing undelivered.
    let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups("orders").await?;
    assert_eq!((info.groups[0].pending, info.groups[0].lag), (0, Some(0)));
    // Each poison order is a dead letter with its metadata.
    let letters: redis::streams::StreamRangeReply = conn.xrange_all("{orders}:dead").await?;
    let mut dead_keys = Vec::new();
    let mut payload_missing = Vec::new();
    for e in letters.ids {
        let f: HashMap<String, String> = streamfleet_streams::entry::fields_from_map(e.map)
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
            .collect();
        assert_eq!(f[dl::F_SOURCE_STREAM], "orders");
        assert_eq!(f[dl::F_GROUP], "billing");
        assert!(!f[dl::F_SOURCE_ID].is_empty() && !f[dl::F_CONSUMER].is_empty() && !f[dl::F_AT].is_empty());
        if f[dl::F_REASON] == "payload-missing" {
            payload_missing.push(f[dl::F_SOURCE_ID].clone());
            continue;
        }
        assert_eq!(f[dl::F_REASON], "permanent", "{f:?}");
        assert!(f[dl::F_ERROR].contains("card declined"));
        assert_eq!(f["poison"], "1");
        assert_eq!(f[dl::F_BUSINESS_KEY], f["order_id"]);
        dead_keys.push(f["order_id"].clone());
    }
    payload_missing.sort();
    let mut trimmed_ids = ids[..TRIMMED].to_vec();
    trimmed_ids.sort();
    assert_eq!(payload_missing, trimmed_ids, "each trimmed pending entry is on record as payload-missing");
    // The resource says exactly how much was lost.
    let scgs: Api<streamfleet_crd::StreamConsumerGroup> = Api::namespaced(client.clone(), &ns.name);
    let status = eventually("payloadLost in status", Duration::from_secs(60), || async {
        let s = scgs.get("orders").await?.status.unwrap_or_default();
        Ok(s.payload_lost.clone().filter(|p| p.total > 0).map(|p| (p, s.health)))
    })
    .await?;
    assert_eq!(status.0.total, TRIMMED as i64, "payload-lost total is exactly the trimmed pending entries");
    assert_eq!(status.1, Some(streamfleet_crd::Health::PayloadLost));
    dead_keys.sort();
    poison.sort();
    assert_eq!(dead_keys, poison);

    // Every injected fault happened, and redeliveries were absorbed: by the
    // guard (suppressed) or refused by the ledger as a second charge.
    let faults: HashMap<String, u64> = conn.hgetall("{ledger}:faults").await?;
    let by_consumer: HashMap<String, u64> = conn.hgetall("{ledger}:by-consumer").await?;
    let slow_charges: u64 = by_consumer.iter().filter(|(c, _)| c.starts_with("slow-worker-")).map(|(_, n)| n).sum();
    let suppressed: Option<u64> = conn.get(streamfleet_worker::guard::suppressed_key("orders", "billing")).await?;
    let refused: HashMap<String, u64> = conn.hgetall("{ledger}:duplicates").await?;
    // Each repeated charge attempt is explained by a death between the first
    // charge and its ack (the first charger was SIGKILLed or crashed), or it
    // is a second effect that got through the guard while the first holder
    // lived: those must be none.
    let charged_by: HashMap<String, String> = conn.hgetall("{ledger}:charged-by").await?;
    let crashed: Vec<String> = conn.smembers("{ledger}:crashed-consumers").await?;
    let died = |consumer: &str| killed_consumers.iter().chain(&crashed).any(|c| c == consumer);
    let second_effects: Vec<(&String, Option<&String>)> = refused
        .keys()
        .map(|order| (order, charged_by.get(order)))
        .filter(|(_, by)| !by.is_some_and(|c| died(c)))
        .collect();
    println!(
        "drill (guard {}): {orders} orders ({} poison, {TRIMMED} trimmed while pending) settled in {:?}; {kills} workers SIGKILLed \
         holding {held_at_kill} entries ({charged_unacked_at_kill} charged, not acked); crashes after the charge: {}; \
         transient failures: {}; charged by the slow worker: {slow_charges}; duplicates suppressed by the guard: {}; \
         duplicate deliveries absorbed by the ledger: {} (all after their first charger died); repeats while the first \
         charger lived (second effects): {}",
        if guard { "on" } else { "off" },
        poison.len(),
        started.elapsed(),
        faults.get("crash").copied().unwrap_or(0),
        faults.get("transient").copied().unwrap_or(0),
        suppressed.unwrap_or(0),
        refused.values().sum::<u64>(),
        second_effects.len()
    );
    assert!(second_effects.is_empty(), "charged again while the first charger lived: {second_effects:?}");
    assert_eq!(kills, 5, "every SIGKILL landed on a running worker");
    assert!(held_at_kill > 0, "no SIGKILL caught a worker holding entries");
    assert!(charged_unacked_at_kill > 0, "no SIGKILL landed between a charge and its ack");
    assert!(faults.get("crash").copied().unwrap_or(0) > 0, "no crash between charge and ack happened");
    assert!(faults.get("transient").copied().unwrap_or(0) > 0, "no transient failure happened");
    assert!(slow_charges > 0, "the slow worker took no part");
    assert!(suppressed.unwrap_or(0) + refused.values().sum::<u64>() > 0, "the drill caused no redelivery at all");
    Ok(())
}
