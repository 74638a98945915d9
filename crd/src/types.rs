use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A Redis Streams consumer group run as a pipeline: the operator creates the
/// group, runs and scales the worker Deployment on lag, runs the recovery
/// CronJob and reports the health of the group's Pending Entries List.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "streamfleet.io",
    version = "v1alpha1",
    kind = "StreamConsumerGroup",
    plural = "streamconsumergroups",
    shortname = "scg",
    doc = "A Redis Streams consumer group run as a pipeline by streamfleet.",
    namespaced,
    status = "StreamConsumerGroupStatus",
    printcolumn = r#"{"name":"Stream","type":"string","jsonPath":".spec.stream","priority":1}"#,
    printcolumn = r#"{"name":"Group","type":"string","jsonPath":".spec.group","priority":1}"#,
    printcolumn = r#"{"name":"Delay","type":"date","description":"Age of the oldest unfinished entry (none when nothing is unfinished)","jsonPath":".status.oldestUnfinishedTime"}"#,
    printcolumn = r#"{"name":"Lag","type":"integer","jsonPath":".status.lag"}"#,
    printcolumn = r#"{"name":"In/s","type":"number","description":"Entries added per second over the last 30 s","jsonPath":".status.throughput.inPerSecond","priority":1}"#,
    printcolumn = r#"{"name":"Out/s","type":"number","description":"Entries finished (acked or dead-lettered) per second over the last 30 s","jsonPath":".status.throughput.outPerSecond","priority":1}"#,
    printcolumn = r#"{"name":"Pending","type":"integer","jsonPath":".status.pending"}"#,
    printcolumn = r#"{"name":"Retrying","type":"integer","description":"Pending entries waiting for a retry on the schedule","jsonPath":".status.retrying.entries"}"#,
    printcolumn = r#"{"name":"Oldest","type":"date","description":"How long the oldest pending entry has been idle","jsonPath":".status.oldestPendingIdleSince","priority":1}"#,
    printcolumn = r#"{"name":"Replicas","type":"string","jsonPath":".status.replicas.summary"}"#,
    printcolumn = r#"{"name":"Dead","type":"integer","description":"Entries in the dead-letter stream","jsonPath":".status.deadLetterLength"}"#,
    printcolumn = r#"{"name":"Lost","type":"integer","description":"Lost payloads not acknowledged","jsonPath":".status.payloadLost.unacknowledged"}"#,
    printcolumn = r#"{"name":"Health","type":"string","jsonPath":".status.health"}"#,
    printcolumn = r#"{"name":"Status","type":"string","description":"Why Ready is what it is","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self.scaling.minReplicas <= self.scaling.maxReplicas").message("spec.scaling.minReplicas must not exceed spec.scaling.maxReplicas"))]
#[x_kube(validation = Rule::new("!has(self.recovery) || !has(self.recovery.deadLetterStream) || self.recovery.deadLetterStream != self.stream").message("spec.recovery.deadLetterStream must differ from spec.stream: dead letters would be consumed again"))]
#[x_kube(validation = Rule::new("(has(self.shards) ? self.shards : 1) >= (has(oldSelf.shards) ? oldSelf.shards : 1)").message("spec.shards may grow, never shrink: entries in the dropped shards would be stranded"))]
#[x_kube(validation = Rule::new("!has(self.shards) || self.shards <= 1 || !has(self.recovery) || !has(self.recovery.deadLetterStream)").message("spec.recovery.deadLetterStream must be unset when spec.shards > 1: each shard dead-letters into its own slot"))]
#[x_kube(validation = Rule::new("!has(self.shards) || self.shards <= 1 || !self.stream.contains('{')").message("spec.stream must carry no hash tag when spec.shards > 1: every shard would share one slot"))]
#[serde(rename_all = "camelCase")]
pub struct StreamConsumerGroupSpec {
    /// How to reach Redis. Secrets hold what is secret (the password, a URL
    /// with credentials, a client key); none of it appears in this resource,
    /// its status, logs or Events.
    pub redis: RedisConnection,

