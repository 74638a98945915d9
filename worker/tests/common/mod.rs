//! What the worker's integration tests share: a scripted handler, a real
//! redis-server with the group, and helpers to read its state.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use anyhow::Result;
use redis::AsyncCommands as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use streamfleet_contract as env;
use streamfleet_testbed::RedisServer;
use streamfleet_worker::{Entry, Handler, Outcome, Worker, WorkerConfig};

/// Behaviour chosen per entry by its `kind` field; counts calls per entry ID.
#[derive(Clone, Default)]
pub struct Scripted {
    pub calls: Arc<Mutex<HashMap<String, u32>>>,
    /// Handlers running now, the most seen at once, and keys running now.
    pub in_flight: Arc<Mutex<(usize, usize, Vec<String>)>>,
    pub overlapping_keys: Arc<Mutex<u32>>,
    pub release: Arc<tokio::sync::Notify>,
}

impl Scripted {
    pub fn calls(&self, id: &str) -> u32 {
        self.calls.lock().unwrap().get(id).copied().unwrap_or(0)
    }
    pub fn total(&self) -> u32 {
        self.calls.lock().unwrap().values().sum()
    }
}

impl Handler for Scripted {
    fn business_key(&self, entry: &Entry) -> Option<String> {
        if entry.field_str("key") == Some("explode") {
            panic!("cannot read this key");
        }
        entry.field_str("key").map(str::to_string)
    }

    async fn handle(&self, entry: &Entry) -> Outcome {
        let n = {
            let mut calls = self.calls.lock().unwrap();
            let n = calls.entry(entry.id.clone()).or_insert(0);
            *n += 1;
            *n
        };
        match entry.field_str("kind").unwrap_or("ok") {
            "ok" => Outcome::Done,
            "slow" => {
                let key = entry.field_str("key").unwrap_or_default().to_string();
                {
                    let mut f = self.in_flight.lock().unwrap();
                    if f.2.contains(&key) {
                        *self.overlapping_keys.lock().unwrap() += 1;
                    }
                    f.0 += 1;
                    f.1 = f.1.max(f.0);
                    f.2.push(key.clone());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut f = self.in_flight.lock().unwrap();
                f.0 -= 1;
                if let Some(at) = f.2.iter().position(|k| *k == key) {
                    f.2.remove(at);
                }
                Outcome::Done
            }
            // Fails every attempt of its first delivery, succeeds after.
            "first-delivery-fails" => match streamfleet_worker::current_delivery() {
                Some(d) if d.deliveries > 1 => Outcome::Done,
                _ => Outcome::Transient("first delivery fails".into()),
            },
            // Blocks its thread, as a synchronous client would.
            "block" => {
                let ms = entry.field_str("block_ms").and_then(|v| v.parse().ok()).unwrap_or(100);
                std::thread::sleep(Duration::from_millis(ms));
                Outcome::Done
            }
            "nap" => {
                let ms = entry.field_str("nap_ms").and_then(|v| v.parse().ok()).unwrap_or(100);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Outcome::Done
            }
            "wait" => {
                self.release.notified().await;
                Outcome::Done
            }
            "panic" => panic!("handler bug"),
            "flaky" if n > 2 => Outcome::Done,
            "flaky" | "down" => Outcome::Transient("dependency down".into()),
            "refused" => Outcome::Permanent("business rule says no".into()),
            _ => Outcome::Malformed("unknown kind".into()),
        }
    }
}

pub fn config(server: &RedisServer, consumer: &str, min_idle_ms: u64, max_deliveries: u64) -> WorkerConfig {
    config_at(&server.url(), consumer, min_idle_ms, max_deliveries)
}

/// [`config`] for a Redis URL (e.g. one naming an ACL user).
pub fn config_at(url: &str, consumer: &str, min_idle_ms: u64, max_deliveries: u64) -> WorkerConfig {
    let vars: HashMap<&str, String> = HashMap::from([
        (env::REDIS_URL, url.to_string()),
        (env::STREAMS, "orders".into()),
        (env::GROUP, "g".into()),
        (env::CONSUMER, consumer.into()),
        (env::MIN_IDLE_MS, min_idle_ms.to_string()),
        (env::MAX_DELIVERIES, max_deliveries.to_string()),
    ]);
    let mut c = WorkerConfig::from_lookup(|k| vars.get(k).cloned()).unwrap();
    c.block = Duration::from_millis(200);
    c
}

pub async fn setup() -> Result<(RedisServer, redis::aio::MultiplexedConnection)> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    streamfleet_streams::ensure_group(&mut conn, "orders", "g", "0").await?;
    Ok((server, conn))
}

pub async fn add(conn: &mut redis::aio::MultiplexedConnection, fields: &[(&str, &str)]) -> Result<String> {
    Ok(conn.xadd("orders", "*", fields).await?)
}

pub async fn pending(conn: &mut redis::aio::MultiplexedConnection) -> Result<usize> {
    let p: redis::streams::StreamPendingReply = conn.xpending("orders", "g").await?;
    Ok(p.count())
}

pub type DeadLetters = Vec<HashMap<String, String>>;

pub async fn dead_letters(conn: &mut redis::aio::MultiplexedConnection) -> Result<DeadLetters> {
    let range: redis::Value = redis::cmd("XRANGE").arg("{orders}:dead:g").arg("-").arg("+").query_async(conn).await?;
    Ok(streamfleet_streams::entry::entries_from_value(range)?
        .into_iter()
        .map(|(_, fields)| fields.into_iter().map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned())).collect())
        .collect())
}

