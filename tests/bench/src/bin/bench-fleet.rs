//! One operator carrying a fleet of StreamConsumerGroups on the local test
//! bed (real API server, real Redis): first 10 resources (the baseline),
//! then 1,000 (BENCH_RESOURCES). For each: time until all are GroupReady, and
//! over a quiet window of several poll cycles the reconciles run, their mean
//! duration, the operator's CPU time, its API writes (should be 0), changes
//! of the resources (should be 0) and of their Deployments (only status
//! updates by kube-controller-manager, which rolls out 1,000 Deployments at
//! its own rate limit), and resident memory.
//!
//! `cargo build --release --workspace --bins && target/release/bench-fleet`

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client, CustomResourceExt as _, ResourceExt as _};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_testbed::process::free_port;
use streamfleet_testbed::{RedisServer, TestBed, eventually, tools};

const NS: &str = "fleet";
const POLL_SECONDS: u64 = 10;

fn scg(i: usize) -> Result<StreamConsumerGroup> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
        "metadata": {"name": format!("p{i:04}")},
        "spec": {
            "redis": {"urlSecretRef": {"name": "redis", "key": "url"}},
            "stream": format!("s{i:04}"), "group": "g",
            "scaling": {"minReplicas": 0, "maxReplicas": 1, "paused": true, "pollIntervalSeconds": POLL_SECONDS},
            "recovery": {"schedule": "0 0 1 1 *"},
            "worker": {"template": {"spec": {"containers": [{"name": "w", "image": "streamfleet/testproc"}]}}}
        }
    }))?)
}

async fn metric(port: u16, name: &str) -> Result<f64> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await?;
    let mut text = String::new();
    s.read_to_string(&mut text).await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// (utime + stime) in seconds, and resident memory in MiB, of a process.
fn proc_usage(pid: u32) -> Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let cpu = (ticks(11) + ticks(12)) / 100.0;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    Ok((cpu, rss_kib / 1024.0))
}

async fn versions<K>(api: &Api<K>) -> Result<BTreeMap<String, String>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(|o| (o.name_any(), o.resource_version().unwrap_or_default()))
        .collect())
}

struct Phase {
    resources: usize,
    ready_after: Duration,
    reconciles: f64,
    mean_reconcile_ms: f64,
    cpu_seconds: f64,
    writes: f64,
    scg_changes: usize,
    deployment_changes: usize,
    rss_mib: f64,
}

async fn measure(client: &Client, port: u16, pid: u32, created_at: Instant, total: usize) -> Result<Phase> {
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), NS);
    eventually("all GroupReady", Duration::from_secs(900), || async {
        let ready = scgs
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|s| {
                s.status
                    .as_ref()
                    .is_some_and(|st| st.conditions.iter().any(|c| c.type_ == "GroupReady" && c.status == "True"))
            })
            .count();
        Ok((ready == total).then_some(()))
    })
    .await?;
    let ready_after = created_at.elapsed();
    // Let the first cycle's status writes and rollouts settle.
    tokio::time::sleep(Duration::from_secs(POLL_SECONDS + 5)).await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let (rv_scg, rv_dep) = (versions(&scgs).await?, versions(&deployments).await?);
    let (writes0, rec0, sum0, cnt0) = (
        metric(port, "streamfleet_api_writes_total").await?,
        metric(port, "streamfleet_reconciles_total").await?,
        metric(port, "streamfleet_reconcile_duration_seconds_sum").await?,
        metric(port, "streamfleet_reconcile_duration_seconds_count").await?,
    );
    let (cpu0, _) = proc_usage(pid)?;
    tokio::time::sleep(Duration::from_secs(POLL_SECONDS * 3)).await;
    let (writes1, rec1, sum1, cnt1) = (
        metric(port, "streamfleet_api_writes_total").await?,
        metric(port, "streamfleet_reconciles_total").await?,
        metric(port, "streamfleet_reconcile_duration_seconds_sum").await?,
        metric(port, "streamfleet_reconcile_duration_seconds_count").await?,
    );
    let (cpu1, rss) = proc_usage(pid)?;
    let changed = |a: &BTreeMap<String, String>, b: &BTreeMap<String, String>| {
        a.iter().filter(|(k, v)| b.get(*k) != Some(v)).count()
    };
    let scg_changes = changed(&rv_scg, &versions(&scgs).await?);
    let deployment_changes = changed(&rv_dep, &versions(&deployments).await?);
    Ok(Phase {
        resources: total,
        ready_after,
        reconciles: rec1 - rec0,
        mean_reconcile_ms: if cnt1 > cnt0 { (sum1 - sum0) / (cnt1 - cnt0) * 1000.0 } else { 0.0 },
        cpu_seconds: cpu1 - cpu0,
        writes: writes1 - writes0,
        scg_changes,
        deployment_changes,
        rss_mib: rss,
    })
}

