//! The Redis password never leaks, and the least-privilege ACL user is
//! enough. A pipeline runs end to end as the `streamfleet` user of
//! `docs/redis-acl.txt` (the default user off): the operator creates the
//! group and polls, workers charge and dead-letter, the recovery sweep runs,
//! and Redis's ACL log shows no command or key refused. The operator reports
//! a wrong password when the Secret changes. Then every pod log, Event,
//! status and owned object of the namespace is searched for the password,
//! and none holds it.

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
    let server = RedisServer::start_in(dir.path(), &[]).await?;
    // The documented ACL line as it is, an admin for this test, the example's
    // ledger its own user (its commands are the example's, not streamfleet's),
    // and the default user off.
    let acl = std::fs::read_to_string(repo_path("docs/redis-acl.txt"))?;
    let line = acl
        .lines()
        .find(|l| l.starts_with("ACL SETUSER"))
        .expect("the ACL line")
        .replace(">PASSWORD", &format!(">{password}"));
    let mut admin = server.connection().await?;
    let mut setuser = redis::cmd("ACL");
    for word in line.split_whitespace().skip(1) {
        setuser.arg(word);
    }
    let () = setuser.query_async(&mut admin).await?;
    for user in [
        "SETUSER admin on >admin-pw ~* &* +@all",
        "SETUSER ledger on >ledger-pw ~{ledger}:* resetchannels +@all",
        "SETUSER default off",
    ] {
        let () = redis::cmd("ACL").arg(user.split(' ').collect::<Vec<_>>()).query_async(&mut admin).await?;
    }
    let url = |pw: &str| format!("redis://streamfleet:{pw}@127.0.0.1:{}/", server.port);
    create_redis_secret(&client, &ns, "redis", &url(&password)).await?;
    let admin_url = format!("redis://admin:admin-pw@127.0.0.1:{}/", server.port);
    let mut conn = redis::Client::open(admin_url.as_str())?.get_multiplexed_async_connection().await?;
    for i in 0..50 {
        let mut cmd = redis::cmd("XADD");
        cmd.arg("orders").arg("*").arg("order_id").arg(i).arg("amount_cents").arg(100 + i);
        if i % 25 == 7 {
            cmd.arg("poison").arg("1");
        }
        let _: String = cmd.query_async(&mut conn).await?;
    }
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 2}\n  recovery: {schedule: \"* * * * *\", minIdleTimeMs: 1000}";
    let ledger = format!("redis://ledger:ledger-pw@127.0.0.1:{}/", server.port);
    f.apply(&manifest(
        "p",
        "orders",
        "billing",
        "streamfleet/example-worker",
        &[("EXAMPLE_LEDGER_URL", &ledger)],
        spec,
    ))
    .await?;
    eventually("orders charged and poison dead-lettered", T, || async {
        let mut c = conn.clone();
        let charged: usize = redis::cmd("HLEN").arg("{ledger}:charges").query_async(&mut c).await?;
        let dead: usize = redis::cmd("XLEN").arg("{orders}:dead:billing").query_async(&mut c).await?;
        Ok((charged == 48 && dead == 2).then_some(()))
    })
    .await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    eventually("a recovery sweep ran", T, || async {
        Ok(scgs.get("p").await?.status.and_then(|s| s.last_recovery).map(|_| ()))
    })
    .await?;

    // Nothing the operator, the workers or the sweep sent was refused.
    let log: Vec<std::collections::HashMap<String, redis::Value>> =
        redis::cmd("ACL").arg("LOG").query_async(&mut conn).await?;
    let refused: Vec<_> = log
        .iter()
        .filter(|e| matches!(e.get("username"), Some(redis::Value::BulkString(u)) if u == b"streamfleet"))
        .collect();
    assert!(refused.is_empty(), "the ACL line refused the pipeline: {refused:?}");
    let groups: Vec<redis::Value> = redis::cmd("XINFO").arg("GROUPS").arg("orders").query_async(&mut conn).await?;
    assert_eq!(groups.len(), 1, "the operator created the group as the ACL user");

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
