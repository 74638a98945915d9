//! The idempotency guard: a Redis record per business key moving
//! `processing` → `completed`, so a redelivered entry whose effect already
//! completed is acked without running the handler again.
//!
//! It saves repeated work; it does not replace an idempotent handler. A
//! `processing` mark names its owner (`processing:<consumer>`). A crash after
//! the effect and before `completed` is written leaves it behind: it expires
//! after min-idle-time, or at once for a consumer the operator declared dead
//! (its pod is gone: `keys::dead_consumers_key`), and the same consumer name
//! (a restarted container in the same pod) owns it still. The entry then runs
//! again, and the handler's own idempotency (a unique key in the business
//! store) decides.

use std::time::Duration;
use streamfleet_streams::config::WorkerConfig;
use streamfleet_streams::{StreamConnection, StreamError, keys};

const COMPLETED: &str = "completed";
/// Replaces a mark held by a dead consumer with ours, if it is still theirs.
const TAKE_OVER: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end return false";

/// A boxed future, so stores can be trait objects.
pub type StoreFuture<'a, T> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<T, Box<dyn std::error::Error + Send + Sync>>> + Send + 'a>,
>;

/// The hook for your own idempotency store (a table with a unique key in the
/// database your handler commits to, say). Keys are `(stream, business key)`.
/// The worker calls `begin` once per batch, `complete` for the keys whose
/// handler succeeded before it acks them, and `release` after a failure.
pub trait IdempotencyStore: Send + Sync + 'static {
    /// The state of each key; `Acquired` ones are now marked in progress.
    fn begin<'a>(&'a self, keys: &'a [(&'a str, &'a str)]) -> StoreFuture<'a, Vec<GuardState>>;
    /// Marks keys completed.
    fn complete<'a>(&'a self, keys: &'a [(&'a str, &'a str)]) -> StoreFuture<'a, ()>;
    /// Clears an in-progress mark so the next delivery may try again.
    fn release<'a>(&'a self, stream: &'a str, key: &'a str) -> StoreFuture<'a, ()>;
}

/// The built-in Redis guard.
pub struct Guard {
    group: String,
    /// This consumer's `processing` mark.
    processing: String,
    processing_ttl: Duration,
    completed_ttl: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardState {
    /// Ours to process.
    Acquired,
    /// Already completed: a duplicate.
    Completed,
    /// Being processed elsewhere, or abandoned mid-way (expires with min-idle-time).
    Busy,
}

impl Guard {
    pub fn new(config: &WorkerConfig, completed_ttl: Duration) -> Self {
        Self {
            group: config.group.clone(),
            processing: format!("processing:{}", config.consumer),
            processing_ttl: config.min_idle,
            completed_ttl,
        }
    }

    /// Same slot as the stream, so a cluster keeps the guard beside its entries.
    fn key(&self, stream: &str, token: &str) -> String {
        keys::companion_key(stream, &format!("idem:{}:{token}", self.group))
    }

