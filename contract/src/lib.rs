//! The worker env contract: the variables the operator injects into every
//! worker container (and the recovery Job), so workers in any language can
//! take part. One type says it on both sides: the operator renders a
//! [`WorkerEnv`] and a worker parses a [`ParsedEnv`]; both carry the same
//! [`Options`]. `docs/env-contract.md`'s table is [`variables_table`].

//!
//! Adding an option is one field of [`Options`], its name below, its row
//! in [`VARIABLES`], and a line each in [`WorkerEnv::render`] and
//! [`ParsedEnv::parse`]: all in this file.

mod variables;

pub use variables::variables_table;

/// Redis URL: `spec.redis.url`, or from the Secret key named in
/// `spec.redis.urlSecretRef`.
pub const REDIS_URL: &str = "STREAMFLEET_REDIS_URL";
/// The ACL user, `spec.redis.username` or from the Secret key named in
/// `spec.redis.usernameSecretRef` (empty otherwise).
pub const REDIS_USERNAME: &str = "STREAMFLEET_REDIS_USERNAME";
/// The password as it is (not percent-encoded), from the Secret key named in
/// `spec.redis.passwordSecretRef` (absent otherwise; the URL then carries
/// none).
pub const REDIS_PASSWORD: &str = "STREAMFLEET_REDIS_PASSWORD";
/// `Standalone` or `Cluster`.
pub const REDIS_MODE: &str = "STREAMFLEET_REDIS_MODE";
/// PEM CA bundle for TLS, from `spec.redis.tls.caSecretRef` (absent otherwise).
pub const REDIS_CA_PEM: &str = "STREAMFLEET_REDIS_CA_PEM";
/// PEM client certificate and key (`tls.crt`, `tls.key` of the Secret named
/// in `spec.redis.tls.clientCertSecretRef`; absent otherwise).
pub const REDIS_CLIENT_CERT_PEM: &str = "STREAMFLEET_REDIS_CLIENT_CERT_PEM";
pub const REDIS_CLIENT_KEY_PEM: &str = "STREAMFLEET_REDIS_CLIENT_KEY_PEM";
/// Comma-separated stream keys the worker consumes.
pub const STREAMS: &str = "STREAMFLEET_STREAMS";
/// Consumer group name.
pub const GROUP: &str = "STREAMFLEET_GROUP";
/// The pod's name and UID (downward API), from which [`CONSUMER`] is built.
pub const POD_NAME: &str = "STREAMFLEET_POD_NAME";
pub const POD_UID: &str = "STREAMFLEET_POD_UID";
/// This consumer's name: `<pod name>.<pod UID>`. The UID makes it
/// unforgeable: the operator releases a consumer's entries only when no pod
/// with that very name and UID exists and the consumer has been silent past a
/// bound, so a process still running (a force-deleted pod) is never released.
pub const CONSUMER: &str = "STREAMFLEET_CONSUMER";
/// Milliseconds an entry must be idle before it may be claimed.
pub const MIN_IDLE_MS: &str = "STREAMFLEET_MIN_IDLE_MS";
/// Deliveries after which an entry is dead-lettered (default 10).
pub const MAX_DELIVERIES: &str = "STREAMFLEET_MAX_DELIVERIES";
/// The retry schedule of transiently failed entries (`docs/retries.md`):
/// `Exponential` (the default) or `Fixed`.
pub const RETRY_BACKOFF: &str = "STREAMFLEET_RETRY_BACKOFF";
/// Milliseconds before the first retry (default: [`MIN_IDLE_MS`]).
pub const RETRY_INITIAL_DELAY_MS: &str = "STREAMFLEET_RETRY_INITIAL_DELAY_MS";
/// The longest delay between two attempts, in milliseconds (default 900000).
pub const RETRY_MAX_DELAY_MS: &str = "STREAMFLEET_RETRY_MAX_DELAY_MS";
/// Each delay is lengthened by a random 0 to this many percent (default 20).
pub const RETRY_JITTER_PERCENT: &str = "STREAMFLEET_RETRY_JITTER_PERCENT";
/// No attempt starts later than this many milliseconds after the entry
/// first failed (absent: only [`MAX_DELIVERIES`] bounds the retries).
pub const RETRY_FOR_MS: &str = "STREAMFLEET_RETRY_FOR_MS";
/// Where dead letters go.
pub const DEAD_LETTER_STREAM: &str = "STREAMFLEET_DEAD_LETTER_STREAM";
/// Handlers in flight per worker process (default 10); entries with the
/// same business key never run at once.
pub const CONCURRENCY: &str = "STREAMFLEET_CONCURRENCY";
/// Handlers in flight per worker when [`CONCURRENCY`] is unset.
pub const DEFAULT_CONCURRENCY: u16 = 10;
/// Milliseconds a worker may spend finishing its handlers in flight after
/// SIGTERM (the pod's grace period less a margin); entries still running then
/// are handed back for another consumer. Default 25000.
pub const DRAIN_TIMEOUT_MS: &str = "STREAMFLEET_DRAIN_TIMEOUT_MS";
/// Milliseconds one attempt of a handler may run before it is dropped and
/// counts as a transient failure (absent: [`MIN_IDLE_MS`]).
pub const HANDLER_TIMEOUT_MS: &str = "STREAMFLEET_HANDLER_TIMEOUT_MS";
/// Entries one read or claim takes ahead of the handlers (absent: [`BATCH_SIZE`]).
pub const PREFETCH: &str = "STREAMFLEET_PREFETCH";
/// Entries claimed per batch by recovery.
pub const BATCH_SIZE: &str = "STREAMFLEET_BATCH_SIZE";
/// `consume` for the worker Deployment, `recovery` for the recovery Job.
pub const MODE: &str = "STREAMFLEET_MODE";
/// `host:port` where the Rust worker library serves `/metrics`, `/healthz`
/// and `/readyz`. Never set by the operator: the pod template's env sets it
/// (e.g. `0.0.0.0:9464`) to have them; absent, no server is started.
pub const METRICS_ADDR: &str = "STREAMFLEET_METRICS_ADDR";

