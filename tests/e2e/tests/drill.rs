//! The fault drill: 10,000 orders (`DRILL_ORDERS`; the full-size drill is
//! 100,000) produced over `DRILL_SECONDS` (60) through the example pipeline
//! while worker processes are SIGKILLed (20, of which 5 aimed at, and shown
//! to land, between a charge and its ack), 3% of charges hit a transient
//! gateway timeout, 1% of orders are poison, one slow but alive worker
//! shares the group, Redis crashes and restarts from its AOF (`appendfsync
//! always`), the kube-apiserver restarts, the leading operator is SIGKILLed,
//! the pipeline grows from one shard to two mid-run (the workers roll over
//! to read both; from then on the producer sends each order to its shard;
//! the example's ledger refuses any fence that goes backwards), and an
//! outside `XTRIM` deletes the payloads of entries pending in a
//! vanished consumer's hands. For the first part of the run the producer
//! trims by length (`XADD … MAXLEN ~`, keeping every undelivered entry), so
//! entries still pending go too: in a live worker's hands (shown to happen)
//! and in dead ones'. Handlers stall up to 0.8 × min-idle-time, so the hold
//! is what keeps a second holder off. One order kills whichever worker runs
//! it, every time (a crash-looping deploy). At the end every order produced
//! is exactly one of: charged, a poison order's `permanent` letter, the
//! killer's `crashed-worker` letter (alone, after exactly the crash limit's
//! deaths), or recorded `payload-missing` uncharged; a charged order is
//! recorded lost only if its charger died after charging (a live holder
//! that completed its entry never leaves a false loss); no order is charged
//! twice and no repeat got past a live first charger (a repeat is excused
//! only by a death of the first charger, timed between its charge and the
//! repeat); every entry is acked or dead-lettered; and every injected fault
//! is shown to have happened. The figures go to
//! `target/figures/drill*.json` (`docs/benchmarks.md#the-fault-drill`).
//!
//! By hand (the full-size drill):
//! `DRILL_ORDERS=100000 DRILL_SECONDS=300 cargo test -p streamfleet-e2e --test drill -- --nocapture crash_drill_every`

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt as _};
use rand::Rng as _;
use redis::AsyncCommands as _;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use streamfleet_e2e::*;
use streamfleet_streams::deadletter as dl;
use streamfleet_streams::shard::{shard_key, shard_keys, shard_of};
use streamfleet_testbed::eventually;

const MIN_IDLE_MS: u64 = 3000;
const MAX_DELIVERIES: u32 = 4;
const BATCH_SIZE: u32 = 50;
/// Chance of a simulated gateway timeout per charge.
const TRANSIENT_PERCENT: u32 = 3;
/// Chance of a stall per charge: often enough that the aimed kills, which
/// wait for one, land while the orders are produced.
const STALL_PERCENT: f64 = 1.0;
/// Shards the full drill grows to mid-run (from one).
const SHARDS_AFTER: u32 = 2;
/// Pending entries whose payloads the outside trim deletes.
const TRIMMED: usize = 25;
/// A stall after the charge, before the ack: 0.8 × min-idle-time, so an
/// entry read with its batch and stalled late in it is idle past
/// min-idle-time unless its holder renews it.
const STALL_MS: u64 = MIN_IDLE_MS * 4 / 5;
/// While the producer trims by length, it keeps the undelivered entries,
/// the batch it adds, and this many more: older entries go, pending or not
/// (a stalled entry is pending longer than this many orders take to come).
const TRIM_KEEP: usize = 100;
/// The deaths after which an entry that kills its worker is dead-lettered
/// `crashed-worker`: the worker's crash limit, 3, or maxDeliveries if lower
/// (`docs/delivery-guarantees.md`).
const CRASH_LIMIT: usize = if MAX_DELIVERIES < 3 { MAX_DELIVERIES as usize } else { 3 };

/// What a drill injects.
struct Plan {
    guard: bool,
    workers: usize,
    /// SIGKILLs of random running workers.
    random_kills: usize,
    /// SIGKILLs aimed between a charge and its ack, each shown to land there.
    aimed_kills: usize,
    /// A Redis crash and restart, a kube-apiserver restart and a SIGKILL of the leading operator.
    infrastructure: bool,
}

/// The drills of this binary run one at a time: the full one restarts the
/// API server both share.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn pipeline(plan: &Plan) -> String {
    let spec = format!(
        "  startId: \"0\"\n  scaling: {{minReplicas: {n}, maxReplicas: {n}, pollIntervalSeconds: 2}}\n  recovery: {{minIdleTimeMs: {MIN_IDLE_MS}, maxDeliveries: {MAX_DELIVERIES}, batchSize: {BATCH_SIZE}}}",
        n = plan.workers
    );
    manifest(
        "orders",
        "orders",
        "billing",
        "streamfleet/example-worker",
        &[
            ("EXAMPLE_TRANSIENT_PERCENT", &TRANSIENT_PERCENT.to_string()),
            // Stalls after the charge, before the ack: the aimed kills' targets.
            ("EXAMPLE_STALL_PERCENT", &STALL_PERCENT.to_string()),
            ("EXAMPLE_STALL_MS", &STALL_MS.to_string()),
            ("EXAMPLE_GUARD", if plan.guard { "on" } else { "off" }),
        ],
        &spec,
    )
}

/// A worker outside the operator's Deployment, in the same group: slow, but
/// alive, holding at most two entries for well under min-idle-time.
fn slow_worker(redis_url: &str, guard: bool) -> Result<Deployment> {
    let env: Vec<serde_json::Value> = [
        ("STREAMFLEET_REDIS_URL", redis_url.to_string()),
        ("STREAMFLEET_STREAMS", "orders".into()),
        ("STREAMFLEET_GROUP", "billing".into()),
        ("STREAMFLEET_MIN_IDLE_MS", MIN_IDLE_MS.to_string()),
        ("STREAMFLEET_MAX_DELIVERIES", MAX_DELIVERIES.to_string()),
        ("STREAMFLEET_DEAD_LETTER_STREAM", "{orders}:dead:billing".into()),
        ("STREAMFLEET_BATCH_SIZE", "2".into()),
        ("EXAMPLE_HANDLER_MS", "400".into()),
        ("EXAMPLE_GUARD", if guard { "on" } else { "off" }.into()),
    ]
    .into_iter()
    .map(|(k, v)| serde_json::json!({"name": k, "value": v}))
    .chain([
        serde_json::json!({"name": "STREAMFLEET_CONSUMER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
    ])
    .collect();
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {"name": "slow-worker"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "slow-worker"}},
            "template": {
                "metadata": {"labels": {"app": "slow-worker"}},
                "spec": {"containers": [{"name": "worker", "image": "streamfleet/example-worker", "env": env}]}
            }
        }
    }))?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_drill_every_order_charged_exactly_once() -> Result<()> {
    let plan = Plan { guard: true, workers: 5, random_kills: 15, aimed_kills: 5, infrastructure: true };
    drill("e2e-drill", plan).await
}

