//! What the operator asks of the API server, counted by the API server
//! itself (its audit log of the operator's service account): at rest nothing
//! but the Lease and its watches; a recovery run costs exactly one status
//! write and one Event; a changed Secret is read once.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::batch::v1::Job;
use kube::Api;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_e2e::*;
use streamfleet_testbed::{TestBed, audit, eventually};

const T: Duration = Duration::from_secs(120);
/// Five polls at the 2 s interval below.
const WINDOW: Duration = Duration::from_secs(10);

/// The operator's requests in `ns` since `from`, by kind, leaving out the
/// Lease (leader election) and its watches, which are allowed at rest.
fn requests_since(bed: &TestBed, ns: &str, from: u64) -> Result<BTreeMap<String, usize>> {
    let all = audit::since(&bed.audit_log, from, &format!("system:serviceaccount:{ns}:"))?;
    let counted: Vec<_> = all.into_iter().filter(|r| r.resource != "leases" && r.verb != "watch").collect();
    Ok(audit::count_by_kind(&counted))
}

async fn run_job(bed: &TestBed, ns: &str, cronjob: &str, job: &str) -> Result<()> {
    run_ok(bed, "kubectl", &["create", "job", "-n", ns, job, "--from", &format!("cronjob/{cronjob}")], None).await?;
    let jobs: Api<Job> = Api::namespaced(bed.client().await?, ns);
    eventually("recovery Job complete", T, || async {
        let done = jobs.get(job).await?.status.and_then(|s| s.succeeded).unwrap_or(0) >= 1;
        Ok(done.then_some(()))
    })
    .await
}

/// The operator's `streamfleet_reconciles_total`.
async fn reconciles(client: &kube::Client, ns: &str) -> Result<u64> {
    let text = operator_http(client, ns, "/metrics").await?;
    let line = text.lines().find(|l| l.starts_with("streamfleet_reconciles_total ")).unwrap_or_default();
    Ok(line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).map_or(0, |v| v as u64))
}

/// The reconcile count and Redis's command counts, read just after a poll
/// ended (the next is seconds away): no poll is counted in one and not the
/// other.
async fn just_after_a_poll(
    client: &kube::Client,
    ns: &str,
    conn: &mut redis::aio::MultiplexedConnection,
) -> Result<(u64, BTreeMap<String, u64>)> {
    let started = Instant::now();
    // Asked when the count was still `seen`: the poll ended after that.
    let mut asked = Instant::now();
    let mut seen = reconciles(client, ns).await?;
    while started.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let asking = Instant::now();
        let now = reconciles(client, ns).await?;
        if now != seen {
            let stats = command_stats(conn).await?;
            // Read well before the next poll (2 s away): else wait for another.
            if asked.elapsed() < Duration::from_secs(1) {
                return Ok((now, stats));
            }
            seen = now;
        }
        asked = asking;
    }
    anyhow::bail!("no poll read promptly in 20 s at a 2 s poll interval")
}

/// Calls per command as Redis counts them (`INFO commandstats`).
async fn command_stats(conn: &mut redis::aio::MultiplexedConnection) -> Result<BTreeMap<String, u64>> {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await?;
    Ok(info
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?.parse().ok()?;
            Some((name.to_string(), calls))
        })
        .collect())
}