/// One row of the table: one variable, or a pair set together.
#[derive(Clone, Copy, Debug)]
pub struct Variable {
    pub names: &'static [&'static str],
    /// Markdown.
    pub meaning: &'static str,
}

/// The variables the operator renders, in the docs' order.
pub const VARIABLES: &[Variable] = &[
    Variable {
        names: &[REDIS_URL],
        meaning: "the Redis URL: `spec.redis.url` (no credentials in it), or from the Secret key in `spec.redis.urlSecretRef` (then never copied into the pod spec)",
    },
    Variable {
        names: &[REDIS_USERNAME],
        meaning: "the ACL user: `spec.redis.username`, or from the Secret key in `spec.redis.usernameSecretRef` (whitespace around it is not part of it; empty when unset)",
    },
    Variable {
        names: &[REDIS_PASSWORD],
        meaning: "the password as it is, byte for byte (not percent-encoded; a trailing newline is part of it), from the Secret key in `spec.redis.passwordSecretRef` (empty when unset; set, the URL carries none). Authenticate with `AUTH [username] password`",
    },
    Variable { names: &[REDIS_MODE], meaning: "`Standalone` or `Cluster`" },
    Variable {
        names: &[REDIS_CA_PEM],
        meaning: "PEM CA bundle for `rediss://`, from `spec.redis.tls.caSecretRef` (empty when unset)",
    },
    Variable {
        names: &[REDIS_CLIENT_CERT_PEM, REDIS_CLIENT_KEY_PEM],
        meaning: "PEM client certificate and key (`tls.crt`, `tls.key` of the `kubernetes.io/tls` Secret in `spec.redis.tls.clientCertSecretRef`; empty when unset), for a server with `tls-auth-clients yes`",
    },
    Variable { names: &[STREAMS], meaning: "comma-separated stream keys" },
    Variable { names: &[GROUP], meaning: "the consumer group" },
    Variable {
        names: &[POD_NAME, POD_UID],
        meaning: "the pod's name and UID (`fieldRef: metadata.name`, `metadata.uid`)",
    },
    Variable {
        names: &[CONSUMER],
        meaning: "this consumer's name: `$(STREAMFLEET_POD_NAME).$(STREAMFLEET_POD_UID)`. The UID makes it unforgeable: the operator releases a consumer's entries only when no pod has that very name and UID **and** the consumer has been silent in Redis for 2 s",
    },
    Variable {
        names: &[DRAIN_TIMEOUT_MS],
        meaning: "how long handlers in flight may run on after SIGTERM: the pod's `terminationGracePeriodSeconds` (default 30) less 3 s, and at least half of it",
    },
    Variable { names: &[MIN_IDLE_MS], meaning: "idle time after which an entry may be claimed" },
    Variable {
        names: &[MAX_DELIVERIES],
        meaning: "deliveries after which an entry is dead-lettered (`spec.recovery.maxDeliveries`, default 10)",
    },
    Variable {
        names: &[RETRY_BACKOFF],
        meaning: "`Exponential` or `Fixed`: how the delay between attempts grows (rule 10, [retries.md](retries.md))",
    },
    Variable {
        names: &[RETRY_INITIAL_DELAY_MS],
        meaning: "the delay after the first failure; absent: `STREAMFLEET_MIN_IDLE_MS`",
    },
    Variable {
        names: &[RETRY_MAX_DELAY_MS],
        meaning: "the longest delay (absent: 900000, or the first delay when longer); delays are capped at 7 days (604800000), the first never below min-idle-time",
    },
    Variable {
        names: &[RETRY_JITTER_PERCENT],
        meaning: "each delay lengthened by a random 0 to this many percent (default 20)",
    },
    Variable {
        names: &[RETRY_FOR_MS],
        meaning: "no attempt later than this after the first failure (only when `spec.recovery.retry.retryForSeconds` is set)",
    },
    Variable {
        names: &[DEAD_LETTER_STREAM],
        meaning: "where dead letters go; never one of `STREAMFLEET_STREAMS` (a worker must refuse to start on that: dead letters would be consumed again). Set only for a pipeline of one shard; with `spec.shards` > 1 it is absent and each shard's letters go to `{<shard>}:dead:<group>` (`<shard>:dead:<group>` when the shard has a hash tag; [sharding.md](sharding.md))",
    },
    Variable { names: &[BATCH_SIZE], meaning: "entries per read and per claim" },
    Variable {
        names: &[PREFETCH],
        meaning: "entries one read (per stream), or one claim of idle or due entries, takes ahead of the handlers, which wait in this worker's hands until a handler is free (only when `spec.worker.prefetch` is set; absent: `STREAMFLEET_BATCH_SIZE`)",
    },
    Variable {
        names: &[CONCURRENCY],
        meaning: "handlers in flight per process (only when `spec.worker.concurrency` is set; absent, the Rust library's default is 10); entries with the same business key never run at once, and each entry is acked as soon as its handler is done",
    },
    Variable { names: &[MODE], meaning: "`consume` (Deployment) or `recovery` (recovery Job in `Worker` mode)" },
    Variable {
        names: &[HANDLER_TIMEOUT_MS],
        meaning: "how long one attempt of a handler may run before it is given up (dropped, in the Rust library) and counts as a transient failure, retried on the retry schedule (only when `spec.worker.handlerTimeoutSeconds` is set; absent: `STREAMFLEET_MIN_IDLE_MS`). A worker that holds its entries (rule 5) keeps them while the handler runs, up to its hung bound: this deadline, the retry budget and min-idle-time more. In `Worker` recovery mode a run is also stopped at the chart's `sweep.activeDeadlineSeconds`, and a rollout stops handlers after `STREAMFLEET_DRAIN_TIMEOUT_MS`",
    },
];

