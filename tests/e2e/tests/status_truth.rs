//! The status tells the truth when things go wrong: payloads lost under the
//! workers' feet read `PayloadLost` until acknowledged; a Redis outage reads
//! `Unknown` with its figures cleared, then heals within a poll; an owned
//! object the API server refuses is a condition with its message while
//! health is still reported. And when things go right: the delay against
//! Redis's clock, entries in and out per second against what was produced.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use kube::Api;
use kube::api::{Patch, PatchParams};
use redis::AsyncCommands as _;
use std::time::{Duration, Instant};
use streamfleet_crd::{Health, PAYLOAD_LOST_ACKNOWLEDGED, StreamConsumerGroup};
use streamfleet_e2e::*;
use streamfleet_testbed::eventually;

const T: Duration = Duration::from_secs(120);

/// The value of metric `name` for resource `p` (labelled namespace, name,
/// stream, group), if any.
fn metric(body: &str, name: &str, namespace: &str) -> Option<String> {
    let labels = format!("{name}{{namespace=\"{namespace}\",name=\"p\",stream=\"orders\",group=\"billing\"}}");
    body.lines().find_map(|l| l.strip_prefix(&labels)).map(|v| v.trim().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_trimmed_under_the_workers_read_payload_lost_until_acknowledged() -> Result<()> {
    let f = Fixture::start("e2e-lost", &[]).await?;
    let (client, ns, mut conn) = (f.client.clone(), &f.ns, f.conn.clone());
    streamfleet_streams::ensure_group(&mut conn, "orders", "billing", "0").await?;
    // 50 orders read by a consumer that is no pod of the pipeline (never
    // reaped) and never acked; then an outside trim deletes their payloads.
    let mut pipe = redis::pipe();
    for i in 0..50 {
        pipe.cmd("XADD").arg("orders").arg("*").arg("order_id").arg(i).arg("amount_cents").arg(100).ignore();
    }
    let () = pipe.query_async(&mut conn).await?;
    let opts = redis::streams::StreamReadOptions::default().group("billing", "ghost").count(50);
    let _: redis::streams::StreamReadReply =
        redis::AsyncCommands::xread_options(&mut conn, &["orders"], &[">"], &opts).await?;
    let _: u64 = redis::cmd("XTRIM").arg("orders").arg("MAXLEN").arg(0).query_async(&mut conn).await?;

    // Example workers: their claim loops meet the 50 deleted entries.
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 1}\n  recovery: {schedule: \"0 0 1 1 *\", minIdleTimeMs: 1000}";
    f.apply(&manifest("p", "orders", "billing", "streamfleet/example-worker", &[], spec)).await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns.name);
    let status = eventually("PayloadLost with 50 lost", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        let lost = s.payload_lost.as_ref().is_some_and(|p| p.total == 50 && p.unacknowledged == 50);
        // Figures of one poll are read a moment apart: wait for both to settle.
        let recorded = s.dead_letter_length == Some(50);
        Ok((lost && recorded && s.health == Some(Health::PayloadLost)).then_some(s))
    })
    .await?;
    assert_eq!(status.pending, Some(0), "the lost entries left the PEL");
    assert_eq!(status.payload_lost.unwrap().latest_ids.len(), 5);
    // One Warning per growth of the record, each with its own figures; the
    // newest names the whole loss.
    let events = events_about(&client, &ns.name, "p").await?;
    let mut lost: Vec<_> = events.iter().filter(|e| e.reason.as_deref() == Some("PayloadLost")).collect();
    lost.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
    let newest = lost.last().expect("a PayloadLost Event");
    assert_eq!(newest.type_.as_deref(), Some("Warning"));
    let note = newest.note.clone().unwrap_or_default();
    assert!(note.contains("(50 in all, 50 not acknowledged)"), "{note}");
    let body = operator_http(&client, &ns.name, "/metrics").await?;
    assert_eq!(metric(&body, "streamfleet_payload_lost_unacknowledged", &ns.name).as_deref(), Some("50"), "{body}");

    // The user acknowledges what they have dealt with: healthy again.
    let ack = serde_json::json!({"metadata": {"annotations": {PAYLOAD_LOST_ACKNOWLEDGED: "50"}}});
    scgs.patch("p", &PatchParams::default(), &Patch::Merge(&ack)).await?;
    eventually("Healthy after acknowledgement", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        Ok((s.health == Some(Health::Healthy)).then_some(()))
    })
    .await?;
    assert!(event_count(&client, &ns.name, "p", "Healthy").await? >= 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_reads_unknown_with_figures_cleared_then_heals() -> Result<()> {
    let mut f = Fixture::start("e2e-outage", &[]).await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    let records = tempfile::tempdir()?;
    let poll: u64 = 2;
    let spec = format!("  scaling: {{minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: {poll}}}");
    f.apply(&recording_manifest("p", "orders", "billing", &records.path().display().to_string(), &spec)).await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    eventually("Healthy with figures", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        Ok((s.health == Some(Health::Healthy) && s.lag == Some(0)).then_some(()))
    })
    .await?;
    // Two orders in the hands of a consumer outside the pipeline, unacked.
    let mut conn = f.redis.connection().await?;
    let first: String = conn.xadd("orders", "*", &[("order_id", "1")]).await?;
    let _: String = conn.xadd("orders", "*", &[("order_id", "2")]).await?;
    let opts = redis::streams::StreamReadOptions::default().group("billing", "elsewhere").count(2);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let (ms, seq) = first.split_once('-').unwrap();
    let (ms, seq): (u64, u64) = (ms.parse()?, seq.parse()?);
    let before_first = if seq > 0 { format!("{ms}-{}", seq - 1) } else { format!("{}-{}", ms - 1, u64::MAX) };
    eventually("resume point before the oldest pending entry", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        Ok((s.resume_id.as_deref() == Some(before_first.as_str()) && s.pending == Some(2)).then_some(()))
    })
    .await?;
    // The delay: the status names when the oldest unfinished entry (that
    // one) was added, to the second; /metrics its age against Redis TIME.
    let oldest = scgs.get("p").await?.status.and_then(|s| s.oldest_unfinished_time).map(|t| t.0.as_second());
    assert_eq!(oldest, Some(i64::try_from(ms / 1000)?), "the oldest unfinished entry's time");
    // Every reading of the gauge is at most a poll or two (and a loaded
    // machine's 3 s) older than Redis's clock, never ahead of it; it must
    // come to show the entry's age past 2 s.
    eventually("streamfleet_delay_seconds past 2 s and true to Redis TIME", T, || async {
        let body = operator_http(&client, &ns, "/metrics").await?;
        let mut conn = f.redis.connection().await?;
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
        let true_delay = (secs * 1000 + micros / 1000 - ms) as f64 / 1000.0;
        let gauge = metric(&body, "streamfleet_delay_seconds", &ns).and_then(|v| v.parse::<f64>().ok());
        if let Some(d) = gauge {
            assert!(
                (true_delay - 2.0 * poll as f64 - 3.0..=true_delay).contains(&d),
                "streamfleet_delay_seconds {d}, truth {true_delay:.3} s"
            );
        }
        Ok(gauge.is_some_and(|d| d > 2.0).then_some(()))
    })
    .await?;
    let table = run_ok(f.bed, "kubectl", &["get", "scg", "p", "-n", &ns], None).await?;
    assert!(table.lines().next().is_some_and(|h| h.contains("DELAY")), "{table}");
    // `-o wide` shows how long the oldest pending entry has been idle as an
    // age (`5s`, `2m3s`), from the time it went idle, not raw milliseconds.
    let since = scgs.get("p").await?.status.and_then(|s| s.oldest_pending_idle_since).map(|t| t.0.as_second());
    assert!(since.is_some_and(|t| t >= i64::try_from(ms / 1000).unwrap_or(0) - 1), "oldestPendingIdleSince {since:?}");
    let wide = run_ok(f.bed, "kubectl", &["get", "scg", "p", "-n", &ns, "-o", "wide"], None).await?;
    let (header, row) = (wide.lines().next().unwrap_or_default(), wide.lines().nth(1).unwrap_or_default());
    let at = header.find("OLDEST").expect("an OLDEST column");
    let age = row.get(at..).unwrap_or_default().split_whitespace().next().unwrap_or_default();
    // (Digits with units, ending in one: raw seconds would be digits alone.)
    let is_age = age.chars().next().is_some_and(|c| c.is_ascii_digit())
        && age.chars().all(|c| c.is_ascii_digit() || "smhdy".contains(c))
        && age.ends_with(|c: char| "smhdy".contains(c));
    assert!(is_age, "OLDEST is {age:?}: {wide}");

    f.redis.stop();
    let stopped = Instant::now();
    let status = eventually("Unknown", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        Ok((s.health == Some(Health::Unknown)).then_some(s))
    })
    .await?;
    let took = stopped.elapsed();
    println!("health Unknown {:.1}s after Redis stopped (poll {poll}s)", took.as_secs_f64());
    assert!(took < Duration::from_secs(2 * poll + 2), "Unknown only after {took:?}");
    assert_eq!(
        (
            status.lag,
            status.pending,
            status.stream_length,
            status.consumers,
            status.payload_lost,
            status.oldest_unfinished_time
        ),
        (None, None, None, None, None, None),
        "figures cleared, never the last good value"
    );
    let degraded = status.conditions.iter().find(|c| c.type_ == "Degraded").unwrap();
    assert_eq!((degraded.status.as_str(), degraded.reason.as_str()), ("True", "GroupNotInspected"));
    let ready = status.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "RedisUnreachable"), "{ready:?}");
    let body = operator_http(&client, &ns, "/metrics").await?;
    assert_eq!(metric(&body, "streamfleet_group_lag", &ns), None, "no stale lag in /metrics: {body}");
    assert_eq!(metric(&body, "streamfleet_delay_seconds", &ns), None, "no stale delay in /metrics: {body}");
    let unknown = format!(
        "streamfleet_health{{namespace=\"{ns}\",name=\"p\",stream=\"orders\",group=\"billing\",health=\"Unknown\"}} 1"
    );
    assert!(body.contains(&unknown), "{body}");

    // Back (empty: nothing was persisted): the group is created again where
    // it was (never at `$`), with a Warning, and reads healthy.
    // Polled at the resource's pace through the outage, not an error
    // backoff grown with it: back within a poll of Redis.
    tokio::time::sleep(Duration::from_secs(20)).await;
    f.redis.restart().await?;
    let restarted = Instant::now();
    eventually("Healthy and Ready again", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        let ready = s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
        Ok((ready && s.health == Some(Health::Healthy) && s.lag == Some(0)).then_some(()))
    })
    .await?;
    let back = restarted.elapsed();
    println!("healthy again {:.1}s after Redis came back (poll {poll}s, down 20 s)", back.as_secs_f64());
    // Within a poll or two (a reconcile may be under way), never the grown
    // backoff of the outage (37 s before the fix).
    assert!(back < Duration::from_secs(2 * poll + 3), "status back only after {back:?}");
    assert_eq!(event_count(&client, &ns, "p", "GroupRecreated").await?, 1, "the group was created again, once");
    let mut conn = f.redis.connection().await?;
    let groups: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups("orders").await?;
    assert_eq!(groups.groups[0].last_delivered_id, before_first, "recreated before the entries that were pending");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_cronjob_is_a_condition_with_the_api_message_and_health_is_still_reported() -> Result<()> {
    let f = Fixture::start("e2e-refused", &[]).await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    let records = tempfile::tempdir()?;
    // Admission checks five fields and the minute and hour ranges; day of
    // month 0 does not exist: the API server refuses the CronJob.
    let spec =
        "  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 1}\n  recovery: {schedule: \"0 0 0 * *\"}";
    f.apply(&recording_manifest("p", "orders", "billing", &records.path().display().to_string(), spec)).await?;
    let scg = wait_condition(&client, &ns, "p", "Ready", "False", Some("CronJobRefused"), T).await?;
    let status = scg.status.unwrap();
    let ready = status.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert!(ready.message.contains("0 0 0 * *") && ready.message.contains("schedule"), "{}", ready.message);
    assert!(status.conditions.iter().any(|c| c.type_ == "GroupReady" && c.status == "True"));
    assert_eq!((status.health, status.lag, status.pending), (Some(Health::Healthy), Some(0), Some(0)));
    // The status is written before the Event is published: wait for it.
    let refused = wait_event(&client, &ns, "p", "CronJobRefused", T).await?;
    assert_eq!(refused.type_.as_deref(), Some("Warning"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_resource_on_the_same_group_is_a_conflict_and_runs_no_workers() -> Result<()> {
    let f = Fixture::start("e2e-conflict", &[]).await?;
    let (bed, client, ns) = (f.bed, f.client.clone(), f.ns.name.clone());
    let records = tempfile::tempdir()?;
    let dir = records.path().display().to_string();
    let spec = "  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 1}";
    f.apply(&recording_manifest("p", "orders", "billing", &dir, spec)).await?;
    wait_condition(&client, &ns, "p", "Ready", "True", None, T).await?;
    f.apply(&recording_manifest("q", "orders", "billing", &dir, spec)).await?;
    let q = wait_condition(&client, &ns, "q", "Conflict", "True", None, T).await?;
    let conflict = q.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Conflict").unwrap();
    assert!(conflict.message.contains(&format!("{ns}/p")), "{}", conflict.message);
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), &ns);
    assert!(deployments.get_opt("q-worker").await?.is_none(), "the second resource runs no workers");
    let table = run_ok(bed, "kubectl", &["get", "scg", "-n", &ns], None).await?;
    let q_row = table.lines().find(|l| l.starts_with("q ")).unwrap_or_default();
    assert!(q_row.contains("Conflict") && q_row.contains("0/0"), "{table}");
    let p_row = table.lines().find(|l| l.starts_with("p ")).unwrap_or_default();
    assert!(p_row.contains("Reconciled") && p_row.contains("1/1"), "{table}");
    assert_eq!(event_count(&client, &ns, "q", "Conflict").await?, 1);

    // The first one goes: the second takes the group over.
    run_ok(bed, "kubectl", &["delete", "scg", "p", "-n", &ns, "--wait=true"], None).await?;
    let q = wait_condition(&client, &ns, "q", "Ready", "True", None, T).await?;
    assert!(q.status.unwrap().conditions.iter().any(|c| c.type_ == "Conflict" && c.status == "False"));
    assert!(deployments.get_opt("q-worker").await?.is_some());
    Ok(())
}

/// Orders arrive at a steady 40 per second for 40 s and the workers keep
/// up: the status reads about 40 in and 40 out per second (the last 30 s,
/// by Redis's clock), in `kubectl get` and in `/metrics` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_arrivals_read_as_entries_in_and_out_per_second() -> Result<()> {
    let f = Fixture::start("e2e-rates", &[]).await?;
    let (client, ns, mut conn) = (f.client.clone(), f.ns.name.clone(), f.conn.clone());
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 1}";
    f.apply(&manifest("p", "orders", "billing", "streamfleet/example-worker", &[], spec)).await?;
    wait_condition(&client, &ns, "p", "Ready", "True", None, T).await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    let rate = 40.0;
    let started = Instant::now();
    let mut sent = 0u64;
    let mut seen = Vec::new();
    while started.elapsed() < Duration::from_secs(40) {
        let mut pipe = redis::pipe();
        for _ in 0..10 {
            pipe.cmd("XADD").arg("orders").arg("*").arg("order_id").arg(sent).arg("amount_cents").arg(100).ignore();
            sent += 1;
        }
        let () = pipe.query_async(&mut conn).await?;
        // Paced by the clock, not by the sleeps: 10 entries every 250 ms.
        let due = Duration::from_secs_f64(sent as f64 / rate);
        tokio::time::sleep(due.saturating_sub(started.elapsed())).await;
        if started.elapsed() > Duration::from_secs(35) {
            seen.push(scgs.get("p").await?.status.and_then(|s| s.throughput));
        }
    }
    // The rates are `-o wide` columns; the default view stays narrow.
    let table = run_ok(f.bed, "kubectl", &["get", "scg", "p", "-n", &ns, "-o", "wide"], None).await?;
    let narrow = run_ok(f.bed, "kubectl", &["get", "scg", "p", "-n", &ns], None).await?;
    let body = operator_http(&client, &ns, "/metrics").await?;
    let near = |x: f64| (rate * 0.75..=rate * 1.25).contains(&x);
    let last = seen.iter().rev().flatten().next().cloned().expect("rates in the status");
    println!("rates after 40 s at {rate}/s: {last:?}");
    assert!(near(last.in_per_second) && near(last.out_per_second), "{last:?}");
    assert!(seen.iter().flatten().all(|t| near(t.in_per_second)), "{seen:?}");
    let header = table.lines().next().unwrap_or_default();
    assert!(header.contains("IN/S") && header.contains("OUT/S") && header.contains("OLDEST"), "{table}");
    let narrow_header = narrow.lines().next().unwrap_or_default();
    assert!(!narrow_header.contains("IN/S") && narrow_header.contains("DELAY"), "{narrow}");
    let arrival = metric(&body, "streamfleet_arrival_rate", &ns).and_then(|v| v.parse::<f64>().ok());
    assert!(arrival.is_some_and(near), "streamfleet_arrival_rate {arrival:?}");
    Ok(())
}

