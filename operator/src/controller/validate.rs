//! Step 1, validate: the raw spec becomes a [`ValidSpec`] of checked, typed
//! values, so no later step re-reads or re-checks raw fields. Admission (the
//! schema and CEL rules) refuses most bad specs; this catches what it cannot,
//! and what an older API server let through.

use crate::error::Error;
use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource as _, ResourceExt as _};
use std::time::Duration;
use streamfleet_contract as contract;
use streamfleet_crd::{
    Backoff, DeletionPolicy, RecoveryMode, RedisConnection, RedisMode, RetrySpec, ScalingSpec, SecretKeyRef,
    StreamConsumerGroup,
};
use streamfleet_streams::retry::Schedule;
use streamfleet_streams::{keys, millis};

/// A spec the controller can act on.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidSpec {
    /// Shard 0: the stream itself.
    pub stream: String,
    /// Every shard's stream key, shard 0 first (`spec.shards`, default 1).
    pub streams: Vec<String>,
    pub group: String,
    pub start_id: String,
    /// Shard 0's dead-letter stream (see [`ValidSpec::dead_letter_stream_of`]).
    pub dead_letter_stream: String,
    pub min_idle: Duration,
    pub max_deliveries: u64,
    /// `spec.recovery.retry` with its defaults: what the workers are told
    /// (`objects`) and what the status reads parked entries against.
    pub retry: Schedule,
    /// Entries released per reaped consumer per poll.
    pub batch: usize,
    pub target_per_replica: u64,
    pub scaling: ScalingSpec,
    pub poll_interval: Duration,
    pub retention: Option<RetentionLimits>,
    pub delete_group: bool,
    /// `spec.suspend`: no workers, no recovery runs.
    pub suspend: bool,
    /// `spec.recovery.deadLetterMaxLength`.
    pub dead_letter_max_length: Option<u64>,
    /// Dead letters older than this are dropped (`spec.recovery.deadLetterMaxAgeSeconds`).
    pub dead_letter_max_age: Option<Duration>,
    /// Fields of `spec.worker.template` a pod template does not have (typos),
    /// dropped when read: the `TemplateFieldsUnknown` condition names them.
    pub unknown_template_fields: Vec<String>,
    pub redis: ValidRedis,
    /// The env contract the workers are told (`objects` renders it).
    pub worker_env: contract::WorkerEnv,
    /// The objects the resource owns, as the spec shapes them.
    pub workload: Workload,
}

/// What the builders (`objects`) make the owned objects from: names, owner,
/// the worker pod template and which of its containers is the worker, the
/// recovery schedule. Derived here once.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// The resource's name: the group label of everything it owns.
    pub resource: String,
    pub namespace: Option<String>,
    /// `None` until the API server has given the resource a uid.
    pub owner: Option<OwnerReference>,
    pub deployment_name: String,
    pub cronjob_name: String,
    /// `spec.worker.template`.
    pub template: PodTemplateSpec,
    /// `spec.worker.containerName`: the container told the env contract
    /// (else the first).
    pub container_name: Option<String>,
    pub recovery_mode: RecoveryMode,
    pub schedule: String,
}

impl Workload {
    /// Which of the template's containers is the worker. A template without
    /// it fails only the objects built from it (`InvalidSpec`): the group,
    /// the status and the dead-letter tools work meanwhile.
    pub fn worker_container(&self) -> Result<usize, Error> {
        let containers = &self
            .template
            .spec
            .as_ref()
            .ok_or_else(|| Error::InvalidSpec("spec.worker.template.spec is required".into()))?
            .containers;
        match self.container_name.as_deref() {
            Some(name) => containers.iter().position(|c| c.name == name).ok_or_else(|| {
                Error::InvalidSpec(format!("spec.worker.containerName: no container named {name:?} in the template"))
            }),
            None if containers.is_empty() => {
                Err(Error::InvalidSpec("spec.worker.template.spec.containers must not be empty".into()))
            }
            None => Ok(0),
        }
    }
}

