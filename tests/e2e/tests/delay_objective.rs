//! Scaling on a delay objective through a 10× arrival ramp: orders arrive at
//! a steady rate, then ten times as fast, then steady again, into a pipeline
//! whose handler takes 200 ms (two at once per pod: about 10 orders per
//! second per replica) with `delayObjectiveSeconds: 20`. The delay is
//! measured from Redis itself every second (its `TIME` against the oldest
//! unfinished entry's ID), beside what the status says and the replicas.
//! Writes `target/figures/delay-objective.json`.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use kube::Api;
use redis::AsyncCommands as _;
use std::time::{Duration, Instant};
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_e2e::*;
use streamfleet_testbed::eventually;

const OBJECTIVE_S: u64 = 20;
const MAX_REPLICAS: i32 = 8;
/// (seconds, orders per second) of the arrival curve.
const CURVE: [(u64, u64); 3] = [(30, 6), (40, 60), (60, 6)];

fn pipeline() -> String {
    format!(
        r#"apiVersion: streamfleet.io/v1alpha1
kind: StreamConsumerGroup
metadata:
  name: orders
spec:
  redis:
    urlSecretRef: {{name: redis, key: url}}
  stream: orders
  group: billing
  startId: "0"
  scaling: {{minReplicas: 1, maxReplicas: {MAX_REPLICAS}, delayObjectiveSeconds: {OBJECTIVE_S}, pollIntervalSeconds: 2, scaleDownStabilizationSeconds: 20}}
  recovery: {{minIdleTimeMs: 10000, batchSize: 10}}
  worker:
    concurrency: 2
    template:
      spec:
        terminationGracePeriodSeconds: 5
        containers:
          - name: worker
            image: streamfleet/example-worker
            env:
              - {{name: RUST_LOG, value: info}}
              - {{name: EXAMPLE_HANDLER_MS, value: "200"}}
"#
    )
}

