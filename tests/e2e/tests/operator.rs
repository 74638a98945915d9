//! The operator, installed with Helm and running as a pod with the chart's
//! ServiceAccount and RBAC, reconciling StreamConsumerGroups against real
//! Redis on the real control plane.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use redis::AsyncCommands as _;
use std::time::Duration;
use streamfleet_contract as env;
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_e2e::*;
use streamfleet_testbed::{RedisServer, TestBed, eventually};

const T: Duration = Duration::from_secs(90);

async fn group_info(server: &RedisServer, stream: &str) -> Result<Vec<(String, String)>> {
    let mut conn = server.connection().await?;
    let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups(stream).await?;
    Ok(info.groups.into_iter().map(|g| (g.name, g.last_delivered_id)).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installed_operator_creates_group_workers_and_recovery() -> Result<()> {
    let f = Fixture::start("e2e-apply", &[]).await?;
    let (client, ns, redis, mut conn) = (f.client.clone(), &f.ns, &f.redis, f.conn.clone());
    // An entry that predates the group: startId 0 must deliver it.
    let first: String = conn.xadd("orders", "*", &[("order", "1")]).await?;
    let records = tempfile::tempdir()?;
    let manifest = recording_manifest(
        "orders",
        "orders",
        "billing",
        &records.path().display().to_string(),
        "  startId: \"0\"\n  recovery:\n    schedule: \"*/7 * * * *\"",
    );
    f.apply(&manifest).await?;

    let scg = wait_condition(&client, &ns.name, "orders", "Ready", "True", None, T).await?;
    let status = scg.status.clone().unwrap_or_default();
    assert_eq!(status.observed_generation, scg.metadata.generation);
    assert_eq!(group_info(redis, "orders").await?, vec![("billing".to_string(), "0-0".to_string())]);
    assert!(first.contains('-'));

    // Owned worker Deployment carrying the env contract, running for real.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    let d = deployments.get("orders-worker").await?;
    let owner = d.owner_references().first().cloned().unwrap_or_default();
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("StreamConsumerGroup", scg.uid().unwrap_or_default().as_str())
    );
    let started = eventually("worker process", T, || async {
        let rec = std::fs::read_dir(records.path())?
            .flatten()
            .find(|e| e.path().extension().is_some_and(|x| x == "start"))
            .map(|e| std::fs::read_to_string(e.path()))
            .transpose()?;
        Ok(rec)
    })
    .await?;
    let rec: serde_json::Value = serde_json::from_str(&started)?;
    let penv = &rec["env"];
    assert_eq!(penv[env::REDIS_URL], redis.url().as_str());
    assert_eq!(penv[env::STREAMS], "orders");
    assert_eq!(penv[env::GROUP], "billing");
    assert_eq!(penv[env::DEAD_LETTER_STREAM], "{orders}:dead");
    let uid = penv[env::POD_UID].as_str().unwrap_or_default();
    assert!(!uid.is_empty(), "the pod UID reaches the worker");
    assert_eq!(
        penv[env::CONSUMER].as_str().unwrap_or_default(),
        format!("{}.{uid}", penv["HOSTNAME"].as_str().unwrap_or_default()),
        "consumer name is the pod name and UID"
    );
    assert!(penv[env::DRAIN_TIMEOUT_MS].as_str().is_some_and(|ms| !ms.is_empty()));

    // Owned recovery CronJob.
    let cronjobs: Api<CronJob> = Api::namespaced(client.clone(), &ns.name);
    let cj = cronjobs.get("orders-recovery").await?;
    assert_eq!(cj.spec.as_ref().map(|s| s.schedule.as_str()), Some("*/7 * * * *"));
    assert_eq!(cj.owner_references().first().map(|o| o.kind.as_str()), Some("StreamConsumerGroup"));

    let reasons = event_reasons(&client, &ns.name, "orders").await?;
    assert!(reasons.iter().any(|r| r == "GroupCreated"), "{reasons:?}");

    // A Deployment someone deletes is repaired.
    deployments.delete("orders-worker", &DeleteParams::default()).await?;
    eventually("Deployment repaired", T, || async {
        Ok(deployments.get_opt("orders-worker").await?.filter(|d| d.metadata.deletion_timestamp.is_none()))
    })
    .await?;

    // A spec change rolls through: two replicas, and the user's edit of an
    // owned field is put back.
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns.name);
    scgs.patch(
        "orders",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"scaling": {"minReplicas": 2}}})),
    )
    .await?;
    eventually("2 replicas", T, || async {
        let d = deployments.get("orders-worker").await?;
        Ok((d.spec.and_then(|s| s.replicas) == Some(2)).then_some(()))
    })
    .await?;
    let scg = wait_condition(&client, &ns.name, "orders", "Ready", "True", None, T).await?;
    eventually("observedGeneration current", T, || async {
        let s = scgs.get("orders").await?;
        Ok((s.status.and_then(|s| s.observed_generation) == s.metadata.generation).then_some(()))
    })
    .await?;
    assert!(scg.metadata.generation >= Some(2));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_and_secret_failures_become_conditions_and_heal() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let ns = bed.namespace(&client, "e2e-fail").await?;
    install_operator(bed, &ns.name, &[]).await?;
    let records = tempfile::tempdir()?;
    let manifest = recording_manifest("p", "s", "g", &records.path().display().to_string(), "");
    run_ok(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(&manifest)).await?;

    // 1. The Secret does not exist.
    wait_condition(&client, &ns.name, "p", "Ready", "False", Some("SecretNotFound"), T).await?;
    // 2. It names a Redis nobody listens on.
    let closed = streamfleet_testbed::process::free_port()?;
    create_redis_secret(&client, &ns.name, "redis", &format!("redis://127.0.0.1:{closed}/")).await?;
    wait_condition(&client, &ns.name, "p", "GroupReady", "False", Some("RedisUnreachable"), T).await?;
    // 3. The password is wrong; it must not leak into the status.
    let dir = tempfile::tempdir()?;
    let redis = RedisServer::start_in(dir.path(), &["--requirepass", "s3cret"]).await?;
    create_redis_secret(&client, &ns.name, "redis", &format!("redis://:wrong-pw@127.0.0.1:{}/", redis.port)).await?;
    let scg = wait_condition(&client, &ns.name, "p", "GroupReady", "False", Some("RedisAuthFailed"), T).await?;
    let status_text = serde_json::to_string(&scg.status)?;
    assert!(!status_text.contains("wrong-pw"), "password in status: {status_text}");
    // 4. Fixed: it heals on its own.
    create_redis_secret(&client, &ns.name, "redis", &format!("redis://:s3cret@127.0.0.1:{}/", redis.port)).await?;
    wait_condition(&client, &ns.name, "p", "Ready", "True", None, T).await?;

    let reasons = event_reasons(&client, &ns.name, "p").await?;
    for r in ["SecretNotFound", "RedisUnreachable", "RedisAuthFailed"] {
        assert!(reasons.iter().any(|x| x == r), "no {r} Event in {reasons:?}");
    }
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns.name);
    for e in events.list(&ListParams::default()).await?.items {
        let note = e.note.unwrap_or_default();
        assert!(!note.contains("wrong-pw") && !note.contains("s3cret"), "secret in Event: {note}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_specs_are_refused_at_admission_naming_the_field() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let ns = bed.namespace(&client, "e2e-admit").await?;
    ensure_crd(bed).await?;
    let apply = |extra: &'static str, stream: &'static str, group: &'static str| {
        let manifest = recording_manifest("x", stream, group, "/tmp", extra);
        let ns = ns.name.clone();
        async move {
            let out = run_tool(bed, "kubectl", &["apply", "-n", &ns, "-f", "-"], Some(&manifest)).await?;
            Ok::<_, anyhow::Error>((out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned()))
        }
    };
    let cases = [
        (
            "  scaling: {minReplicas: 5, maxReplicas: 2}\n",
            "spec.scaling.minReplicas must not exceed spec.scaling.maxReplicas",
        ),
        ("  startId: \"yesterday\"\n", "spec.startId"),
        ("  recovery: {schedule: \"every minute\"}\n", "spec.recovery.schedule"),
        ("  recovery: {schedule: \"61 * * * *\"}\n", "spec.recovery.schedule: the minute field takes 0-59"),
        ("  recovery: {schedule: \"0 24 * * *\"}\n", "spec.recovery.schedule: the hour field takes 0-23"),
        ("  scaling: {maxReplicas: 0}\n", "spec.scaling.maxReplicas"),
        ("  deletionPolicy: Shred\n", "spec.deletionPolicy"),
        // A dead-letter stream that is the source would feed itself forever.
        ("  recovery: {deadLetterStream: s}\n", "spec.recovery.deadLetterStream must differ from spec.stream"),
    ];
    for (extra, expected) in cases {
        let (ok, stderr) = apply(extra, "s", "g").await?;
        assert!(!ok, "accepted: {extra}");
        assert!(stderr.contains(expected), "for {extra:?} expected {expected:?} in: {stderr}");
    }
    let (ok, stderr) = apply("", "", "g").await?;
    assert!(!ok && stderr.contains("spec.stream"), "{stderr}");

    // Valid, then an attempt to rename the group or stream.
    let (ok, stderr) = apply("", "s", "g").await?;
    assert!(ok, "{stderr}");
    let (ok, stderr) = apply("", "s", "other").await?;
    assert!(!ok && stderr.contains("spec.group is immutable"), "{stderr}");
    let (ok, stderr) = apply("", "s2", "g").await?;
    assert!(!ok && stderr.contains("spec.stream is immutable"), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletion_policy_delete_destroys_the_group_and_retain_keeps_it() -> Result<()> {
    let f = Fixture::start("e2e-delete", &[]).await?;
    let (bed, client, ns, redis) = (f.bed, f.client.clone(), &f.ns, &f.redis);
    let records = tempfile::tempdir()?;
    let dir = records.path().display().to_string();
    let keep = recording_manifest("keep", "s", "kept", &dir, "");
    let drop = recording_manifest("drop", "s", "dropped", &dir, "  deletionPolicy: Delete");
    run_ok(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(&format!("{keep}---\n{drop}"))).await?;
    wait_condition(&client, &ns.name, "keep", "GroupReady", "True", None, T).await?;
    let dropped = wait_condition(&client, &ns.name, "drop", "GroupReady", "True", None, T).await?;
    assert!(dropped.finalizers().iter().any(|f| f == "streamfleet.io/delete-group"));
    assert_eq!(group_info(redis, "s").await?.len(), 2);

    run_ok(bed, "kubectl", &["delete", "-n", &ns.name, "scg", "keep", "drop", "--wait=true", "--timeout=60s"], None)
        .await?;
    let groups: Vec<String> = group_info(redis, "s").await?.into_iter().map(|(g, _)| g).collect();
    assert_eq!(groups, vec!["kept".to_string()]);
    // The owned Deployments go with their owners (garbage collector).
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    eventually("owned Deployments collected", T, || async {
        let names: Vec<String> =
            deployments.list(&ListParams::default()).await?.items.iter().map(|d| d.name_any()).collect();
        Ok((!names.iter().any(|n| n.ends_with("-worker"))).then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_hands_over_with_one_leader_at_a_time() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let ns = bed.namespace(&client, "e2e-leader").await?;
    install_operator(bed, &ns.name, &["--set", "replicaCount=2"]).await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let holder = |l: Lease| l.spec.and_then(|s| s.holder_identity);
    let leader =
        eventually("a leader", T, || async { Ok(leases.get_opt("streamfleet-leader").await?.and_then(holder)) })
            .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let operator_pods: Vec<String> = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=streamfleet-operator"))
        .await?
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert_eq!(operator_pods.len(), 2);
    assert!(operator_pods.contains(&leader));
    let standby = operator_pods.iter().find(|p| **p != leader).cloned().unwrap_or_default();

    let redis = RedisServer::start().await?;
    create_redis_secret(&client, &ns.name, "redis", &redis.url()).await?;
    let records = tempfile::tempdir()?;
    let dir = records.path().display().to_string();
    run_ok(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(&recording_manifest("a", "s", "g1", &dir, "")))
        .await?;
    wait_condition(&client, &ns.name, "a", "GroupReady", "True", None, T).await?;
    let leading = |pod: &str| {
        let log = std::fs::read_to_string(bed.pod_dir(&ns.name, pod).join("operator.log")).unwrap_or_default();
        log.matches(" leading ").count()
    };
    assert_eq!(leading(&standby), 0, "the standby must not act while the leader holds the lease");

    // Kill the leader: it releases the lease on SIGTERM and another replica
    // (the standby, or the leader's replacement, whichever asks first) takes it.
    pods.delete(&leader, &DeleteParams::default()).await?;
    let successor = eventually("a new leader", T, || async {
        Ok(leases.get("streamfleet-leader").await.ok().and_then(holder).filter(|h| *h != leader))
    })
    .await?;
    let live = pods.get_opt(&successor).await?;
    assert!(live.is_some_and(|p| p.metadata.deletion_timestamp.is_none()), "{successor} is not a live pod");
    // Exactly one replica has become leader since: the successor.
    let all: Vec<String> = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=streamfleet-operator"))
        .await?
        .items
        .iter()
        .map(|p| p.name_any())
        .filter(|p| *p != leader)
        .collect();
    for pod in &all {
        assert_eq!(leading(pod), usize::from(*pod == successor), "{pod} leadership log");
    }
    run_ok(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(&recording_manifest("b", "s", "g2", &dir, "")))
        .await?;
    wait_condition(&client, &ns.name, "b", "GroupReady", "True", None, T).await?;
    let groups: Vec<String> = group_info(&redis, "s").await?.into_iter().map(|(g, _)| g).collect();
    assert_eq!(groups, vec!["g1".to_string(), "g2".to_string()]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_object_is_reported_and_does_not_stall_the_others() -> Result<()> {
    let f = Fixture::start("e2e-guard", &[]).await?;
    let (bed, client, ns, redis) = (f.bed, f.client.clone(), &f.ns, &f.redis);
    // The pod template is schemaless in the CRD (the API server validates it on
    // the Deployment), so this passes admission but cannot be parsed.
    let broken = r#"apiVersion: streamfleet.io/v1alpha1
kind: StreamConsumerGroup
metadata:
  name: broken
spec:
  redis:
    urlSecretRef: {name: redis, key: url}
  stream: s
  group: broken
  worker:
    template:
      spec:
        containers: "not a list"
"#;
    run_ok(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(broken)).await?;
    let records = tempfile::tempdir()?;
    let good = recording_manifest("good", "s", "good", &records.path().display().to_string(), "");
    run_ok(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(&good)).await?;
    wait_condition(&client, &ns.name, "good", "Ready", "True", None, T).await?;
    eventually("InvalidObject event", T, || async {
        let reasons = event_reasons(&client, &ns.name, "broken").await?;
        Ok(reasons.iter().any(|r| r == "InvalidObject").then_some(()))
    })
    .await?;
    let groups: Vec<String> = group_info(redis, "s").await?.into_iter().map(|(g, _)| g).collect();
    assert_eq!(groups, vec!["good".to_string()]);
    Ok(())
}
