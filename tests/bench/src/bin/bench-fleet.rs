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
//! * settling: until no status changes over two polls and every recovering
//!   resource has a run reported (its `lastRecovery` left out of the
//!   comparison); a level still moving after 10 minutes is flagged;
//! * over a window at rest of one minute, from half past to half past
//!   (one minute boundary, so each recovering resource runs once in it):
//!   the operator's requests by verb and resource as the API server
//!   counted them (its audit log of the operator's service account), the
//!   API server's own `apiserver_request_total` over the same window
//!   (every client), the operator's CPU per poll cycle and its RSS.
//!
//! It checks what the page claims at rest: the CronJob controller ran
//! each recovering resource once in the window, and the operator wrote one
//! status and one Event per run and nothing else. BENCH_RUNS (default 3)
//! runs, each on a fresh test bed in a child process; the figure shows
//! every run, and the program fails (after writing it) when a level of a
//! run did not hold.
//!
//! Writes `docs/figures/fleet.json`. BENCH_DEBUG=1 also prints, per level,
//! the operator's Events.
//! `cargo build --release --workspace --bins && target/release/bench-fleet`

use anyhow::{Context as _, Result, bail};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{ListParams, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_e2e::{ensure_crd, run_ok};
use streamfleet_testbed::{RedisServer, TestBed, audit, tools};

const NS: &str = "fleet";
const POLL_SECONDS: u64 = 10;
const WINDOW: Duration = Duration::from_secs(60);
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

/// The pid of the operator pod's process (`streamfleet run`), which must
/// be this tree's build: the figure is this commit's.
fn operator_pid() -> Result<u32> {
    let binary = tools::cargo_bin("streamfleet")?;
    let mut other = None;
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_operator =
            args.first().is_some_and(|a| a.ends_with(b"streamfleet")) && args.get(1) == Some(&b"run".as_slice());
        match exe {
            Some(exe) if is_operator && exe == binary => return Ok(pid),
            Some(exe) if is_operator => other = Some(exe),
            _ => {}
        }
    }
    match other {
        // The test bed's kubelet prefers an image in `target/images` tagged
        // as the chart's image (left by a plain `scripts/build-images.sh`).
        Some(exe) => bail!(
            "the operator pod runs {}, not this tree's build {}: an image in target/images carries the chart's tag \
             (a `scripts/build-images.sh` run); move target/images away and run again",
            exe.display(),
            binary.display()
        ),
        None => bail!("no operator process ({} run)", binary.display()),
    }
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

/// Every resource's status by name, as compared to tell whether the fleet
/// is at rest: a recovering resource's `lastRecovery` changes with every
/// run, so it is compared without it, and such a resource is not at rest
/// before one run was reported (`None` then).
async fn statuses(client: Client) -> Result<BTreeMap<String, Option<String>>> {
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client, NS);
    let list = scgs.list(&ListParams::default()).await?;
    Ok(list
        .items
        .into_iter()
        .map(|s| {
            let name = s.metadata.name.clone().unwrap_or_default();
            let mut status = serde_json::to_value(&s.status).unwrap_or_default();
            let compared = if recovering(&name) {
                status.as_object_mut().and_then(|o| o.remove("lastRecovery")).filter(|v| !v.is_null()).map(|_| status)
            } else {
                Some(status)
            };
            (name, compared.map(|v| v.to_string()))
        })
        .collect())
}

/// Resources not at rest between two looks: a status that changed, or a
/// recovering resource with no run reported yet.
fn moving(before: &BTreeMap<String, Option<String>>, after: &BTreeMap<String, Option<String>>) -> Vec<String> {
    after
        .iter()
        .filter(|(name, status)| status.is_none() || before.get(*name) != Some(*status))
        .map(|(name, _)| name.clone())
        .collect()
}

/// Whether the resource named `name` runs a recovery Job every minute.
fn recovering(name: &str) -> bool {
    name.strip_prefix('p').and_then(|i| i.parse::<usize>().ok()).is_some_and(|i| i < RECOVERING)
}

