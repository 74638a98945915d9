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
    let range: redis::streams::StreamRangeReply = conn.xrange_all("{orders}:dead:g").await?;
    Ok(range
        .ids
        .into_iter()
        .map(|e| {
            streamfleet_streams::entry::fields_from_map(e.map)
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                .collect()
        })
        .collect())
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