    /// The stream key the group consumes. Immutable: a new stream is a new
    /// resource. Workers are told the streams comma-separated and trimmed:
    /// no comma, and no white space at its ends (Unicode's, as they trim).
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.stream is immutable"))]
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = r"^[^,\s\p{Z}\x{0B}\x{85}](?:[^,]*[^,\s\p{Z}\x{0B}\x{85}])?$")
    )]
    pub stream: String,

    /// The consumer group name. Immutable: renaming would orphan the old
    /// group's pending entries.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.group is immutable"))]
    #[schemars(length(min = 1, max = 128))]
    pub group: String,

    /// How many stream keys the pipeline spreads over (default 1: the stream
    /// itself). Shard 0 is `stream`, shard i is `<stream>:<i>`, so on Redis
    /// Cluster the shards land in different slots; a producer sends each
    /// entry to its business key's shard (`docs/sharding.md`). May grow,
    /// never shrink. With more than one shard the stream name carries no hash
    /// tag and each shard dead-letters into its own `{<shard>}:dead:<group>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub shards: Option<i32>,

    /// Where a newly created group starts: `$` (only entries added after
    /// creation), `0` (the whole stream) or an explicit entry ID such as
    /// `1700000000000-0`. Used only when the group is created; an existing
    /// group keeps its position.
    #[serde(default = "default_start_id")]
    #[schemars(regex(pattern = r"^(\$|0|[0-9]{1,20}(-[0-9]{1,20})?)$"))]
    pub start_id: String,

    /// The worker pods. The operator owns a Deployment built from this
    /// template and injects the streamfleet env contract into its worker
    /// container.
    pub worker: WorkerSpec,

    /// How the worker Deployment is scaled on lag and pending entries.
    #[serde(default)]
    pub scaling: ScalingSpec,

    /// The recovery runs that settle stuck entries: dead-letter poison ones and
    /// record lost payloads (`Sweep`), or claim and re-run them (`Worker`).
    #[serde(default)]
    pub recovery: RecoverySpec,

    /// Optional trimming of the stream (`XTRIM MINID` each poll), always held
    /// at the safe floor: no entry that any group on the stream, managed or
    /// not, still has pending or undelivered is trimmed. A policy that would
    /// cut deeper sets the `RetentionBlocked` condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<RetentionSpec>,

    /// What happens to the consumer group in Redis when this resource is
    /// deleted: `Retain` (default) keeps it, `Delete` destroys it.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,

    /// Suspends the pipeline: the workers are scaled to zero (after their
    /// drain) and the recovery CronJob is suspended. The group is still
    /// inspected: lag, pending and dead letters are still reported, health
    /// reads `Suspended` (or `PayloadLost`). Entries wait in Redis; retention
    /// never trims what is undelivered or pending. `false` (default) resumes.
    /// The worker Deployment's replicas are the operator's: `kubectl scale`
    /// on it is undone at the next poll, this field is how to stop.
    #[serde(default)]
    pub suspend: bool,
}

fn default_start_id() -> String {
    "$".to_string()
}

/// Connection to a standalone Redis server or a Redis Cluster.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[x_kube(validation = Rule::new("has(self.url) != has(self.urlSecretRef)").message("spec.redis: set exactly one of url and urlSecretRef"))]
#[x_kube(validation = Rule::new("!has(self.username) || has(self.passwordSecretRef)").message("spec.redis.username needs spec.redis.passwordSecretRef: Redis authenticates a user by its password"))]
#[x_kube(validation = Rule::new("!has(self.usernameSecretRef) || has(self.passwordSecretRef)").message("spec.redis.usernameSecretRef needs spec.redis.passwordSecretRef: Redis authenticates a user by its password"))]
#[x_kube(validation = Rule::new("!has(self.username) || !has(self.usernameSecretRef)").message("spec.redis: set at most one of username and usernameSecretRef"))]
#[serde(rename_all = "camelCase")]
pub struct RedisConnection {
    /// The Secret key holding the Redis URL (`redis://` or `rediss://`,
    /// credentials percent-encoded in it, or kept apart in `username` and
    /// `passwordSecretRef`). In `Cluster` mode, any node of the cluster.
    /// One of `url` and `urlSecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_secret_ref: Option<SecretKeyRef>,

    /// The Redis URL, without credentials (`redis://redis-master.db:6379`;
    /// `rediss://` for TLS): the password comes from `passwordSecretRef`.
    /// In `Cluster` mode, any node of the cluster. One of `url` and
    /// `urlSecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('redis://') || self.startsWith('rediss://')").message("spec.redis.url must start with redis:// or rediss://"))]
    #[x_kube(validation = Rule::new("!self.contains('@') && !self.contains('?')").message("spec.redis.url must carry no credentials or query: put the password in a Secret named by spec.redis.passwordSecretRef"))]
    pub url: Option<String>,

    /// The ACL user to authenticate as (`AUTH <username> <password>`).
    /// Omit for the `default` user. Needs `passwordSecretRef`. One of
    /// `username` and `usernameSecretRef` at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub username: Option<String>,

    /// A Secret key holding the ACL user's name (leading and trailing
    /// whitespace, a trailing newline say, is not part of it), for a
    /// secret manager that keeps the user with the password. Needs
    /// `passwordSecretRef`. One of `username` and `usernameSecretRef` at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,

    /// A Secret key holding the password alone, as it is (no percent-encoding):
    /// e.g. the `redis-password` key of the Secret the Bitnami Redis chart
    /// creates. The URL must then carry no password of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,

    /// `Standalone` (default) for one server, `Cluster` for Redis Cluster.
    #[serde(default)]
    pub mode: RedisMode,

    /// TLS settings for `rediss://` URLs. Omit to use the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<RedisTls>,
}

/// A key in a Secret in the resource's own namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key within the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A Secret in the resource's own namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Whether the URL names one server or a cluster.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RedisMode {
    /// One Redis server (possibly behind a proxy that looks like one).
    #[default]
    Standalone,
    /// Redis Cluster: stream keys are routed by hash slot.
    Cluster,
}

/// TLS to Redis.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RedisTls {
    /// A Secret key holding the PEM CA bundle that signs the server's
    /// certificate. Omit to trust the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,

    /// A `kubernetes.io/tls` Secret (keys `tls.crt` and `tls.key`, as
    /// cert-manager writes them) holding the client certificate and key
    /// presented to a server that requires one (`tls-auth-clients yes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_secret_ref: Option<SecretRef>,
}

