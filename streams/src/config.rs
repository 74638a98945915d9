//! The env contract (`streamfleet_contract`), parsed and checked: what a
//! worker, the recovery sweep and the dead-letter tools are told by the operator.

use crate::{ClientTls, Endpoint, Mode};
use std::time::Duration;
use streamfleet_contract as env;

/// What a worker is told by the operator.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub endpoint: Endpoint,
    pub streams: Vec<String>,
    pub group: String,
    pub consumer: String,
    /// Entries idle this long may be claimed by another consumer.
    pub min_idle: Duration,
    /// Deliveries after which an entry is dead-lettered.
    pub max_deliveries: u64,
    /// Where dead letters go (`DEAD_LETTER_STREAM`, or the first stream's
    /// default); see [`WorkerConfig::dead_letter_stream_of`].
    pub dead_letter_stream: String,
    /// Whether `DEAD_LETTER_STREAM` was set: else each stream (shard) has
    /// its own dead-letter stream in its own slot.
    pub dead_letter_stream_set: bool,
    pub batch_size: usize,
    /// Handlers in flight at once.
    pub concurrency: usize,
    /// How long one blocking read waits for new entries.
    pub block: Duration,
    /// How long handlers in flight may run on after shutdown begins.
    pub drain_timeout: Duration,
    pub mode: RunMode,
    /// When a transiently failed entry is tried again (`retry`).
    pub retry: crate::retry::Schedule,
    /// Where the library serves `/metrics`, `/healthz` and `/readyz`
    /// ([`env::METRICS_ADDR`]); `None`: nowhere.
    pub metrics_addr: Option<String>,
    /// The contract as parsed, for options read as they are told.
    pub options: env::Options,
}

/// The default delivery bound: with the other defaults (first retry after
/// min-idle-time, 60 s, doubling to 15 minutes) ten deliveries span 90
/// minutes, so an hour's outage is ridden out with ten attempts per entry.
pub const DEFAULT_MAX_DELIVERIES: u64 = env::DEFAULT_MAX_DELIVERIES;

pub use env::{ContractError as ConfigError, RunMode};