/// A Secret's key, which the kubelet reads into a variable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretKey {
    pub secret: String,
    pub key: String,
}

/// Where a variable's value comes from in the worker's pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Value(String),
    /// Read by the kubelet from a Secret: never copied into the pod spec.
    Secret(SecretKey),
    /// The downward API (`metadata.name`, `metadata.uid`).
    PodField(&'static str),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RedisMode {
    #[default]
    Standalone,
    Cluster,
}

/// `consume`: the Deployment's long-running loop; `recovery`: claim idle
/// entries, re-run handlers, exit when the PEL holds nothing claimable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RunMode {
    #[default]
    Consume,
    Recovery,
}

/// How a retry delay grows from one delivery to the next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backoff {
    /// `initial · 2^(n−1)`, at most `max`.
    #[default]
    Exponential,
    /// Always `initial`.
    Fixed,
}

/// The retry schedule as told; absent values take the worker's defaults.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retry {
    pub backoff: Backoff,
    pub initial_delay_ms: Option<u64>,
    pub max_delay_ms: Option<u64>,
    pub jitter_percent: Option<u32>,
    pub retry_for_ms: Option<u64>,
}

/// What a worker is told of its pipeline, besides how to reach Redis and
/// who it is: the same on both sides of the contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    pub streams: Vec<String>,
    pub group: String,
    pub min_idle_ms: u64,
    pub max_deliveries: u64,
    pub batch_size: u64,
    pub mode: RunMode,
    pub retry: Retry,
    /// Absent: each stream (shard) dead-letters into its own slot.
    pub dead_letter_stream: Option<String>,
    pub concurrency: Option<u16>,
    pub drain_timeout_ms: Option<u64>,
    /// Absent: min-idle-time.
    pub handler_timeout_ms: Option<u64>,
    /// Entries per read; absent: `batch_size`.
    pub prefetch: Option<u64>,
}

