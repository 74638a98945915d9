//! Proves the test bed itself: the real kube-controller-manager turns
//! Deployments and CronJobs into pods, and the kubelet stand-in runs them as
//! local processes with the right env, identity and signals.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt as _};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;
use streamfleet_testbed::{TestBed, eventually};

const TIMEOUT: Duration = Duration::from_secs(60);

fn started(dir: &Path) -> Vec<Value> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "start"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|text| serde_json::from_str(&text).ok())
        .collect()
}

fn count_with_ext(dir: &Path, ext: &str) -> usize {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == ext))
        .count()
}

fn pid_alive(pid: u64) -> bool {
    // A zombie is a process that already exited and has not been reaped yet.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map(|s| !s.contains(") Z ")).unwrap_or(false)
}

fn testproc_deployment(name: &str, replicas: i32, out_dir: &Path) -> Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "main",
                        "image": "streamfleet/testproc:dev",
                        "args": ["run"],
                        "env": [
                            {"name": "TESTPROC_DIR", "value": out_dir.display().to_string()},
                            {"name": "TESTPROC_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                            {"name": "REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "redis", "key": "url"}}},
                            {"name": "GREETING", "value": "hello-$(POD_NAMESPACE)"}
                        ]
                    }]
                }
            }
        }
    }))?)
}

async fn scale(client: &Client, ns: &str, name: &str, replicas: i32) -> Result<()> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    api.patch(name, &PatchParams::default(), &Patch::Merge(json!({"spec": {"replicas": replicas}}))).await?;
    Ok(())
}

async fn ready_replicas(client: &Client, ns: &str, name: &str) -> Result<i32> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    Ok(api.get(name).await?.status.and_then(|s| s.ready_replicas).unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployment_replicas_become_local_processes_and_stop_with_sigterm() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let ns = bed.namespace(&client, "rig-deploy").await?;
    let out = tempfile::tempdir()?;

    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "redis"}, "stringData": {"url": "redis://127.0.0.1:1/"}
    }))?;
    Api::<Secret>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &secret).await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    deployments.create(&PostParams::default(), &testproc_deployment("tp", 2, out.path())?).await?;

    // Two replicas → two real processes, each with its own resolved env.
    let records = eventually("2 processes", TIMEOUT, || async {
        let r = started(out.path());
        Ok((r.len() == 2).then_some(r))
    })
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let pod_names: Vec<String> = pods.list(&ListParams::default()).await?.items.iter().map(|p| p.name_any()).collect();
    for r in &records {
        let env = &r["env"];
        assert!(pod_names.contains(&env["TESTPROC_NAME"].as_str().unwrap_or_default().to_string()), "{env}");
        assert_eq!(env["POD_NAMESPACE"], ns.name.as_str());
        assert_eq!(env["REDIS_URL"], "redis://127.0.0.1:1/");
        assert_eq!(env["GREETING"], format!("hello-{}", ns.name));
        assert!(pid_alive(r["pid"].as_u64().unwrap_or(0)));
    }
    eventually("2 ready replicas", TIMEOUT, || async {
        Ok((ready_replicas(&client, &ns.name, "tp").await? == 2).then_some(()))
    })
    .await?;

    // The pod runs as its ServiceAccount: authenticated, and denied by RBAC.
    let kubeconfig = records[0]["env"]["KUBECONFIG"].as_str().unwrap_or_default().to_string();
    let pod_client = streamfleet_testbed::control_plane::client_from(Path::new(&kubeconfig)).await?;
    let denied = Api::<Pod>::namespaced(pod_client, &ns.name).list(&ListParams::default()).await;
    match denied {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403);
            assert!(s.message.contains(&format!("system:serviceaccount:{}:default", ns.name)), "{}", s.message);
        }
        other => panic!("expected 403 for the default service account, got {other:?}"),
    }

    // Scale up: one more process.
    scale(&client, &ns.name, "tp", 3).await?;
    eventually("3rd process", TIMEOUT, || async { Ok((started(out.path()).len() == 3).then_some(())) }).await?;
    eventually("3 ready replicas", TIMEOUT, || async {
        Ok((ready_replicas(&client, &ns.name, "tp").await? == 3).then_some(()))
    })
    .await?;

    // Scale to zero: every process gets SIGTERM, exits, and its pod goes away.
    scale(&client, &ns.name, "tp", 0).await?;
    eventually("3 SIGTERMs", TIMEOUT, || async { Ok((count_with_ext(out.path(), "sigterm") == 3).then_some(())) })
        .await?;
    eventually("pods removed", TIMEOUT, || async {
        Ok(pods.list(&ListParams::default()).await?.items.is_empty().then_some(()))
    })
    .await?;
    for r in started(out.path()) {
        let pid = r["pid"].as_u64().unwrap_or(0);
        eventually("process exit", TIMEOUT, || async { Ok((!pid_alive(pid)).then_some(())) }).await?;
    }
    Ok(())
}

fn job_template(out_dir: &Path, exit_code: u8) -> Value {
    json!({
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{
                    "name": "main",
                    "image": "streamfleet/testproc",
                    "args": ["exit", exit_code.to_string()],
                    "env": [
                        {"name": "TESTPROC_DIR", "value": out_dir.display().to_string()},
                        {"name": "TESTPROC_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                    ]
                }]
            }}
        }
    })
}

fn job_condition(job: &Job, kind: &str) -> bool {
    job.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == kind && c.status == "True"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cronjob_controller_creates_a_job_that_runs_to_succeeded() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let ns = bed.namespace(&client, "rig-cron").await?;
    let out = tempfile::tempdir()?;

    let cron: CronJob = serde_json::from_value(json!({
        "metadata": {"name": "sweep"},
        "spec": {"schedule": "* * * * *", "concurrencyPolicy": "Forbid", "jobTemplate": job_template(out.path(), 0)}
    }))?;
    Api::<CronJob>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &cron).await?;

    // The real cronjob controller fires at the next minute boundary.
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    let job = eventually("a Job from the CronJob", Duration::from_secs(90), || async {
        Ok(jobs.list(&ListParams::default()).await?.items.into_iter().next())
    })
    .await?;
    let owner = job.owner_references().first().map(|o| (o.kind.clone(), o.name.clone()));
    assert_eq!(owner, Some(("CronJob".to_string(), "sweep".to_string())));
    let name = job.name_any();
    eventually("Job Complete", TIMEOUT, || async {
        let job = jobs.get(&name).await?;
        Ok(job_condition(&job, "Complete").then_some(job))
    })
    .await?;
    assert!(count_with_ext(out.path(), "start") >= 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_container_fails_its_job() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let ns = bed.namespace(&client, "rig-fail").await?;
    let out = tempfile::tempdir()?;
    let mut job: Value = job_template(out.path(), 3);
    job["metadata"] = json!({"name": "fails"});
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    jobs.create(&PostParams::default(), &serde_json::from_value(job)?).await?;
    eventually("Job Failed", TIMEOUT, || async {
        Ok(job_condition(&jobs.get("fails").await?, "Failed").then_some(()))
    })
    .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let pod = pods.list(&ListParams::default()).await?.items.into_iter().next();
    let status = pod.and_then(|p| p.status).unwrap_or_default();
    assert_eq!(status.phase.as_deref(), Some("Failed"));
    let exit = status.container_statuses.unwrap_or_default()[0]
        .state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .map(|t| t.exit_code);
    assert_eq!(exit, Some(3));
    Ok(())
}
