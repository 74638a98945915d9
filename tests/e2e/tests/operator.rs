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
    let sweep_pod = [
        "--set-string",
        r"sweep.podAnnotations.sidecar\.istio\.io/inject=false",
        "--set",
        "sweep.tolerations[0].key=dedicated,sweep.tolerations[0].operator=Exists",
    ];
    let f = Fixture::start("e2e-apply", &sweep_pod).await?;
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
    )
    // A worker option through a real API server (kept by the CRD's schema,
    // not pruned) to the worker's environment.
    .replace("  worker:\n    template:", "  worker:\n    handlerTimeoutSeconds: 90\n    template:");
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
    assert_eq!(penv[env::DEAD_LETTER_STREAM], "{orders}:dead:billing");
    let uid = penv[env::POD_UID].as_str().unwrap_or_default();
    assert!(!uid.is_empty(), "the pod UID reaches the worker");
    assert_eq!(
        penv[env::CONSUMER].as_str().unwrap_or_default(),
        format!("{}.{uid}", penv["HOSTNAME"].as_str().unwrap_or_default()),
        "consumer name is the pod name and UID"
    );
    assert!(penv[env::DRAIN_TIMEOUT_MS].as_str().is_some_and(|ms| !ms.is_empty()));
    assert_eq!(penv[env::HANDLER_TIMEOUT_MS], "90000");

    // The operator made its digest key, and may create no other Secret
    // (RBAC cannot limit `create` to a name; the chart's admission policy
    // does): no service-account token can be minted with its account.
    let operator =
        deployments.list(&ListParams::default().labels("app.kubernetes.io/name=streamfleet-operator")).await?;
    let account = operator.items[0]
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_default();
    let as_operator = format!("--as=system:serviceaccount:{}:{account}", ns.name);
    let key = run_tool(
        f.bed,
        "kubectl",
        &["get", "secret", "-n", &ns.name, "-l", "app.kubernetes.io/managed-by=streamfleet-operator", "-o", "name"],
        None,
    )
    .await?;
    assert!(String::from_utf8_lossy(&key.stdout).trim().ends_with("-digest-key"), "{key:?}");
    let other = "{apiVersion: v1, kind: Secret, metadata: {name: other}, stringData: {k: v}}".to_string();
    let token = format!(
        "{{apiVersion: v1, kind: Secret, type: kubernetes.io/service-account-token, \
         metadata: {{name: token, annotations: {{kubernetes.io/service-account.name: {account}}}}}}}"
    );
    for manifest in [other, token] {
        let args = ["create", "-n", &ns.name, as_operator.as_str(), "-f", "-"];
        let out = run_tool(f.bed, "kubectl", &args, Some(&manifest)).await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("may create one Secret only"), "{manifest}: {stderr}");
    }

    // Owned recovery CronJob.
    let cronjobs: Api<CronJob> = Api::namespaced(client.clone(), &ns.name);
    let cj = cronjobs.get("orders-recovery").await?;
    assert_eq!(cj.spec.as_ref().map(|s| s.schedule.as_str()), Some("*/7 * * * *"));
    assert_eq!(cj.owner_references().first().map(|o| o.kind.as_str()), Some("StreamConsumerGroup"));
    // The chart's sweep settings reach the Jobs the operator creates.
    let job = cj.spec.clone().unwrap().job_template.spec.unwrap();
    assert_eq!(job.active_deadline_seconds, Some(900), "sweep.activeDeadlineSeconds");
    let sweep = &job.template.spec.clone().unwrap().containers[0];
    let limits = sweep.resources.clone().and_then(|r| r.limits).unwrap_or_default();
    assert_eq!(limits.get("memory").map(|q| q.0.as_str()), Some("256Mi"), "sweep.resources");
    let annotations = job.template.metadata.clone().and_then(|m| m.annotations).unwrap_or_default();
    assert_eq!(annotations.get("sidecar.istio.io/inject").map(String::as_str), Some("false"), "sweep.podAnnotations");
    let tolerations = job.template.spec.clone().and_then(|s| s.tolerations).unwrap_or_default();
    assert_eq!(tolerations[0].key.as_deref(), Some("dedicated"), "sweep.tolerations");

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
    // 3. A Redis older than 7.0 (6.2.14): refused, naming its version.
    let old = RedisServer::start_binary(&streamfleet_testbed::redis_server::old_server_binary()?).await?;
    create_redis_secret(&client, &ns.name, "redis", &old.url()).await?;
    let scg = wait_condition(&client, &ns.name, "p", "GroupReady", "False", Some("RedisUnsupported"), T).await?;
    let conditions = scg.status.unwrap_or_default().conditions;
    let ready = conditions.iter().find(|c| c.type_ == "Ready").map(|c| c.message.clone()).unwrap_or_default();
    assert!(ready.contains("version 6.2.14") && ready.contains("7.0 or later"), "{ready}");
    let keys: i64 = redis::cmd("DBSIZE").query_async(&mut old.connection().await?).await?;
    assert_eq!(keys, 0, "nothing was written to the old server");
    // 4. The password is wrong; it must not leak into the status.
    let dir = tempfile::tempdir()?;
    let redis = RedisServer::start_in(dir.path(), &["--requirepass", "s3cret"]).await?;
    create_redis_secret(&client, &ns.name, "redis", &format!("redis://:wrong-pw@127.0.0.1:{}/", redis.port)).await?;
    let scg = wait_condition(&client, &ns.name, "p", "GroupReady", "False", Some("RedisAuthFailed"), T).await?;
    let status_text = serde_json::to_string(&scg.status)?;
    assert!(!status_text.contains("wrong-pw"), "password in status: {status_text}");
    // 5. Fixed: it heals on its own.
    create_redis_secret(&client, &ns.name, "redis", &format!("redis://:s3cret@127.0.0.1:{}/", redis.port)).await?;
    wait_condition(&client, &ns.name, "p", "Ready", "True", None, T).await?;

    let reasons = event_reasons(&client, &ns.name, "p").await?;
    for r in ["SecretNotFound", "RedisUnreachable", "RedisUnsupported", "RedisAuthFailed"] {
        assert!(reasons.iter().any(|x| x == r), "no {r} Event in {reasons:?}");
    }
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns.name);
    let events = events.list(&ListParams::default()).await?.items;
    for e in &events {
        let note = e.note.clone().unwrap_or_default();
        assert!(!note.contains("wrong-pw") && !note.contains("s3cret"), "secret in Event: {note}");
    }
    // The old server's Warning names its version and what is needed.
    let unsupported = events.iter().find(|e| e.reason.as_deref() == Some("RedisUnsupported")).expect("the Event");
    let note = unsupported.note.clone().unwrap_or_default();
    assert_eq!(unsupported.type_.as_deref(), Some("Warning"));
    assert!(note.contains("6.2.14") && note.contains("7.0 or later"), "{note}");
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
        // Letters dropped before anyone could read them.
        ("  recovery: {deadLetterMaxAgeSeconds: 30}\n", "spec.recovery.deadLetterMaxAgeSeconds"),
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
    // Workers are told the streams comma-separated and trimmed: a name that
    // would reach them as another is refused.
    let (ok, stderr) = apply("", "a,b", "g").await?;
    assert!(!ok && stderr.contains("spec.stream"), "{stderr}");
    let (ok, stderr) = apply("", "\"s\\u00A0\"", "g").await?;
    assert!(!ok && stderr.contains("spec.stream"), "a no-break space at its end: {stderr}");
    // Where Redis is and how to authenticate, refused naming the field.
    let redis_cases = [
        (
            "    url: redis://db:6379\n    urlSecretRef: {name: redis, key: url}",
            "spec.redis: set exactly one of url and urlSecretRef",
        ),
        ("    mode: Standalone", "spec.redis: set exactly one of url and urlSecretRef"),
        ("    url: redis://u:pw@db:6379", "spec.redis.url must carry no credentials"),
        ("    url: redis://db:6379/?password=pw", "spec.redis.url must carry no credentials or query"),
        ("    url: http://db:6379", "spec.redis.url must start with redis:// or rediss://"),
        ("    url: redis://db:6379\n    username: u", "spec.redis.username needs spec.redis.passwordSecretRef"),
        (
            "    url: redis://db:6379\n    usernameSecretRef: {name: r, key: user}",
            "spec.redis.usernameSecretRef needs spec.redis.passwordSecretRef",
        ),
        (
            "    url: redis://db:6379\n    username: u\n    usernameSecretRef: {name: r, key: user}\n    passwordSecretRef: {name: r, key: p}",
            "spec.redis: set at most one of username and usernameSecretRef",
        ),
    ];
    for (redis, expected) in redis_cases {
        let manifest = manifest_with_redis("x", "s", "g", "streamfleet/testproc", &[], "", redis);
        let out = run_tool(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(&manifest)).await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "accepted: {redis}");
        assert!(stderr.contains(expected), "for {redis:?} expected {expected:?} in: {stderr}");
    }

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
    let release =
        install_operator(bed, &ns.name, &["--set", "replicaCount=2", "--set", "podDisruptionBudget.enabled=true"])
            .await?;
    // One Lease per release: two releases in one namespace never share a leader.
    let lease_name = format!("{release}-streamfleet-leader");
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let holder = |l: Lease| l.spec.and_then(|s| s.holder_identity);
    let leader =
        eventually("a leader", T, || async { Ok(leases.get_opt(&lease_name).await?.and_then(holder)) }).await?;
    let budgets: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> = Api::namespaced(client.clone(), &ns.name);
    let budget = eventually("the budget counts both replicas", T, || async {
        let pdb = budgets.get(&format!("{release}-streamfleet")).await?;
        Ok(pdb.status.filter(|s| s.expected_pods == 2))
    })
    .await?;
    assert_eq!(budget.disruptions_allowed, 1, "a drain may take one operator pod, never the last");
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
        Ok(leases.get(&lease_name).await.ok().and_then(holder).filter(|h| *h != leader))
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
async fn a_malformed_object_is_reported_and_does_not_stall_the_others_and_a_template_typo_is_named() -> Result<()> {
    let f = Fixture::start("e2e-guard", &[]).await?;
    let (bed, client, ns, redis) = (f.bed, f.client.clone(), &f.ns, &f.redis);
    // A port past 32 bits where an int or a string may go: Kubernetes' own
    // schema (the CRD's for the pod template) admits it, but it cannot be
    // parsed.
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
        containers:
          - name: w
            image: worker
            livenessProbe: {httpGet: {port: 3000000000}}
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

    // A typo in the pod template: the CRD carries the real PodTemplateSpec
    // schema, so the API server refuses it naming the field (kubectl asks
    // for strict field validation) and nothing is created.
    let typo = r#"apiVersion: streamfleet.io/v1alpha1
kind: StreamConsumerGroup
metadata:
  name: typo
spec:
  redis:
    urlSecretRef: {name: redis, key: url}
  stream: t
  group: typo
  worker:
    template:
      spec:
        containers:
          - name: w
            image: worker
            resoures: {limits: {cpu: "1"}}
"#;
    let field = "spec.worker.template.spec.containers[0].resoures";
    let refused = run_tool(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(typo)).await?;
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains(&format!("unknown field \"{field}\"")), "{said}");
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns.name);
    assert!(scgs.get_opt("typo").await?.is_none(), "a refused resource was created");
    // A client that asks only to be warned (Helm's default): it is told,
    // the field is dropped before it is stored, and the other fields stand.
    let warned = run_tool(bed, "kubectl", &["apply", "--validate=warn", "-n", &ns.name, "-f", "-"], Some(typo)).await?;
    let said = String::from_utf8_lossy(&warned.stderr);
    assert!(warned.status.success() && said.contains(&format!("unknown field \"{field}\"")), "{said}");
    let stored = serde_json::to_value(scgs.get("typo").await?.spec.worker.template)?;
    assert_eq!(stored["spec"]["containers"][0]["image"], "worker", "{stored}");
    assert!(stored["spec"]["containers"][0].get("resoures").is_none(), "{stored}");
    Ok(())
}

