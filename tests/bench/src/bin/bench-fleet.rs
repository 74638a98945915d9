//! One operator carrying a fleet of StreamConsumerGroups on the local test
//! bed: a real kube-apiserver (auditing service-account requests), etcd,
//! kube-controller-manager, the kubelet stand-in and redis-server. The
//! operator runs as the Helm-installed pod, leader election on.
//!
//! The fleet grows through BENCH_LEVELS (default 10,100,1000,5000). Half of
//! the resources are live: a stream with entries nobody acks (lag) and a
//! worker pod running (capped at BENCH_LIVE_MAX pods, default 500: every
//! pod is a process on this machine); the other half idle at zero replicas.
//! Four resources run a recovery Job every minute. At each level:
//!
//! * time from the first create until every resource is GroupReady;
//! * over a window at rest of 70 s (seven 10 s polls, at least one minute
//!   boundary, so recovery Jobs run in it): the operator's requests by verb
//!   and resource as the API server counted them (its audit log of the
//!   operator's service account), the API server's own
//!   `apiserver_request_total` over the same window (every client), the
//!   operator's CPU per poll cycle and its RSS.
//!
//! Writes `docs/figures/fleet.json`. BENCH_DEBUG=1 also prints, per level,
//! which statuses changed in the window and the operator's Events.
//! `cargo build --release --workspace --bins && target/release/bench-fleet`

use anyhow::{Context as _, Result, bail};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_e2e::{ensure_crd, run_ok};
use streamfleet_testbed::{RedisServer, TestBed, audit, tools};

const NS: &str = "fleet";
const POLL_SECONDS: u64 = 10;
const WINDOW: Duration = Duration::from_secs(70);
/// Resources whose recovery CronJob runs every minute.
const RECOVERING: usize = 4;

fn scg(i: usize, live: bool) -> Result<StreamConsumerGroup> {
    let (min, schedule) = (if live { 1 } else { 0 }, if i < RECOVERING { "* * * * *" } else { "0 0 1 1 *" });
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
        "metadata": {"name": format!("p{i:05}")},
        "spec": {
            "redis": {"urlSecretRef": {"name": "redis", "key": "url"}},
            "stream": format!("s{i:05}"), "group": "g", "startId": "0",
            "scaling": {"minReplicas": min, "maxReplicas": 1, "pollIntervalSeconds": POLL_SECONDS},
            "recovery": {"schedule": schedule},
            "worker": {"template": {"spec": {"containers": [{
                "name": "w", "image": "streamfleet/testproc",
                "env": [{"name": "TESTPROC_DIR", "value": records_dir()}]
            }]}}}
        }
    }))?)
}

/// Where the worker pods (testproc: they start, record it and wait) write.
fn records_dir() -> String {
    tools::workspace_root().join("target/bench-fleet/records").display().to_string()
}

/// (utime + stime) in seconds, and resident memory in MiB, of a process.
fn proc_usage(pid: u32) -> Result<(f64, f64)> {
    let cpu = streamfleet_bench::process_cpu(&pid.to_string());
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    Ok((cpu, rss_kib / 1024.0))
}

/// The pid of the operator pod's process (`streamfleet run`).
fn operator_pid() -> Result<u32> {
    let binary = tools::cargo_bin("streamfleet")?;
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if exe.as_deref() == Some(binary.as_path()) && args.get(1) == Some(&b"run".as_slice()) {
            return Ok(pid);
        }
    }
    bail!("no operator process ({} run)", binary.display())
}

/// `apiserver_request_total`, summed by "verb resource[/subresource]".
async fn apiserver_requests(client: &Client) -> Result<BTreeMap<String, f64>> {
    let mut req = http::Request::new(Vec::new());
    *req.uri_mut() = http::Uri::from_static("/metrics");
    let text = client.request_text(req).await?;
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let label = |name: &str| {
            line.split_once(&format!("{name}=\""))
                .and_then(|(_, rest)| rest.split_once('"'))
                .map_or(String::new(), |(v, _)| v.to_string())
        };
        let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        let (resource, sub) = (label("resource"), label("subresource"));
        let kind = if sub.is_empty() { resource } else { format!("{resource}/{sub}") };
        *out.entry(format!("{} {kind}", label("verb").to_lowercase())).or_insert(0.0) += value;
    }
    Ok(out)
}

async fn create(client: &Client, range: std::ops::Range<usize>, live_max: usize) -> Result<()> {
    let api: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), NS);
    let results: Vec<Result<()>> = futures::stream::iter(range)
        .map(|i| {
            let api = api.clone();
            async move {
                // Every other resource is live, until the pod cap.
                let live = i % 2 == 0 && i / 2 < live_max;
                api.create(&PostParams::default(), &scg(i, live)?).await?;
                Ok(())
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect()
}

/// Every resource's status, as JSON, by name.
async fn statuses(client: Client) -> Result<BTreeMap<String, String>> {
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client, NS);
    let list = scgs.list(&ListParams::default()).await?;
    Ok(list
        .items
        .into_iter()
        .map(|s| (s.metadata.name.clone().unwrap_or_default(), serde_json::to_string(&s.status).unwrap_or_default()))
        .collect())
}

/// Whether the resource named `name` runs a recovery Job every minute.
fn recovering(name: &str) -> bool {
    name.strip_prefix('p').and_then(|i| i.parse::<usize>().ok()).is_some_and(|i| i < RECOVERING)
}

async fn ready_count(client: &Client) -> Result<usize> {
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), NS);
    Ok(scgs
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.conditions.iter().any(|c| c.type_ == "GroupReady" && c.status == "True"))
        })
        .count())
}

