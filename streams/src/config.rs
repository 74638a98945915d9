//! The env contract (`streamfleet_contract`), parsed and checked: what a
//! worker, the recovery sweep and the dead-letter tools are told by the operator.

use crate::{Endpoint, Mode};
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
}

/// `consume`: the Deployment's long-running loop; `recovery`: claim idle
/// entries, re-run handlers, exit when the PEL holds nothing claimable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunMode {
    Consume,
    Recovery,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{0} is not set")]
    Missing(&'static str),
    #[error("{name} is invalid: {why}")]
    Invalid { name: &'static str, why: String },
}

impl WorkerConfig {
    /// Where `stream`'s dead letters go: the configured dead-letter stream,
    /// or, when none is set, the stream's own `{<stream>}:dead`, which shares
    /// its Redis Cluster slot (so every shard dead-letters atomically).
    pub fn dead_letter_stream_of(&self, stream: &str) -> String {
        if self.dead_letter_stream_set {
            self.dead_letter_stream.clone()
        } else {
            crate::keys::dead_letter_stream(stream)
        }
    }

    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Parses the contract from any lookup (the environment, or a map in tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let required =
            |name: &'static str| get(name).filter(|v| !v.trim().is_empty()).ok_or(ConfigError::Missing(name));
        let number = |name: &'static str, default: u64| -> Result<u64, ConfigError> {
            match get(name) {
                None => Ok(default),
                Some(v) => v.trim().parse::<u64>().map_err(|e| ConfigError::Invalid { name, why: e.to_string() }),
            }
        };
        let mode = match get(env::REDIS_MODE).as_deref() {
            None | Some("Standalone") => Mode::Standalone,
            Some("Cluster") => Mode::Cluster,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    name: env::REDIS_MODE,
                    why: format!("{other:?} is not Standalone or Cluster"),
                });
            }
        };
        let streams: Vec<String> =
            required(env::STREAMS)?.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
        let max_deliveries = number(env::MAX_DELIVERIES, 5)?;
        if max_deliveries == 0 {
            return Err(ConfigError::Invalid { name: env::MAX_DELIVERIES, why: "must be at least 1".into() });
        }
        let min_idle = Duration::from_millis(number(env::MIN_IDLE_MS, 60_000)?);
        if min_idle < Duration::from_millis(100) {
            return Err(ConfigError::Invalid { name: env::MIN_IDLE_MS, why: "must be at least 100".into() });
        }
        let first = streams.first().cloned().unwrap_or_default();
        let run_mode = match get(env::MODE).as_deref() {
            None | Some("consume") => RunMode::Consume,
            Some("recovery") => RunMode::Recovery,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    name: env::MODE,
                    why: format!("{other:?} is not consume or recovery"),
                });
            }
        };
        let dead_letter_stream_set = get(env::DEAD_LETTER_STREAM).is_some();
        let dead_letter_stream =
            get(env::DEAD_LETTER_STREAM).unwrap_or_else(|| crate::keys::dead_letter_stream(&first));
        if streams.contains(&dead_letter_stream) {
            // Dead letters would be read again, failed again and re-added: a loop.
            return Err(ConfigError::Invalid {
                name: env::DEAD_LETTER_STREAM,
                why: format!("{dead_letter_stream:?} is also a stream this worker consumes"),
            });
        }
        Ok(Self {
            endpoint: Endpoint {
                url: required(env::REDIS_URL)?,
                mode,
                ca_pem: get(env::REDIS_CA_PEM).map(String::into_bytes),
            },
            group: required(env::GROUP)?,
            consumer: required(env::CONSUMER)?,
            min_idle,
            max_deliveries,
            dead_letter_stream,
            dead_letter_stream_set,
            batch_size: usize::try_from(number(env::BATCH_SIZE, 100)?.clamp(1, 10_000)).unwrap_or(100),
            concurrency: usize::try_from(number(env::CONCURRENCY, 10)?.clamp(1, 1_000)).unwrap_or(10),
            block: Duration::from_millis(2_000),
            drain_timeout: Duration::from_millis(number(env::DRAIN_TIMEOUT_MS, 25_000)?),
            mode: run_mode,
            streams,
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
        assert_eq!(c.max_deliveries, 5);
        assert_eq!(c.min_idle, Duration::from_secs(60));
        assert_eq!(c.dead_letter_stream, "{orders}:dead");
        assert_eq!(c.mode, RunMode::Consume);
        assert_eq!(c.endpoint.mode, Mode::Standalone);
    }

    #[test]
    fn errors_name_the_variable() {
        let mut pairs = base();
        pairs.retain(|(k, _)| *k != env::GROUP);
        assert_eq!(WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err(), ConfigError::Missing(env::GROUP));
        let mut pairs = base();
        pairs.push((env::MAX_DELIVERIES, "many"));
        let err = WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err().to_string();
        assert!(err.starts_with(env::MAX_DELIVERIES), "{err}");
        let mut pairs = base();
        pairs.push((env::MODE, "sideways"));
        assert!(WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err().to_string().contains(env::MODE));
        let mut pairs = base();
        pairs.push((env::DEAD_LETTER_STREAM, "refunds"));
        let err = WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err().to_string();
        assert!(err.starts_with(env::DEAD_LETTER_STREAM) && err.contains("also a stream"), "{err}");
    }
}