/// Waits until `total` resources are GroupReady; the seconds since
/// `started` when the last one became so. Watched, not listed: a list of
/// thousands of resources every few seconds is API server work that starves
/// what it measures, and a watch sees the very moment.
async fn all_ready(client: &Client, total: usize, started: Instant) -> Result<f64> {
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), NS);
    let mut ready = std::collections::HashSet::new();
    let mut changes = watcher(scgs, watcher::Config::default()).default_backoff().applied_objects().boxed();
    let deadline = started + Duration::from_secs(1800);
    while ready.len() < total {
        let change = tokio::time::timeout_at(deadline.into(), changes.next())
            .await
            .map_err(|_| anyhow::anyhow!("{} of {total} GroupReady after 30 minutes", ready.len()))?
            .context("the watch ended")?;
        // The watcher relists after an error (its backoff): every object
        // comes again, so nothing is missed.
        let scg = match change {
            Ok(scg) => scg,
            Err(e) => {
                eprintln!("watching the fleet: {e} (the watcher starts again)");
                continue;
            }
        };
        let name = scg.metadata.name.clone().unwrap_or_default();
        let is_ready = scg
            .status
            .as_ref()
            .is_some_and(|st| st.conditions.iter().any(|c| c.type_ == "GroupReady" && c.status == "True"));
        if is_ready {
            ready.insert(name);
        } else {
            ready.remove(&name);
        }
    }
    Ok(started.elapsed().as_secs_f64())
}

/// One level of one run.
#[derive(serde::Serialize, serde::Deserialize)]
struct Level {
    resources: usize,
    /// Resources created at this level (the ones before it stay).
    created: usize,
    /// The operator's requests from the first create until all were
    /// ready, by "verb resource".
    ramp: BTreeMap<String, usize>,
    live: usize,
    ready_seconds: f64,
    /// Seconds from all ready until no resource moved over two polls.
    settle_seconds: f64,
    /// Resources still moving when the settle check gave up (0: at rest).
    unsettled: usize,
    cpu_per_cycle: f64,
    rss_mib: f64,
    /// The operator's requests in the window, by "verb resource".
    operator: BTreeMap<String, usize>,
    /// Jobs the CronJob controller created in the window.
    recovery_runs: usize,
    /// Every client's requests in the window, by "verb resource".
    apiserver: BTreeMap<String, f64>,
}

/// Whether a "verb resource" request writes.
fn is_write(kind: &str) -> bool {
    !kind.starts_with("get ") && !kind.starts_with("list ")
}

impl Level {
    /// The operator's writes in the window (Lease renewals and watches
    /// are not counted in `operator`).
    fn writes(&self) -> usize {
        self.operator.iter().filter(|(k, _)| is_write(k)).map(|(_, n)| n).sum()
    }

    /// What the level claims at rest, or why not: every recovering
    /// resource ran once in the window, and the operator wrote one status
    /// and one Event per run, nothing else.
    fn at_rest_problem(&self) -> Option<String> {
        if self.unsettled > 0 {
            return Some(format!("{} resources still changing after {:.0} s", self.unsettled, self.settle_seconds));
        }
        let recovering = RECOVERING.min(self.resources);
        if self.recovery_runs != recovering {
            return Some(format!("{} recovery runs in the window, not {recovering}", self.recovery_runs));
        }
        let (status, events) = (
            self.operator.get("patch streamconsumergroups/status").copied().unwrap_or(0),
            ["create events", "patch events"].iter().filter_map(|k| self.operator.get(*k)).sum::<usize>(),
        );
        (self.writes() != 2 * self.recovery_runs || status != self.recovery_runs || events != self.recovery_runs).then(
            || {
                format!(
                    "{} writes for {} recovery runs ({} status, {} Event), not one status and one Event per run",
                    self.writes(),
                    self.recovery_runs,
                    status,
                    events
                )
            },
        )
    }
}