/// A smaller drill without the idempotency guard: the ledger's own
/// idempotency (one charge per order) alone keeps every order charged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_drill_without_the_guard_the_handlers_idempotency_holds_alone() -> Result<()> {
    let plan = Plan { guard: false, workers: 3, random_kills: 3, aimed_kills: 2, infrastructure: false };
    drill("e2e-drill-noguard", plan).await
}

/// An entry's ID as the drill names it: on the first shard (`orders`) its
/// ID, on another `<shard>@<ID>` (IDs repeat across streams).
fn qualified(stream: &str, id: &str) -> String {
    if stream == "orders" { id.to_string() } else { format!("{stream}@{id}") }
}

/// Produces orders `range` (1% poison; `killer`, if in range, kills each
/// worker that runs it) in batches, each to its order's shard among
/// `shards`, trimming the first shard by length to `keep` entries when
/// given; returns (qualified entry ID, order) per order.
async fn produce(
    conn: &mut redis::aio::MultiplexedConnection,
    range: std::ops::Range<usize>,
    killer: usize,
    keep: Option<usize>,
    shards: u32,
) -> Result<Vec<(String, usize)>> {
    let mut pipe = redis::pipe();
    let mut streams = Vec::new();
    for i in range.clone() {
        let stream = shard_key("orders", shard_of(&i.to_string(), shards));
        pipe.cmd("XADD").arg(&stream);
        if let (Some(keep), "orders") = (keep, stream.as_str()) {
            pipe.arg("MAXLEN").arg("~").arg(keep);
        }
        streams.push(stream);
        pipe.arg("*").arg("order_id").arg(i).arg("amount_cents").arg(100 + i);
        if i % 100 == 42 {
            pipe.arg("poison").arg("1");
        }
        if i == killer {
            pipe.arg("crash").arg("1");
        }
    }
    let ids: Vec<String> = pipe.query_async(conn).await?;
    Ok(ids.iter().zip(&streams).map(|(id, stream)| qualified(stream, id)).zip(range).collect())
}

/// Entries the group has not delivered yet (`XINFO GROUPS` lag; unknown
/// after a deletion past the group's last-delivered ID).
async fn undelivered(conn: &mut redis::aio::MultiplexedConnection) -> Result<Option<usize>> {
    let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups("orders").await?;
    Ok(info.groups.iter().find(|g| g.name == "billing").and_then(|g| g.lag))
}

/// Pending entries (of the oldest 1,000) whose payload is gone, other than
/// the vanished consumer's: `(ID, holder)`.
async fn pending_without_payload(conn: &mut redis::aio::MultiplexedConnection) -> Result<Vec<(String, String)>> {
    let flat: Vec<String> = redis::Script::new(
        r"
        local out = {}
        for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000)) do
            if p[2] ~= 'vanished' and #redis.call('XRANGE', KEYS[1], p[1], p[1]) == 0 then
                out[#out + 1] = p[1]
                out[#out + 1] = p[2]
            end
        end
        return out",
    )
    .key("orders")
    .arg("billing")
    .invoke_async(conn)
    .await?;
    Ok(flat.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect())
}

/// The dead letters, by what they say: poison orders (`permanent`), the
/// killer (`crashed-worker`), and payloads lost (order, when recorded).
#[derive(Default)]
struct Letters {
    permanent: Vec<String>,
    crashed: Vec<String>,
    lost: Vec<(String, u64)>,
}

/// Reads the dead letters, checking what each says of itself; a
/// payload-missing letter names its entry, whose order `order_of` gives.
async fn read_letters(
    conn: &mut redis::aio::MultiplexedConnection,
    order_of: &HashMap<String, usize>,
    shards: &[String],
) -> Result<Letters> {
    let mut entries = Vec::new();
    for shard in shards {
        let dead = streamfleet_streams::keys::dead_letter_stream(shard, "billing");
        let range: redis::Value = redis::cmd("XRANGE").arg(&dead).arg("-").arg("+").query_async(conn).await?;
        entries.extend(streamfleet_streams::entry::entries_from_value(range)?.into_iter().map(|e| (shard.clone(), e)));
    }
    let mut letters = Letters::default();
    for (shard, (_, fields)) in entries {
        let f: HashMap<String, String> =
            fields.into_iter().map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned())).collect();
        assert_eq!(f[dl::F_SOURCE_STREAM], shard, "a shard's letters are its own");
        assert_eq!(f[dl::F_GROUP], "billing");
        assert!(!f[dl::F_SOURCE_ID].is_empty() && !f[dl::F_CONSUMER].is_empty() && !f[dl::F_AT].is_empty());
        match f[dl::F_REASON].as_str() {
            "payload-missing" => {
                let id = qualified(&f[dl::F_SOURCE_STREAM], &f[dl::F_SOURCE_ID]);
                let order = order_of.get(&id).unwrap_or_else(|| panic!("{f:?}: never produced"));
                letters.lost.push((order.to_string(), f[dl::F_AT].parse()?));
            }
            "crashed-worker" => {
                assert_eq!((f["crash"].as_str(), &f[dl::F_BUSINESS_KEY]), ("1", &f["order_id"]), "{f:?}");
                letters.crashed.push(f["order_id"].clone());
            }
            reason => {
                assert_eq!(reason, "permanent", "{f:?}");
                assert!(f[dl::F_ERROR].contains("card declined"));
                assert_eq!(f["poison"], "1");
                assert_eq!(f[dl::F_BUSINESS_KEY], f["order_id"]);
                letters.permanent.push(f["order_id"].clone());
            }
        }
    }
    Ok(letters)
}

/// What the faults did, as observed.
#[derive(Default, Debug)]
struct Observed {
    random_kills: usize,
    /// Aimed kills that landed with the order charged and its entry still
    /// pending in the dead process's hands.
    aimed_landed: Vec<(String, String)>,
    /// Aimed kills that missed (the ack came first); not counted.
    aimed_missed: usize,
    /// Each SIGKILLed consumer and when (Unix ms, taken after the kill).
    killed_consumers: Vec<(String, u64)>,
    redis_restart: Option<(String, String)>,
    apiserver_restart: Option<(u32, u32)>,
    leader_killed: Option<String>,
    /// The pipeline grown to [`SHARDS_AFTER`] shards, when (from the first order).
    grown: Option<Duration>,
    /// When Redis crashed (Unix ms, its own clock).
    crashed_at_ms: Option<u64>,
}

