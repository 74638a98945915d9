//! Recovery through the real CronJob template: `Sweep` mode (the operator
//! image) dead-letters poison and records lost payloads; `Worker` mode (the
//! user's image) re-runs handlers on abandoned entries; results reach the
//! resource's status and Events; the replay command puts dead letters back.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::batch::v1::Job;
use kube::Api;
use redis::AsyncCommands as _;
use std::time::Duration;
use streamfleet_crd::{Health, StreamConsumerGroup};
use streamfleet_e2e::*;
use streamfleet_testbed::{TestBed, eventually, tools};

const T: Duration = Duration::from_secs(120);

/// Entries read by a consumer that is not a pod of the pipeline (so reaping
/// leaves it alone) and never acked.
async fn abandon(conn: &mut redis::aio::MultiplexedConnection, n: usize) -> Result<Vec<String>> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id: String =
            conn.xadd("orders", "*", &[("order_id", format!("o{i}")), ("amount_cents", "100".into())]).await?;
        ids.push(id);
    }
    let opts = redis::streams::StreamReadOptions::default().group("billing", "ghost").count(n);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    Ok(ids)
}

/// The group, then [`abandon`]ed entries, the first of them delivered a
/// second time (as if it had failed once already).
async fn abandon_with_poison(conn: &mut redis::aio::MultiplexedConnection, n: usize) -> Result<Vec<String>> {
    streamfleet_streams::ensure_group(conn, "orders", "billing", "0").await?;
    let ids = abandon(conn, n).await?;
    let _: redis::Value =
        redis::cmd("XCLAIM").arg("orders").arg("billing").arg("ghost").arg(0).arg(&ids[0]).query_async(conn).await?;
    Ok(ids)
}