/// The keys of a `kubernetes.io/tls` Secret.
pub const TLS_CERT_KEY: &str = "tls.crt";
pub const TLS_PRIVATE_KEY_KEY: &str = "tls.key";

/// The worker fleet.
#[derive(Serialize, Deserialize, Clone, Debug, JsonSchema)]
#[serde(rename_all = "camelCase", try_from = "WorkerSpecWire")]
pub struct WorkerSpec {
    /// The pod template of the worker Deployment (a core/v1 PodTemplateSpec;
    /// `kubectl explain deployment.spec.template` documents its fields),
    /// validated with Kubernetes' schema: a field a pod template does not
    /// have (a typo) is refused, or dropped with a warning when the client
    /// asks only to be warned. Its labels and containers are the user's;
    /// the operator adds its own selector labels and the env contract.
    #[schemars(schema_with = "pod_template_schema")]
    pub template: PodTemplateSpec,

    /// The container that receives the env contract. Defaults to the first
    /// container of the template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    pub container_name: Option<String>,

    /// Handlers in flight per worker pod (`STREAMFLEET_CONCURRENCY`; the
    /// library's default is 10). Entries with the same business key never
    /// run at once. `scaling.targetPerReplica` is per pod, whatever this is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub concurrency: Option<i32>,

    /// Seconds one attempt of a handler may run before it is dropped and
    /// counts as a transient failure, retried on the retry schedule
    /// (`STREAMFLEET_HANDLER_TIMEOUT_MS`). Unset: `recovery.minIdleTimeMs`.
    /// While a handler runs its entry stays this worker's (held), longer
    /// than min-idle-time too. A recovery run in `Worker` mode still ends at
    /// its deadline, and a rollout stops handlers after the pod's grace period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400))]
    pub handler_timeout_seconds: Option<i64>,

    /// Entries one read, or one claim of idle or due entries, takes ahead
    /// of the handlers (`XREADGROUP … COUNT`, per shard;
    /// `STREAMFLEET_PREFETCH`). Unset: `recovery.batchSize`. Entries taken
    /// wait in this worker's hands until a handler is free: set it near
    /// `concurrency` when handlers are slow, so that idle workers get the
    /// work instead (as Celery's prefetch multiplier of 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub prefetch: Option<i32>,

    /// Fields written in `template` that a pod template does not have (a
    /// typo such as `resoures`), as paths under `spec.worker.template`:
    /// dropped when the resource was read, so the operator says so (the
    /// `TemplateFieldsUnknown` condition) rather than run pods without them
    /// in silence. The CRD's schema now refuses them at admission; a
    /// resource stored under an older CRD may still hold some. Not part of
    /// the resource.
    #[serde(skip)]
    #[schemars(skip)]
    pub unknown_template_fields: Vec<String>,
}

/// Equal as resources: `unknown_template_fields` is what reading the
/// resource found, not part of it (written back, the typos are gone).
impl PartialEq for WorkerSpec {
    fn eq(&self, other: &Self) -> bool {
        self.template == other.template
            && self.container_name == other.container_name
            && self.concurrency == other.concurrency
            && self.handler_timeout_seconds == other.handler_timeout_seconds
            && self.prefetch == other.prefetch
    }
}

/// [`WorkerSpec`] as written: its pod template kept as JSON until every
/// field in it is accounted for (a resource stored under an older CRD,
/// whose template was schemaless, may hold unknown fields). The same schema.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
struct WorkerSpecWire {
    /// The pod template of the worker Deployment (a core/v1 PodTemplateSpec;
    /// `kubectl explain deployment.spec.template` documents its fields),
    /// validated with Kubernetes' schema: a field a pod template does not
    /// have (a typo) is refused, or dropped with a warning when the client
    /// asks only to be warned. Its labels and containers are the user's;
    /// the operator adds its own selector labels and the env contract.
    #[schemars(schema_with = "pod_template_schema")]
    template: serde_json::Value,

    /// The container that receives the env contract. Defaults to the first
    /// container of the template.
    #[serde(default)]
    #[schemars(length(max = 63))]
    container_name: Option<String>,

    /// Handlers in flight per worker pod (`STREAMFLEET_CONCURRENCY`; the
    /// library's default is 10). Entries with the same business key never
    /// run at once. `scaling.targetPerReplica` is per pod, whatever this is.
    #[serde(default)]
    #[schemars(range(min = 1, max = 1000))]
    concurrency: Option<i32>,

    /// Seconds one attempt of a handler may run before it is dropped and
    /// counts as a transient failure, retried on the retry schedule
    /// (`STREAMFLEET_HANDLER_TIMEOUT_MS`). Unset: `recovery.minIdleTimeMs`.
    /// While a handler runs its entry stays this worker's (held), longer
    /// than min-idle-time too. A recovery run in `Worker` mode still ends at
    /// its deadline, and a rollout stops handlers after the pod's grace period.
    #[serde(default)]
    #[schemars(range(min = 1, max = 86400))]
    handler_timeout_seconds: Option<i64>,