/// Runs BENCH_RUNS (default 3) fresh test beds through the levels, each in
/// a child process of its own (its bed dies with it), then writes the
/// figure of all runs. Fails when a level did not settle or wrote more
/// than its recovery runs explain, after writing the figure that shows it.
#[tokio::main]
async fn main() -> Result<()> {
    let levels: Vec<usize> = std::env::var("BENCH_LEVELS")
        .unwrap_or_else(|_| "10,100,1000,5000".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let live_max: usize = std::env::var("BENCH_LIVE_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let dir = tools::workspace_root().join("target/bench-fleet");
    if let Some(out) = std::env::var_os("BENCH_FLEET_RUN_OUT") {
        return one_run(&levels, live_max, &dir, std::path::Path::new(&out)).await;
    }
    let runs: usize = std::env::var("BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    std::fs::create_dir_all(&dir)?;
    let mut all: Vec<Vec<Level>> = Vec::new();
    let mut failed_runs = Vec::new();
    for run in 1..=runs {
        println!("run {run} of {runs}");
        let out = dir.join(format!("run-{run}.json"));
        let _ = std::fs::remove_file(&out);
        let status = std::process::Command::new(std::env::current_exe()?).env("BENCH_FLEET_RUN_OUT", &out).status()?;
        if !status.success() {
            failed_runs.push(format!("run {run} failed ({status}); its levels measured before are shown"));
        }
        // The levels it measured (all of them, when it did not fail).
        if let Ok(bytes) = std::fs::read(&out) {
            all.push(serde_json::from_slice(&bytes)?);
        }
    }
    // The runs' server is gone with them: the same binary, asked again.
    let server = RedisServer::start().await?;
    let redis_version = streamfleet_bench::redis_version(&mut server.connection().await?).await?;
    let mut problems = publish(&levels, &all, live_max, &redis_version)?;
    problems.extend(failed_runs);
    anyhow::ensure!(problems.is_empty(), "levels that do not hold what the figure claims:\n{}", problems.join("\n"));
    Ok(())
}

/// One run through the levels on a fresh test bed; writes its levels to
/// `out` after each one.
async fn one_run(levels: &[usize], live_max: usize, dir: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let bed: &'static TestBed = Box::leak(Box::new(TestBed::start_detached(dir.join("bed"))?));
    std::fs::create_dir_all(records_dir())?;
    let client = bed.client().await?;
    ensure_crd(bed).await?;
    // A Redis set up as production's should be (appendonly yes): on one
    // that may lose writes, every resource rightly carries a condition and
    // a Warning, and the fleet would measure those.
    let redis = RedisServer::start_with(&["--appendonly", "yes"]).await?;
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
    for &total in levels {
        // Streams of the new live resources get entries nobody acks: lag.
        let mut pipe = redis::pipe();
        for i in (done..total).filter(|i| i % 2 == 0 && i / 2 < live_max) {
            pipe.cmd("XADD").arg(format!("s{i:05}")).arg("*").arg("order_id").arg(i).ignore();
        }
        if !pipe.is_empty() {
            let () = pipe.query_async(&mut conn).await?;
        }
        let (started, ramp_offset) = (Instant::now(), audit::offset(&bed.audit_log)?);
        create(&client, done..total, live_max).await?;
        let ready_seconds = all_ready(&client, total, started).await?;
        // What the operator wrote to bring the new resources up.
        let ramp: Vec<_> = audit::since(&bed.audit_log, ramp_offset, &operator_user)?
            .into_iter()
            .filter(|r| r.resource != "leases" && r.verb != "watch")
            .collect();
        // At rest first: rollouts done, pods started, the live resources'
        // backlog (nobody reads it) reported Stalled, every recovering
        // resource's first run reported. Until nothing moves over two
        // polls (10 minutes at most: then the level is flagged).
        let settle_started = Instant::now();
        let unsettled = loop {
            let before = statuses(client.clone()).await?;
            tokio::time::sleep(Duration::from_secs(POLL_SECONDS * 2)).await;
            let after = statuses(client.clone()).await?;
            let moving = moving(&before, &after);
            if moving.is_empty() || settle_started.elapsed() > Duration::from_secs(600) {
                println!(
                    "{total} resources: at rest after {:.0} s ({} still changing{})",
                    settle_started.elapsed().as_secs_f64(),
                    moving.len(),
                    moving.first().map(|m| format!(", e.g. {m}")).unwrap_or_default()
                );
                break moving.len();
            }
        };
        let settle_seconds = settle_started.elapsed().as_secs_f64();
        // The window is one minute from half past to half past: exactly one
        // minute boundary (the recovering resources' runs), and 30 s on
        // either side for the runs to be reported.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
        tokio::time::sleep(Duration::from_secs_f64((30.0 - now % 60.0).rem_euclid(60.0))).await;
        let (offset, api0, (cpu0, _)) =
            (audit::offset(&bed.audit_log)?, apiserver_requests(&client).await?, proc_usage(pid)?);
        tokio::time::sleep(WINDOW).await;
        let (cpu1, rss_mib) = proc_usage(pid)?;
        let requests = audit::since(&bed.audit_log, offset, &operator_user)?;
        let api1 = apiserver_requests(&client).await?;
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
            created: total - done,
            ramp: audit::count_by_kind(&ramp),
            live: (0..total).filter(|i| i % 2 == 0 && i / 2 < live_max).count(),
            ready_seconds,
            settle_seconds,
            unsettled,
            cpu_per_cycle: (cpu1 - cpu0) / (WINDOW.as_secs_f64() / POLL_SECONDS as f64),
            rss_mib,
            operator: audit::count_by_kind(&counted),
            recovery_runs,
            apiserver,
        };
        println!(
            "{} resources ({} live): all ready in {:.1} s; at rest {} s: operator requests {:?} ({} recovery Jobs); CPU per poll cycle {:.3} s; RSS {:.1} MiB{}",
            level.resources,
            level.live,
            level.ready_seconds,
            WINDOW.as_secs(),
            level.operator,
            level.recovery_runs,
            level.cpu_per_cycle,
            level.rss_mib,
            level.at_rest_problem().map(|p| format!("; NOT AT REST: {p}")).unwrap_or_default()
        );
        results.push(level);
        std::fs::write(out, serde_json::to_vec(&results)?)?;
        done = total;
    }
    Ok(())
}

/// Writes the figure of every run's levels; returns what did not hold.
fn publish(levels: &[usize], runs: &[Vec<Level>], live_max: usize, redis_version: &str) -> Result<Vec<String>> {
    let per_minute = 60.0 / WINDOW.as_secs_f64();
    let mut problems = Vec::new();
    let mut rows = Vec::new();
    let mut summary = Vec::new();
    for (i, &resources) in levels.iter().enumerate() {
        let of_level: Vec<&Level> = runs.iter().filter_map(|r| r.get(i)).collect();
        let Some(first) = of_level.first() else { continue };
        let runs_of = |f: &dyn Fn(&Level) -> f64| streamfleet_bench::Runs(of_level.iter().map(|l| f(l)).collect());
        let (ready, rss, cpu) = (runs_of(&|l| l.ready_seconds), runs_of(&|l| l.rss_mib), runs_of(&|l| l.cpu_per_cycle));
        let all_clients = runs_of(&|l| l.apiserver.values().sum::<f64>() * per_minute);
        // The operator's requests, summed over the runs, per run.
        let mut operator: BTreeMap<&str, usize> = BTreeMap::new();
        for l in &of_level {
            for (k, n) in &l.operator {
                *operator.entry(k).or_insert(0) += n;
            }
        }
        let operator = if operator.is_empty() {
            "none".to_string()
        } else {
            operator
                .iter()
                .map(|(k, n)| format!("{k} {:.1}", *n as f64 / of_level.len() as f64))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let writes: Vec<String> = of_level.iter().map(|l| format!("{}/{}", l.writes(), l.recovery_runs)).collect();
        // The ramp's writes per created resource, summed over the runs.
        let mut ramp: BTreeMap<&str, usize> = BTreeMap::new();
        for l in &of_level {
            for (k, n) in l.ramp.iter().filter(|(k, _)| is_write(k)) {
                *ramp.entry(k).or_insert(0) += n;
            }
        }
        let created: usize = of_level.iter().map(|l| l.created).sum::<usize>().max(1);
        let ramp = format!(
            "{:.2} ({})",
            ramp.values().sum::<usize>() as f64 / created as f64,
            ramp.iter().map(|(k, n)| format!("{k} {:.2}", *n as f64 / created as f64)).collect::<Vec<_>>().join(", ")
        );
        let mut level_problems = Vec::new();
        for (run, l) in of_level.iter().enumerate() {
            if let Some(p) = l.at_rest_problem() {
                level_problems.push(format!("run {}: {p}", run + 1));
            }
        }
        let at_rest = if level_problems.is_empty() {
            format!("yes (settled in {} s)", runs_of(&|l| l.settle_seconds).listed(0))
        } else {
            format!("**NO**: {}", level_problems.join("; "))
        };
        problems.extend(level_problems.iter().map(|p| format!("{resources} resources, {p}")));
        rows.push(serde_json::json!([
            resources,
            first.live,
            ready.listed(1),
            format!("{:.1}", ready.median()),
            ramp,
            format!("{:.3}", cpu.median()),
            rss.listed(1),
            operator,
            writes.join(" · "),
            format!("{:.0}", all_clients.median()),
            at_rest,
        ]));
        let target = match resources {
            1000 => format!(" (target ≤ 64 MiB: {})", if rss.median() <= 64.0 { "met" } else { "missed" }),
            5000 => format!(
                " (targets ≤ 60 s: {}; ≤ 128 MiB: {})",
                if ready.median() <= 60.0 { "met" } else { "missed" },
                if rss.median() <= 128.0 { "met" } else { "missed" }
            ),
            _ => String::new(),
        };
        summary.push(format!("{resources}: ready in {:.1} s, RSS {:.1} MiB{target}", ready.median(), rss.median()));
    }
    let summary = format!(
        "Median of {} runs. {}. Every level of every run settled, and at rest ran each recovering resource once and wrote one status and one Event per run and nothing else: {}",
        runs.len(),
        summary.join("; "),
        if problems.is_empty() { "yes".to_string() } else { format!("**no** ({} levels)", problems.len()) }
    );
    println!("{summary}");
    streamfleet_testbed::publish_figure(
        "fleet",
        &serde_json::json!({
            "what": "One operator (the Helm-installed pod, leader election on) as the fleet grows, each run on a fresh test bed; half the resources live (lag, a worker pod), four running a recovery Job every minute; requests counted by the API server (audit log of the operator's service account; apiserver_request_total for every client) over a one-minute window at rest holding one minute boundary",
            "settings": {
                "runs": runs.len(),
                "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
                "redis": redis_version,
                "redis persistence": "appendonly yes",
                "pollIntervalSeconds": POLL_SECONDS,
                "window seconds": WINDOW.as_secs(),
                "live pods cap": live_max,
                "recovering resources": RECOVERING,
                "kubernetes": "kube-apiserver, etcd, kube-controller-manager from scripts/build-tools.sh; pods run by the kubelet stand-in",
            },
            "columns": ["resources", "live", "all ready after, s (runs)", "median s", "operator writes per resource created, until all ready (verb resource)", "operator CPU per poll cycle, s (median)", "operator RSS, MiB (runs)", "operator requests in the window per run (verb resource; Lease and watches left out)", "operator writes / recovery runs in the window (each run)", "all clients' requests per minute (median)", "at rest"],
            "rows": rows,
            "summary": summary,
        }),
    )?;
    Ok(problems)
}
