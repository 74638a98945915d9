//! Retries on the schedule under the operator, with the example order
//! worker and its ledger standing in for a payment provider: the provider
//! goes down while orders arrive, for less than the schedule's horizon and
//! then for longer. Writes its figures to `target/figures/retries.json`.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use kube::Api;
use redis::AsyncCommands as _;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use streamfleet_crd::{Health, StreamConsumerGroup};
use streamfleet_e2e::*;
use streamfleet_testbed::eventually;

const T: Duration = Duration::from_secs(120);
/// The schedule under test: 1 s, 2 s, 4 s, then 8 s; six deliveries, so
/// five delays of 23 s in all before jitter (up to 20% more each).
const SPEC: &str = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 2, targetPerReplica: 1000, pollIntervalSeconds: 1}\n  recovery: {minIdleTimeMs: 1000, maxDeliveries: 6, batchSize: 50, retry: {backoff: Exponential, initialDelayMs: 1000, maxDelayMs: 8000, jitterPercent: 20}}";
const HORIZON: Duration = Duration::from_secs(23);
const OUTAGE: Duration = Duration::from_secs(12);

async fn produce(conn: &mut redis::aio::MultiplexedConnection, from: usize, to: usize) -> Result<()> {
    for i in from..to {
        let fields = [("order_id", i.to_string()), ("amount_cents", (100 + i).to_string())];
        let _: String = conn.xadd("orders", "*", &fields).await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

async fn attempts_while_down(conn: &mut redis::aio::MultiplexedConnection) -> Result<u64> {
    let down: Option<u64> = conn.hget("{ledger}:faults", "down").await?;
    Ok(down.unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_ridden_out_on_the_schedule_and_a_longer_one_dead_letters_at_its_horizon() -> Result<()> {
    let f = Fixture::start("e2e-retries", &[]).await?;
    let (client, ns, mut conn) = (f.client.clone(), &f.ns, f.conn.clone());
    f.apply(&manifest("orders", "orders", "billing", "streamfleet/example-worker", &[], SPEC)).await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns.name);
    produce(&mut conn, 0, 20).await?;
    eventually("the first orders charged", T, || async {
        Ok((conn.clone().hlen::<_, usize>("{ledger}:charges").await? == 20).then_some(()))
    })
    .await?;

    // 1. The provider is down for 12 s while 200 orders arrive.
    let _: () = conn.set("{ledger}:down", 1).await?;
    let down_at = Instant::now();
    produce(&mut conn, 20, 220).await?;
    let status = eventually("Retrying shown", OUTAGE, || async {
        let s = scgs.get("orders").await?.status.unwrap_or_default();
        Ok(s.retrying.clone().filter(|r| r.entries >= 10 && s.health == Some(Health::Retrying)).map(|_| s))
    })
    .await?;
    let retrying = status.retrying.clone().unwrap();
    assert!(retrying.last_error.as_deref().unwrap_or_default().contains("503"), "{retrying:?}");
    assert!(retrying.next_attempt_time.is_some(), "{retrying:?}");
    assert!(retrying.by_delivery.iter().all(|d| d.deliveries >= 1 && d.entries > 0), "{retrying:?}");
    let table = run_ok(f.bed, "kubectl", &["get", "scg", "orders", "-n", &ns.name], None).await?;
    assert!(table.contains("RETRYING") && table.contains("Retrying"), "{table}");
    let degraded = events_about(&client, &ns.name, "orders").await?.into_iter().find(|e| {
        e.reason.as_deref() == Some("HealthDegraded") && e.note.as_deref().unwrap_or_default().contains("-> Retrying")
    });
    let degraded = match degraded {
        Some(e) => e,
        None => {
            eventually("the Retrying Warning", T, || async {
                Ok(events_about(&client, &ns.name, "orders").await?.into_iter().find(|e| {
                    e.reason.as_deref() == Some("HealthDegraded")
                        && e.note.as_deref().unwrap_or_default().contains("-> Retrying")
                }))
            })
            .await?
        }
    };
    assert!(degraded.note.as_deref().unwrap_or_default().contains("503"), "{degraded:?}");
    tokio::time::sleep(OUTAGE.saturating_sub(down_at.elapsed())).await;
    let _: () = conn.del("{ledger}:down").await?;
    let outage = down_at.elapsed();
    let attempts = attempts_while_down(&mut conn).await?;
    let up_at = Instant::now();
    eventually("every order charged after the outage", T, || async {
        let charged: usize = conn.clone().hlen("{ledger}:charges").await?;
        let pending: redis::streams::StreamPendingReply = conn.clone().xpending("orders", "billing").await?;
        Ok((charged == 220 && pending.count() == 0).then_some(()))
    })
    .await?;
    let drained = up_at.elapsed();
    let dead: usize = conn.xlen("{orders}:dead:billing").await?;
    assert_eq!(dead, 0, "an outage shorter than the horizon dead-letters nothing");
    let duplicates: HashMap<String, i64> = conn.hgetall("{ledger}:duplicates").await?;
    assert!(duplicates.is_empty(), "every order charged once: {duplicates:?}");
    // The schedule's bound: in 12 s an entry gets at most deliveries at 0,
    // 1, 3 and 7 s (and 15 s is past the outage), each tried for at most a
    // quarter of min-idle-time in process (250 ms: four calls at most). The
    // circuit breaker spares most of those calls.
    let bound = 200 * 4 * 4;
    assert!(attempts <= bound, "{attempts} calls to the provider while it was down, bound {bound}");
    // The circuit breaker spares most of them (52 calls where it measured).
    assert!(attempts * 10 <= bound, "{attempts} calls while down: the circuit breaker did not pause them");
    let per_second = attempts as f64 / outage.as_secs_f64();
    let status = eventually("healthy again", T, || async {
        let s = scgs.get("orders").await?.status.unwrap_or_default();
        Ok((s.retrying.as_ref().is_some_and(|r| r.entries == 0) && s.health == Some(Health::Healthy)).then_some(s))
    })
    .await?;
    assert_eq!(status.pending, Some(0));

    // 2. Down for longer than the horizon: 30 orders dead-lettered
    // `retries-exhausted` after six attempts, not before the horizon.
    let _: () = conn.set("{ledger}:down", 1).await?;
    let long_from = Instant::now();
    produce(&mut conn, 220, 250).await?;
    let letters = eventually("30 dead letters", T, || async {
        let letters: redis::streams::StreamRangeReply = conn.clone().xrange_all("{orders}:dead:billing").await?;
        Ok((letters.ids.len() == 30).then_some(letters))
    })
    .await?;
    let long_took = long_from.elapsed();
    let _: () = conn.del("{ledger}:down").await?;
    let mut earliest = Duration::MAX;
    for letter in &letters.ids {
        let field = |k: &str| letter.get::<String>(k).unwrap_or_default();
        assert_eq!(field("streamfleet.reason"), "retries-exhausted", "{letter:?}");
        assert_eq!(field("streamfleet.deliveries"), "6", "{letter:?}");
        assert!(field("streamfleet.error").contains("503"), "{letter:?}");
        // From the order's arrival (its ID's time) to its dead letter.
        let produced: u64 = field("streamfleet.source-id").split('-').next().unwrap().parse()?;
        let at: u64 = field("streamfleet.dead-lettered-at").parse()?;
        earliest = earliest.min(Duration::from_millis(at.saturating_sub(produced)));
    }
    assert!(
        earliest >= HORIZON,
        "a letter written {earliest:?} after its order arrived, before the horizon {HORIZON:?}"
    );
    let charged: usize = conn.hlen("{ledger}:charges").await?;
    assert_eq!(charged, 220, "none of the 30 was charged");

    streamfleet_testbed::write_figure(
        "retries",
        &serde_json::json!({
            "what": "The example worker's payment provider down while orders arrive (e2e `retries`): calls to it while down, dead letters, and the time to drain once it is back",
            "settings": {"minIdleTimeMs": 1000, "maxDeliveries": 6, "backoff": "Exponential", "initialDelayMs": 1000, "maxDelayMs": 8000, "jitterPercent": 20, "workers": 1, "batchSize": 50},
            "columns": ["outage", "orders during it", "calls to the provider while down (per second)", "the schedule's bound without the circuit breaker", "dead letters", "after it: all charged within (s)"],
            "rows": [
                [format!("{:.1} s (horizon {} s)", outage.as_secs_f64(), HORIZON.as_secs()), 200, format!("{attempts} ({per_second:.1}/s)"), format!("{bound} ({:.1}/s)", bound as f64 / outage.as_secs_f64()), 0, format!("{:.1}", drained.as_secs_f64())],
                [format!("{:.1} s", long_took.as_secs_f64()), 30, "-", "-", format!("30 retries-exhausted, the first {:.1} s after its order arrived", earliest.as_secs_f64()), "-"],
            ],
            "summary": format!("An outage shorter than the horizon: 0 dead letters, every order charged once, {per_second:.1} calls per second to the provider while it was down (the circuit breaker open). Longer: dead-lettered after 6 attempts, none before the horizon."),
        }),
    )?;
    Ok(())
}