    /// Entries one read, or one claim of idle or due entries, takes ahead
    /// of the handlers (`XREADGROUP … COUNT`, per shard;
    /// `STREAMFLEET_PREFETCH`). Unset: `recovery.batchSize`. Entries taken
    /// wait in this worker's hands until a handler is free: set it near
    /// `concurrency` when handlers are slow, so that idle workers get the
    /// work instead (as Celery's prefetch multiplier of 1).
    #[serde(default)]
    #[schemars(range(min = 1, max = 10000))]
    prefetch: Option<i32>,
}

impl TryFrom<WorkerSpecWire> for WorkerSpec {
    type Error = serde_json::Error;

    fn try_from(wire: WorkerSpecWire) -> Result<Self, Self::Error> {
        let template: PodTemplateSpec = serde_json::from_value(wire.template.clone())?;
        let read = serde_json::to_value(&template)?;
        let mut unknown = Vec::new();
        unknown_fields(&wire.template, &read, "spec.worker.template", &mut unknown);
        Ok(Self {
            template,
            container_name: wire.container_name,
            concurrency: wire.concurrency,
            handler_timeout_seconds: wire.handler_timeout_seconds,
            prefetch: wire.prefetch,
            unknown_template_fields: unknown,
        })
    }
}

/// The paths (under `at`) of fields in `written` that `read` (the same
/// value parsed into its type and written back) lacks: fields the type does
/// not have. A `null` is no field.
fn unknown_fields(written: &serde_json::Value, read: &serde_json::Value, at: &str, out: &mut Vec<String>) {
    use serde_json::Value;
    match (written, read) {
        (Value::Object(written), Value::Object(read)) => {
            for (name, value) in written {
                let path = format!("{at}.{name}");
                match read.get(name) {
                    _ if value.is_null() => {}
                    None => out.push(path),
                    Some(kept) => unknown_fields(value, kept, &path, out),
                }
            }
        }
        (Value::Array(written), Value::Array(read)) => {
            for (i, (value, kept)) in written.iter().zip(read).enumerate() {
                unknown_fields(value, kept, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Kubernetes' own PodTemplateSpec schema, so that a typo in the template is
/// refused at admission (or pruned, with a warning, for a client that asks
/// only to be warned) instead of dropped in silence. Without the field
/// descriptions the CRD stays near 230 KB: applied server-side.
fn pod_template_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let schema = <PodTemplateSpec as JsonSchema>::json_schema(generator);
    // The field descriptions are Kubernetes' own (`kubectl explain
    // deployment.spec.template`): without them the CRD stays small.
    fn strip(value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                map.remove("description");
                map.values_mut().for_each(strip);
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut value = schema.clone().to_value();
    strip(&mut value);
    if let serde_json::Value::Object(map) = &mut value {
        map.insert("description".into(), "A core/v1 PodTemplateSpec for the worker pods.".into());
    }
    schemars::Schema::try_from(value).unwrap_or(schema)
}

/// Lag-driven scaling of the worker Deployment.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScalingSpec {
    /// Fewest worker replicas. 0 allows scale to zero when the group is idle.
    #[serde(default = "default_min_replicas")]
    #[schemars(range(min = 0, max = 1000))]
    pub min_replicas: i32,

    /// Most worker replicas.
    #[serde(default = "default_max_replicas")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,

    /// The delay (age of the oldest unfinished entry) to keep under, in
    /// seconds. When set, replicas follow the arrival rate, the backlog to
    /// drain within it and each replica's measured completion rate (at 80%
    /// of it); until a rate is measured, `targetPerReplica` decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400))]
    pub delay_objective_seconds: Option<i32>,

    /// Lag plus pending entries one replica is expected to carry.
    #[serde(default = "default_target_per_replica")]
    #[schemars(range(min = 1))]
    pub target_per_replica: i64,

    /// Lag plus pending above which a pipeline at zero replicas is woken.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub activation_threshold: i64,

    /// How long the desired replica count must stay lower before scaling down.
    #[serde(default = "default_scale_down_stabilization")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_down_stabilization_seconds: i32,

    /// How long lag and pending must both stay zero before scaling to zero.
    #[serde(default = "default_cooldown")]
    #[schemars(range(min = 0, max = 86400))]
    pub cooldown_seconds: i32,

    /// How often the operator inspects the group.
    #[serde(default = "default_poll_interval")]
    #[schemars(range(min = 1, max = 3600))]
    pub poll_interval_seconds: i32,

    /// Hold the current replica count; health is still reported.
    #[serde(default)]
    pub paused: bool,
}

fn default_min_replicas() -> i32 {
    1
}
fn default_max_replicas() -> i32 {
    10
}
fn default_target_per_replica() -> i64 {
    100
}
fn default_scale_down_stabilization() -> i32 {
    60
}
fn default_cooldown() -> i32 {
    300
}
fn default_poll_interval() -> i32 {
    10
}

impl Default for ScalingSpec {
    fn default() -> Self {
        Self {
            min_replicas: default_min_replicas(),
            max_replicas: default_max_replicas(),
            delay_objective_seconds: None,
            target_per_replica: default_target_per_replica(),
            activation_threshold: 0,
            scale_down_stabilization_seconds: default_scale_down_stabilization(),
            cooldown_seconds: default_cooldown(),
            poll_interval_seconds: default_poll_interval(),
            paused: false,
        }
    }
}

/// The recovery CronJob.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[x_kube(validation = Rule::new("!has(self.retry) || !has(self.retry.initialDelayMs) || self.retry.initialDelayMs >= self.minIdleTimeMs").message("spec.recovery.retry.initialDelayMs must not be shorter than spec.recovery.minIdleTimeMs: an entry is claimed again only after min-idle-time anyway"))]
#[x_kube(validation = Rule::new("!has(self.retry) || !has(self.retry.maxDelayMs) || self.retry.maxDelayMs >= (has(self.retry.initialDelayMs) ? self.retry.initialDelayMs : self.minIdleTimeMs)").message("spec.recovery.retry.maxDelayMs must not be shorter than the first delay (spec.recovery.retry.initialDelayMs, or spec.recovery.minIdleTimeMs when unset)"))]
#[x_kube(validation = Rule::new("!has(self.retry) || !has(self.retry.retryForSeconds) || self.retry.retryForSeconds * 1000 >= (has(self.retry.initialDelayMs) ? self.retry.initialDelayMs : self.minIdleTimeMs)").message("spec.recovery.retry.retryForSeconds must not be shorter than the first delay: no entry would ever be retried"))]
#[serde(rename_all = "camelCase")]
pub struct RecoverySpec {
    /// Cron schedule of the sweep (five fields, as in a CronJob).
    #[serde(default = "default_schedule")]
    #[x_kube(validation = Rule::new("self.split(' ').filter(f, f != '').size() == 5").message("spec.recovery.schedule must have five cron fields"))]
    #[x_kube(validation = Rule::new("self.split(' ').filter(f, f != '').size() != 5 || self.split(' ').filter(f, f != '')[0].matches('^([*]|[0-5]?[0-9](-[0-5]?[0-9])?)(/[0-9]+)?(,([0-5]?[0-9](-[0-5]?[0-9])?)(/[0-9]+)?)*$')").message("spec.recovery.schedule: the minute field takes 0-59"))]
    #[x_kube(validation = Rule::new("self.split(' ').filter(f, f != '').size() != 5 || self.split(' ').filter(f, f != '')[1].matches('^([*]|(1?[0-9]|2[0-3])(-(1?[0-9]|2[0-3]))?)(/[0-9]+)?(,((1?[0-9]|2[0-3])(-(1?[0-9]|2[0-3]))?)(/[0-9]+)?)*$')").message("spec.recovery.schedule: the hour field takes 0-23"))]
    #[schemars(length(min = 9, max = 128))]
    pub schedule: String,

    /// Milliseconds an entry must sit unacknowledged before it is claimed.
    /// Must exceed the p99 handler time including its retries.
    #[serde(default = "default_min_idle_ms")]
    #[schemars(range(min = 1000))]
    pub min_idle_time_ms: i64,

    /// Deliveries after which an entry is dead-lettered: the retry
    /// schedule's horizon by count (`retry`). The default, 10, with the
    /// default schedule spans 90 minutes: an hour's outage is ridden out.
    #[serde(default = "default_max_deliveries")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_deliveries: i32,

    /// When an entry whose handler failed transiently is tried again
    /// (`docs/retries.md`). Kept in the PEL: the entry keeps its ID and its
    /// delivery count is its attempt count.
    #[serde(default)]
    pub retry: RetrySpec,

    /// Entries per claim step of a worker, and per page of the recovery
    /// sweep (at most 1000 per page: one script settles a page).
    #[serde(default = "default_batch_size")]
    #[schemars(range(min = 1, max = 10000))]
    pub batch_size: i32,

    /// The dead-letter stream. Defaults to the group's own
    /// `{<stream>}:dead:<group>` (or `<stream>:dead:<group>` when the stream
    /// key has a hash tag), so two groups on one stream keep their letters,
    /// caps and counts apart; it shares the stream's Redis Cluster slot so an
    /// entry is dead-lettered atomically with its ack. An explicit name on a
    /// cluster must carry the stream's hash tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub dead_letter_stream: Option<String>,

    /// Caps each dead-letter stream at this many letters: every poll the
    /// operator trims the oldest beyond it (`XTRIM MAXLEN`), sets the
    /// `DeadLetterCapReached` condition and publishes a Warning Event naming
    /// how many it dropped. Unset (default): never trimmed, because a dead
    /// letter is the only record of work that failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub dead_letter_max_length: Option<i64>,

    /// Drops dead letters older than this many seconds (by their IDs, the
    /// time they were dead-lettered, against the Redis server's clock):
    /// every poll the operator trims them (`XTRIM MINID`) and publishes a
    /// Normal Event `DeadLettersExpired` naming how many. At least 60. Unset
    /// (default): kept whatever their age. Sidekiq keeps its dead set 6
    /// months, asynq its archive 90 days: 7776000 is asynq's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 60))]
    pub dead_letter_max_age_seconds: Option<i64>,

    /// `Sweep` runs the operator image, which dead-letters poison and
    /// records lost payloads without running handlers (the workers' own
    /// claims take the rest); `Worker` runs the worker template in recovery
    /// mode, which claims idle entries and re-runs the handlers.
    #[serde(default)]
    pub mode: RecoveryMode,
}

/// The retry schedule of transiently failed entries.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetrySpec {
    /// `Exponential` (each delay twice the one before, at most
    /// `maxDelayMs`) or `Fixed` (always `initialDelayMs`).
    #[serde(default)]
    pub backoff: Backoff,
    /// Milliseconds from the first failure to the second attempt. Unset:
    /// `minIdleTimeMs`; never shorter. At most 7 days.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1000, max = 604800000))]
    pub initial_delay_ms: Option<i64>,
    /// The longest delay between two attempts, in milliseconds. Unset: 15
    /// minutes (900000), or the first delay when that is longer. At most 7
    /// days.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1000, max = 604800000))]
    pub max_delay_ms: Option<i64>,
    /// Each delay is lengthened by a random 0 to this many percent, so
    /// entries that failed together do not come back together.
    #[serde(default = "default_jitter_percent")]
    #[schemars(range(min = 0, max = 100))]
    pub jitter_percent: i32,
    /// No attempt starts later than this many seconds after the entry
    /// first failed: the last delay is cut short to land on it, and an
    /// entry failing then is dead-lettered `retries-exhausted`. Unset:
    /// `maxDeliveries` alone bounds the retries. At most a year.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 31536000))]
    pub retry_for_seconds: Option<i64>,
}

/// How a retry delay grows.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Backoff {
    #[default]
    Exponential,
    Fixed,
}

fn default_jitter_percent() -> i32 {
    20
}

impl Default for RetrySpec {
    fn default() -> Self {
        Self {
            backoff: Backoff::default(),
            initial_delay_ms: None,
            max_delay_ms: None,
            jitter_percent: default_jitter_percent(),
            retry_for_seconds: None,
        }
    }
}

fn default_schedule() -> String {
    "*/5 * * * *".to_string()
}
fn default_min_idle_ms() -> i64 {
    60_000
}
fn default_max_deliveries() -> i32 {
    10
}
fn default_batch_size() -> i32 {
    100
}

impl Default for RecoverySpec {
    fn default() -> Self {
        Self {
            schedule: default_schedule(),
            min_idle_time_ms: default_min_idle_ms(),
            max_deliveries: default_max_deliveries(),
            retry: RetrySpec::default(),
            batch_size: default_batch_size(),
            dead_letter_stream: None,
            dead_letter_max_length: None,
            dead_letter_max_age_seconds: None,
            mode: RecoveryMode::default(),
        }
    }
}

/// Who runs the recovery sweep.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum RecoveryMode {
    /// The operator image dead-letters poison and records lost payloads;
    /// handlers are not re-run.
    #[default]
    Sweep,
    /// The worker image runs in recovery mode and re-runs handlers.
    Worker,
}

/// Stream retention, bounded by the safe floor.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetentionSpec {
    /// Keep at most this many entries (a long excess is trimmed over several
    /// polls, at most 10,000 entries located per poll).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_length: Option<i64>,
    /// Keep entries younger than this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_age_seconds: Option<i64>,
}

