//! The idempotency guard, two records with two jobs: a lock per business
//! key (`processing:<consumer>:<fence>` while a delivery holds it: never two
//! handlers of one key at once) and a completion record per event
//! (`Entry::event_id`: the entry ID, or its `streamfleet.event-id` field),
//! so a redelivered event whose effect already completed is acked without
//! running the handler again, while another event of the same key runs.
//!
//! It saves repeated work; it does not replace an idempotent handler. A
//! `processing` mark names its owner and a fencing token
//! (`processing:<consumer>:<fence>`); its holder extends it while the entry
//! is in hand (`lease`) and only the holder of that very token releases it.
//! A crash after the effect and before `completed` is written leaves the
//! mark behind: it expires after min-idle-time, or is void at once for a
//! consumer the operator declared dead (its pod is gone:
//! `keys::dead_consumers_key`), and the same consumer name (a restarted
//! container in the same pod) owns it still. The entry then runs again with a
//! larger fence, and the handler's own idempotency decides: a business store
//! that records the largest fence per key and refuses a smaller one turns
//! the guard into a fence (`consumer::current_delivery`).

use std::time::Duration;
use streamfleet_streams::config::WorkerConfig;
use streamfleet_streams::{StreamConnection, StreamError, keys};

/// A boxed future, so stores can be trait objects.
pub type StoreFuture<'a, T> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<T, Box<dyn std::error::Error + Send + Sync>>> + Send + 'a>,
>;

/// The hook for your own idempotency store (a table with a unique key in the
/// database your handler commits to, say). Keys are `(stream, event ID)`
/// (`Entry::event_id`): one record per event, not per business key.
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
    consumer: String,
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

/// One business key's state, and for an acquired key the fencing token of
/// this acquisition: the larger of the shard's counter and the Redis
/// server's clock in microseconds (`TIME`). On one shard every acquisition
/// gets a larger fence than the one before. Across shards (after `shards`
/// grows, a key moves to another shard's counter), after the counter key is
/// lost (a restart without persistence, an eviction) and after a failover,
/// the next fence of a key is still larger than its last one as long as
/// that last acquisition was longer ago than the clock difference between
/// the servers involved (none for shards of one server; NTP-level skew on a
/// cluster). A store that keeps the largest fence per key and refuses a
/// smaller one therefore never refuses a legitimate new holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acquisition {
    pub state: GuardState,
    pub fence: Option<u64>,
}

/// Takes every free lock of a batch, in one script per stream. An entry
/// whose event completed (its completion record) is a duplicate and takes
/// nothing. Otherwise its lock (business key, or the event without one) is
/// ours when it has no mark, when the mark is this consumer's own (a restart
/// under the same name), when its owner was declared dead, or when it holds
/// `completed` (a record of the key-level guard before events had their
/// own: not an event's). The counter reserves a fence for each distinct
/// lock of the batch (a lock found taken leaves its fence unused: fences
/// only need to grow), never below the server's clock in microseconds, so
/// they rise across shards, a lost counter and a failover (see
/// [`Acquisition`]), and the mark records owner and fence
/// (`processing:<consumer>:<fence>`); `SET … NX GET` takes a free lock and
/// reads a taken one's mark in one call. A lock repeated in the batch is
/// busy after its first entry.
/// KEYS: fence counter, dead-consumer registry, then per entry its lock and
/// its completion record. ARGV: consumer, TTL ms.
/// Returns per entry: state (0 acquired, 1 completed, 2 busy), fence (0 for none).
static ACQUIRE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        local out, seen, distinct = {}, {}, 0
        for i = 3, #KEYS, 2 do
            if not seen[KEYS[i]] then
                seen[KEYS[i]] = true
                distinct = distinct + 1
            end
        end
        seen = {}
        local fence = 0
        if distinct > 0 then
            -- Never below the server's clock in microseconds: fences keep
            -- rising when a key moves to another shard's counter, when the
            -- counter is lost, or after a failover. Exact in a Lua number
            -- (below 2^53) and written back in full digits.
            local t = redis.call('TIME')
            local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
            fence = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
            if fence < floor then fence = floor end
            redis.call('SET', KEYS[1], string.format('%.0f', fence + distinct))
        end
        local prefix = 'processing:' .. ARGV[1] .. ':'
        for i = 3, #KEYS, 2 do
            local key, state, given = KEYS[i], 2, 0
            if redis.call('GET', KEYS[i + 1]) == 'completed' then
                state = 1
            elseif not seen[key] then
                seen[key] = true
                fence = fence + 1
                local mark = prefix .. string.format('%.0f', fence)
                local v = redis.call('SET', key, mark, 'NX', 'PX', ARGV[2], 'GET')
                if not v then
                    state, given = 0, fence
                else
                    local owner = string.match(v, '^processing:([^:]+)')
                    if v == 'completed' or owner == ARGV[1] or (owner and redis.call('ZSCORE', KEYS[2], owner)) then
                        redis.call('SET', key, mark, 'PX', ARGV[2])
                        state, given = 0, fence
                    end
                end
            end
            out[#out + 1] = state
            out[#out + 1] = given
        end
        return out",
    )
});