async fn create(client: &Client, range: std::ops::Range<usize>) -> Result<()> {
    use futures::StreamExt as _;
    let api: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), NS);
    let results: Vec<Result<()>> = futures::stream::iter(range)
        .map(|i| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &scg(i)?).await?;
                Ok(())
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect()
}

#[tokio::main]
async fn main() -> Result<()> {
    let total: usize = std::env::var("BENCH_RESOURCES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let dir = tools::workspace_root().join("target/bench-fleet");
    let bed = TestBed::start_detached(dir.clone())?;
    let client = bed.client().await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.create(&PostParams::default(), &StreamConsumerGroup::crd()).await?;
    let redis = RedisServer::start().await?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &serde_json::from_value(serde_json::json!({"metadata": {"name": NS}}))?)
        .await?;
    let secret: Secret =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "redis"}, "stringData": {"url": redis.url()}}))?;
    Api::<Secret>::namespaced(client.clone(), NS).create(&PostParams::default(), &secret).await?;
    eventually("CRD served", Duration::from_secs(60), || async {
        Ok(Api::<StreamConsumerGroup>::namespaced(client.clone(), NS)
            .list(&ListParams::default())
            .await
            .ok()
            .map(|_| ()))
    })
    .await?;

    let port = free_port()?;
    let operator = tools::cargo_bin("streamfleet")?;
    let args: Vec<String> = [
        "run",
        "--leader-election=false",
        "--watch-namespace",
        NS,
        "--health-addr",
        &format!("127.0.0.1:{port}"),
        "--log-format",
        "text",
        "--log",
        "warn",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let daemon = {
        let mut cmd = std::process::Command::new(&operator);
        cmd.args(&args).env("KUBECONFIG", &bed.kubeconfig);
        let log = std::fs::File::create(dir.join("operator.log"))?;
        cmd.stdout(log.try_clone()?).stderr(log);
        streamfleet_testbed::process::die_with_parent(&mut cmd);
        cmd.spawn().context("starting the operator")?
    };
    let pid = daemon.id();

    let mut phases = Vec::new();
    for (from, to) in [(0, 10.min(total)), (10.min(total), total)] {
        let created_at = Instant::now();
        create(&client, from..to).await?;
        phases.push(measure(&client, port, pid, created_at, to).await?);
    }
    let mut child = daemon;
    let _ = child.kill();

    println!(
        "one operator, resources on the local test bed (poll interval {POLL_SECONDS}s, quiet window {}s)",
        POLL_SECONDS * 3
    );
    for p in &phases {
        println!(
            "  {:>5} resources: all GroupReady {:>6.1}s after creation; in the window: {:>5.0} reconciles, mean {:.1} ms, \
             operator CPU {:.2}s; operator API writes {}, resources changed {} (Deployments changed {}, by \
             kube-controller-manager's status updates); RSS {:.1} MiB",
            p.resources,
            p.ready_after.as_secs_f64(),
            p.reconciles,
            p.mean_reconcile_ms,
            p.cpu_seconds,
            p.writes,
            p.scg_changes,
            p.deployment_changes,
            p.rss_mib
        );
    }
    if let [a, b] = &phases[..] {
        println!(
            "  ratios {}/{}: reconciles {:.1}x, mean reconcile {:.2}x, CPU {:.1}x, RSS {:.2}x",
            b.resources,
            a.resources,
            b.reconciles / a.reconciles.max(1.0),
            b.mean_reconcile_ms / a.mean_reconcile_ms.max(0.001),
            b.cpu_seconds / a.cpu_seconds.max(0.01),
            b.rss_mib / a.rss_mib.max(0.1)
        );
        if b.writes > 0.0 || b.scg_changes > 0 {
            bail!("writes while nothing changed");
        }
    }
    Ok(())
}