fn workload(scg: &StreamConsumerGroup) -> Workload {
    Workload {
        resource: scg.name_any(),
        namespace: scg.namespace(),
        owner: scg.controller_owner_ref(&()),
        deployment_name: crate::objects::worker_deployment_name(scg),
        cronjob_name: crate::objects::recovery_cronjob_name(scg),
        template: scg.spec.worker.template.clone(),
        container_name: scg.spec.worker.container_name.clone(),
        recovery_mode: scg.spec.recovery.mode,
        schedule: scg.spec.recovery.schedule.clone(),
    }
}

/// `spec.redis`, checked: one source of the URL, a password wherever a
/// username is named.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidRedis {
    pub url: UrlSource,
    pub username: Option<UsernameSource>,
    /// The password's Secret key; `None` when the URL carries credentials or
    /// none are needed.
    pub password: Option<SecretKeyRef>,
    pub mode: streamfleet_streams::Mode,
    pub ca: Option<SecretKeyRef>,
    /// The `kubernetes.io/tls` Secret of the client certificate.
    pub client_cert: Option<String>,
}

/// Where the ACL user's name is written.
#[derive(Clone, Debug, PartialEq)]
pub enum UsernameSource {
    /// In the spec (`spec.redis.username`).
    Spec(String),
    /// In a Secret key (`spec.redis.usernameSecretRef`).
    Secret(SecretKeyRef),
}

/// Where the Redis URL is written.
#[derive(Clone, Debug, PartialEq)]
pub enum UrlSource {
    /// In the spec (`spec.redis.url`): no credentials in it.
    Spec(String),
    /// In a Secret key (`spec.redis.urlSecretRef`): credentials may be.
    Secret(SecretKeyRef),
}

/// `spec.redis` checked as admission does.
pub fn validate_redis(redis: &RedisConnection) -> Result<ValidRedis, Error> {
    let url = match (&redis.url, &redis.url_secret_ref) {
        (Some(url), None) => {
            if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                return Err(Error::InvalidSpec("spec.redis.url must start with redis:// or rediss://".into()));
            }
            // A query may carry credentials too (`?password=`) for some clients.
            if url.contains('@') || url.contains('?') {
                return Err(Error::InvalidSpec(
                    "spec.redis.url must carry no credentials or query: put the password in a Secret named by \
                     spec.redis.passwordSecretRef"
                        .into(),
                ));
            }
            UrlSource::Spec(url.clone())
        }
        (None, Some(r)) => UrlSource::Secret(r.clone()),
        _ => return Err(Error::InvalidSpec("spec.redis: set exactly one of url and urlSecretRef".into())),
    };
    let username = match (&redis.username, &redis.username_secret_ref) {
        (None, None) => None,
        (Some(name), None) => Some(UsernameSource::Spec(name.clone())),
        (None, Some(r)) => Some(UsernameSource::Secret(r.clone())),
        (Some(_), Some(_)) => {
            return Err(Error::InvalidSpec("spec.redis: set at most one of username and usernameSecretRef".into()));
        }
    };
    if username.is_some() && redis.password_secret_ref.is_none() {
        let field = if redis.username.is_some() { "username" } else { "usernameSecretRef" };
        return Err(Error::InvalidSpec(format!("spec.redis.{field} needs spec.redis.passwordSecretRef")));
    }
    let tls = redis.tls.as_ref();
    Ok(ValidRedis {
        url,
        username,
        password: redis.password_secret_ref.clone(),
        mode: match redis.mode {
            RedisMode::Standalone => streamfleet_streams::Mode::Standalone,
            RedisMode::Cluster => streamfleet_streams::Mode::Cluster,
        },
        ca: tls.and_then(|t| t.ca_secret_ref.clone()),
        client_cert: tls.and_then(|t| t.client_cert_secret_ref.as_ref()).map(|c| c.name.clone()),
    })
}

/// `spec.retention`, in the units the stream protocol takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionLimits {
    pub max_length: Option<u64>,
    pub max_age_ms: Option<u64>,
}