/// No `/scale` on the resource: its replicas are the scaling policy's. By
/// hand, as the README says: pause the policy, then `kubectl scale` the
/// worker Deployment; the operator holds that count, and takes over again
/// once unpaused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_pipeline_keeps_the_replicas_scaled_by_hand() -> Result<()> {
    let f = Fixture::start("e2e-handscale", &[]).await?;
    let (bed, client, ns) = (f.bed, f.client.clone(), f.ns.name.clone());
    let records = tempfile::tempdir()?;
    let dir = records.path().display().to_string();
    let spec = "  scaling: {minReplicas: 1, maxReplicas: 3, pollIntervalSeconds: 1, paused: true}";
    f.apply(&recording_manifest("p", "orders", "billing", &dir, spec)).await?;
    wait_condition(&client, &ns, "p", "Ready", "True", None, T).await?;
    run_ok(bed, "kubectl", &["scale", "-n", &ns, "deployment/p-worker", "--replicas", "2"], None).await?;
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    let desired =
        || async { Ok::<_, anyhow::Error>(scgs.get("p").await?.status.and_then(|s| s.replicas).map(|r| r.desired)) };
    eventually("desired 2 in the status", T, || async { Ok(desired().await?.filter(|d| *d == 2)) }).await?;
    // Several polls later, still the count set by hand.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    assert_eq!(deployments.get("p-worker").await?.spec.and_then(|s| s.replicas), Some(2));
    // Unpaused: the policy decides again (no lag: down to minReplicas).
    let unpaused = "  scaling: {minReplicas: 1, maxReplicas: 3, pollIntervalSeconds: 1}";
    f.apply(&recording_manifest("p", "orders", "billing", &dir, unpaused)).await?;
    eventually("back to the policy's 1", T, || async {
        let replicas = deployments.get("p-worker").await?.spec.and_then(|s| s.replicas);
        Ok((replicas == Some(1)).then_some(()))
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspended_pipeline_runs_no_workers_nor_recovery_and_still_reports_then_resumes() -> Result<()> {
    let mut f = Fixture::start("e2e-suspend", &[]).await?;
    let (bed, client, ns) = (f.bed, f.client.clone(), f.ns.name.clone());
    let records = tempfile::tempdir()?;
    let spec = "  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 1}";
    f.apply(&recording_manifest("p", "orders", "billing", &records.path().display().to_string(), spec)).await?;
    wait_condition(&client, &ns, "p", "Ready", "True", None, T).await?;
    let (deployments, cronjobs): (Api<Deployment>, Api<CronJob>) =
        (Api::namespaced(client.clone(), &ns), Api::namespaced(client.clone(), &ns));
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    let replicas = |d: Deployment| d.spec.and_then(|s| s.replicas);
    let suspended = |c: CronJob| c.spec.and_then(|s| s.suspend);
    assert_eq!(replicas(deployments.get("p-worker").await?), Some(1));
    assert_eq!(suspended(cronjobs.get("p-recovery").await?), Some(false));

    run_ok(
        bed,
        "kubectl",
        &["patch", "scg", "p", "-n", &ns, "--type=merge", "-p", r#"{"spec":{"suspend":true}}"#],
        None,
    )
    .await?;
    eventually("workers at zero, recovery suspended", T, || async {
        let zero = replicas(deployments.get("p-worker").await?) == Some(0);
        Ok((zero && suspended(cronjobs.get("p-recovery").await?) == Some(true)).then_some(()))
    })
    .await?;
    // Entries keep arriving: the figures still move while suspended.
    for i in 0..7 {
        let _: String = f.conn.xadd("orders", "*", &[("order_id", i.to_string())]).await?;
    }
    let status = eventually("Suspended with the new lag", T, || async {
        let s = scgs.get("p").await?.status.unwrap_or_default();
        Ok((s.health == Some(streamfleet_crd::Health::Suspended) && s.lag == Some(7)).then_some(s))
    })
    .await?;
    let degraded = status.conditions.iter().find(|c| c.type_ == "Degraded").unwrap();
    assert_eq!(degraded.status, "False", "suspended on purpose is not degraded: {degraded:?}");
    let table = run_ok(bed, "kubectl", &["get", "scg", "p", "-n", &ns], None).await?;
    assert!(table.contains("Suspended"), "{table}");
    let announced = wait_event(&client, &ns, "p", "Suspended", T).await?;
    assert_eq!(announced.type_.as_deref(), Some("Normal"));

    run_ok(
        bed,
        "kubectl",
        &["patch", "scg", "p", "-n", &ns, "--type=merge", "-p", r#"{"spec":{"suspend":false}}"#],
        None,
    )
    .await?;
    eventually("workers back, recovery scheduled again", T, || async {
        let one = replicas(deployments.get("p-worker").await?) == Some(1);
        let health = scgs.get("p").await?.status.unwrap_or_default().health;
        let running = suspended(cronjobs.get("p-recovery").await?) == Some(false);
        Ok((one && running && health != Some(streamfleet_crd::Health::Suspended)).then_some(()))
    })
    .await?;
    let resumed = eventually("a Resumed Event", T, || async {
        let n = event_count(&client, &ns, "p", "Resumed").await?;
        Ok((n > 0).then_some(n))
    })
    .await?;
    assert_eq!(resumed, 1, "announced once: {:?}", event_reasons(&client, &ns, "p").await?);
    assert_eq!(event_count(&client, &ns, "p", "Suspended").await?, 1, "announced once");
    Ok(())
}
