//! The worker env contract: the variables the operator injects into every
//! worker container (and the recovery Job), so workers in any language can
//! take part. One type says it on both sides: the operator renders a
//! [`WorkerEnv`] and a worker parses a [`ParsedEnv`]; both carry the same
//! [`Options`]. `docs/env-contract.md`'s table is [`variables_table`].

mod env;
mod variables;

pub use env::{
    Backoff, ContractError, DEFAULT_BATCH_SIZE, DEFAULT_MAX_DELIVERIES, DEFAULT_MIN_IDLE_MS, Options, ParsedEnv,
    RedisMode, RedisSource, RedisValues, Retry, RunMode, SecretKey, Source, WorkerEnv,
};
pub use variables::{VARIABLES, Variable, variables_table};

/// Redis URL: `spec.redis.url`, or from the Secret key named in
/// `spec.redis.urlSecretRef`.
pub const REDIS_URL: &str = "STREAMFLEET_REDIS_URL";
/// The ACL user, `spec.redis.username` (absent otherwise).
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
/// Entries claimed per batch by recovery.
pub const BATCH_SIZE: &str = "STREAMFLEET_BATCH_SIZE";
/// `consume` for the worker Deployment, `recovery` for the recovery Job.
pub const MODE: &str = "STREAMFLEET_MODE";
/// `host:port` where the Rust worker library serves `/metrics`, `/healthz`
/// and `/readyz`. Never set by the operator: the pod template's env sets it
/// (e.g. `0.0.0.0:9464`) to have them; absent, no server is started.
pub const METRICS_ADDR: &str = "STREAMFLEET_METRICS_ADDR";