impl ValidSpec {
    /// Where `stream`'s dead letters go: shard 0's configured (or default)
    /// dead-letter stream, and each further shard's own, in its slot.
    pub fn dead_letter_stream_of(&self, stream: &str) -> String {
        if stream == self.stream {
            self.dead_letter_stream.clone()
        } else {
            keys::dead_letter_stream(stream, &self.group)
        }
    }

    /// The resource's group on `stream` (one of its shards).
    pub fn group_on<'a>(&'a self, stream: &'a str) -> streamfleet_streams::GroupRef<'a> {
        streamfleet_streams::GroupRef::new(stream, &self.group)
    }
}

fn within(field: &str, value: i64, min: i64, max: i64) -> Result<u64, Error> {
    u64::try_from(value).ok().filter(|_| (min..=max).contains(&value)).ok_or_else(|| {
        let bounds = if max == i64::MAX { format!("at least {min}") } else { format!("{min} to {max}") };
        Error::InvalidSpec(format!("{field} must be {bounds}, is {value}"))
    })
}

fn positive(field: &str, value: i64) -> Result<u64, Error> {
    u64::try_from(value)
        .ok()
        .filter(|v| *v > 0)
        .ok_or_else(|| Error::InvalidSpec(format!("{field} must be positive, is {value}")))
}

/// `spec.recovery.retry` checked as admission does (for an API server that
/// let it through), with the defaults the workers apply.
/// Also what the workers are told of it.
fn retry_schedule(spec: &RetrySpec, min_idle: Duration) -> Result<(Schedule, contract::Retry), Error> {
    let ms = |field: &str, v: Option<i64>| v.map(|v| positive(field, v).map(Duration::from_millis)).transpose();
    let initial = ms("spec.recovery.retry.initialDelayMs", spec.initial_delay_ms)?;
    let max = ms("spec.recovery.retry.maxDelayMs", spec.max_delay_ms)?;
    let retry_for = spec
        .retry_for_seconds
        .map(|s| positive("spec.recovery.retry.retryForSeconds", s).map(Duration::from_secs))
        .transpose()?;
    let first = initial.unwrap_or(min_idle);
    if first < min_idle {
        return Err(Error::InvalidSpec(
            "spec.recovery.retry.initialDelayMs must not be shorter than spec.recovery.minIdleTimeMs".into(),
        ));
    }
    if max.is_some_and(|max| max < first) || retry_for.is_some_and(|limit| limit < first) {
        return Err(Error::InvalidSpec(
            "spec.recovery.retry.maxDelayMs and retryForSeconds must not be shorter than the first delay".into(),
        ));
    }
    let jitter = u32::try_from(spec.jitter_percent).ok().filter(|p| *p <= 100).ok_or_else(|| {
        Error::InvalidSpec(format!("spec.recovery.retry.jitterPercent must be 0 to 100, is {}", spec.jitter_percent))
    })?;
    let backoff = match spec.backoff {
        Backoff::Exponential => contract::Backoff::Exponential,
        Backoff::Fixed => contract::Backoff::Fixed,
    };
    let told = contract::Retry {
        backoff,
        initial_delay_ms: initial.map(millis),
        max_delay_ms: max.map(millis),
        jitter_percent: Some(jitter),
        retry_for_ms: retry_for.map(millis),
    };
    Ok((Schedule::with_defaults(backoff, initial, max, Some(jitter), retry_for, min_idle), told))
}