async fn run_recovery_now(bed: &TestBed, ns: &str, name: &str) -> Result<()> {
    let cronjob = format!("cronjob/{name}-recovery");
    run_ok(bed, "kubectl", &["create", "job", "-n", ns, "recover-now", "--from", &cronjob], None).await?;
    let client = bed.client().await?;
    let jobs: Api<Job> = Api::namespaced(client, ns);
    eventually("recovery Job complete", T, || async {
        let job = jobs.get("recover-now").await?;
        let done = job.status.and_then(|s| s.succeeded).unwrap_or(0) >= 1;
        Ok(done.then_some(()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_dead_letters_poison_reports_lost_payloads_and_replay_requeues() -> Result<()> {
    let f = Fixture::start("e2e-sweep", &[]).await?;
    let (bed, client, ns, mut conn) = (f.bed, f.client.clone(), &f.ns, f.conn.clone());
    // ids[0]: delivered twice (= maxDeliveries); ids[1]: payload trimmed; ids[2]: delivered once.
    let ids = abandon_with_poison(&mut conn, 3).await?;
    let _: i64 = conn.xdel("orders", &[&ids[1]]).await?;
    // Workers that never consume (testproc): the PEL stays as arranged.
    let records = tempfile::tempdir()?;
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 2}\n  recovery: {schedule: \"0 0 1 1 *\", maxDeliveries: 2, minIdleTimeMs: 1000}";
    f.apply(&recording_manifest("p", "orders", "billing", &records.path().display().to_string(), spec)).await?;
    wait_condition(&client, &ns.name, "p", "Ready", "True", None, T).await?;
    tokio::time::sleep(Duration::from_millis(1200)).await;

    run_recovery_now(bed, &ns.name, "p").await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns.name);
    let status = eventually("lastRecovery in status", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        Ok(s.last_recovery.clone().filter(|_| s.health == Some(Health::PayloadLost)).map(|r| (r, s)))
    })
    .await?;
    let (last, status) = status;
    assert_eq!((last.claimed, last.dead_lettered, last.payload_lost), (1, 1, 1), "{last:?}");
    assert_eq!(status.dead_letter_length, Some(2));
    assert_eq!(status.pending, Some(1), "the young entry is left to the workers");
    eventually("PayloadLost Event", T, || async {
        Ok((event_count(&client, &ns.name, "p", "PayloadLost").await? >= 1).then_some(()))
    })
    .await?;

    // Replay with the operator binary: the poison order goes back, the
    // payload-missing record stays.
    let out = tokio::process::Command::new(tools::cargo_bin("streamfleet")?)
        .args(["dead-letters", "--dead-letter-stream", "{orders}:dead:billing", "replay", "--all"])
        .env("STREAMFLEET_REDIS_URL", f.redis.url())
        .env("STREAMFLEET_LOG_FORMAT", "text")
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("requeued ") && stdout.contains("-> orders ") && stdout.contains("skipped"), "{stdout}");
    let dlq: usize = conn.xlen("{orders}:dead:billing").await?;
    assert_eq!(dlq, 1);
    let last_entry: redis::streams::StreamRangeReply = conn.xrevrange_count("orders", "+", "-", 1).await?;
    let fields = streamfleet_streams::entry::fields_from_map(last_entry.ids[0].map.clone());
    assert!(fields.contains(&("order_id".to_string(), b"o0".to_vec())), "{fields:?}");
    Ok(())
}

/// The chart installed into a namespace that enforces restricted Pod
/// Security (labelled before the install): the operator's pods are
/// admitted (the install waits for them), so are the workers of a template
/// that follows the standard, and the recovery CronJob's sweep Job runs
/// there and does its work (a poison entry dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_and_a_sweep_job_run_under_restricted_pod_security() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let ns = bed.namespace(&client, "e2e-restricted").await?;
    let label = "pod-security.kubernetes.io/enforce=restricted";
    run_ok(bed, "kubectl", &["label", "namespace", &ns.name, label], None).await?;
    install_operator(bed, &ns.name, &[]).await?;
    let redis = streamfleet_testbed::RedisServer::start().await?;
    let mut conn = redis.connection().await?;
    create_redis_secret(&client, &ns.name, "redis", &redis.url()).await?;
    // The first delivered twice (= maxDeliveries): the sweep dead-letters it.
    abandon_with_poison(&mut conn, 2).await?;
    let records = tempfile::tempdir()?;
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 2}\n  recovery: {schedule: \"0 0 1 1 *\", maxDeliveries: 2, minIdleTimeMs: 1000}";
    let manifest = recording_manifest("p", "orders", "billing", &records.path().display().to_string(), spec);
    let restricted = "            image: streamfleet/testproc\n            securityContext:\n              runAsNonRoot: true\n              runAsUser: 65532\n              allowPrivilegeEscalation: false\n              capabilities: {drop: [ALL]}\n              seccompProfile: {type: RuntimeDefault}\n";
    let manifest = manifest.replace("            image: streamfleet/testproc\n", restricted);
    assert!(manifest.contains("seccompProfile"), "{manifest}");
    run_ok(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(&manifest)).await?;
    wait_condition(&client, &ns.name, "p", "WorkersAvailable", "True", None, T).await?;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    run_recovery_now(bed, &ns.name, "p").await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns.name);
    let last = eventually("lastRecovery in status", T, || async {
        Ok(scgs.get("p").await?.status.and_then(|s| s.last_recovery))
    })
    .await?;
    assert_eq!(last.dead_lettered, 1, "{last:?}");
    let dead: usize = conn.xlen("{orders}:dead:billing").await?;
    assert_eq!(dead, 1);
    // The check bites: a pod breaking the standard is refused here.
    let lax = serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "lax"},
        "spec": {"containers": [{"name": "c", "image": "streamfleet/testproc"}]}});
    let out =
        run_tool(bed, "kubectl", &["create", "--dry-run=server", "-n", &ns.name, "-f", "-"], Some(&lax.to_string()))
            .await?;
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("PodSecurity"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_mode_recovery_reruns_handlers_on_abandoned_entries() -> Result<()> {
    let f = Fixture::start("e2e-wrecover", &[]).await?;
    let (bed, client, ns, mut conn) = (f.bed, f.client.clone(), &f.ns, f.conn.clone());
    streamfleet_streams::ensure_group(&mut conn, "orders", "billing", "0").await?;
    abandon(&mut conn, 5).await?;
    // The Deployment is paused at zero so only the recovery Job can charge.
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 0, maxReplicas: 1, paused: true}\n  recovery: {schedule: \"0 0 1 1 *\", mode: Worker, minIdleTimeMs: 1000}";
    f.apply(&manifest("p", "orders", "billing", "streamfleet/example-worker", &[], spec)).await?;
    wait_condition(&client, &ns.name, "p", "GroupReady", "True", None, T).await?;
    tokio::time::sleep(Duration::from_millis(1200)).await;

    run_recovery_now(bed, &ns.name, "p").await?;
    let charged: usize = conn.hlen("{ledger}:charges").await?;
    assert_eq!(charged, 5, "the recovery Job ran the handler on every abandoned order");
    let pending: redis::streams::StreamPendingReply = conn.xpending("orders", "billing").await?;
    assert_eq!(pending.count(), 0);
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns.name);
    let last =
        eventually("lastRecovery", T, || async { Ok(scgs.get("p").await?.status.and_then(|s| s.last_recovery)) })
            .await?;
    assert_eq!(last.claimed, 5);
    assert_eq!(last.payload_lost, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_trims_but_never_past_another_groups_pending_entries() -> Result<()> {
    let f = Fixture::start("e2e-retain", &[]).await?;
    let mut conn = f.conn.clone();
    for i in 1..=50 {
        let _: String = conn.xadd("orders", format!("{i}-0"), &[("order_id", i)]).await?;
    }
    // A group the operator does not manage still holds 20-0..30-0 pending.
    streamfleet_streams::ensure_group(&mut conn, "orders", "reporting", "0").await?;
    let opts = redis::streams::StreamReadOptions::default().group("reporting", "r").count(30);
    let read: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let ids: Vec<String> = read.keys.into_iter().flat_map(|k| k.ids.into_iter().map(|e| e.id)).collect();
    let _: i64 = conn.xack("orders", "reporting", &ids[..19]).await?;

    let records = tempfile::tempdir()?;
    let spec = "  startId: \"$\"\n  retention: {maxLength: 5}";
    f.apply(&recording_manifest("p", "orders", "billing", &records.path().display().to_string(), spec)).await?;
    let scg = f.wait_condition("p", "RetentionBlocked", "True").await?;
    let message =
        scg.status.unwrap_or_default().conditions.into_iter().find(|c| c.type_ == "RetentionBlocked").unwrap().message;
    assert!(message.contains("held at 20-0"), "{message}");
    let first: redis::streams::StreamRangeReply = conn.xrange_count("orders", "-", "+", 1).await?;
    assert_eq!(first.ids[0].id, "20-0", "the other group's oldest pending entry stays");
    let len: usize = conn.xlen("orders").await?;
    assert_eq!(len, 31);

    // Once that group is done, the policy applies in full.
    let _: i64 = conn.xack("orders", "reporting", &ids[19..]).await?;
    let rest: redis::streams::StreamReadReply = conn
        .xread_options(
            &["orders"],
            &[">"],
            &redis::streams::StreamReadOptions::default().group("reporting", "r").count(100),
        )
        .await?;
    let rest: Vec<String> = rest.keys.into_iter().flat_map(|k| k.ids.into_iter().map(|e| e.id)).collect();
    let _: i64 = conn.xack("orders", "reporting", &rest).await?;
    f.wait_condition("p", "RetentionBlocked", "False").await?;
    let len: usize = conn.xlen("orders").await?;
    assert_eq!(len, 5);
    Ok(())
}

/// A recovery run that keeps failing writes no report; its Job says how it
/// ended: the `RecoveryFailing` condition, one Warning per failed run, the
/// `streamfleet_recovery_failing` gauge; the next run that succeeds clears
/// them. The failing run outlasts the schedule's interval, so under
/// `Forbid` the next run starts the moment it ends (the CronJob's own
/// status then never shows a moment with no run active).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_recovery_run_is_a_condition_a_warning_and_a_metric_until_one_succeeds() -> Result<()> {
    // A run ends by the chart's deadline at the latest: past the next minute.
    let f = Fixture::start("e2e-recfail", &["--set", "sweep.activeDeadlineSeconds=65"]).await?;
    let (bed, client, ns) = (f.bed, f.client.clone(), f.ns.name.clone());
    // Worker mode, workers paused at zero: only the recovery Jobs run, from
    // the worker template, whose image cannot be pulled: each run waits to
    // its deadline and fails.
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 0, maxReplicas: 1, paused: true}\n  recovery: {schedule: \"* * * * *\", mode: Worker, minIdleTimeMs: 1000}";
    f.apply(&manifest("p", "orders", "billing", "streamfleet/not-pulled", &[], spec)).await?;
    let long = Duration::from_secs(240);
    let scg = wait_condition(&client, &ns, "p", "RecoveryFailing", "True", Some("LastRunFailed"), long).await?;
    let condition = scg.status.unwrap_or_default().conditions.into_iter().find(|c| c.type_ == "RecoveryFailing");
    let message = condition.map(|c| c.message).unwrap_or_default();
    assert!(
        message.contains("failed: DeadlineExceeded") && message.contains("no run on record succeeded"),
        "{message}"
    );
    // The case the CronJob's status hides: the next run already going.
    let cronjob =
        Api::<k8s_openapi::api::batch::v1::CronJob>::namespaced(client.clone(), &ns).get("p-recovery").await?;
    let active = cronjob.status.and_then(|s| s.active).unwrap_or_default();
    assert!(!active.is_empty(), "the run after the failed one started at once");
    // The failed Job, found the way the runbook looks for it, is the one named.
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns);
    let selector = "streamfleet.io/consumer-group=p,app.kubernetes.io/component=recovery";
    let listed = jobs.list(&kube::api::ListParams::default().labels(selector)).await?.items;
    let failed: Vec<String> = listed
        .iter()
        .filter(|j| {
            let conditions = j.status.as_ref().and_then(|s| s.conditions.as_ref());
            conditions.is_some_and(|c| c.iter().any(|c| c.type_ == "Failed" && c.status == "True"))
        })
        .filter_map(|j| j.metadata.name.clone())
        .collect();
    assert!(failed.iter().any(|j| message.contains(&format!("Job {j},"))), "{message}: failed Jobs {failed:?}");
    let warning = wait_event(&client, &ns, "p", "RecoveryRunFailed", T).await?;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert_eq!(warning.note.as_deref(), Some(message.as_str()), "the Warning says what the condition says");
    let series =
        format!(r#"streamfleet_recovery_failing{{namespace="{ns}",name="p",stream="orders",group="billing"}}"#);
    let metrics = operator_http(&client, &ns, "/metrics").await?;
    assert!(metrics.contains(&format!("{series} 1")), "{metrics}");
    // Beside it, what the operator says of itself.
    assert!(
        metrics.contains("streamfleet_leader 1") && metrics.contains("streamfleet_build_info{version="),
        "{metrics}"
    );

    // Fixed, and the run made from the broken template removed: the next
    // run succeeds and clears the condition and the gauge.
    f.apply(&manifest("p", "orders", "billing", "streamfleet/example-worker", &[], spec)).await?;
    // One Warning per failed run: each failed Job named once, never repeated.
    let events = events_about(&client, &ns, "p").await?;
    let mut notes: Vec<String> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("RecoveryRunFailed"))
        .inspect(|e| assert_eq!(e.series.as_ref().map_or(1, |s| s.count), 1, "{e:?}"))
        .filter_map(|e| e.note.clone())
        .collect();
    let all = notes.len();
    notes.sort();
    notes.dedup();
    assert_eq!(notes.len(), all, "a failed run announced twice: {notes:?}");
    run_ok(bed, "kubectl", &["delete", "jobs", "-n", &ns, "-l", selector], None).await?;
    wait_condition(&client, &ns, "p", "RecoveryFailing", "False", Some("LastRunSucceeded"), long).await?;
    let metrics = operator_http(&client, &ns, "/metrics").await?;
    assert!(metrics.contains(&format!("{series} 0")), "{metrics}");
    Ok(())
}