struct Level {
    resources: usize,
    live: usize,
    ready_seconds: f64,
    cpu_per_cycle: f64,
    rss_mib: f64,
    operator: BTreeMap<String, usize>,
    recovery_runs: usize,
    apiserver: BTreeMap<String, f64>,
}

#[tokio::main]
async fn main() -> Result<()> {
    let levels: Vec<usize> = std::env::var("BENCH_LEVELS")
        .unwrap_or_else(|_| "10,100,1000,5000".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let live_max: usize = std::env::var("BENCH_LIVE_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let dir = tools::workspace_root().join("target/bench-fleet");
    let bed: &'static TestBed = Box::leak(Box::new(TestBed::start_detached(dir.clone())?));
    std::fs::create_dir_all(records_dir())?;
    let client = bed.client().await?;
    ensure_crd(bed).await?;
    let redis = RedisServer::start().await?;
    let mut conn = redis.connection().await?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &serde_json::from_value(serde_json::json!({"metadata": {"name": NS}}))?)
        .await?;
    let secret: Secret =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "redis"}, "stringData": {"url": redis.url()}}))?;
    Api::<Secret>::namespaced(client.clone(), NS).create(&PostParams::default(), &secret).await?;
    let chart = tools::workspace_root().join("charts/streamfleet").display().to_string();
    run_ok(
        bed,
        "helm",
        &[
            "install",
            "sf",
            &chart,
            "--namespace",
            NS,
            "--set",
            "watchNamespace=fleet",
            "--set",
            "log.level=warn",
            "--set",
            "console.enabled=false",
            // The CRD is the test bed's (ensure_crd).
            "--set",
            "crds.install=false",
            // The test bed's pods share the host's network namespace.
            "--set",
            "listenOn=podIP",
        ],
        None,
    )
    .await?;
    run_ok(bed, "kubectl", &["rollout", "status", "-n", NS, "deployment/sf-streamfleet", "--timeout=120s"], None)
        .await
        .context("the operator pod")?;
    let pid = operator_pid()?;
    let operator_user = format!("system:serviceaccount:{NS}:");

    let mut done = 0;
    let mut results = Vec::new();
    for &total in &levels {
        // Streams of the new live resources get entries nobody acks: lag.
        let mut pipe = redis::pipe();
        for i in (done..total).filter(|i| i % 2 == 0 && i / 2 < live_max) {
            pipe.cmd("XADD").arg(format!("s{i:05}")).arg("*").arg("order_id").arg(i).ignore();
        }
        if !pipe.is_empty() {
            let () = pipe.query_async(&mut conn).await?;
        }
        let started = Instant::now();
        create(&client, done..total, live_max).await?;
        // Listing thousands of resources is itself API server work: look
        // every 2 s, not every 100 ms, or the bench starves what it measures.
        while ready_count(&client).await? < total {
            anyhow::ensure!(started.elapsed() < Duration::from_secs(1800), "not all GroupReady after 30 minutes");
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let ready_seconds = started.elapsed().as_secs_f64();
        // At rest first: rollouts done, pods started, the live resources'
        // backlog (nobody reads it) reported Stalled. Until no status but a
        // recovering resource's changes over two polls (10 minutes at most).
        let settle_started = Instant::now();
        loop {
            let before = statuses(client.clone()).await?;
            tokio::time::sleep(Duration::from_secs(POLL_SECONDS * 2)).await;
            let after = statuses(client.clone()).await?;
            let moving = before.keys().filter(|k| before.get(*k) != after.get(*k) && !recovering(k)).count();
            if moving == 0 || settle_started.elapsed() > Duration::from_secs(600) {
                println!(
                    "{total} resources at rest after {:.0} s ({moving} still changing)",
                    settle_started.elapsed().as_secs_f64()
                );
                break;
            }
        }
        let (offset, api0, (cpu0, _)) =
            (audit::offset(&bed.audit_log)?, apiserver_requests(&client).await?, proc_usage(pid)?);
        let before = statuses(client.clone()).await?;
        tokio::time::sleep(WINDOW).await;
        let after = statuses(client.clone()).await?;
        let changed: Vec<&String> =
            before.keys().filter(|k| before.get(*k) != after.get(*k) && !recovering(k)).collect();
        if let Some(first) = changed.first() {
            println!(
                "{} statuses of resources without recovery runs changed in the window; {first}:\n  before {}\n  after  {}",
                changed.len(),
                before[*first],
                after[*first]
            );
        }
        if std::env::var_os("BENCH_DEBUG").is_some() {
            let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), NS);
            for e in events.list(&ListParams::default()).await?.items {
                if e.reporting_controller.as_deref() == Some("streamfleet") {
                    println!(
                        "event {:?} {:?} {:?} x{:?}: {:?}",
                        e.regarding.and_then(|r| r.name),
                        e.reason,
                        e.event_time.map(|t| t.0.to_string()),
                        e.series.map(|s| s.count),
                        e.note
                    );
                }
            }
        }
        let (cpu1, rss_mib) = proc_usage(pid)?;
        let api1 = apiserver_requests(&client).await?;
        let requests = audit::since(&bed.audit_log, offset, &operator_user)?;
        let counted: Vec<_> = requests.into_iter().filter(|r| r.resource != "leases" && r.verb != "watch").collect();
        let apiserver: BTreeMap<String, f64> = api1
            .iter()
            .map(|(k, v)| (k.clone(), v - api0.get(k).copied().unwrap_or(0.0)))
            .filter(|(k, v)| *v > 0.0 && !k.starts_with("watch"))
            .collect();
        // Recovery runs in the window, as the API server saw them: Jobs created by the CronJob controller.
        let recovery_runs = apiserver.get("post jobs").copied().unwrap_or(0.0) as usize;
        let level = Level {
            resources: total,
            live: (0..total).filter(|i| i % 2 == 0 && i / 2 < live_max).count(),
            ready_seconds,
            cpu_per_cycle: (cpu1 - cpu0) / (WINDOW.as_secs_f64() / POLL_SECONDS as f64),
            rss_mib,
            operator: audit::count_by_kind(&counted),
            recovery_runs,
            apiserver,
        };
        println!(
            "{} resources ({} live): all ready in {:.1} s; at rest {} s: operator requests {:?} ({} recovery Jobs); CPU per poll cycle {:.3} s; RSS {:.1} MiB",
            level.resources,
            level.live,
            level.ready_seconds,
            WINDOW.as_secs(),
            level.operator,
            level.recovery_runs,
            level.cpu_per_cycle,
            level.rss_mib
        );
        results.push(level);
        publish(&results, live_max)?;
        done = total;
    }

    Ok(())
}