/// `spec.redis` as the workers are told it: the spec's values and Secret
/// keys, never a Secret's content.
fn redis_source(redis: &ValidRedis) -> contract::RedisSource {
    let secret = |r: &SecretKeyRef| contract::SecretKey { secret: r.name.clone(), key: r.key.clone() };
    contract::RedisSource {
        url: match &redis.url {
            // No credentials in it (validated): a plain value.
            UrlSource::Spec(url) => contract::Source::Value(url.clone()),
            UrlSource::Secret(r) => contract::Source::Secret(secret(r)),
        },
        mode: match redis.mode {
            streamfleet_streams::Mode::Standalone => contract::RedisMode::Standalone,
            streamfleet_streams::Mode::Cluster => contract::RedisMode::Cluster,
        },
        username: redis.username.as_ref().map(|u| match u {
            UsernameSource::Spec(name) => contract::Source::Value(name.clone()),
            UsernameSource::Secret(r) => contract::Source::Secret(secret(r)),
        }),
        password: redis.password.as_ref().map(secret),
        ca: redis.ca.as_ref().map(secret),
        client_cert_secret: redis.client_cert.clone(),
    }
}

pub fn validate(scg: &StreamConsumerGroup) -> Result<ValidSpec, Error> {
    let spec = &scg.spec;
    // Workers are told the streams comma-separated, each trimmed: a name
    // with a comma or white space at its ends would reach them as another.
    // (The group is told as it is; only a blank one is none.)
    if spec.stream.contains(',') || spec.stream.trim() != spec.stream || spec.stream.is_empty() {
        return Err(Error::InvalidSpec(format!(
            "spec.stream {:?} must be non-empty, without commas or white space at its ends",
            spec.stream
        )));
    }
    if spec.group.trim().is_empty() {
        return Err(Error::InvalidSpec("spec.group must not be blank".into()));
    }
    let redis = validate_redis(&spec.redis)?;
    let dead_letter_stream =
        spec.recovery.dead_letter_stream.clone().unwrap_or_else(|| keys::dead_letter_stream(&spec.stream, &spec.group));
    if dead_letter_stream == spec.stream {
        return Err(Error::InvalidSpec(
            "spec.recovery.deadLetterStream equals spec.stream: dead letters would be consumed again".into(),
        ));
    }
    if spec.redis.mode == RedisMode::Cluster && !keys::same_slot(&dead_letter_stream, &spec.stream) {
        return Err(Error::InvalidSpec(format!(
            "spec.recovery.deadLetterStream {dead_letter_stream:?} must carry the hash tag of spec.stream {:?} \
             on a Redis Cluster (a dead letter is moved with its ack in one MULTI)",
            spec.stream
        )));
    }
    let shards = u32::try_from(spec.shards.unwrap_or(1))
        .ok()
        .filter(|n| (1..=64).contains(n))
        .ok_or_else(|| Error::InvalidSpec(format!("spec.shards must be 1 to 64, is {:?}", spec.shards)))?;
    if shards > 1 && spec.recovery.dead_letter_stream.is_some() {
        return Err(Error::InvalidSpec(
            "spec.recovery.deadLetterStream must be unset when spec.shards > 1: each shard dead-letters into its own slot"
                .into(),
        ));
    }
    if shards > 1 && keys::hash_tag(&spec.stream).is_some() {
        return Err(Error::InvalidSpec(format!(
            "spec.stream {:?} must carry no hash tag when spec.shards > 1: every shard would share one slot",
            spec.stream
        )));
    }
    let retention = match &spec.retention {
        Some(r) => Some(RetentionLimits {
            max_length: r.max_length.map(|n| positive("spec.retention.maxLength", n)).transpose()?,
            max_age_ms: r
                .max_age_seconds
                .map(|s| positive("spec.retention.maxAgeSeconds", s).map(|s| s.saturating_mul(1000)))
                .transpose()?,
        }),
        None => None,
    };
    // The schema's bounds, for an API server that let a spec past them:
    // a worker refuses what is outside.
    let min_idle =
        Duration::from_millis(within("spec.recovery.minIdleTimeMs", spec.recovery.min_idle_time_ms, 1000, i64::MAX)?);
    let (retry, told_retry) = retry_schedule(&spec.recovery.retry, min_idle)?;
    if let Some(objective) = spec.scaling.delay_objective_seconds {
        positive("spec.scaling.delayObjectiveSeconds", objective.into())?;
    }
    let streams = streamfleet_streams::shard::shard_keys(&spec.stream, shards);
    let max_deliveries = within("spec.recovery.maxDeliveries", spec.recovery.max_deliveries.into(), 1, 1000)?;
    let batch = within("spec.recovery.batchSize", spec.recovery.batch_size.into(), 1, 10_000)?;
    let concurrency = spec
        .worker
        .concurrency
        .map(|n| {
            u16::try_from(n)
                .ok()
                .filter(|n| (1..=1000).contains(n))
                .ok_or_else(|| Error::InvalidSpec(format!("spec.worker.concurrency must be 1 to 1000, is {n}")))
        })
        .transpose()?;
    // What the workers are told; each object sets its run mode and drain time.
    let worker_env = contract::WorkerEnv {
        redis: redis_source(&redis),
        options: contract::Options {
            streams: streams.clone(),
            group: spec.group.clone(),
            min_idle_ms: millis(min_idle),
            max_deliveries,
            batch_size: batch,
            mode: contract::RunMode::Consume,
            retry: told_retry,
            // Sharded: unset, so each shard dead-letters into its own slot.
            dead_letter_stream: (shards == 1).then(|| dead_letter_stream.clone()),
            concurrency,
            drain_timeout_ms: None,
            handler_timeout_ms: spec
                .worker
                .handler_timeout_seconds
                .map(|s| within("spec.worker.handlerTimeoutSeconds", s, 1, 86_400).map(|s| s * 1000))
                .transpose()?,
            prefetch: spec.worker.prefetch.map(|n| within("spec.worker.prefetch", n.into(), 1, 10_000)).transpose()?,
        },
    };
    Ok(ValidSpec {
        stream: spec.stream.clone(),
        streams,
        group: spec.group.clone(),
        start_id: spec.start_id.clone(),
        min_idle,
        retry,
        max_deliveries,
        batch: usize::try_from(batch).unwrap_or(usize::MAX),
        target_per_replica: positive("spec.scaling.targetPerReplica", spec.scaling.target_per_replica)?,
        scaling: spec.scaling.clone(),
        poll_interval: Duration::from_secs(positive(
            "spec.scaling.pollIntervalSeconds",
            spec.scaling.poll_interval_seconds.into(),
        )?),
        retention,
        delete_group: spec.deletion_policy == DeletionPolicy::Delete,
        suspend: spec.suspend,
        dead_letter_max_length: match spec.recovery.dead_letter_max_length {
            Some(n) => Some(positive("spec.recovery.deadLetterMaxLength", n)?),
            None => None,
        },
        dead_letter_max_age: match spec.recovery.dead_letter_max_age_seconds {
            Some(s) => Some(Duration::from_secs(positive("spec.recovery.deadLetterMaxAgeSeconds", s)?)),
            None => None,
        },
        dead_letter_stream,
        unknown_template_fields: spec.worker.unknown_template_fields.clone(),
        redis,
        worker_env,
        workload: workload(scg),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_stream_name_reaches_the_workers_as_it_is_or_is_refused() {
        let named = |stream: &str, group: &str| {
            let mut s = scg(json!({}));
            (s.spec.stream, s.spec.group) = (stream.into(), group.into());
            validate(&s).map(|_| ()).map_err(|e| e.to_string())
        };
        for stream in ["a,b", " orders", "orders\u{a0}", "orders\n", ""] {
            let e = named(stream, "g").unwrap_err();
            assert!(e.contains("spec.stream"), "{stream:?}: {e}");
        }
        assert!(named("my orders", " g,h").is_ok(), "inner spaces; a group is told as it is");
        assert!(named("orders", " ").unwrap_err().contains("spec.group must not be blank"));
    }

    #[test]
    fn the_redis_url_has_one_source_and_a_username_needs_a_password() {
        let redis = |r: serde_json::Value| {
            let mut s = scg(json!({}));
            s.spec.redis = serde_json::from_value(r).unwrap();
            validate(&s).map(|v| v.redis).map_err(|e| e.to_string())
        };
        let plain =
            redis(json!({"url": "redis://db:6379", "username": "u", "passwordSecretRef": {"name": "r", "key": "p"}}));
        assert_eq!(plain.unwrap().url, UrlSource::Spec("redis://db:6379".into()));
        let both = redis(json!({"url": "redis://db:6379", "urlSecretRef": {"name": "r", "key": "url"}}));
        assert!(both.unwrap_err().contains("set exactly one of url and urlSecretRef"));
        assert!(redis(json!({"mode": "Cluster"})).unwrap_err().contains("set exactly one"));
        let credentials = redis(json!({"url": "redis://u:pw@db:6379"})).unwrap_err();
        assert!(credentials.contains("spec.redis.url must carry no credentials"), "{credentials}");
        assert!(redis(json!({"url": "http://db"})).unwrap_err().contains("redis:// or rediss://"));
        let query = redis(json!({"url": "redis://db:6379/?password=pw"})).unwrap_err();
        assert!(query.contains("no credentials or query"), "{query}");
        let alone = redis(json!({"urlSecretRef": {"name": "r", "key": "url"}, "username": "u"})).unwrap_err();
        assert!(alone.contains("spec.redis.username needs spec.redis.passwordSecretRef"), "{alone}");
        let user = json!({"name": "r", "key": "user"});
        let alone = redis(json!({"url": "redis://db:6379", "usernameSecretRef": user})).unwrap_err();
        assert!(alone.contains("spec.redis.usernameSecretRef needs spec.redis.passwordSecretRef"), "{alone}");
        let password = json!({"name": "r", "key": "p"});
        let both = redis(
            json!({"url": "redis://db:6379", "username": "u", "usernameSecretRef": user, "passwordSecretRef": password}),
        );
        assert!(both.unwrap_err().contains("set at most one of username and usernameSecretRef"));
        let kept = redis(json!({"url": "redis://db:6379", "usernameSecretRef": user, "passwordSecretRef": password}));
        assert_eq!(
            kept.unwrap().username,
            Some(UsernameSource::Secret(SecretKeyRef { name: "r".into(), key: "user".into() }))
        );
    }

    #[test]
    fn shards_are_keys_of_their_own_and_refuse_a_shared_dead_letter_stream_or_hash_tag() {
        let v = validate(&scg(json!({"shards": 3}))).unwrap();
        assert_eq!(v.streams, vec!["orders", "orders:1", "orders:2"]);
        assert_eq!(v.dead_letter_stream_of("orders"), "{orders}:dead:g");
        assert_eq!(v.dead_letter_stream_of("orders:2"), "{orders:2}:dead:g");
        assert_eq!(validate(&scg(json!({}))).unwrap().streams, vec!["orders"]);
        let shared = validate(&scg(json!({"shards": 2, "recovery": {"deadLetterStream": "dlq"}}))).unwrap_err();
        assert!(shared.to_string().contains("spec.recovery.deadLetterStream must be unset"), "{shared}");
        let mut tagged = scg(json!({"shards": 2}));
        tagged.spec.stream = "{shop}orders".into();
        assert!(validate(&tagged).unwrap_err().to_string().contains("no hash tag"));
        assert!(validate(&scg(json!({"shards": 0}))).unwrap_err().to_string().contains("spec.shards"));
    }

    #[test]
    fn two_groups_on_one_stream_dead_letter_apart_by_default() {
        let billing = validate(&scg(json!({"group": "billing", "shards": 2}))).unwrap();
        let audit = validate(&scg(json!({"group": "audit", "shards": 2}))).unwrap();
        for stream in ["orders", "orders:1"] {
            let (b, a) = (billing.dead_letter_stream_of(stream), audit.dead_letter_stream_of(stream));
            assert_ne!(b, a, "a cap or purge on one group's letters would take the other's");
            assert!(keys::same_slot(&b, stream) && keys::same_slot(&a, stream), "{b} {a} beside {stream}");
        }
    }

    fn scg(extra: serde_json::Value) -> StreamConsumerGroup {
        let mut spec = json!({"redis": {"urlSecretRef": {"name": "r", "key": "url"}}, "stream": "orders", "group": "g",
                              "worker": {"template": {"spec": {"containers": [{"name": "w"}]}}}});
        if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
            spec.extend(extra.clone());
        }
        serde_json::from_value(json!({"apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
                                      "metadata": {"name": "p", "namespace": "n"}, "spec": spec}))
        .unwrap()
    }

    #[test]
    fn defaults_become_typed_values() {
        let v = validate(&scg(json!({"retention": {"maxAgeSeconds": 60}}))).unwrap();
        assert_eq!(v.dead_letter_stream, "{orders}:dead:g");
        assert_eq!(v.min_idle, Duration::from_secs(60));
        assert_eq!((v.max_deliveries, v.batch, v.target_per_replica), (10, 100, 100));
        assert_eq!(v.poll_interval, Duration::from_secs(10));
        assert_eq!(v.retention, Some(RetentionLimits { max_length: None, max_age_ms: Some(60_000) }));
        assert!(!v.delete_group);
    }

    #[test]
    fn the_retry_schedule_takes_its_defaults_and_is_checked_as_admission_does() {
        let v = validate(&scg(json!({"recovery": {"minIdleTimeMs": 2000}}))).unwrap();
        assert_eq!(
            (v.retry.initial, v.retry.max),
            (Duration::from_secs(2), streamfleet_streams::retry::DEFAULT_MAX_DELAY)
        );
        assert_eq!((v.retry.jitter_percent, v.retry.retry_for), (20, None));
        // A min-idle-time above the default cap raises the cap with it.
        let long = validate(&scg(json!({"recovery": {"minIdleTimeMs": 1_800_000}}))).unwrap();
        assert_eq!(long.retry.max, Duration::from_secs(1_800));
        for (retry, field) in [
            (json!({"initialDelayMs": 1000}), "initialDelayMs"),
            (json!({"maxDelayMs": 1000}), "maxDelayMs"),
            (json!({"retryForSeconds": 1}), "retryForSeconds"),
            (json!({"jitterPercent": 101}), "jitterPercent"),
        ] {
            let e = validate(&scg(json!({"recovery": {"minIdleTimeMs": 2000, "retry": retry}}))).unwrap_err();
            assert!(e.to_string().contains(field), "{field}: {e}");
        }
    }

    #[test]
    fn a_dead_letter_stream_equal_to_the_stream_is_refused() {
        let e = validate(&scg(json!({"recovery": {"deadLetterStream": "orders"}}))).unwrap_err();
        assert!(e.to_string().contains("spec.recovery.deadLetterStream"), "{e}");
        assert_eq!(e.reason(), "InvalidSpec");
    }

    #[test]
    fn on_a_cluster_the_dead_letter_stream_must_share_the_slot() {
        let cluster = json!({"redis": {"urlSecretRef": {"name": "r", "key": "url"}, "mode": "Cluster"}});
        let mut bad = cluster.clone();
        bad["recovery"] = json!({"deadLetterStream": "dead-orders"});
        assert!(validate(&scg(bad)).unwrap_err().to_string().contains("hash tag"));
        let mut good = cluster;
        good["recovery"] = json!({"deadLetterStream": "{orders}:poison"});
        assert_eq!(validate(&scg(good)).unwrap().dead_letter_stream, "{orders}:poison");
    }

    #[test]
    fn out_of_range_numbers_name_the_field() {
        let e = validate(&scg(json!({"scaling": {"targetPerReplica": 0}}))).unwrap_err();
        assert!(e.to_string().contains("spec.scaling.targetPerReplica"), "{e}");
        let e = validate(&scg(json!({"retention": {"maxLength": -1}}))).unwrap_err();
        assert!(e.to_string().contains("spec.retention.maxLength"), "{e}");
        let e = validate(&scg(json!({"scaling": {"delayObjectiveSeconds": 0}}))).unwrap_err();
        assert!(e.to_string().contains("spec.scaling.delayObjectiveSeconds"), "{e}");
    }
}