/// `spec.recovery.deadLetterMaxAgeSeconds`: letters dead-lettered longer
/// ago than that are dropped each poll, with a Normal Event saying how
/// many; younger letters stay, and the status counts what is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_past_their_age_are_dropped_with_an_event() -> Result<()> {
    let f = Fixture::start("e2e-dlage", &[]).await?;
    let (client, ns, mut conn) = (f.client.clone(), f.ns.name.clone(), f.conn.clone());
    streamfleet_streams::ensure_group(&mut conn, "orders", "billing", "0").await?;
    let (secs, _micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let dead = streamfleet_streams::keys::dead_letter_stream("orders", "billing");
    // Three letters from 10 minutes ago, two from the last few seconds.
    for (i, age_s) in [(0, 600), (1, 600), (2, 600), (3, 5), (4, 1)] {
        let _: String = conn.xadd(&dead, format!("{}-{i}", (secs - age_s) * 1000), &[("reason", "permanent")]).await?;
    }
    let records = tempfile::tempdir()?;
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 2}\n  recovery: {schedule: \"0 0 1 1 *\", deadLetterMaxAgeSeconds: 300}";
    f.apply(&recording_manifest("p", "orders", "billing", &records.path().display().to_string(), spec)).await?;
    let event = wait_event(&client, &ns, "p", "DeadLettersExpired", T).await?;
    assert_eq!(event.type_.as_deref(), Some("Normal"));
    let note = event.note.unwrap_or_default();
    assert!(note.starts_with(&format!("dropped 3 letters of {dead} dead-lettered over 300 s ago")), "{note}");
    let left: usize = conn.xlen(&dead).await?;
    assert_eq!(left, 2, "the young letters stay");
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    eventually("deadLetterLength 2", T, || async {
        Ok(scgs.get("p").await?.status.and_then(|s| s.dead_letter_length).filter(|n| *n == 2))
    })
    .await?;
    assert_eq!(event_count(&client, &ns, "p", "DeadLettersExpired").await?, 1, "nothing more to drop, no more Events");
    Ok(())
}