/// Writes the figure of the levels measured so far (a long run that stops
/// still leaves its figures).
fn publish(results: &[Level], live_max: usize) -> Result<()> {
    let per_minute = 60.0 / WINDOW.as_secs_f64();
    let rows: Vec<serde_json::Value> = results
        .iter()
        .map(|l| {
            let operator = if l.operator.is_empty() {
                "none".to_string()
            } else {
                l.operator
                    .iter()
                    .map(|(k, n)| format!("{k} {:.1}", *n as f64 * per_minute))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let mut top: Vec<(&String, &f64)> = l.apiserver.iter().collect();
            top.sort_by(|a, b| b.1.total_cmp(a.1));
            let all: f64 = l.apiserver.values().sum::<f64>() * per_minute;
            serde_json::json!([
                l.resources,
                l.live,
                format!("{:.1}", l.ready_seconds),
                format!("{:.3}", l.cpu_per_cycle),
                format!("{:.1}", l.rss_mib),
                operator,
                format!("{:.1}", l.recovery_runs as f64 * per_minute),
                format!("{all:.0}"),
            ])
        })
        .collect();
    let last = results.last().context("no level")?;
    let writes_at_rest: usize =
        last.operator.iter().filter(|(k, _)| !k.starts_with("get") && !k.starts_with("list")).map(|(_, n)| n).sum();
    let summary = format!(
        "At {} resources: ready in {:.1} s, RSS {:.1} MiB (targets: 1,000 ≤ 64 MiB; 5,000 ready ≤ 60 s and ≤ 128 MiB); operator writes at rest {} in {} s with {} recovery Jobs run (target: status and Event writes only for the runs, 0 Secret reads)",
        last.resources,
        last.ready_seconds,
        last.rss_mib,
        writes_at_rest,
        WINDOW.as_secs(),
        last.recovery_runs
    );
    println!("{summary}");
    streamfleet_testbed::publish_figure(
        "fleet",
        &serde_json::json!({
            "what": "One operator (the Helm-installed pod, leader election on) as the fleet grows; half the resources live (lag, a worker pod), four running a recovery Job every minute; requests counted by the API server (audit log of the operator's service account; apiserver_request_total for every client) over a window at rest",
            "settings": {"pollIntervalSeconds": POLL_SECONDS, "window seconds": WINDOW.as_secs(), "live pods cap": live_max, "recovering resources": RECOVERING, "kubernetes": "kube-apiserver, etcd, kube-controller-manager from scripts/build-tools.sh; pods run by the kubelet stand-in"},
            "columns": ["resources", "live", "all ready after (s)", "operator CPU per poll cycle (s)", "operator RSS (MiB)", "operator requests per minute at rest (verb resource, Lease and watches left out)", "recovery Jobs per minute", "all clients' requests per minute"],
            "rows": rows,
            "summary": summary,
        }),
    )?;
    Ok(())
}