/// How to reach Redis, as the operator tells it: from the spec alone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisSource {
    /// A value, or a Secret key when the URL may carry credentials.
    pub url: Source,
    pub mode: RedisMode,
    /// A value, or a Secret key (`spec.redis.usernameSecretRef`).
    pub username: Option<Source>,
    pub password: Option<SecretKey>,
    pub ca: Option<SecretKey>,
    /// The `kubernetes.io/tls` Secret of a client certificate.
    pub client_cert_secret: Option<String>,
}

/// How to reach Redis, as a worker reads it. Its `Debug` shows no
/// secret (the URL may carry credentials).
#[derive(Clone, PartialEq, Eq)]
pub struct RedisValues {
    pub url: String,
    pub mode: RedisMode,
    pub username: Option<String>,
    /// As it is, byte for byte: only empty means none.
    pub password: Option<String>,
    pub ca_pem: Option<String>,
    /// The client certificate and its key, both PEM.
    pub client_cert_pem: Option<(String, String)>,
}

/// Everything the operator tells a worker container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerEnv {
    pub redis: RedisSource,
    pub options: Options,
}

/// Everything a worker reads from its environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedEnv {
    pub redis: RedisValues,
    /// This consumer's name ([`CONSUMER`]).
    pub consumer: String,
    pub options: Options,
    /// [`METRICS_ADDR`], which the pod template sets, never the operator.
    pub metrics_addr: Option<String>,
}

impl std::fmt::Debug for RedisValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |v: bool| if v { "<redacted>" } else { "<unset>" };
        f.debug_struct("RedisValues")
            .field("url", &"<redacted>")
            .field("mode", &self.mode)
            .field("username", &self.username)
            .field("password", &set(self.password.is_some()))
            .field("ca_pem", &set(self.ca_pem.is_some()))
            .field("client_cert_pem", &set(self.client_cert_pem.is_some()))
            .finish()
    }
}

/// The Secret keys of a `kubernetes.io/tls` Secret.
const TLS_CERT_KEY: &str = "tls.crt";
const TLS_PRIVATE_KEY_KEY: &str = "tls.key";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContractError {
    Missing(&'static str),
    Invalid { name: &'static str, why: String },
}

impl std::fmt::Display for ContractError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing(name) => write!(f, "{name} is not set"),
            Self::Invalid { name, why } => write!(f, "{name} is invalid: {why}"),
        }
    }
}

impl std::error::Error for ContractError {}