/// What deleting the resource does to the group in Redis.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum DeletionPolicy {
    /// Keep the group and its pending entries.
    #[default]
    Retain,
    /// Destroy the group (`XGROUP DESTROY`); its pending entries are dropped.
    Delete,
}

/// Observed state, written by the operator only when it changes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StreamConsumerGroupStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// `Ready`, `GroupReady`, `WorkersAvailable`, `Degraded`, `RetentionBlocked`, `Conflict`,
    /// `DelayUnknown`, `EvictionPossible`, `LossOnRestartPossible`, `DeadLetterCapReached`,
    /// `TemplateFieldsUnknown`, `RecoveryFailing`, `RecoveryDeadlineTooShort`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub conditions: Vec<Condition>,

    /// How late the group is: when its oldest unfinished entry (pending, or
    /// not yet delivered), over every shard, was added, by the Redis
    /// primary's clock (the entry ID's milliseconds, to the second). The
    /// `Delay` column shows its age; `streamfleet_delay_seconds` the exact
    /// delay against Redis `TIME`. A time, not an age, so that a pipeline
    /// where nothing moves does not rewrite its status every poll. Absent
    /// when nothing is unfinished, when the group is not inspected, and
    /// when the stream's IDs are not times (a producer sets explicit IDs;
    /// the `DelayUnknown` condition says so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_unfinished_time: Option<Time>,

    /// Entries not yet delivered to the group, counted from stream IDs up to
    /// 1,000 (Redis's own figure beyond; 1001 when Redis reports none and
    /// more than 1,000 wait: a floor); absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,

    /// Entries delivered but not acknowledged (the PEL size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<i64>,

    /// Arrival and completion rates over about the last 30 s (from the
    /// newest reading at least 30 s old), and when the
    /// work outstanding will be done at them; absent until two polls a
    /// second apart have read the counters, and when they are unreadable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput: Option<ThroughputStatus>,

    /// Idle time of the oldest pending entry, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_idle_seconds: Option<i64>,

    /// Since when the oldest pending entry has been idle (its last delivery
    /// or claim, by the Redis server's clock, to the second): the `Oldest`
    /// column shows it as a duration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_idle_since: Option<Time>,

    /// Highest delivery count among the inspected pending entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_delivery_count: Option<i64>,

    /// Consumers the group knows (live and not yet reaped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers: Option<i64>,

    /// Consumers that own pending entries, most first (at most 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub consumer_pending: Vec<ConsumerPending>,

    /// Length of the stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_length: Option<i64>,

    /// Length of the dead-letter stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_length: Option<i64>,

    /// Worker replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<ReplicaStatus>,

    /// Overall classification, judged over a window: Healthy, Lagging,
    /// Stalled, Stopped, Rewound, Retrying, PoisonForming, PayloadLost,
    /// Unknown or Suspended (`spec.suspend`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<Health>,

    /// The last recovery sweep's outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_recovery: Option<RecoveryStatus>,

    /// Pending entries whose payload was found trimmed or deleted, by
    /// workers, sweeps or any other consumer that follows the env contract;
    /// absent when unknown. Health stays `PayloadLost` while some are not
    /// acknowledged (annotation `streamfleet.io/payload-lost-acknowledged`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_lost: Option<PayloadLostStatus>,

    /// Pending entries waiting for a retry on the schedule
    /// (`spec.recovery.retry`); `entries: 0` when none wait, absent when
    /// unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retrying: Option<RetryingStatus>,

    /// Where the group would be created again if it vanished (its stream
    /// deleted, Redis restarted without persistence): just before its oldest
    /// pending entry, or at its last delivered one, as last observed. Nothing
    /// that was not acknowledged is skipped; some entries may be delivered
    /// again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub resume_id: Option<String>,

    /// Per shard, when the pipeline has more than one (`spec.shards`); the
    /// top-level figures are their totals.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub shards: Vec<ShardStatus>,
}