/// Deletes a mark only if it is still the given one (owner and fence).
static RELEASE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")
});

impl Guard {
    pub fn new(config: &WorkerConfig, completed_ttl: Duration) -> Self {
        Self {
            group: config.group.clone(),
            consumer: config.consumer.clone(),
            processing_ttl: config.min_idle,
            completed_ttl,
        }
    }

    /// Same slot as the stream, so a cluster keeps the guard beside its entries.
    pub fn key(&self, stream: &str, token: &str) -> String {
        keys::guard_key(stream, &self.group, token)
    }

    /// The value of the mark an acquisition with `fence` wrote.
    pub fn mark(&self, fence: u64) -> String {
        format!("processing:{}:{fence}", self.consumer)
    }

    pub fn completed_ttl(&self) -> Duration {
        self.completed_ttl
    }

    /// The record that `event` completed.
    pub fn completion_key(&self, stream: &str, event: &str) -> String {
        keys::completion_key(stream, &self.group, event)
    }

    /// The states of a batch's entries, `(stream, lock token, event)` each,
    /// acquiring every free lock: one round trip per stream in the batch.
    pub async fn begin_all(
        &self,
        conn: &mut StreamConnection,
        items: &[(&str, &str, &str)],
    ) -> Result<Vec<Acquisition>, StreamError> {
        let mut out = vec![Acquisition { state: GuardState::Busy, fence: None }; items.len()];
        let mut streams: Vec<&str> = items.iter().map(|(s, ..)| *s).collect();
        streams.sort_unstable();
        streams.dedup();
        for stream in streams {
            let indices: Vec<usize> = (0..items.len()).filter(|&i| items[i].0 == stream).collect();
            let mut script = ACQUIRE.prepare_invoke();
            script
                .key(keys::companion_key(stream, &format!("fence:{}", self.group)))
                .key(keys::dead_consumers_key(stream, &self.group));
            for &i in &indices {
                script.key(self.key(stream, items[i].1)).key(self.completion_key(stream, items[i].2));
            }
            script.arg(&self.consumer).arg(millis(self.processing_ttl));
            let states: Vec<(u8, u64)> = match script.invoke_async(conn).await {
                Ok(states) => states,
                Err(e) => {
                    // The batch is handed back unstarted: the marks taken on
                    // the streams before this one go too, or other consumers
                    // find those keys busy until the marks expire.
                    self.release_acquired(conn, items, &out).await;
                    return Err(StreamError::new("idempotency guard", e));
                }
            };
            for (i, (state, fence)) in indices.into_iter().zip(states) {
                out[i] = match state {
                    0 => Acquisition { state: GuardState::Acquired, fence: Some(fence) },
                    1 => Acquisition { state: GuardState::Completed, fence: None },
                    _ => Acquisition { state: GuardState::Busy, fence: None },
                };
            }
        }
        Ok(out)
    }

    /// Releases, as far as Redis lets it, the marks `acquired` took for
    /// `items` (a failed `begin_all`).
    async fn release_acquired(
        &self,
        conn: &mut StreamConnection,
        items: &[(&str, &str, &str)],
        acquired: &[Acquisition],
    ) {
        for ((stream, token, _), acquisition) in items.iter().zip(acquired) {
            if let (GuardState::Acquired, Some(fence)) = (acquisition.state, acquisition.fence)
                && let Err(e) = self.release(conn, stream, token, fence).await
            {
                tracing::warn!(stream, error = %e, "releasing a guard mark of a batch handed back; it expires with its TTL");
            }
        }
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

    /// Lets a failed attempt be retried at once by the next delivery: only
    /// the mark this acquisition wrote (never a `completed` one, never one a
    /// later holder took over).
    pub async fn release(
        &self,
        conn: &mut StreamConnection,
        stream: &str,
        token: &str,
        fence: u64,
    ) -> Result<(), StreamError> {
        let _: i64 = RELEASE
            .key(self.key(stream, token))
            .arg(self.mark(fence))
            .invoke_async(conn)
            .await
            .map_err(|e| StreamError::new("idempotency guard", e))?;
        Ok(())
    }
}

pub use streamfleet_streams::keys::suppressed_key;

/// At least 1: a PX of 0 is refused by Redis.
pub(crate) fn millis(d: Duration) -> u64 {
    streamfleet_streams::millis(d).max(1)
}