/// Redis `TIME` and the delay as Redis tells it: `TIME` less the ID time
/// of the oldest unfinished entry (the oldest pending, or else the first
/// after the group's last delivered ID), in milliseconds.
async fn true_delay_ms(conn: &mut redis::aio::MultiplexedConnection) -> Result<(u64, u64)> {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    let now = secs * 1000 + micros / 1000;
    let pending: redis::streams::StreamPendingReply = conn.xpending("orders", "billing").await?;
    let groups: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups("orders").await?;
    let after: redis::streams::StreamRangeReply =
        conn.xrange_count("orders", format!("({}", groups.groups[0].last_delivered_id), "+", 1).await?;
    let ms = |id: &str| id.split('-').next().and_then(|ms| ms.parse::<u64>().ok());
    let oldest = match &pending {
        redis::streams::StreamPendingReply::Data(d) => ms(&d.start_id),
        _ => None,
    };
    let oldest = [oldest, after.ids.first().and_then(|e| ms(&e.id))].into_iter().flatten().min();
    Ok((now, oldest.map_or(0, |at| now.saturating_sub(at))))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenfold_ramp_is_brought_back_under_the_delay_objective_and_replicas_come_back_down() -> Result<()> {
    let f = Fixture::start("e2e-objective", &[]).await?;
    let (client, ns, mut conn) = (f.client.clone(), f.ns.name.clone(), f.conn.clone());
    f.apply(&pipeline()).await?;
    wait_condition(&client, &ns, "orders", "Ready", "True", None, Duration::from_secs(120)).await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);

    // The producer: the curve, paced by the clock.
    let producer = {
        let mut conn = f.redis.connection().await?;
        tokio::spawn(async move {
            let started = Instant::now();
            let (mut sent, mut phase_start) = (0u64, 0.0);
            for (seconds, rate) in CURVE {
                let phase_sent = sent;
                while started.elapsed().as_secs_f64() < phase_start + seconds as f64 {
                    let due = phase_start + (sent - phase_sent + 1) as f64 / rate as f64;
                    tokio::time::sleep(Duration::from_secs_f64(due).saturating_sub(started.elapsed())).await;
                    let fields = [("order_id", sent.to_string()), ("amount_cents", "100".to_string())];
                    let _: String = conn.xadd("orders", "*", &fields).await?;
                    sent += 1;
                }
                phase_start += seconds as f64;
            }
            anyhow::Ok(sent)
        })
    };

    // One sample a second: (s since the start, true delay s, the status's
    // delay s (Redis TIME less its oldest unfinished time), desired, available).
    let started = Instant::now();
    let ramp = (CURVE[0].0, CURVE[0].0 + CURVE[1].0);
    let total: u64 = CURVE.iter().map(|(s, _)| s).sum();
    let mut samples: Vec<(f64, f64, Option<f64>, i32, i32)> = Vec::new();
    while started.elapsed() < Duration::from_secs(total + 60) {
        let (now_ms, truth) = true_delay_ms(&mut conn).await?;
        let truth = truth as f64 / 1000.0;
        let s = scgs.get("orders").await?.status.unwrap_or_default();
        let shown = match &s.oldest_unfinished_time {
            Some(t) => Some((now_ms as f64 / 1000.0 - t.0.as_second() as f64).max(0.0)),
            // Nothing unfinished, as of the last poll.
            None if s.pending.is_some() => Some(0.0),
            None => None,
        };
        let (desired, current) = s.replicas.map_or((0, 0), |r| (r.desired, r.current));
        samples.push((started.elapsed().as_secs_f64(), truth, shown, desired, current));
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(Duration::from_millis(50))).await;
    }
    let sent = producer.await??;
    eventually("every order charged", Duration::from_secs(120), || async {
        let charged: u64 = conn.clone().hlen("{ledger}:charges").await?;
        Ok((charged == sent).then_some(()))
    })
    .await?;
    let repeats: u64 = conn.hlen("{ledger}:duplicates").await?;
    // Deliveries after the first: no fault is injected here, so any comes
    // from a scale-down interrupting a pod that held entries.
    let redelivered: Option<u64> = conn.hget("{ledger}:faults", "redelivered").await?;
    let redelivered = redelivered.unwrap_or(0);

    // The headline: how long the delay stayed under the objective, and how
    // soon after the ramp began it was back under for good.
    let objective = OBJECTIVE_S as f64;
    let under = samples.iter().filter(|s| s.1 <= objective).count() as f64 / samples.len() as f64;
    let peak = samples.iter().map(|s| s.1).fold(0.0, f64::max);
    let last_over = samples.iter().filter(|s| s.1 > objective).map(|s| s.0).fold(None, |_, t| Some(t));
    let back_under = last_over.map_or(0.0, |t| (t - ramp.0 as f64).max(0.0));
    let most = samples.iter().map(|s| s.3).max().unwrap_or(0);
    let end = samples.last().map_or(0, |s| s.3);
    // The status's delay tracks the truth: within two polls and a write
    // (its time is a second's floor, and a poll old).
    let off: Vec<_> = samples
        .iter()
        .filter_map(|s| s.2.map(|d| (s.0, s.1, d)))
        .filter(|(_, truth, shown)| (shown - truth).abs() > 2.0 * 2.0 + 2.0)
        .collect();
    println!(
        "delay objective {OBJECTIVE_S}s, ramp {}→{}/s for {}s: {sent} orders; delay under the objective {:.0}% of \
         the time, peak {peak:.1}s, back under {back_under:.0}s after the ramp began; replicas up to {most}, {end} at \
         the end; repeats absorbed {repeats}; redelivered {redelivered}",
        CURVE[0].1,
        CURVE[1].1,
        CURVE[1].0,
        under * 100.0
    );
    assert!(off.is_empty(), "status delay far from Redis's: {off:?}");
    assert!(most > 2, "never scaled up: {samples:?}");
    assert!(back_under <= 90.0, "delay over the objective until {back_under}s after the ramp began");
    assert!(end <= 2, "replicas not back down: {end}");
    // Scale-in never interrupts work: a pod told to stop finishes what it
    // started and hands back the rest with its delivery uncounted.
    assert_eq!(redelivered, 0, "deliveries after the first, with no fault injected: from scale-downs");
    // The objective sized the fleet, not the entry count.
    let events = events_about(&client, &ns, "orders").await?;
    let by_objective = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Scaled"))
        .filter_map(|e| e.note.clone())
        .find(|note| note.contains(&format!("(objective {OBJECTIVE_S}s)")));
    assert!(by_objective.is_some(), "no Scaled Event from the objective: {events:?}");
    // The pods left were priced before the last scale-down.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
    let workers = pods.list(&kube::api::ListParams::default().labels("app.kubernetes.io/component=worker")).await?;
    let priced = workers.items.iter().filter(|p| {
        p.metadata.annotations.as_ref().is_some_and(|a| a.contains_key("controller.kubernetes.io/pod-deletion-cost"))
    });
    assert!(priced.count() >= 1, "no pod-deletion-cost on the pods left");
    let tenth = |v: f64| (v * 10.0).round() / 10.0;
    let series: Vec<_> = samples.iter().map(|s| (tenth(s.0), tenth(s.1), s.2.map(tenth), s.3, s.4)).collect();
    streamfleet_testbed::write_figure(
        "delay-objective",
        &serde_json::json!({
            "what": "A 10× arrival ramp through a pipeline scaled on a delay objective (e2e `delay_objective`): the delay measured from Redis every second, and the replicas",
            "settings": {"delayObjectiveSeconds": OBJECTIVE_S, "maxReplicas": MAX_REPLICAS, "handler": "200 ms, 2 at once per pod", "batchSize": 10, "pollIntervalSeconds": 2, "scaleDownStabilizationSeconds": 20, "curve": CURVE.iter().map(|(s, r)| format!("{r}/s for {s}s")).collect::<Vec<_>>()},
            "columns": ["orders", "delay under the objective (share of seconds)", "peak delay (s)", "back under for good, after the ramp began (s)", "most replicas", "replicas at the end", "redelivered (scale-down)", "repeats absorbed"],
            "rows": [[sent, format!("{:.0}%", under * 100.0), format!("{peak:.1}"), last_over.map_or_else(|| "never over".to_string(), |_| format!("{back_under:.0}")), most, end, redelivered, repeats]],
            "series": {"columns": ["s", "delay (s, from Redis)", "delay in status (s)", "replicas desired", "replicas available"], "rows": series},
            "summary": format!("Delay under the {OBJECTIVE_S} s objective {:.0}% of the time through a {}→{}/s ramp; {}; {most} replicas at most, {end} at the end.", under * 100.0, CURVE[0].1, CURVE[1].1, last_over.map_or_else(|| "never over it".to_string(), |_| format!("back under {back_under:.0} s after it began"))),
        }),
    )?;
    Ok(())
}