/// Entries in and out per second, as `kubectl get` shows them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ThroughputStatus {
    /// Entries added to the stream per second (every shard), to 0.1.
    pub in_per_second: f64,
    /// Entries finished per second: acknowledged or dead-lettered (every
    /// shard), to 0.1.
    pub out_per_second: f64,
    /// Seconds until the lag and pending are done at these rates; absent
    /// while they do not shrink, 0 when nothing is outstanding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drains_in_seconds: Option<i64>,
}

/// One shard's figures.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShardStatus {
    /// The shard's stream key.
    pub stream: String,
    /// When the shard's oldest unfinished entry was added; absent when
    /// nothing is unfinished or unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_unfinished_time: Option<Time>,
    /// Entries not yet delivered; absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,
    pub pending: i64,
    /// Idle time of the shard's oldest pending entry, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_idle_seconds: Option<i64>,
    /// Length of the shard's dead-letter stream.
    pub dead_letter_length: i64,
}

/// The annotation through which a user acknowledges lost payloads: its value
/// is the `status.payloadLost.total` they have dealt with.
pub const PAYLOAD_LOST_ACKNOWLEDGED: &str = "streamfleet.io/payload-lost-acknowledged";

/// Lost work, as recorded in Redis for the group.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PayloadLostStatus {
    /// Entries lost, ever.
    pub total: i64,
    /// `total` less what the acknowledgement annotation covers.
    pub unacknowledged: i64,
    /// The latest lost entry IDs, newest first (at most 5).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 5))]
    pub latest_ids: Vec<String>,
}