/// A Redis that may evict keys when its memory is full (a `maxmemory-policy`
/// other than `noeviction`) can drop a stream with its groups and every
/// pending entry; one without an append-only file (the test bed's) loses
/// what was written since its last snapshot when it restarts: the resource
/// says each with a condition and one Warning, and stops saying so within a
/// check (a minute) of the setting being fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_keys_or_lose_writes_is_a_condition_and_a_warning_until_fixed() -> Result<()> {
    let f = Fixture::start_with_redis("e2e-evict", &[], &["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])
        .await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    let records = tempfile::tempdir()?;
    let spec = "  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 2}";
    f.apply(&recording_manifest("p", "orders", "billing", &records.path().display().to_string(), spec)).await?;
    let scg = wait_condition(&client, &ns, "p", "EvictionPossible", "True", Some("MaxmemoryPolicy"), T).await?;
    let status = scg.status.unwrap();
    let condition = status.conditions.iter().find(|c| c.type_ == "EvictionPossible").unwrap();
    assert!(
        condition.message.contains("allkeys-lru") && condition.message.contains("noeviction"),
        "{}",
        condition.message
    );
    // The pipeline still runs: a warning, not a refusal.
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    eventually("Healthy and Ready", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        let ready = s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
        Ok((ready && s.health == Some(Health::Healthy)).then_some(()))
    })
    .await?;
    assert_eq!(event_count(&client, &ns, "p", "EvictionPossible").await?, 1, "one Warning, not one per poll");
    let scg = wait_condition(&client, &ns, "p", "LossOnRestartPossible", "True", Some("AppendOnlyFileOff"), T).await?;
    let status = scg.status.unwrap();
    let condition = status.conditions.iter().find(|c| c.type_ == "LossOnRestartPossible").unwrap();
    assert!(condition.message.contains("aof_enabled:0"), "{}", condition.message);
    assert_eq!(event_count(&client, &ns, "p", "LossOnRestartPossible").await?, 1, "one Warning, not one per poll");

    let mut conn = f.redis.connection().await?;
    let () = redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("noeviction").query_async(&mut conn).await?;
    let () = redis::cmd("CONFIG").arg("SET").arg("appendonly").arg("yes").query_async(&mut conn).await?;
    let fixed = Instant::now();
    eventually("the conditions gone", Duration::from_secs(60 + 30), || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        let said = |type_: &str| s.conditions.iter().any(|c| c.type_ == type_);
        Ok((!said("EvictionPossible") && !said("LossOnRestartPossible")).then_some(()))
    })
    .await?;
    println!("conditions gone {:.0}s after the settings were fixed", fixed.elapsed().as_secs_f64());
    assert_eq!(event_count(&client, &ns, "p", "EvictionPossible").await?, 1);
    assert_eq!(event_count(&client, &ns, "p", "LossOnRestartPossible").await?, 1);
    Ok(())
}