    /// The states of a batch's business keys: `SET NX` for every key, then
    /// `GET` for those already taken; a mark of a consumer declared dead is
    /// taken over (compare-and-set). One round trip when nothing is taken.
    pub async fn begin_all(
        &self,
        conn: &mut StreamConnection,
        items: &[(&str, &str)],
    ) -> Result<Vec<GuardState>, StreamError> {
        let err = |e| StreamError::new("idempotency guard", e);
        let mut pipe = redis::pipe();
        for (stream, token) in items {
            pipe.cmd("SET")
                .arg(self.key(stream, token))
                .arg(&self.processing)
                .arg("NX")
                .arg("PX")
                .arg(millis(self.processing_ttl));
        }
        let acquired: Vec<Option<String>> = pipe.query_async(conn).await.map_err(err)?;
        let taken: Vec<usize> = acquired.iter().enumerate().filter(|(_, a)| a.is_none()).map(|(i, _)| i).collect();
        let mut states = vec![GuardState::Acquired; items.len()];
        if taken.is_empty() {
            return Ok(states);
        }
        let mut pipe = redis::pipe();
        for &i in &taken {
            pipe.cmd("GET").arg(self.key(items[i].0, items[i].1));
        }
        let values: Vec<Option<String>> = pipe.query_async(conn).await.map_err(err)?;
        let mut held_by_others = Vec::new();
        let mut first_in_batch = std::collections::HashMap::new();
        for (i, item) in items.iter().enumerate() {
            first_in_batch.entry(*item).or_insert(i);
        }
        for (i, value) in taken.into_iter().zip(values) {
            let repeated_in_batch = first_in_batch.get(&items[i]).is_some_and(|first| *first < i);
            states[i] = match value {
                Some(v) if v == COMPLETED => GuardState::Completed,
                // The same key earlier in this batch holds it.
                Some(_) if repeated_in_batch => GuardState::Busy,
                // Ours, from before a restart of this same consumer.
                Some(v) if v == self.processing => GuardState::Acquired,
                // Expired between the two round trips: try again next delivery.
                None => GuardState::Busy,
                Some(v) => {
                    held_by_others.push((i, v));
                    GuardState::Busy
                }
            };
        }
        for (i, mark) in self.dead_owners(conn, items, held_by_others).await? {
            let took: Option<String> = redis::Script::new(TAKE_OVER)
                .key(self.key(items[i].0, items[i].1))
                .arg(&mark)
                .arg(&self.processing)
                .arg(millis(self.processing_ttl))
                .invoke_async(conn)
                .await
                .map_err(err)?;
            if took.is_some() {
                states[i] = GuardState::Acquired;
            }
        }
        Ok(states)
    }

    /// Of the marks held by others, those whose owner was declared dead.
    async fn dead_owners(
        &self,
        conn: &mut StreamConnection,
        items: &[(&str, &str)],
        held: Vec<(usize, String)>,
    ) -> Result<Vec<(usize, String)>, StreamError> {
        if held.is_empty() {
            return Ok(held);
        }
        let mut pipe = redis::pipe();
        for (i, mark) in &held {
            let owner = mark.strip_prefix("processing:").unwrap_or_default();
            pipe.cmd("ZSCORE").arg(keys::dead_consumers_key(items[*i].0, &self.group)).arg(owner);
        }
        let declared: Vec<Option<f64>> =
            pipe.query_async(conn).await.map_err(|e| StreamError::new("idempotency guard", e))?;
        Ok(held.into_iter().zip(declared).filter(|(_, d)| d.is_some()).map(|(h, _)| h).collect())
    }

    /// Adds the `completed` mark of a business key to a pipeline (sent with
    /// the batch's acks).
    pub fn complete_into(&self, pipe: &mut redis::Pipeline, stream: &str, token: &str) {
        pipe.cmd("SET").arg(self.key(stream, token)).arg(COMPLETED).arg("PX").arg(millis(self.completed_ttl)).ignore();
    }

    /// Keeps a durable count of suppressed duplicates per group beside the
    /// stream (`suppressed_key`), which outlives the worker processes.
    pub async fn count_suppressed(&self, conn: &mut StreamConnection, stream: &str) -> Result<(), StreamError> {
        let _: i64 = redis::cmd("INCR")
            .arg(suppressed_key(stream, &self.group))
            .query_async(conn)
            .await
            .map_err(|e| StreamError::new("idempotency guard", e))?;
        Ok(())
    }

    /// Lets a failed attempt be retried at once by the next delivery.
    pub async fn release(&self, conn: &mut StreamConnection, stream: &str, token: &str) -> Result<(), StreamError> {
        // Only our own `processing` mark: never a `completed` one.
        let script = redis::Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
        );
        let _: i64 = script
            .key(self.key(stream, token))
            .arg(&self.processing)
            .invoke_async(conn)
            .await
            .map_err(|e| StreamError::new("idempotency guard", e))?;
        Ok(())
    }
}

pub use streamfleet_streams::keys::suppressed_key;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