/// Pending entries waiting for a retry on the schedule (`spec.recovery.retry`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetryingStatus {
    /// Entries waiting for their next attempt.
    pub entries: i64,
    /// Of those, entries whose next attempt is their last (`maxDeliveries`):
    /// dead-lettered `retries-exhausted` if it fails too.
    pub on_last_attempt: i64,
    /// When the next of them is due (of the first 100 waiting at each
    /// delivery count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_time: Option<Time>,
    /// The last error of that entry (at most 256 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub last_error: Option<String>,
    /// Entries waiting, by the delivery count they failed at.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub by_delivery: Vec<RetryingAtDelivery>,
}

/// Entries waiting for a retry after failing at one delivery count.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetryingAtDelivery {
    /// The delivery they failed at; their next attempt is the one after.
    pub deliveries: i64,
    pub entries: i64,
}

/// Pending entries owned by one consumer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerPending {
    /// The consumer (a pod name).
    pub name: String,
    /// Entries it holds unacknowledged.
    pub pending: i64,
}

/// Desired and current worker replicas.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// Replicas the scaling policy asks for.
    pub desired: i32,
    /// Replicas of the Deployment that are available.
    pub current: i32,
    /// `current/desired`, for `kubectl get`.
    pub summary: String,
}

/// Health classification of the pipeline.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Health {
    /// Work is done as it comes: the delay is not rising.
    Healthy,
    /// The delay has risen over the last 30 s while entries are completed:
    /// the workers fall behind the arrivals.
    Lagging,
    /// Work waiting and no progress.
    Stalled,
    /// Work waiting and no consumer reading: no worker runs, or none has
    /// touched the group for 30 s.
    Stopped,
    /// The group's last delivered ID went back (`XGROUP SETID`, or the
    /// group created again where it was): entries after it are delivered
    /// again until it passes where it was.
    Rewound,
    /// Many entries wait for a retry after failing transiently: a
    /// downstream is likely failing (`status.retrying` names the error).
    Retrying,
    /// Entries are being redelivered towards the dead-letter threshold.
    PoisonForming,
    /// Pending entries whose payload was trimmed or deleted.
    PayloadLost,
    /// The group could not be inspected.
    Unknown,
    /// `spec.suspend`: no workers, no recovery runs; figures still reported.
    Suspended,
}

