//! The Redis password never leaks. A pipeline on a password-protected
//! redis-server runs end to end: workers charge and dead-letter, the recovery
//! sweep runs, and the operator reports a wrong password when the Secret
//! changes. Then every pod log, Event, status and owned object of the
//! namespace is searched for the password, and none holds it.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use kube::Api;
use rand::Rng as _;
use std::time::Duration;
use streamfleet_crd::{Health, StreamConsumerGroup};
use streamfleet_e2e::*;
use streamfleet_testbed::{RedisServer, eventually};

const T: Duration = Duration::from_secs(150);

/// Every file under `dir`, as text.
fn read_all(dir: &std::path::Path, out: &mut String) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            read_all(&path, out)?;
        } else if let Ok(bytes) = std::fs::read(&path) {
            out.push_str(&String::from_utf8_lossy(&bytes));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_password_appears_in_no_log_event_status_or_object() -> Result<()> {
    let f = Fixture::start("e2e-secret", &[]).await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    let dir = tempfile::tempdir()?;
    let password = format!("pw-{:016x}", rand::rng().random::<u64>());
    let wrong = format!("pw-{:016x}", rand::rng().random::<u64>());
    let server = RedisServer::start_in(dir.path(), &["--requirepass", &password]).await?;
    let url = |pw: &str| format!("redis://:{pw}@127.0.0.1:{}/", server.port);
    create_redis_secret(&client, &ns, "redis", &url(&password)).await?;
    let mut conn = redis::Client::open(url(&password).as_str())?.get_multiplexed_async_connection().await?;
    for i in 0..50 {
        let mut cmd = redis::cmd("XADD");
        cmd.arg("orders").arg("*").arg("order_id").arg(i).arg("amount_cents").arg(100 + i);
        if i % 25 == 7 {
            cmd.arg("poison").arg("1");
        }
        let _: String = cmd.query_async(&mut conn).await?;
    }
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 2}\n  recovery: {schedule: \"* * * * *\", minIdleTimeMs: 1000}";
    f.apply(&manifest("p", "orders", "billing", "streamfleet/example-worker", &[], spec)).await?;
    eventually("orders charged and poison dead-lettered", T, || async {
        let mut c = conn.clone();
        let charged: usize = redis::cmd("HLEN").arg("{ledger}:charges").query_async(&mut c).await?;
        let dead: usize = redis::cmd("XLEN").arg("{orders}:dead").query_async(&mut c).await?;
        Ok((charged == 48 && dead == 2).then_some(()))
    })
    .await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    eventually("a recovery sweep ran", T, || async {
        Ok(scgs.get("p").await?.status.and_then(|s| s.last_recovery).map(|_| ()))
    })
    .await?;

    // A wrong password: the operator says the group is unknown, and why,
    // without echoing the URL.
    create_redis_secret(&client, &ns, "redis", &url(&wrong)).await?;
    let status = eventually("the wrong password reported", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        Ok((s.health == Some(Health::Unknown)).then_some(s))
    })
    .await?;
    let said: String = status.conditions.iter().map(|c| c.message.clone()).collect::<Vec<_>>().join("\n");
    assert!(
        said.to_lowercase().contains("auth") || said.contains("WRONGPASS") || said.contains("password"),
        "the conditions say why: {said}"
    );

    // Everything the run left behind, searched for both passwords.
    let mut haystack = String::new();
    read_all(&f.bed.pod_dir(&ns, "_").with_file_name(""), &mut haystack)?;
    let logs = haystack.len();
    for kind in ["events", "streamconsumergroups", "deployments", "cronjobs", "jobs", "pods", "replicasets"] {
        haystack.push_str(&run_ok(f.bed, "kubectl", &["get", kind, "-n", &ns, "-o", "yaml"], None).await?);
    }
    haystack.push_str(&operator_http(&client, &ns, "/metrics").await.unwrap_or_default());
    assert!(logs > 0 && haystack.contains("dead-lettered"), "the search covers the run's logs");
    assert!(haystack.contains("DeadLettered") || haystack.contains("RecoveryCompleted"), "and its Events");
    for secret in [&password, &wrong] {
        assert!(!haystack.contains(secret.as_str()), "the password {secret} leaked");
    }
    Ok(())
}