/// What one poll of a resource at rest has Redis execute over a whole
/// reconcile (health inspection, recovery report, payload-loss record),
/// counted by the server, a script's own calls included: the figure the
/// docs state the per-poll cost from. `info` is
/// left out: this test's own reads, and the operator's settings check
/// (once a minute per endpoint, not per poll).
fn write_poll_cost(polls: u64, before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> Result<()> {
    assert!(polls >= 3, "{polls} reconciles in the {WINDOW:?} window at a 2 s poll interval");
    let sent: BTreeMap<&str, u64> = after
        .iter()
        .filter(|(name, _)| name.as_str() != "info")
        .map(|(name, n)| (name.as_str(), n - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect();
    let total: u64 = sent.values().sum();
    // The inspection's script and its consumers read: what was counted is the poll.
    for command in ["evalsha", "xinfo|consumers"] {
        assert!(sent.contains_key(command), "no {command} over {polls} polls: {sent:?}");
    }
    // Every poll at rest sends the same commands.
    for (name, n) in &sent {
        assert_eq!(n % polls, 0, "{name} ×{n} over {polls} polls: not the same every poll ({sent:?})");
    }
    let by_command: Vec<String> = sent.iter().map(|(name, n)| format!("{name} ×{}", n / polls)).collect();
    streamfleet_testbed::write_figure(
        "poll-cost",
        &serde_json::json!({
            "what": "What one poll of a resource at rest has Redis execute over a whole reconcile (health inspection, last recovery report, payload-loss record), counted by the server (INFO commandstats: a script's own calls count, each besides its EVALSHA) over the polls of a window, the poll count read from the operator's streamfleet_reconciles_total",
            "settings": {"shards": 1, "pollIntervalSeconds": 2, "window": format!("{} s", WINDOW.as_secs()), "left out": "info (the settings check, once a minute per endpoint)"},
            "columns": ["polls in the window", "commands executed per poll", "by command"],
            "rows": [[polls, total / polls, by_command.join(", ")]],
            "summary": format!("{} commands executed per poll on one shard (a script's own calls included), the same at every poll.", total / polls),
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_rest_the_operator_makes_no_api_request_and_a_recovery_run_costs_one_status_write_and_one_event()
-> Result<()> {
    let f = Fixture::start("e2e-rest", &[]).await?;
    let (bed, client, ns) = (f.bed, f.client.clone(), &f.ns.name);
    // A backlog nobody consumes (the workers only record their start): at
    // rest is "nothing changes", not "nothing to do".
    let mut conn = f.conn.clone();
    for i in 0..3 {
        let _: String = redis::AsyncCommands::xadd(&mut conn, "orders", "*", &[("order_id", i)]).await?;
    }
    let records = tempfile::tempdir()?;
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 2}\n  recovery: {schedule: \"0 0 1 1 *\"}";
    f.apply(&recording_manifest("quiet", "orders", "billing", &records.path().display().to_string(), spec)).await?;
    wait_condition(&client, ns, "quiet", "Ready", "True", None, T).await?;
    // A first recovery run, so the window below is after one (a run used to
    // make every later poll re-announce it).
    run_job(bed, ns, "quiet-recovery", "recover-1").await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), ns);
    let first = eventually("first lastRecovery", T, || async {
        Ok(scgs.get("quiet").await?.status.and_then(|s| s.last_recovery))
    })
    .await?;
    // Nothing reads the backlog: after 30 s with no consumer it is Stopped, a
    // change of its own. At rest starts after it.
    eventually("health Stopped", T, || async {
        let health = scgs.get("quiet").await?.status.and_then(|s| s.health);
        Ok((health == Some(streamfleet_crd::Health::Stopped)).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // At rest: five polls, no request but the Lease and the watches. Redis
    // counts what the polls sent it (nothing else uses this server: the
    // workers only record their start).
    let from = audit::offset(&bed.audit_log)?;
    let status_before = scgs.get("quiet").await?.status;
    let (reconciles_before, commands_before) = just_after_a_poll(&client, ns, &mut conn).await?;
    tokio::time::sleep(WINDOW - Duration::from_secs(1)).await;
    let (reconciles_after, commands_after) = just_after_a_poll(&client, ns, &mut conn).await?;
    let at_rest = requests_since(bed, ns, from)?;
    let status_after = scgs.get("quiet").await?.status;
    assert!(
        at_rest.is_empty(),
        "at rest the operator asked the API server for {at_rest:?}; status before {}, after {}",
        serde_json::to_string(&status_before)?,
        serde_json::to_string(&status_after)?
    );
    write_poll_cost(reconciles_after - reconciles_before, &commands_before, &commands_after)?;
    let polls = audit::since(&bed.audit_log, from, &format!("system:serviceaccount:{ns}:"))?;
    assert!(polls.iter().any(|r| r.resource == "leases"), "the audit log sees the operator (its Lease renewals)");

    // A second recovery run, at least a second after the first (the report's
    // time has second precision): one status write, one Event, nothing else.
    let events_before = event_count(&client, ns, "quiet", "RecoveryCompleted").await?;
    let from = audit::offset(&bed.audit_log)?;
    run_job(bed, ns, "quiet-recovery", "recover-2").await?;
    eventually("second lastRecovery", T, || async {
        let latest = scgs.get("quiet").await?.status.and_then(|s| s.last_recovery);
        Ok(latest.filter(|l| l.time != first.time))
    })
    .await?;
    tokio::time::sleep(WINDOW).await;
    let mut around_run = requests_since(bed, ns, from)?;
    // The same note within minutes continues the first run's Event as a
    // series (a patch); otherwise it is a new Event (a create): one write.
    let event_writes = around_run.remove("create events").unwrap_or(0) + around_run.remove("patch events").unwrap_or(0);
    assert_eq!(event_writes, 1, "one Event write per recovery run");
    let expected: BTreeMap<String, usize> = [("patch streamconsumergroups/status".to_string(), 1)].into();
    assert_eq!(around_run, expected, "a recovery run and five polls after it");
    assert_eq!(event_count(&client, ns, "quiet", "RecoveryCompleted").await?, events_before + 1);

    // A rotated Secret is read again, once, and then no more.
    let from = audit::offset(&bed.audit_log)?;
    run_ok(bed, "kubectl", &["label", "secret", "-n", ns, "redis", "rotated=1"], None).await?;
    tokio::time::sleep(WINDOW).await;
    let after_rotation = requests_since(bed, ns, from)?;
    assert_eq!(after_rotation, [("get secrets".to_string(), 1)].into(), "after the Secret changed");
    Ok(())
}