/// Outcome of one recovery sweep.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecoveryStatus {
    /// When the sweep finished.
    pub time: Time,
    /// Entries taken from their holders: by a sweep, to dead-letter them;
    /// in `Worker` mode, to run them again.
    pub claimed: i64,
    /// Entries moved to the dead-letter stream.
    pub dead_lettered: i64,
    /// Pending entries whose payload was gone.
    pub payload_lost: i64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt as _;

    fn minimal() -> serde_json::Value {
        serde_json::json!({
            "redis": {"urlSecretRef": {"name": "redis", "key": "url"}},
            "stream": "orders",
            "group": "billing",
            "worker": {"template": {"spec": {"containers": [{"name": "w", "image": "worker"}]}}}
        })
    }

    #[test]
    fn a_typo_in_the_pod_template_is_named_not_dropped_in_silence() {
        let mut spec = minimal();
        spec["worker"]["template"] = serde_json::json!({
            "metadata": {"labels": {"team": "billing"}, "creationTimestamp": null},
            "spec": {
                "containers": [
                    {"name": "w", "image": "worker", "resources": {"limits": {"cpu": "1"}}, "env": []},
                    {"name": "sidecar", "image": "proxy", "resoures": {"limits": {"cpu": "1"}}}
                ],
                "nodeSelectr": {"disk": "ssd"},
                "terminationGracePeriodSeconds": 30
            }
        });
        let spec: StreamConsumerGroupSpec = serde_json::from_value(spec).unwrap();
        assert_eq!(
            spec.worker.unknown_template_fields,
            vec!["spec.worker.template.spec.containers[1].resoures", "spec.worker.template.spec.nodeSelectr"]
        );
        assert_eq!(spec.worker.template.spec.unwrap().containers[0].name, "w", "the known fields are read");
        let clean: StreamConsumerGroupSpec = serde_json::from_value(minimal()).unwrap();
        assert!(clean.worker.unknown_template_fields.is_empty());
        // Not part of the resource: never written back.
        assert!(serde_json::to_value(&clean).unwrap()["worker"].get("unknownTemplateFields").is_none());
    }

    /// The schema admits what Kubernetes' own schema admits; a few values
    /// pass it and still cannot be read (a port past 32 bits where an int
    /// or a string may go): such an object is refused whole by the parse,
    /// which the controller reports (`InvalidObject`) and steps past.
    #[test]
    fn a_template_the_schema_admits_may_still_not_parse() {
        let mut spec = minimal();
        spec["worker"]["template"]["spec"]["containers"][0]["livenessProbe"] =
            serde_json::json!({"httpGet": {"port": 3_000_000_000_u64}});
        assert!(serde_json::from_value::<StreamConsumerGroupSpec>(spec).is_err());
    }

    #[test]
    fn minimal_spec_takes_documented_defaults() {
        let spec: StreamConsumerGroupSpec = serde_json::from_value(minimal()).unwrap();
        assert_eq!(spec.start_id, "$");
        assert_eq!(spec.scaling, ScalingSpec::default());
        assert_eq!(spec.recovery.max_deliveries, 10);
        assert_eq!(spec.recovery.retry, RetrySpec::default());
        assert_eq!(spec.deletion_policy, DeletionPolicy::Retain);
        assert_eq!(spec.redis.mode, RedisMode::Standalone);
        assert_eq!(spec.recovery.dead_letter_stream, None);
    }

    #[test]
    fn schema_carries_cel_rules_and_immutability() {
        let crd = serde_json::to_string(&StreamConsumerGroup::crd()).unwrap();
        assert!(crd.contains("self.scaling.minReplicas <= self.scaling.maxReplicas"));
        assert!(crd.contains("spec.group is immutable"));
        assert!(crd.contains("spec.recovery.deadLetterStream must differ from spec.stream"));
        assert!(crd.contains("the minute field takes 0-59") && crd.contains("the hour field takes 0-23"));
        assert!(crd.contains("spec.stream is immutable"));
        assert!(
            crd.contains("spec.recovery.retry.initialDelayMs must not be shorter than spec.recovery.minIdleTimeMs")
        );
        // The pod template with Kubernetes' own schema: unknown fields refused.
        let crd: serde_json::Value = serde_json::from_str(&crd).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let template = &spec["properties"]["worker"]["properties"]["template"];
        assert!(template.get("x-kubernetes-preserve-unknown-fields").is_none(), "{template}");
        let container = &template["properties"]["spec"]["properties"]["containers"]["items"];
        assert!(container["properties"]["resources"].is_object() && container["properties"]["resoures"].is_null());
    }
}