impl WorkerEnv {
    /// The variables in the order the pod spec lists them (the consumer
    /// after the pod fields it expands; the order is part of the pod
    /// template, so changing it rolls every worker).
    pub fn render(&self) -> Vec<(&'static str, Source)> {
        let value = |v: String| Source::Value(v);
        let (redis, o) = (&self.redis, &self.options);
        let mut out = vec![
            (REDIS_URL, redis.url.clone()),
            (
                REDIS_MODE,
                value(
                    match redis.mode {
                        RedisMode::Standalone => "Standalone",
                        RedisMode::Cluster => "Cluster",
                    }
                    .into(),
                ),
            ),
            (STREAMS, value(o.streams.join(","))),
            (GROUP, value(o.group.clone())),
            (POD_NAME, Source::PodField("metadata.name")),
            (POD_UID, Source::PodField("metadata.uid")),
            // Expanded by the kubelet from the two above.
            (CONSUMER, value(format!("$({POD_NAME}).$({POD_UID})"))),
            (MIN_IDLE_MS, value(o.min_idle_ms.to_string())),
            (MAX_DELIVERIES, value(o.max_deliveries.to_string())),
            (BATCH_SIZE, value(o.batch_size.to_string())),
            (
                MODE,
                value(
                    match o.mode {
                        RunMode::Consume => "consume",
                        RunMode::Recovery => "recovery",
                    }
                    .into(),
                ),
            ),
            (
                RETRY_BACKOFF,
                value(
                    match o.retry.backoff {
                        Backoff::Exponential => "Exponential",
                        Backoff::Fixed => "Fixed",
                    }
                    .into(),
                ),
            ),
        ];
        let mut optional = |name: &'static str, v: Option<String>| {
            if let Some(v) = v {
                out.push((name, Source::Value(v)));
            }
        };
        optional(RETRY_INITIAL_DELAY_MS, o.retry.initial_delay_ms.map(|v| v.to_string()));
        optional(RETRY_MAX_DELAY_MS, o.retry.max_delay_ms.map(|v| v.to_string()));
        optional(RETRY_JITTER_PERCENT, o.retry.jitter_percent.map(|v| v.to_string()));
        optional(RETRY_FOR_MS, o.retry.retry_for_ms.map(|v| v.to_string()));
        optional(DEAD_LETTER_STREAM, o.dead_letter_stream.clone());
        // What the spec does not give is set empty (unset, to the worker), so
        // an `envFrom` in the pod template cannot supply it: an explicit `env`
        // entry wins over `envFrom`, and how to reach Redis is the spec's alone.
        let secret_or_empty = |r: &Option<SecretKey>| r.clone().map_or_else(|| value(String::new()), Source::Secret);
        let cert = |key: &str| {
            redis.client_cert_secret.as_ref().map(|secret| SecretKey { secret: secret.clone(), key: key.into() })
        };
        out.extend([
            (REDIS_USERNAME, redis.username.clone().unwrap_or_else(|| value(String::new()))),
            (REDIS_PASSWORD, secret_or_empty(&redis.password)),
            (REDIS_CA_PEM, secret_or_empty(&redis.ca)),
            (REDIS_CLIENT_CERT_PEM, secret_or_empty(&cert(TLS_CERT_KEY))),
            (REDIS_CLIENT_KEY_PEM, secret_or_empty(&cert(TLS_PRIVATE_KEY_KEY))),
        ]);
        let mut optional = |name: &'static str, v: Option<String>| {
            if let Some(v) = v {
                out.push((name, Source::Value(v)));
            }
        };
        optional(CONCURRENCY, o.concurrency.map(|v| v.to_string()));
        optional(DRAIN_TIMEOUT_MS, o.drain_timeout_ms.map(|v| v.to_string()));
        optional(HANDLER_TIMEOUT_MS, o.handler_timeout_ms.map(|v| v.to_string()));
        optional(PREFETCH, o.prefetch.map(|v| v.to_string()));
        out
    }
}

/// Defaults a worker takes for what it is not told.
pub const DEFAULT_MIN_IDLE_MS: u64 = 60_000;

/// The least [`MIN_IDLE_MS`] a worker accepts: no consumer of a group claims
/// an entry idle for less (workers rely on it to prove their hold on what
/// they just read).
pub const LEAST_MIN_IDLE_MS: u64 = 100;
pub const DEFAULT_MAX_DELIVERIES: u64 = 10;
pub const DEFAULT_BATCH_SIZE: u64 = 100;