/// SIGKILLs a running worker, the least killed so far; returns its consumer name.
async fn kill_a_worker(client: &kube::Client, ns: &str, kills: &mut HashMap<String, usize>) -> Result<Option<String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let workers = pods.list(&ListParams::default().labels("app.kubernetes.io/component=worker")).await?.items;
    let ready = workers.iter().filter(|p| {
        p.metadata.deletion_timestamp.is_none()
            && p.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|s| s.first())
                .is_some_and(|s| s.ready && s.state.as_ref().is_some_and(|st| st.running.is_some()))
    });
    let Some(victim) =
        ready.min_by_key(|p| (kills.get(&p.name_any()).copied().unwrap_or(0), rand::rng().random::<u32>()))
    else {
        return Ok(None);
    };
    let name = victim.name_any();
    sigkill_container(client, ns, &name).await?;
    *kills.entry(name.clone()).or_default() += 1;
    // Consumer names are `<pod name>.<pod UID>`.
    Ok(Some(format!("{name}.{}", victim.metadata.uid.clone().unwrap_or_default())))
}

/// One look, in one script: is `id` pending with `consumer`, and is `order` charged?
async fn charged_and_held(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    id: &str,
    consumer: &str,
    order: &str,
) -> Result<bool> {
    let (held, charged): (i64, i64) = redis::Script::new(
        r"
        local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
        local held = (#p == 1 and p[1][2] == ARGV[3]) and 1 or 0
        return {held, redis.call('HEXISTS', KEYS[2], ARGV[4])}",
    )
    .key(stream)
    .key("{ledger}:charges")
    .arg("billing")
    .arg(id)
    .arg(consumer)
    .arg(order)
    .invoke_async(conn)
    .await?;
    Ok(held == 1 && charged == 1)
}

/// SIGKILLs a worker stalled between a charge and its ack; true when it is
/// shown to have landed there: charged and held before, still held (by a
/// process that is now dead) after.
async fn aimed_kill(
    client: &kube::Client,
    ns: &str,
    conn: &mut redis::aio::MultiplexedConnection,
    seen: &mut usize,
) -> Result<Option<(String, String, bool)>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    // A stall lasts 2 s: watch for one in progress for a while rather than
    // only looking at what was announced since the last attempt.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let stalls: Vec<String> = conn.lrange("{ledger}:stalls", 0, -1).await?;
        let fresh = stalls.get(*seen..).unwrap_or_default().to_vec();
        *seen = stalls.len();
        // The newest stall first: the one most likely still stalled.
        for stall in fresh.iter().rev() {
            let parts: Vec<&str> = stall.split(' ').collect();
            let [pid, consumer, id, order, stream] = parts[..] else { continue };
            let pod = consumer.split_once('.').map_or(consumer, |(pod, _)| pod);
            let Some(p) = pods.get_opt(pod).await? else { continue };
            let container = streamfleet_testbed::kubelet::container_pid(&p, "worker");
            if container.map(|c| c.to_string()).as_deref() != Some(pid)
                || !charged_and_held(conn, stream, id, consumer, order).await?
            {
                continue;
            }
            sigkill_container(client, ns, pod).await?;
            let landed = charged_and_held(conn, stream, id, consumer, order).await?;
            return Ok(Some((consumer.to_string(), order.to_string(), landed)));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(None)
}

/// Now, in Unix milliseconds (the ledger's times come from Redis on this machine's clock).
fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// `INFO server` run_id: a new one means a new process.
async fn run_id(conn: &mut redis::aio::MultiplexedConnection) -> Result<String> {
    let info: String = redis::cmd("INFO").arg("server").query_async(conn).await?;
    Ok(info.lines().find_map(|l| l.strip_prefix("run_id:")).unwrap_or_default().trim().to_string())
}

/// The drill's size, and the orders it singles out.
struct Run {
    /// Orders asked for (`DRILL_ORDERS`): the figure's name and settings.
    orders: usize,
    /// How long the orders are produced for (`DRILL_SECONDS`).
    seconds: u64,
    /// Orders produced before the pipeline exists (the vanished consumer's among them).
    first: usize,
    /// Mid-run, while the faults land: the order that kills its worker.
    killer: usize,
    /// Until well before the killer, the producer trims by length.
    trim_until: usize,
}

impl Run {
    fn from_env() -> Result<Self> {
        let orders: usize = std::env::var("DRILL_ORDERS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
        let seconds: u64 = std::env::var("DRILL_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
        let first = orders.min(1000);
        let killer = (orders / 2 / 100 * 100 + 17).max(first + 17);
        anyhow::ensure!(killer < orders, "DRILL_ORDERS {orders}: too few for the killer order");
        Ok(Self { orders, seconds, first, killer, trim_until: killer.saturating_sub(1000) })
    }
}

/// What the producer shares with the faults: its turn (a Redis restart
/// waits for the batch in flight) and the shards it sends to (one, until
/// the growth is done).
#[derive(Clone)]
struct Production {
    turn: std::sync::Arc<tokio::sync::Mutex<()>>,
    shards: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl Production {
    fn new() -> Self {
        Self { turn: Default::default(), shards: std::sync::Arc::new(1.into()) }
    }

    fn shards(&self) -> u32 {
        self.shards.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The orders produced, as (qualified entry ID, order), and the entries
/// found pending without a payload after a trim by length, with their holder.
type Produced = (Vec<(String, usize)>, Vec<(String, String)>);

async fn drill(namespace: &str, plan: Plan) -> Result<()> {
    let _one = ONE_AT_A_TIME.lock().await;
    let run = Run::from_env()?;
    let helm: &[&str] = if plan.infrastructure { &["--set", "replicaCount=2"] } else { &[] };
    // (Stalls of the server, an `fsync` under `appendfsync always` say, are
    // shown at the end: no hold can be renewed through one.)
    let redis_args = ["--appendonly", "yes", "--appendfsync", "always", "--latency-monitor-threshold", "100"];
    let mut f = Fixture::start_with_redis(namespace, helm, &redis_args).await?;
    let started = Instant::now();
    let mut produced = start_pipeline(&mut f, &plan, &run).await?;
    let production = Production::new();
    let producer = produce_over_the_run(f.redis.url(), &run, &production);
    let (mut observed, top_ups) = inject_faults(&mut f, &plan, &run, &production, &producer, started).await?;
    // The faults take their own time (a restarted API server, a leader's
    // Lease handed over, aimed kills waiting for a stall): settling is
    // measured from the first order, and this says how much of it was theirs.
    let faults_done = started.elapsed();
    let (rest, trimmed_in_hand) = producer.await??;
    produced.extend(rest);
    produced.extend(top_ups);
    let order_of: HashMap<String, usize> = produced.iter().cloned().collect();
    let shards = shard_keys("orders", production.shards());
    settle(&f, &order_of, &shards, &observed).await?;
    let settled_in = started.elapsed();

    let mut conn = f.redis.connection().await?;
    // Whole ledgers of 100,000 orders come back in one reply.
    conn.set_response_timeout(Duration::from_secs(120));
    let ledger = Ledger::read(&mut conn, &shards).await?;
    let letters = read_letters(&mut conn, &order_of, &shards).await?;
    let accounts = account_for_every_order(&produced, &run, &ledger, &letters)?;
    for death in &ledger.aborts {
        let (consumer, at) = death.split_once(' ').expect("<consumer> <ms>");
        observed.killed_consumers.push((consumer.to_string(), at.parse()?));
    }
    nothing_left_pending(&mut conn, &shards).await?;
    status_counts_the_losses(&f, accounts.lost.len()).await?;
    let verdict = Verdict::of(&ledger, &letters, &observed, &trimmed_in_hand, &order_of, &accounts.lost);
    // The server's longest stall since its restart (`LATENCY LATEST`: event,
    // when, latest ms, longest ms).
    let stalls: Vec<(String, u64, u64, u64)> = redis::cmd("LATENCY").arg("LATEST").query_async(&mut conn).await?;
    let longest_stall = stalls.iter().max_by_key(|s| s.3).map(|(event, _, _, ms)| format!("{ms} ms ({event})"));
    let transient = ledger.faults.get("transient").copied().unwrap_or(0);
    let slow_charges: u64 =
        ledger.by_consumer.iter().filter(|(c, _)| c.starts_with("slow-worker-")).map(|(_, n)| n).sum();
    let refused = ledger.refused.values().sum::<u64>();
    let absorbed = ledger.suppressed.unwrap_or(0) + refused;
    let lost = &accounts.lost;
    println!(
        "drill (guard {}): {} orders over {} s ({} poison, {} payload-lost of which {} charged first by a \
         charger that then died; trimmed by length in a live worker's hands and completed by it: {}) settled in {:?}; \
         worker SIGKILLs: {} random + {} aimed between effect and ack (shown: charged and still held by the dead \
         process; {} aimed missed, the ack came first); Redis crash-restarts from AOF: {}; kube-apiserver restarts: {}; \
         leading operator SIGKILLed: {}; fault phase ended at {faults_done:?}; transient failures: {transient}; charged by the slow worker: {slow_charges}; duplicate \
         deliveries absorbed: {absorbed} (guard suppressed {}, ledger refused {refused}, of which by the first charger's own consumer \
         name, a retry after a lost reply or its restarted process: {}; of charges in flight at the Redis crash: {}); \
         deaths caused by the killer order before its crashed-worker letter: {}; longest Redis stall since its restart: {}; \
         duplicate effects: {}",
        if plan.guard { "on" } else { "off" },
        produced.len(),
        run.seconds,
        accounts.poison,
        lost.len(),
        lost.len() - accounts.lost_uncharged,
        verdict.completed_after_trim.len(),
        settled_in,
        observed.random_kills,
        observed.aimed_landed.len(),
        observed.aimed_missed,
        usize::from(observed.redis_restart.is_some()),
        usize::from(observed.apiserver_restart.is_some()),
        observed.leader_killed.as_deref().unwrap_or("no"),
        ledger.suppressed.unwrap_or(0),
        ledger.own_retries.values().sum::<u64>(),
        verdict.crash_repeats,
        ledger.aborts.len(),
        longest_stall.as_deref().unwrap_or("none over 100 ms"),
        verdict.duplicate_effects.len()
    );
    let timed: Vec<String> = verdict
        .duplicate_effects
        .iter()
        .map(|(order, by)| {
            format!("{order} {by:?} {:?} {:?}", ledger.charged_at.get(order), ledger.repeated_at.get(order))
        })
        .collect();
    assert!(
        verdict.duplicate_effects.is_empty(),
        "charged again while the first charger lived (order, first charger, charged at, repeated at; Redis crashed at \
         {:?}; its longest stall since: {longest_stall:?}): {timed:?}",
        observed.crashed_at_ms
    );
    assert!(
        verdict.false_losses.is_empty(),
        "recorded lost though charged by a holder that lived on: {:?}",
        verdict.false_losses
    );
    // Every fault happened.
    assert!(
        run.trim_until <= run.first || !verdict.completed_after_trim.is_empty(),
        "no entry was trimmed by length in a live worker's hands and completed: {trimmed_in_hand:?}"
    );
    assert_eq!(observed.random_kills, plan.random_kills, "every random SIGKILL landed on a running worker");
    assert!(observed.aimed_landed.len() >= plan.aimed_kills, "aimed SIGKILLs that landed: {:?}", observed.aimed_landed);
    for (consumer, order) in &observed.aimed_landed {
        assert!(
            ledger.charges.contains_key(order),
            "{order}, charged when {consumer} was killed, is not in the ledger"
        );
    }
    assert_eq!(observed.redis_restart.is_some(), plan.infrastructure, "the Redis restart");
    assert_eq!(observed.apiserver_restart.is_some(), plan.infrastructure, "the kube-apiserver restart");
    assert_eq!(observed.leader_killed.is_some(), plan.infrastructure, "the leader's SIGKILL");
    assert_eq!(observed.grown.is_some(), plan.infrastructure, "the growth to {SHARDS_AFTER} shards");
    if plan.infrastructure {
        let on_new_shard = produced.iter().filter(|(id, _)| id.contains('@')).count();
        assert!(on_new_shard > 0, "no order was sent to the new shard");
        assert_eq!(
            ledger.faults.get("stale-fence").copied().unwrap_or(0),
            0,
            "a fence went backwards after the growth"
        );
    }
    let expected = accounts.expected as u64;
    assert!(transient * 100 >= expected, "transient failures {transient} for {expected} charges: under 1%");
    assert!(slow_charges > 0, "the slow worker took no part");
    assert!(absorbed > 0, "the drill caused no redelivery at all");

    // The figures of a drill that passed.
    let name = match (run.orders, plan.guard) {
        (10_000, true) => "drill".to_string(),
        (10_000, false) => "drill-noguard".to_string(),
        (n, guard) => format!("drill-{n}{}", if guard { "" } else { "-noguard" }),
    };
    let row = |what: &str, n: String| serde_json::json!([what, n]);
    let rows = vec![
        row("orders produced (1% poison)", produced.len().to_string()),
        row("worker SIGKILLs, random", observed.random_kills.to_string()),
        row(
            "worker SIGKILLs aimed between a charge and its ack, shown to land there",
            observed.aimed_landed.len().to_string(),
        ),
        row(
            "deaths caused by the order that kills its worker (then a crashed-worker letter, alone)",
            ledger.aborts.len().to_string(),
        ),
        row("Redis crash-restarts from its AOF", usize::from(observed.redis_restart.is_some()).to_string()),
        row("kube-apiserver restarts", usize::from(observed.apiserver_restart.is_some()).to_string()),
        row("leading operator SIGKILLed", usize::from(observed.leader_killed.is_some()).to_string()),
        row("shards at the end (grown from 1 mid-run, the workers rolled over)", shards.len().to_string()),
        row("transient gateway failures", transient.to_string()),
        row("payloads trimmed under a vanished consumer, reported payload-missing", TRIMMED.to_string()),
        row(
            "payloads lost in all (outside trim and the producer's MAXLEN), each on record as payload-missing",
            lost.len().to_string(),
        ),
        row(
            "entries trimmed by length in a live worker's hands, then completed by it (no loss record)",
            verdict.completed_after_trim.len().to_string(),
        ),
        row("charged by the slow but live worker", slow_charges.to_string()),
        row("duplicate deliveries absorbed (guard or ledger)", absorbed.to_string()),
        row("repeats of charges in flight at the Redis crash", verdict.crash_repeats.to_string()),
        row("duplicate effects", verdict.duplicate_effects.len().to_string()),
        row(
            "seconds from the first order to the end of the fault phase (the last fault and its recovery waits)",
            format!("{:.1}", faults_done.as_secs_f64()),
        ),
        row("seconds from the first order to every order settled", format!("{:.1}", settled_in.as_secs_f64())),
    ];
    streamfleet_testbed::write_figure(
        &name,
        &serde_json::json!({
            "what": format!(
                "The fault drill (guard {}): orders through the example pipeline while the faults below are injected, each shown to have happened",
                if plan.guard { "on" } else { "off" }
            ),
            "settings": {
                "orders": run.orders, "productionSeconds": run.seconds, "workers": plan.workers,
                "guard": plan.guard, "minIdleTimeMs": MIN_IDLE_MS, "maxDeliveries": MAX_DELIVERIES,
                "batchSize": BATCH_SIZE, "stallMs": STALL_MS, "stallPercent": STALL_PERCENT,
                "transientPercent": TRANSIENT_PERCENT, "trimKeep": TRIM_KEEP,
            },
            "columns": ["injected or observed", "count"],
            "rows": rows,
            "summary": format!(
                "{} orders settled in {:.0} s: every order charged once or dead-lettered, duplicate effects {}.",
                produced.len(),
                settled_in.as_secs_f64(),
                verdict.duplicate_effects.len()
            ),
        }),
    )?;
    Ok(())
}

/// Before the pipeline exists: a consumer outside it takes the first
/// orders and vanishes, then an outside trim deletes exactly those pending
/// entries' payloads. Then the pipeline and the slow worker, until Ready.
/// Returns the first orders.
async fn start_pipeline(f: &mut Fixture, plan: &Plan, run: &Run) -> Result<Vec<(String, usize)>> {
    let mut conn = f.conn.clone();
    streamfleet_streams::ensure_group(&mut conn, "orders", "billing", "0").await?;
    let produced = produce(&mut conn, 0..run.first, usize::MAX, None, 1).await?;
    let opts = redis::streams::StreamReadOptions::default().group("billing", "vanished").count(TRIMMED);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let trimmed: u64 =
        redis::cmd("XTRIM").arg("orders").arg("MINID").arg(&produced[TRIMMED].0).query_async(&mut conn).await?;
    assert_eq!(trimmed, TRIMMED as u64, "the trim deleted exactly the vanished consumer's pending entries");

    f.apply(&pipeline(plan)).await?;
    Api::<Deployment>::namespaced(f.client.clone(), &f.ns.name)
        .create(&PostParams::default(), &slow_worker(&f.redis.url(), plan.guard)?)
        .await?;
    wait_condition(&f.client, &f.ns.name, "orders", "Ready", "True", None, Duration::from_secs(120)).await?;
    Ok(produced)
}

/// The rest of the orders, produced at an even pace over the drill while
/// the faults are injected. Until `trim_until` the producer trims by length,
/// keeping what the group has not read yet: what goes is delivered, pending
/// or not. After each trim, entries pending without a payload are noted with
/// their holder.
fn produce_over_the_run(url: String, run: &Run, production: &Production) -> tokio::task::JoinHandle<Result<Produced>> {
    let (first, orders, seconds, killer, trim_until) = (run.first, run.orders, run.seconds, run.killer, run.trim_until);
    let production = production.clone();
    tokio::spawn(async move {
        let batches = (orders - first).div_ceil(100).max(1);
        let pause = Duration::from_millis(seconds * 1000 / batches as u64);
        let (mut out, mut trimmed_in_hand) = (Vec::new(), Vec::new());
        let mut next = first;
        while next < orders {
            let end = (next + 100).min(orders);
            let _turn = production.turn.lock().await;
            let mut c = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
            let keep = match end <= trim_until {
                true => undelivered(&mut c).await?.map(|unread| unread + (end - next) + TRIM_KEEP),
                false => None,
            };
            out.extend(produce(&mut c, next..end, killer, keep, production.shards()).await?);
            if keep.is_some() {
                trimmed_in_hand.extend(pending_without_payload(&mut c).await?);
            }
            drop(_turn);
            next = end;
            tokio::time::sleep(pause).await;
        }
        anyhow::Ok((out, trimmed_in_hand))
    })
}

/// The faults, spread over the production window, then aimed kills until
/// enough have landed. Returns what was observed, and the orders produced
/// to top up the stalls the aimed kills wait for.
async fn inject_faults(
    f: &mut Fixture,
    plan: &Plan,
    run: &Run,
    production: &Production,
    producer: &tokio::task::JoinHandle<Result<Produced>>,
    started: Instant,
) -> Result<(Observed, Vec<(String, usize)>)> {
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    let mut conn = f.redis.connection().await?;
    let steps = plan.random_kills + plan.aimed_kills + if plan.infrastructure { 4 } else { 0 };
    let gap = Duration::from_millis(run.seconds * 1000 / (steps as u64 + 1));
    let mut schedule: Vec<&str> = std::iter::repeat_n("kill", plan.random_kills).collect();
    if plan.infrastructure {
        for (at, fault) in
            [(steps / 5, "redis"), (2 * steps / 5, "grow"), (3 * steps / 5, "apiserver"), (4 * steps / 5, "leader")]
        {
            schedule.insert(at.min(schedule.len()), fault);
        }
    }
    let mut observed = Observed::default();
    let mut kills_per_pod = HashMap::new();
    let mut stalls_seen = 0;
    let mut aim_every = (schedule.len() / plan.aimed_kills.max(1)).max(1);
    let mut step = 0;
    let mut top_ups = Vec::new();
    while step < schedule.len() || observed.aimed_landed.len() < plan.aimed_kills {
        // (Once the schedule is done, aimed kills follow one another: each
        // waits for a stall of its own.)
        if step < schedule.len() {
            tokio::time::sleep(gap).await;
        }
        // Aimed kills go between the scheduled faults until enough have landed.
        if observed.aimed_landed.len() < plan.aimed_kills && (step % aim_every == 0 || step >= schedule.len()) {
            // Stalls come only from orders being handled: once production is
            // over and the backlog drained, more orders make more targets.
            if step >= schedule.len() && producer.is_finished() {
                let _turn = production.turn.lock().await;
                let more = run.orders + top_ups.len()..run.orders + top_ups.len() + 500;
                top_ups.extend(produce(&mut conn, more, usize::MAX, None, production.shards()).await?);
            }
            if let Some((consumer, order, landed)) = aimed_kill(&client, &ns, &mut conn, &mut stalls_seen).await? {
                observed.killed_consumers.push((consumer.clone(), unix_ms()));
                if landed {
                    observed.aimed_landed.push((consumer, order));
                } else {
                    observed.aimed_missed += 1;
                }
            }
            if step >= schedule.len() {
                anyhow::ensure!(
                    started.elapsed() < Duration::from_secs(run.seconds * 3 + 120),
                    "aimed kills: {observed:?}"
                );
                aim_every = 1;
                continue;
            }
        }
        match schedule[step] {
            "kill" => match kill_a_worker(&client, &ns, &mut kills_per_pod).await? {
                Some(consumer) => {
                    observed.killed_consumers.push((consumer, unix_ms()));
                    observed.random_kills += 1;
                }
                // Every worker is restarting: try again next step.
                None => continue,
            },
            "redis" => {
                let (run_ids, crashed_at_ms) = crash_redis(f, production).await?;
                conn = f.redis.connection().await?;
                observed.redis_restart = Some(run_ids);
                observed.crashed_at_ms = Some(crashed_at_ms);
            }
            "grow" => {
                grow(f, production).await?;
                observed.grown = Some(started.elapsed());
            }
            "apiserver" => {
                let (before, after) = f.bed.restart_apiserver().await?;
                assert_ne!(before, after);
                observed.apiserver_restart = Some((before, after));
            }
            "leader" => observed.leader_killed = Some(kill_the_leader(f).await?),
            _ => unreachable!(),
        }
        step += 1;
    }
    Ok((observed, top_ups))
}

/// Crashes Redis between two of the producer's batches and restarts it from
/// its AOF; shows that it restarted and that nothing acknowledged before the
/// crash was lost. Returns its run IDs before and after, and when it
/// crashed (Unix ms, Redis's clock).
async fn crash_redis(f: &mut Fixture, production: &Production) -> Result<((String, String), u64)> {
    let _quiet = production.turn.lock().await;
    let mut conn = f.redis.connection().await?;
    let before = run_id(&mut conn).await?;
    let last: redis::streams::StreamRangeReply = conn.xrevrange_count("orders", "+", "-", 1).await?;
    let last = last.ids[0].id.clone();
    let charged_before: usize = conn.hlen("{ledger}:charges").await?;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let crashed_at_ms = secs * 1000 + micros / 1000;
    f.redis.crash_and_restart().await?;
    let mut conn = eventually("Redis back from its AOF", Duration::from_secs(60), || async {
        let mut c = f.redis.connection().await?;
        let _: () = redis::cmd("PING").query_async(&mut c).await?;
        Ok(Some(c))
    })
    .await?;
    let after = run_id(&mut conn).await?;
    assert_ne!(before, after, "Redis did not restart");
    let kept: redis::streams::StreamRangeReply = conn.xrange("orders", &last, &last).await?;
    assert_eq!(kept.ids.len(), 1, "the last entry before the crash is gone");
    let charged_after: usize = conn.hlen("{ledger}:charges").await?;
    assert!(charged_after >= charged_before, "charges lost in the crash: {charged_before} -> {charged_after}");
    Ok(((before, after), crashed_at_ms))
}

/// Grows the resource to [`SHARDS_AFTER`] shards; once the new shard's
/// group exists the producer sends each order to its shard.
async fn grow(f: &Fixture, production: &Production) -> Result<()> {
    let scgs: Api<streamfleet_crd::StreamConsumerGroup> = Api::namespaced(f.client.clone(), &f.ns.name);
    let patch = serde_json::json!({"spec": {"shards": SHARDS_AFTER}});
    scgs.patch("orders", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await?;
    let last = shard_key("orders", SHARDS_AFTER - 1);
    eventually("the new shard's group", Duration::from_secs(60), || async {
        let groups: redis::RedisResult<redis::streams::StreamInfoGroupsReply> =
            f.redis.connection().await?.xinfo_groups(&last).await;
        Ok(groups.ok().filter(|g| g.groups.iter().any(|g| g.name == "billing")).map(|_| ()))
    })
    .await?;
    production.shards.store(SHARDS_AFTER, std::sync::atomic::Ordering::SeqCst);
    Ok(())
}

/// SIGKILLs the leading operator and shows leadership going on: a live
/// operator renews the Lease after the kill. Returns the killed leader.
async fn kill_the_leader(f: &Fixture) -> Result<String> {
    let leases: Api<Lease> = Api::namespaced(f.client.clone(), &f.ns.name);
    let lease_name = format!("{}-streamfleet-leader", f.release);
    let lease = eventually("a leader", Duration::from_secs(60), || async {
        Ok(leases.get_opt(&lease_name).await.ok().flatten().and_then(|l| l.spec))
    })
    .await?;
    let leader = lease.holder_identity.clone().unwrap_or_default();
    let killed_at = k8s_openapi::jiff::Timestamp::now();
    sigkill_container(&f.client, &f.ns.name, &leader).await?;
    eventually("the Lease renewed after the leader's SIGKILL", Duration::from_secs(90), || async {
        let spec = leases.get(&lease_name).await?.spec;
        Ok(spec.and_then(|s| s.renew_time).filter(|t| t.0 > killed_at).map(|_| ()))
    })
    .await?;
    Ok(leader)
}

/// Entries pending on any shard.
async fn pending_in(mut c: redis::aio::MultiplexedConnection, shards: &[String]) -> Result<usize> {
    let mut n = 0;
    for shard in shards {
        let pending: redis::streams::StreamPendingReply = c.xpending(shard, "billing").await?;
        n += pending.count();
    }
    Ok(n)
}

/// Waits until settled: nothing pending, and every order charged or
/// dead-lettered (a lost payload counts once, charged or not). Fails saying
/// where each order stands.
async fn settle(f: &Fixture, order_of: &HashMap<String, usize>, shards: &[String], observed: &Observed) -> Result<()> {
    let orders = order_of.len();
    let settled = eventually("every order settled", Duration::from_secs(900), || async {
        let mut c = f.redis.connection().await?;
        c.set_response_timeout(Duration::from_secs(120));
        if pending_in(c.clone(), shards).await? > 0 {
            return Ok(None);
        }
        let charged: std::collections::HashSet<String> = c.hkeys("{ledger}:charges").await?;
        let letters = read_letters(&mut c, order_of, shards).await?;
        let lost_uncharged = letters.lost.iter().filter(|(o, _)| !charged.contains(o)).count();
        let done = charged.len() + letters.permanent.len() + letters.crashed.len() + lost_uncharged;
        // (More than `orders` is settled too: the checks after say what is wrong.)
        Ok((done >= orders).then_some(()))
    })
    .await;
    let Err(e) = settled else { return Ok(()) };
    let mut conn = f.redis.connection().await?;
    conn.set_response_timeout(Duration::from_secs(120));
    let charged: usize = conn.hlen("{ledger}:charges").await?;
    let letters = read_letters(&mut conn, order_of, shards).await?;
    let pending = pending_in(conn.clone(), shards).await?;
    Err(e.context(format!(
        "charged {charged}, permanent {}, crashed {}, lost {}, pending {pending} of {orders} orders; {observed:?}",
        letters.permanent.len(),
        letters.crashed.len(),
        letters.lost.len(),
    )))
}

/// The example's ledger and the guard's counters, as the drill ends.
struct Ledger {
    /// Order → amount charged.
    charges: HashMap<String, u64>,
    /// Injected faults by kind (`transient`, `stale-fence`).
    faults: HashMap<String, u64>,
    /// Charges per consumer.
    by_consumer: HashMap<String, u64>,
    /// Second charges the ledger refused, per order.
    refused: HashMap<String, u64>,
    /// Of those, by the first charger's own consumer name (a retry after a
    /// lost reply, or its restarted process).
    own_retries: HashMap<String, u64>,
    charged_by: HashMap<String, String>,
    charged_at: HashMap<String, u64>,
    /// When a consumer other than the first charger tried to charge again.
    repeated_at: HashMap<String, u64>,
    /// The killer order's victims: `<consumer> <ms>`.
    aborts: Vec<String>,
    /// Deliveries the guard suppressed, over every shard (`None`: no counter).
    suppressed: Option<u64>,
}

impl Ledger {
    async fn read(conn: &mut redis::aio::MultiplexedConnection, shards: &[String]) -> Result<Self> {
        let mut suppressed = None;
        for shard in shards {
            let n: Option<u64> = conn.get(streamfleet_worker::guard::suppressed_key(shard, "billing")).await?;
            suppressed = match (suppressed, n) {
                (None, None) => None,
                (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
            };
        }
        Ok(Self {
            charges: conn.hgetall("{ledger}:charges").await?,
            faults: conn.hgetall("{ledger}:faults").await?,
            by_consumer: conn.hgetall("{ledger}:by-consumer").await?,
            refused: conn.hgetall("{ledger}:duplicates").await?,
            own_retries: conn.hgetall("{ledger}:own-retries").await?,
            charged_by: conn.hgetall("{ledger}:charged-by").await?,
            charged_at: conn.hgetall("{ledger}:charged-at").await?,
            repeated_at: conn.hgetall("{ledger}:repeated-at").await?,
            aborts: conn.lrange("{ledger}:aborts", 0, -1).await?,
            suppressed,
        })
    }
}

/// Where the orders ended up, each accounted for once.
struct Accounts {
    /// Orders on record as `payload-missing`.
    lost: std::collections::BTreeSet<String>,
    /// Of those, never charged.
    lost_uncharged: usize,
    poison: usize,
    /// Orders that must be charged: produced, minus poison, minus the
    /// killer, minus those lost before anyone charged them.
    expected: usize,
}

/// Every order produced is exactly one of: charged (the right amount),
/// a poison order's `permanent` letter, the killer's `crashed-worker` letter
/// (alone, after exactly the crash limit's deaths), or on record lost and
/// uncharged; the outside trim's entries are all on record, uncharged.
fn account_for_every_order(
    produced: &[(String, usize)],
    run: &Run,
    ledger: &Ledger,
    letters: &Letters,
) -> Result<Accounts> {
    let charged = &ledger.charges;
    let lost: std::collections::BTreeSet<String> = letters.lost.iter().map(|(o, _)| o.clone()).collect();
    assert_eq!(lost.len(), letters.lost.len(), "one payload-missing record per entry: {:?}", letters.lost);
    for (_, order) in &produced[..TRIMMED] {
        let order = order.to_string();
        assert!(lost.contains(&order) && !charged.contains_key(&order), "trimmed under the vanished consumer: {order}");
    }
    let lost_uncharged: std::collections::BTreeSet<String> =
        lost.iter().filter(|o| !charged.contains_key(*o)).cloned().collect();
    let poison: Vec<String> = produced.iter().filter(|(_, i)| i % 100 == 42).map(|(_, i)| i.to_string()).collect();
    // Each poison order is a dead letter once, unless its payload went first.
    let mut permanent = letters.permanent.clone();
    permanent.sort();
    let mut poison_letters: Vec<String> = poison.iter().filter(|o| !lost.contains(*o)).cloned().collect();
    poison_letters.sort();
    assert_eq!(permanent, poison_letters, "each poison order is a dead letter, once");
    assert_eq!(
        letters.crashed,
        [run.killer.to_string()],
        "the order that kills its worker is a crashed-worker letter, alone"
    );
    assert_eq!(ledger.aborts.len(), CRASH_LIMIT, "deaths caused by the killer order: {:?}", ledger.aborts);
    let expected_set: std::collections::BTreeSet<String> = produced
        .iter()
        .map(|(_, i)| i.to_string())
        .filter(|o| !poison.contains(o) && !lost_uncharged.contains(o) && *o != run.killer.to_string())
        .collect();
    let charged_set: std::collections::BTreeSet<String> = charged.keys().cloned().collect();
    assert_eq!(charged_set, expected_set, "charged = produced - poison - killer - lost uncharged");
    for (_, i) in produced.iter().filter(|(_, i)| expected_set.contains(&i.to_string())) {
        assert_eq!(charged[&i.to_string()], 100 + u64::try_from(*i)?, "order {i} charged the wrong amount");
    }
    Ok(Accounts { lost_uncharged: lost_uncharged.len(), poison: poison.len(), expected: expected_set.len(), lost })
}

/// Every entry acked or dead-lettered: nothing pending, nothing
/// undelivered, on every shard.
async fn nothing_left_pending(conn: &mut redis::aio::MultiplexedConnection, shards: &[String]) -> Result<()> {
    for shard in shards {
        let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups(shard).await?;
        let billing = info.groups.iter().find(|g| g.name == "billing").expect("the group");
        assert_eq!((billing.pending, billing.lag), (0, Some(0)), "{shard}");
    }
    Ok(())
}

/// The resource says exactly how much was lost.
async fn status_counts_the_losses(f: &Fixture, lost: usize) -> Result<()> {
    let scgs: Api<streamfleet_crd::StreamConsumerGroup> = Api::namespaced(f.client.clone(), &f.ns.name);
    let status = eventually("payloadLost in status", Duration::from_secs(60), || async {
        let s = scgs.get("orders").await?.status.unwrap_or_default();
        Ok(s.payload_lost.clone().filter(|p| p.total >= lost as i64).map(|p| (p, s.health)))
    })
    .await?;
    assert_eq!(status.0.total, lost as i64, "payload-lost total is exactly the loss records");
    assert_eq!(status.1, Some(streamfleet_crd::Health::PayloadLost));
    Ok(())
}

/// Duplicates and losses, judged: deliveries absorbed (the guard suppressed
/// them, or the ledger refused a second charge) versus duplicate effects (a
/// repeat that got past a first charger still alive, other than that
/// charger's own retry of a charge whose reply it lost), which must be none.
struct Verdict {
    duplicate_effects: Vec<(String, Option<String>)>,
    /// Repeats of charges in flight at the Redis crash (their ack may never
    /// have been persisted: the protocol working, whoever charged first).
    crash_repeats: usize,
    /// Charged orders on record lost though their charger lived on.
    false_losses: Vec<String>,
    /// Entries trimmed by the producer while pending in a worker's hands,
    /// then completed by that worker: charged by it, and no loss record.
    completed_after_trim: std::collections::BTreeSet<String>,
}

impl Verdict {
    fn of(
        ledger: &Ledger,
        letters: &Letters,
        observed: &Observed,
        trimmed_in_hand: &[(String, String)],
        order_of: &HashMap<String, usize>,
        lost: &std::collections::BTreeSet<String>,
    ) -> Self {
        // A repeat is excused only when the first charger died after
        // charging and before the repeat: never because it was killed at
        // some other time.
        let died_between = |consumer: &str, from: u64, to: u64| {
            observed.killed_consumers.iter().any(|(c, at)| c == consumer && from <= *at && *at <= to)
        };
        // A charge made in the seconds before the Redis crash may have lost
        // its ack (never persisted, never confirmed): its repeat is the
        // protocol working, whoever charged first.
        let in_flight_at_crash = |order: &str| {
            observed
                .crashed_at_ms
                .zip(ledger.charged_at.get(order))
                .is_some_and(|(crash, at)| *at <= crash && crash - at < 5000)
        };
        // Every refused charge by a consumer other than the first charger
        // (own retries of a lost reply aside) is timed in `repeated-at`.
        let foreign = ledger
            .refused
            .iter()
            .filter(|(order, n)| **n > ledger.own_retries.get(*order).copied().unwrap_or(0))
            .count();
        assert_eq!(foreign, ledger.repeated_at.len(), "every foreign repeat is timed");
        let repeats: Vec<(String, Option<String>)> = ledger
            .repeated_at
            .iter()
            .filter(|(order, repeat)| {
                let first = ledger.charged_at.get(*order).copied().unwrap_or(u64::MAX);
                !ledger.charged_by.get(*order).is_some_and(|c| died_between(c, first, **repeat))
            })
            .map(|(order, _)| (order.clone(), ledger.charged_by.get(order).cloned()))
            .collect();
        let crash_repeats = repeats.iter().filter(|(order, _)| in_flight_at_crash(order)).count();
        // Loss means lost: a charged order is on record as lost only when
        // its charger died after charging and before the record (its entry
        // then lost its payload in a dead consumer's hands), or when the
        // charger never heard back (a charge in flight at the Redis crash: a
        // retry was due, and the payload went first).
        let false_losses = letters
            .lost
            .iter()
            .filter(|(order, at)| {
                let charged = ledger.charged_at.get(order).copied();
                ledger.charges.contains_key(order)
                    && !in_flight_at_crash(order)
                    && !charged.zip(ledger.charged_by.get(order)).is_some_and(|(from, c)| died_between(c, from, *at))
            })
            .map(|(order, _)| order.clone())
            .collect();
        // (Had a holder died holding a trimmed entry, the claim after it
        // would have found the payload gone and recorded the loss.)
        let completed_after_trim = trimmed_in_hand
            .iter()
            .filter_map(|(id, holder)| order_of.get(id).map(|o| (o.to_string(), holder)))
            .filter(|(order, holder)| ledger.charged_by.get(order) == Some(*holder) && !lost.contains(order))
            .map(|(order, _)| order)
            .collect();
        let duplicate_effects = repeats.into_iter().filter(|(order, _)| !in_flight_at_crash(order)).collect();
        Self { duplicate_effects, crash_repeats, false_losses, completed_after_trim }
    }
}