/// [`config_at`] for a worker `c1` on a Redis Cluster.
pub fn cluster_config(cluster: &streamfleet_testbed::RedisCluster, min_idle_ms: u64) -> WorkerConfig {
    let mut c = config_at(&cluster.urls()[0], "c1", min_idle_ms, 5);
    c.endpoint.mode = streamfleet_streams::Mode::Cluster;
    c
}

/// Runs a worker in the background; the returned sender stops it.
pub fn spawn(
    worker: Worker<Scripted>,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Result<(), streamfleet_worker::WorkerError>>) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    (tx, handle)
}

pub const T: Duration = Duration::from_secs(20);

/// Runs each entry's handler until the gate opens; records each run with
/// its delivery number.
#[derive(Clone)]
pub struct Gated {
    pub open: tokio::sync::watch::Receiver<bool>,
    pub runs: std::sync::Arc<std::sync::Mutex<Vec<(String, u64)>>>,
}

impl streamfleet_worker::Handler for Gated {
    fn business_key(&self, entry: &streamfleet_worker::Entry) -> Option<String> {
        entry.field_str("key").map(str::to_string)
    }

    async fn handle(&self, entry: &streamfleet_worker::Entry) -> streamfleet_worker::Outcome {
        let deliveries = streamfleet_worker::current_delivery().map_or(0, |d| d.deliveries);
        self.runs.lock().unwrap().push((entry.id.clone(), deliveries));
        let _ = self.open.clone().wait_for(|open| *open).await;
        streamfleet_worker::Outcome::Done
    }
}

// A slot migrating on a real Redis Cluster.

/// Starts moving `slot` from `from` to `to` the standard way (`IMPORTING`,
/// `MIGRATING`) and moves the stream alone: until [`finish_migration`],
/// every script that touches the stream and its companion keys (guard
/// marks, start records) meets `TRYAGAIN`, and so does one that creates a
/// key in the slot beside an existing one.
pub async fn begin_migration(cluster: &streamfleet_testbed::RedisCluster, slot: u16, from: u16, to: u16) -> Result<()> {
    let (mut source, mut target) = (node(cluster, from).await?, node(cluster, to).await?);
    let (from_id, to_id) = (node_id(&mut source).await?, node_id(&mut target).await?);
    let () =
        redis::cmd("CLUSTER").arg("SETSLOT").arg(slot).arg("IMPORTING").arg(&from_id).query_async(&mut target).await?;
    let () =
        redis::cmd("CLUSTER").arg("SETSLOT").arg(slot).arg("MIGRATING").arg(&to_id).query_async(&mut source).await?;
    migrate(&mut source, to, &["orders".to_string()]).await
}

/// Moves the slot's other keys and gives it to `to` on every master.
pub async fn finish_migration(
    cluster: &streamfleet_testbed::RedisCluster,
    slot: u16,
    from: u16,
    to: u16,
) -> Result<()> {
    let mut source = node(cluster, from).await?;
    let rest: Vec<String> =
        redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(slot).arg(1000).query_async(&mut source).await?;
    assert!(!rest.is_empty(), "companion keys still on the old master mid-migration");
    migrate(&mut source, to, &rest).await?;
    let to_id = node_id(&mut node(cluster, to).await?).await?;
    for n in &cluster.nodes {
        let mut c = n.connection().await?;
        let () = redis::cmd("CLUSTER").arg("SETSLOT").arg(slot).arg("NODE").arg(&to_id).query_async(&mut c).await?;
    }
    Ok(())
}

pub async fn node(cluster: &streamfleet_testbed::RedisCluster, port: u16) -> Result<redis::aio::MultiplexedConnection> {
    cluster.nodes.iter().find(|n| n.port == port).expect("a node").connection().await
}

pub async fn node_id(c: &mut redis::aio::MultiplexedConnection) -> Result<String> {
    Ok(redis::cmd("CLUSTER").arg("MYID").query_async(c).await?)
}

pub async fn migrate(source: &mut redis::aio::MultiplexedConnection, to: u16, keys: &[String]) -> Result<()> {
    let _: String = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(to)
        .arg("")
        .arg(0)
        .arg(5000)
        .arg("KEYS")
        .arg(keys)
        .query_async(source)
        .await?;
    Ok(())
}

/// How many commands `port` has refused with `TRYAGAIN` or redirected with
/// `ASK`: what a half-moved slot answers.
pub async fn half_moved_refusals(cluster: &streamfleet_testbed::RedisCluster, port: u16) -> Result<u64> {
    let info: String = redis::cmd("INFO").arg("errorstats").query_async(&mut node(cluster, port).await?).await?;
    let count = |code: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("errorstat_{code}:count=")))
            .and_then(|n| n.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok(count("TRYAGAIN") + count("ASK"))
}

pub async fn add_orders(
    conn: &mut redis::cluster_async::ClusterConnection,
    keys: std::ops::Range<usize>,
) -> Result<()> {
    for i in keys {
        let _: String =
            redis::cmd("XADD").arg("orders").arg("*").arg("key").arg(format!("k{i}")).query_async(conn).await?;
    }
    Ok(())
}