impl ParsedEnv {
    /// Parses the contract from any lookup (the environment, or a map in
    /// tests); an error names the variable.
    pub fn parse(get: impl Fn(&str) -> Option<String>) -> Result<Self, ContractError> {
        let required =
            |name: &'static str| get(name).filter(|v| !v.trim().is_empty()).ok_or(ContractError::Missing(name));
        // Set empty is unset: the operator sets every variable of how to
        // reach Redis that the spec does not give to "", so that an
        // `envFrom` cannot supply it.
        let present = |name: &'static str| get(name).filter(|v| !v.trim().is_empty());
        let number = |name: &'static str| -> Result<Option<u64>, ContractError> {
            get(name)
                .map(|v| v.trim().parse::<u64>())
                .transpose()
                .map_err(|e| ContractError::Invalid { name, why: e.to_string() })
        };
        let one_of = |name: &'static str, choices: &[&'static str]| -> Result<Option<usize>, ContractError> {
            match get(name) {
                None => Ok(None),
                Some(v) => choices.iter().position(|c| *c == v.trim()).map(Some).ok_or_else(|| {
                    ContractError::Invalid { name, why: format!("{v:?} is not {}", choices.join(" or ")) }
                }),
            }
        };
        let mode = match one_of(REDIS_MODE, &["Standalone", "Cluster"])? {
            Some(1) => RedisMode::Cluster,
            _ => RedisMode::Standalone,
        };
        let streams: Vec<String> =
            required(STREAMS)?.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
        let max_deliveries = number(MAX_DELIVERIES)?.unwrap_or(DEFAULT_MAX_DELIVERIES);
        if max_deliveries == 0 {
            return Err(ContractError::Invalid { name: MAX_DELIVERIES, why: "must be at least 1".into() });
        }
        let min_idle_ms = number(MIN_IDLE_MS)?.unwrap_or(DEFAULT_MIN_IDLE_MS);
        if min_idle_ms < LEAST_MIN_IDLE_MS {
            let why = format!("must be at least {LEAST_MIN_IDLE_MS}");
            return Err(ContractError::Invalid { name: MIN_IDLE_MS, why });
        }
        let run_mode = match one_of(MODE, &["consume", "recovery"])? {
            Some(1) => RunMode::Recovery,
            _ => RunMode::Consume,
        };
        let group = required(GROUP)?;
        let dead_letter_stream = get(DEAD_LETTER_STREAM);
        if let Some(dead) = dead_letter_stream.as_ref().filter(|d| streams.contains(d)) {
            // Dead letters would be read again, failed again and re-added: a loop.
            return Err(ContractError::Invalid {
                name: DEAD_LETTER_STREAM,
                why: format!("{dead:?} is also a stream this worker consumes"),
            });
        }
        let backoff = match one_of(RETRY_BACKOFF, &["Exponential", "Fixed"])? {
            Some(1) => Backoff::Fixed,
            _ => Backoff::Exponential,
        };
        let initial_delay_ms = number(RETRY_INITIAL_DELAY_MS)?;
        if let Some(initial) = initial_delay_ms.filter(|ms| *ms < min_idle_ms) {
            return Err(ContractError::Invalid {
                name: RETRY_INITIAL_DELAY_MS,
                why: format!("{initial} ms is shorter than min-idle-time ({min_idle_ms} ms)"),
            });
        }
        let jitter_percent = match get(RETRY_JITTER_PERCENT) {
            None => None,
            Some(v) => {
                Some(v.trim().parse::<u32>().ok().filter(|p| *p <= 100).ok_or_else(|| ContractError::Invalid {
                    name: RETRY_JITTER_PERCENT,
                    why: format!("{v:?} is not a whole number from 0 to 100"),
                })?)
            }
        };
        let retry = Retry {
            backoff,
            initial_delay_ms,
            max_delay_ms: number(RETRY_MAX_DELAY_MS)?,
            jitter_percent,
            retry_for_ms: number(RETRY_FOR_MS)?,
        };
        // The password as it is: only an empty value means none.
        let password = get(REDIS_PASSWORD).filter(|p| !p.is_empty());
        // Whitespace around the name (a Secret's trailing newline) is not part of it.
        let username = get(REDIS_USERNAME).map(|u| u.trim().to_string()).filter(|u| !u.is_empty());
        if username.is_some() && password.is_none() {
            return Err(ContractError::Invalid {
                name: REDIS_USERNAME,
                why: format!("set without {REDIS_PASSWORD}: Redis authenticates a user by its password"),
            });
        }
        let client_cert_pem = match (present(REDIS_CLIENT_CERT_PEM), present(REDIS_CLIENT_KEY_PEM)) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((cert, key)),
            (Some(_), None) => return Err(ContractError::Missing(REDIS_CLIENT_KEY_PEM)),
            (None, Some(_)) => return Err(ContractError::Missing(REDIS_CLIENT_CERT_PEM)),
        };
        Ok(Self {
            redis: RedisValues {
                url: required(REDIS_URL)?.trim().to_string(),
                mode,
                username,
                password,
                ca_pem: present(REDIS_CA_PEM),
                client_cert_pem,
            },
            consumer: required(CONSUMER)?,
            options: Options {
                streams,
                group,
                min_idle_ms,
                max_deliveries,
                batch_size: number(BATCH_SIZE)?.unwrap_or(DEFAULT_BATCH_SIZE).clamp(1, 10_000),
                mode: run_mode,
                retry,
                dead_letter_stream,
                concurrency: number(CONCURRENCY)?.map(|n| u16::try_from(n.clamp(1, 1_000)).unwrap_or(1_000)),
                drain_timeout_ms: number(DRAIN_TIMEOUT_MS)?,
                handler_timeout_ms: match number(HANDLER_TIMEOUT_MS)? {
                    Some(0) => {
                        return Err(ContractError::Invalid {
                            name: HANDLER_TIMEOUT_MS,
                            why: "must be at least 1".into(),
                        });
                    }
                    ms => ms,
                },
                prefetch: number(PREFETCH)?.map(|n| n.clamp(1, 10_000)),
            },
            metrics_addr: get(METRICS_ADDR).map(|a| a.trim().to_string()).filter(|a| !a.is_empty()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// What the kubelet does with a rendered list: values as they are
    /// (`$(NAME)` expanded from variables listed before), Secret keys and
    /// pod fields read.
    fn kubelet(rendered: &[(&'static str, Source)]) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        for (name, source) in rendered {
            let value = match source {
                Source::Value(v) => {
                    env.iter().fold(v.clone(), |v, (k, x): (&String, &String)| v.replace(&format!("$({k})"), x))
                }
                Source::Secret(r) => format!("{}/{}", r.secret, r.key),
                Source::PodField(path) => format!("<{path}>"),
            };
            assert!(env.insert(name.to_string(), value).is_none(), "{name} rendered twice");
        }
        env
    }

    fn options() -> Options {
        Options {
            streams: vec!["orders".into()],
            group: "billing".into(),
            min_idle_ms: 60_000,
            max_deliveries: 10,
            batch_size: 100,
            mode: RunMode::Consume,
            retry: Retry::default(),
            dead_letter_stream: None,
            concurrency: None,
            drain_timeout_ms: None,
            handler_timeout_ms: None,
            prefetch: None,
        }
    }

    fn told() -> WorkerEnv {
        WorkerEnv {
            redis: RedisSource {
                url: Source::Value("redis://redis:6379".into()),
                mode: RedisMode::Standalone,
                username: None,
                password: None,
                ca: None,
                client_cert_secret: None,
            },
            options: options(),
        }
    }

    /// Whatever the operator renders, a worker parses back the same options.
    #[test]
    fn what_is_rendered_parses_back_to_the_same_options() {
        let secret = |s: &str, k: &str| SecretKey { secret: s.into(), key: k.into() };
        let mut every = told();
        every.redis = RedisSource {
            url: Source::Secret(secret("redis", "url")),
            mode: RedisMode::Cluster,
            username: Some(Source::Secret(secret("redis", "username"))),
            password: Some(secret("redis", "password")),
            ca: Some(secret("ca", "ca.crt")),
            client_cert_secret: Some("client".into()),
        };
        every.options = Options {
            streams: vec!["{orders}:0".into(), "{orders}:1".into()],
            group: "billing".into(),
            min_idle_ms: 1_500,
            max_deliveries: 7,
            batch_size: 33,
            mode: RunMode::Recovery,
            retry: Retry {
                backoff: Backoff::Fixed,
                initial_delay_ms: Some(2_000),
                max_delay_ms: Some(9_000),
                jitter_percent: Some(5),
                retry_for_ms: Some(120_000),
            },
            dead_letter_stream: Some("dead".into()),
            concurrency: Some(4),
            drain_timeout_ms: Some(27_000),
            handler_timeout_ms: Some(300_000),
            prefetch: Some(12),
        };
        for env in [told(), every] {
            let seen = kubelet(&env.render());
            let parsed = ParsedEnv::parse(|k| seen.get(k).cloned()).unwrap();
            assert_eq!(parsed.options, env.options);
            assert_eq!(parsed.consumer, "<metadata.name>.<metadata.uid>");
            assert_eq!(parsed.redis.mode, env.redis.mode);
            let from = |s: &Option<SecretKey>| s.as_ref().map(|r| format!("{}/{}", r.secret, r.key));
            assert_eq!(parsed.redis.password, from(&env.redis.password));
            assert_eq!(parsed.redis.ca_pem, from(&env.redis.ca));
            let username = env.redis.username.as_ref().map(|u| match u {
                Source::Value(v) => v.clone(),
                Source::Secret(r) => format!("{}/{}", r.secret, r.key),
                Source::PodField(path) => format!("<{path}>"),
            });
            assert_eq!(parsed.redis.username, username);
            assert_eq!(
                parsed.redis.client_cert_pem,
                env.redis.client_cert_secret.as_ref().map(|s| (format!("{s}/tls.crt"), format!("{s}/tls.key")))
            );
            // Every variable rendered is one the docs' table names.
            for (name, _) in env.render() {
                assert!(VARIABLES.iter().any(|v| v.names.contains(&name)), "{name} is not in VARIABLES");
            }
        }
    }

    #[test]
    fn debug_shows_no_secret() {
        let env = BTreeMap::from([
            (REDIS_URL.to_string(), "redis://u:url-secret@h:6379".to_string()),
            (REDIS_PASSWORD.to_string(), "pw-secret".to_string()),
            (REDIS_CLIENT_CERT_PEM.to_string(), "CERT".to_string()),
            (REDIS_CLIENT_KEY_PEM.to_string(), "key-secret".to_string()),
            (STREAMS.to_string(), "orders".to_string()),
            (GROUP.to_string(), "g".to_string()),
            (CONSUMER.to_string(), "c".to_string()),
        ]);
        let shown = format!("{:?}", ParsedEnv::parse(|k| env.get(k).cloned()).unwrap());
        assert!(!shown.contains("secret"), "{shown}");
    }

    #[test]
    fn the_pod_lists_the_pod_fields_before_the_consumer_that_expands_them() {
        let names: Vec<_> = told().render().into_iter().map(|(n, _)| n).collect();
        let at = |n| names.iter().position(|x| *x == n).unwrap();
        assert!(at(POD_NAME) < at(CONSUMER) && at(POD_UID) < at(CONSUMER), "{names:?}");
    }

    #[test]
    fn errors_name_the_variable() {
        let base = kubelet(&told().render());
        for (name, value) in [
            (MAX_DELIVERIES, "many"),
            (MAX_DELIVERIES, "0"),
            (MIN_IDLE_MS, "99"),
            (MODE, "sideways"),
            (REDIS_MODE, "Sentinel"),
            (DEAD_LETTER_STREAM, "orders"),
            (REDIS_USERNAME, "streamfleet"),
            (RETRY_BACKOFF, "Linear"),
            (RETRY_INITIAL_DELAY_MS, "1000"),
            (RETRY_JITTER_PERCENT, "101"),
            (RETRY_FOR_MS, "soon"),
            (HANDLER_TIMEOUT_MS, "0"),
        ] {
            let mut env = base.clone();
            env.insert(name.into(), value.into());
            let err = ParsedEnv::parse(|k| env.get(k).cloned()).unwrap_err().to_string();
            assert!(err.starts_with(name), "{name}={value}: {err}");
        }
        let mut env = base.clone();
        env.remove(GROUP);
        assert_eq!(ParsedEnv::parse(|k| env.get(k).cloned()).unwrap_err(), ContractError::Missing(GROUP));
        let mut env = base;
        env.insert(REDIS_CLIENT_CERT_PEM.into(), "CERT".into());
        assert_eq!(
            ParsedEnv::parse(|k| env.get(k).cloned()).unwrap_err(),
            ContractError::Missing(REDIS_CLIENT_KEY_PEM)
        );
    }
}