impl WorkerConfig {
    /// Where `stream`'s dead letters go: the configured dead-letter stream,
    /// or, when none is set, the group's own `{<stream>}:dead:<group>`, which
    /// shares the stream's Redis Cluster slot (so every shard dead-letters atomically).
    pub fn dead_letter_stream_of(&self, stream: &str) -> String {
        if self.dead_letter_stream_set {
            self.dead_letter_stream.clone()
        } else {
            crate::keys::dead_letter_stream(stream, &self.group)
        }
    }

    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Parses the contract ([`env::ParsedEnv`]) from any lookup (the
    /// environment, or a map in tests), with the library's defaults.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let parsed = env::ParsedEnv::parse(get)?;
        let (redis, o) = (parsed.redis, &parsed.options);
        let min_idle = Duration::from_millis(o.min_idle_ms);
        let first = o.streams.first().cloned().unwrap_or_default();
        // Dead letters read again would fail again and be re-added: a loop.
        // (A set dead-letter stream is checked by the contract; each
        // stream's own default is checked here.)
        if o.dead_letter_stream.is_none()
            && let Some(s) =
                o.streams.iter().find(|s| o.streams.contains(&crate::keys::dead_letter_stream(s, &o.group)))
        {
            return Err(ConfigError::Invalid {
                name: env::STREAMS,
                why: format!(
                    "{:?} is also a stream this worker consumes",
                    crate::keys::dead_letter_stream(s, &o.group)
                ),
            });
        }
        let ms = |v: Option<u64>| v.map(Duration::from_millis);
        // (The defaults and bounds are `Schedule::with_defaults`'s, shared with
        // the operator's status.)
        let retry = crate::retry::Schedule::with_defaults(
            o.retry.backoff,
            Some(ms(o.retry.initial_delay_ms).unwrap_or(min_idle)),
            ms(o.retry.max_delay_ms),
            o.retry.jitter_percent,
            ms(o.retry.retry_for_ms),
            min_idle,
        );
        Ok(Self {
            endpoint: Endpoint {
                url: redis.url,
                mode: match redis.mode {
                    env::RedisMode::Standalone => Mode::Standalone,
                    env::RedisMode::Cluster => Mode::Cluster,
                },
                ca_pem: redis.ca_pem.map(String::into_bytes),
                username: redis.username,
                password: redis.password,
                client_tls: redis
                    .client_cert_pem
                    .map(|(cert, key)| ClientTls { cert_pem: cert.into_bytes(), key_pem: key.into_bytes() }),
            },
            streams: o.streams.clone(),
            group: o.group.clone(),
            consumer: parsed.consumer,
            min_idle,
            max_deliveries: o.max_deliveries,
            dead_letter_stream_set: o.dead_letter_stream.is_some(),
            dead_letter_stream: o
                .dead_letter_stream
                .clone()
                .unwrap_or_else(|| crate::keys::dead_letter_stream(&first, &o.group)),
            batch_size: usize::try_from(o.batch_size).unwrap_or(100),
            concurrency: usize::from(o.concurrency.unwrap_or(env::DEFAULT_CONCURRENCY)),
            block: Duration::from_millis(2_000),
            drain_timeout: Duration::from_millis(o.drain_timeout_ms.unwrap_or(25_000)),
            mode: o.mode,
            retry,
            metrics_addr: parsed.metrics_addr,
            options: parsed.options,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    fn base() -> Vec<(&'static str, &'static str)> {
        vec![
            (env::REDIS_URL, "redis://127.0.0.1:6379/"),
            (env::STREAMS, "orders, refunds"),
            (env::GROUP, "billing"),
            (env::CONSUMER, "pod-1"),
        ]
    }

    #[test]
    fn parses_the_contract_with_defaults() {
        let c = WorkerConfig::from_lookup(lookup(&base())).unwrap();
        assert_eq!(c.streams, vec!["orders", "refunds"]);
        assert_eq!(c.max_deliveries, 10);
        let retry = &c.retry;
        assert_eq!(
            (retry.backoff, retry.initial, retry.max),
            (crate::retry::Backoff::Exponential, c.min_idle, crate::retry::DEFAULT_MAX_DELAY)
        );
        assert_eq!((retry.jitter_percent, retry.retry_for), (20, None));
        // The defaults ride out an hour's outage.
        assert!(retry.horizon(c.max_deliveries) >= Duration::from_secs(3600), "{:?}", retry.horizon(c.max_deliveries));
        assert_eq!(c.min_idle, Duration::from_secs(60));
        // The group's own, beside its stream: another group on `orders` has another.
        assert_eq!(c.dead_letter_stream, "{orders}:dead:billing");
        assert_eq!(c.dead_letter_stream_of("refunds"), "{refunds}:dead:billing");
        assert_eq!(c.mode, RunMode::Consume);
        assert_eq!(c.endpoint.mode, Mode::Standalone);
    }

    /// The contract's errors (each case: `streamfleet_contract`'s tests)
    /// reach the worker as they are.
    #[test]
    fn errors_name_the_variable() {
        let mut pairs = base();
        pairs.retain(|(k, _)| *k != env::GROUP);
        assert_eq!(WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err(), ConfigError::Missing(env::GROUP));
        let mut pairs = base();
        pairs.push((env::MAX_DELIVERIES, "many"));
        let err = WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err().to_string();
        assert!(err.starts_with(env::MAX_DELIVERIES), "{err}");
        // A stream's own dead-letter stream consumed too: a loop, refused.
        let mut pairs = base();
        pairs.retain(|(k, _)| *k != env::STREAMS);
        pairs.push((env::STREAMS, "orders,{orders}:dead:billing"));
        let err = WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err().to_string();
        assert!(err.starts_with(env::STREAMS) && err.contains("also a stream"), "{err}");
    }

    #[test]
    fn the_retry_schedule_is_read_from_the_contract() {
        let mut pairs = base();
        pairs.extend([
            (env::MIN_IDLE_MS, "1000"),
            (env::RETRY_BACKOFF, "Fixed"),
            (env::RETRY_INITIAL_DELAY_MS, "2000"),
            (env::RETRY_MAX_DELAY_MS, "20000"),
            (env::RETRY_JITTER_PERCENT, "0"),
            (env::RETRY_FOR_MS, "60000"),
        ]);
        let c = WorkerConfig::from_lookup(lookup(&pairs)).unwrap();
        let expected = crate::retry::Schedule {
            backoff: crate::retry::Backoff::Fixed,
            initial: Duration::from_secs(2),
            max: Duration::from_secs(20),
            jitter_percent: 0,
            retry_for: Some(Duration::from_secs(60)),
        };
        assert_eq!(c.retry, expected);
    }
}
