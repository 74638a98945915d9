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
}

/// The default delivery bound: with the other defaults (first retry after
/// min-idle-time, 60 s, doubling to 15 minutes) ten deliveries span 90
/// minutes, so an hour's outage is ridden out with ten attempts per entry.
pub const DEFAULT_MAX_DELIVERIES: u64 = 10;

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
        let max_deliveries = number(env::MAX_DELIVERIES, DEFAULT_MAX_DELIVERIES)?;
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
        let group = required(env::GROUP)?;
        let dead_letter_stream_set = get(env::DEAD_LETTER_STREAM).is_some();
        let dead_letter_stream =
            get(env::DEAD_LETTER_STREAM).unwrap_or_else(|| crate::keys::dead_letter_stream(&first, &group));
        if streams.contains(&dead_letter_stream) {
            // Dead letters would be read again, failed again and re-added: a loop.
            return Err(ConfigError::Invalid {
                name: env::DEAD_LETTER_STREAM,
                why: format!("{dead_letter_stream:?} is also a stream this worker consumes"),
            });
        }
        let retry = retry_schedule(&get, min_idle)?;
        // The password as it is: only an empty value means none.
        let password = get(env::REDIS_PASSWORD).filter(|p| !p.is_empty());
        if get(env::REDIS_USERNAME).is_some_and(|u| !u.is_empty()) && password.is_none() {
            return Err(ConfigError::Invalid {
                name: env::REDIS_USERNAME,
                why: format!("set without {}: Redis authenticates a user by its password", env::REDIS_PASSWORD),
            });
        }
        // Set empty is unset: the operator sets every variable of how to
        // reach Redis that the spec does not give to "", so that an
        // `envFrom` cannot supply it.
        let present = |name: &'static str| get(name).filter(|v| !v.trim().is_empty());
        let client_tls = match (present(env::REDIS_CLIENT_CERT_PEM), present(env::REDIS_CLIENT_KEY_PEM)) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(ClientTls { cert_pem: cert.into_bytes(), key_pem: key.into_bytes() }),
            (Some(_), None) => return Err(ConfigError::Missing(env::REDIS_CLIENT_KEY_PEM)),
            (None, Some(_)) => return Err(ConfigError::Missing(env::REDIS_CLIENT_CERT_PEM)),
        };
        Ok(Self {
            endpoint: Endpoint {
                url: required(env::REDIS_URL)?.trim().to_string(),
                mode,
                ca_pem: present(env::REDIS_CA_PEM).map(String::into_bytes),
                username: get(env::REDIS_USERNAME).filter(|u| !u.is_empty()),
                password,
                client_tls,
            },
            group,
            consumer: required(env::CONSUMER)?,
            min_idle,
            max_deliveries,
            dead_letter_stream,
            dead_letter_stream_set,
            batch_size: usize::try_from(number(env::BATCH_SIZE, 100)?.clamp(1, 10_000)).unwrap_or(100),
            concurrency: usize::try_from(number(env::CONCURRENCY, env::DEFAULT_CONCURRENCY.into())?.clamp(1, 1_000))
                .unwrap_or(env::DEFAULT_CONCURRENCY.into()),
            block: Duration::from_millis(2_000),
            drain_timeout: Duration::from_millis(number(env::DRAIN_TIMEOUT_MS, 25_000)?),
            mode: run_mode,
            streams,
            retry,
            metrics_addr: get(env::METRICS_ADDR).map(|a| a.trim().to_string()).filter(|a| !a.is_empty()),
        })
    }
}

/// The retry schedule from the contract (`STREAMFLEET_RETRY_*`), with its
/// defaults; the first delay may not be shorter than min-idle-time.
fn retry_schedule(
    get: &impl Fn(&str) -> Option<String>,
    min_idle: Duration,
) -> Result<crate::retry::Schedule, ConfigError> {
    use crate::retry::{Backoff, Schedule};
    // (The defaults and bounds are `Schedule::with_defaults`'s, shared with
    // the operator's status.)
    let ms = |name: &'static str| -> Result<Option<Duration>, ConfigError> {
        get(name)
            .map(|v| v.trim().parse::<u64>().map(Duration::from_millis))
            .transpose()
            .map_err(|e| ConfigError::Invalid { name, why: e.to_string() })
    };
    let backoff = match get(env::RETRY_BACKOFF).as_deref().map(str::trim) {
        None | Some("Exponential") => Backoff::Exponential,
        Some("Fixed") => Backoff::Fixed,
        Some(other) => {
            return Err(ConfigError::Invalid {
                name: env::RETRY_BACKOFF,
                why: format!("{other:?} is not Exponential or Fixed"),
            });
        }
    };
    let initial = ms(env::RETRY_INITIAL_DELAY_MS)?.unwrap_or(min_idle);
    if initial < min_idle {
        return Err(ConfigError::Invalid {
            name: env::RETRY_INITIAL_DELAY_MS,
            why: format!("{} ms is shorter than min-idle-time ({} ms)", initial.as_millis(), min_idle.as_millis()),
        });
    }
    let jitter_percent = match get(env::RETRY_JITTER_PERCENT) {
        None => None,
        Some(v) => Some(v.trim().parse::<u32>().ok().filter(|p| *p <= 100).ok_or_else(|| ConfigError::Invalid {
            name: env::RETRY_JITTER_PERCENT,
            why: format!("{v:?} is not a whole number from 0 to 100"),
        })?),
    };
    let max = ms(env::RETRY_MAX_DELAY_MS)?;
    let retry_for = ms(env::RETRY_FOR_MS)?;
    Ok(Schedule::with_defaults(backoff, Some(initial), max, jitter_percent, retry_for, min_idle))
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
        let mut pairs = base();
        pairs.push((env::REDIS_USERNAME, "streamfleet"));
        let err = WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err().to_string();
        assert!(err.starts_with(env::REDIS_USERNAME) && err.contains(env::REDIS_PASSWORD), "{err}");
        let mut pairs = base();
        pairs.push((env::REDIS_CLIENT_CERT_PEM, "CERT"));
        assert_eq!(
            WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err(),
            ConfigError::Missing(env::REDIS_CLIENT_KEY_PEM)
        );
        for (name, value) in [
            (env::RETRY_BACKOFF, "Linear"),
            (env::RETRY_INITIAL_DELAY_MS, "1000"),
            (env::RETRY_JITTER_PERCENT, "101"),
            (env::RETRY_FOR_MS, "soon"),
        ] {
            let mut pairs = base();
            pairs.push((name, value));
            let err = WorkerConfig::from_lookup(lookup(&pairs)).unwrap_err().to_string();
            assert!(err.starts_with(name), "{name}={value}: {err}");
        }
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
