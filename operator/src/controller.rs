//! The StreamConsumerGroup controller: a pipeline of
//! resolve the Redis endpoint → ensure the group → build the owned objects
//! (pure, in `objects`) → server-side apply them → write status and Events.

use crate::conditions;
use crate::error::Error;
use crate::health::{self, HealthMemory};
use crate::metrics::Metrics;
use crate::objects::{self, ObjectSettings};
use crate::reaper;
use crate::scaling::{self, ScalingMemory};
use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::{ObjectReference, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Resource as _, ResourceExt as _};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use streamfleet_crd::{
    ConsumerPending, DeletionPolicy, Health, RecoveryStatus, RedisMode, ReplicaStatus, StreamConsumerGroup,
    StreamConsumerGroupStatus,
};
use streamfleet_streams::health::{GroupSnapshot, Lag};
use streamfleet_streams::{Connections, Endpoint, GroupCreation, Mode, StreamConnection};

/// Present while the group must be destroyed before the resource may go
/// (`deletionPolicy: Delete`).
pub const FINALIZER: &str = "streamfleet.io/delete-group";

/// Field managers, one per call site, so `managedFields` says who set what.
const MANAGER_DEPLOYMENT: &str = "streamfleet-worker-deployment";
const MANAGER_CRONJOB: &str = "streamfleet-recovery-cronjob";
const MANAGER_STATUS: &str = "streamfleet-status";

const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub recorder: Recorder,
    pub connections: Connections,
    pub settings: ObjectSettings,
    pub metrics: Arc<Metrics>,
    /// Watch caches of the objects this operator owns: no API reads per poll.
    deployments: Store<Deployment>,
    cronjobs: Store<CronJob>,
    /// Pods of the workloads this operator owns, for reaping.
    pods: Store<Pod>,
    caches_synced: Arc<AtomicBool>,
    failures: Mutex<HashMap<String, u32>>,
    memory: Mutex<HashMap<String, ResourceMemory>>,
    clock: Instant,
}

struct Stores {
    deployments: Store<Deployment>,
    cronjobs: Store<CronJob>,
    pods: Store<Pod>,
}

/// What the policies remember about one resource between polls.
#[derive(Default)]
struct ResourceMemory {
    scaling: ScalingMemory,
    health: HealthMemory,
    /// Per field manager: fingerprint of the object last applied, and the
    /// uid/generation the API server gave it.
    applied: HashMap<&'static str, (u64, String)>,
}

impl Context {
    fn new(
        client: Client,
        settings: ObjectSettings,
        metrics: Arc<Metrics>,
        instance: Option<String>,
        stores: Stores,
    ) -> Self {
        let reporter = Reporter { controller: "streamfleet".into(), instance };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            connections: Connections::default(),
            settings,
            metrics,
            deployments: stores.deployments,
            cronjobs: stores.cronjobs,
            pods: stores.pods,
            caches_synced: Arc::new(AtomicBool::new(false)),
            failures: Mutex::new(HashMap::new()),
            memory: Mutex::new(HashMap::new()),
            clock: Instant::now(),
        }
    }

    /// Backoff for the next retry of `key`: 2s, 4s, ... capped at a minute,
    /// so a broken resource is retried steadily but never hot-loops.
    fn next_backoff(&self, key: &str) -> Duration {
        let Ok(mut failures) = self.failures.lock() else {
            return MAX_BACKOFF;
        };
        let n = failures.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        (Duration::from_secs(1) * 2u32.saturating_pow((*n).min(6))).min(MAX_BACKOFF)
    }

    fn reset_backoff(&self, key: &str) {
        if let Ok(mut failures) = self.failures.lock() {
            failures.remove(key);
        }
    }

    async fn publish(&self, reference: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note.chars().take(1000).collect()),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, reference).await {
            tracing::warn!(error = %e, "publishing event");
        }
    }
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    client: Client,
    settings: ObjectSettings,
    metrics: Arc<Metrics>,
    instance: Option<String>,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let api = |c: &Client| -> (Api<Deployment>, Api<CronJob>, Api<Pod>) {
        match &namespace {
            Some(ns) => {
                (Api::namespaced(c.clone(), ns), Api::namespaced(c.clone(), ns), Api::namespaced(c.clone(), ns))
            }
            None => (Api::all(c.clone()), Api::all(c.clone()), Api::all(c.clone())),
        }
    };
    let (deployments, cronjobs, pods) = api(&client);
    // DeserializeGuard: one object that fails to parse is reported, and the
    // watch carries on for all the others.
    let scgs: Api<DeserializeGuard<StreamConsumerGroup>> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let owned = watcher::Config::default().labels("app.kubernetes.io/managed-by=streamfleet");
    // Each owned kind is watched once: the watch fills a cache the reconciler
    // reads (no GET per poll) and triggers the owner's reconcile on change.
    let (deployment_store, writer) = reflector::store();
    let deployment_events =
        reflector::reflector(writer, watcher(deployments, owned.clone())).default_backoff().touched_objects();
    let (cronjob_store, writer) = reflector::store();
    let cronjob_events =
        reflector::reflector(writer, watcher(cronjobs, owned.clone())).default_backoff().touched_objects();
    // Pods: a worker's deletion is acted on at once (reaping).
    let (pod_store, writer) = reflector::store();
    let pod_events = reflector::reflector(writer, watcher(pods, owned)).default_backoff().touched_objects();
    let stores =
        Stores { deployments: deployment_store.clone(), cronjobs: cronjob_store.clone(), pods: pod_store.clone() };
    let ctx = Arc::new(Context::new(client, settings, metrics, instance, stores));
    let synced = ctx.caches_synced.clone();
    tokio::spawn(async move {
        // Reaping needs complete pod knowledge; applies need the owned caches.
        let ready = pod_store.wait_until_ready().await.is_ok()
            && deployment_store.wait_until_ready().await.is_ok()
            && cronjob_store.wait_until_ready().await.is_ok();
        synced.store(ready, Ordering::SeqCst);
    });
    Controller::new(scgs, watcher::Config::default().any_semantic())
        .owns_stream(deployment_events)
        .owns_stream(cronjob_events)
        .watches_stream(pod_events, |pod: Pod| {
            let name = pod.labels().get(objects::GROUP_LABEL)?.clone();
            Some(ObjectRef::new(&name).within(&pod.namespace()?))
        })
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((obj, _)) => tracing::debug!(object = %obj, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile failed"),
            }
        })
        .await;
}

fn key(scg: &StreamConsumerGroup) -> String {
    format!("{}/{}", scg.namespace().unwrap_or_default(), scg.name_any())
}

fn error_policy(obj: Arc<DeserializeGuard<StreamConsumerGroup>>, error: &Error, ctx: Arc<Context>) -> Action {
    let Ok(scg) = &obj.0 else {
        return Action::await_change();
    };
    ctx.metrics.failed(error.reason());
    let backoff = ctx.next_backoff(&key(scg));
    tracing::warn!(resource = %key(scg), reason = error.reason(), error = %error, retry_in = ?backoff, "reconcile failed");
    Action::requeue(backoff)
}

async fn reconcile(obj: Arc<DeserializeGuard<StreamConsumerGroup>>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = reconcile_guarded(&obj, &ctx).await;
    ctx.metrics.reconciled(started.elapsed());
    result
}

async fn reconcile_guarded(obj: &DeserializeGuard<StreamConsumerGroup>, ctx: &Arc<Context>) -> Result<Action, Error> {
    let scg = match &obj.0 {
        Ok(scg) => scg,
        Err(invalid) => {
            let reference = ObjectReference {
                api_version: Some("streamfleet.io/v1alpha1".into()),
                kind: Some("StreamConsumerGroup".into()),
                name: invalid.metadata.name.clone(),
                namespace: invalid.metadata.namespace.clone(),
                uid: invalid.metadata.uid.clone(),
                ..ObjectReference::default()
            };
            ctx.publish(&reference, EventType::Warning, "InvalidObject", "Reconcile", invalid.error.clone()).await;
            return Ok(Action::await_change());
        }
    };
    if scg.metadata.deletion_timestamp.is_some() {
        return cleanup(scg, ctx).await;
    }
    // Decide nothing on a half-filled cache: a missing Deployment would read
    // as zero replicas, a missing pod as a dead consumer.
    if !ctx.caches_synced.load(Ordering::SeqCst) {
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    sync_finalizer(scg, ctx).await?;
    match apply(scg, ctx).await {
        Ok(applied) => {
            ctx.reset_backoff(&key(scg));
            write_status(scg, ctx, success_status(scg, &applied, &now())).await?;
            let poll = u64::try_from(scg.spec.scaling.poll_interval_seconds.max(1)).unwrap_or(10);
            Ok(Action::requeue(Duration::from_secs(poll)))
        }
        Err(e) => {
            if e.is_users() {
                ctx.publish(&scg.object_ref(&()), EventType::Warning, e.reason(), "Reconcile", e.to_string()).await;
                write_status(scg, ctx, failure_status(scg, &e, &now())).await?;
            }
            Err(e)
        }
    }
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// What a successful apply observed and decided.
pub struct Applied {
    pub last_recovery: Option<RecoveryStatus>,
    pub retention: Option<streamfleet_streams::retention::Retention>,
    pub desired_replicas: i32,
    pub available_replicas: i32,
    pub snapshot: Option<GroupSnapshot>,
    pub health: Health,
    pub health_message: String,
}

async fn apply(scg: &StreamConsumerGroup, ctx: &Context) -> Result<Applied, Error> {
    let ns = scg.namespace().unwrap_or_default();
    let spec = &scg.spec;
    let endpoint = resolve_endpoint(&ctx.client, scg).await?;
    let mut conn = ctx.connections.get(&endpoint).await?;
    let created = streamfleet_streams::ensure_group(&mut conn, &spec.stream, &spec.group, &spec.start_id).await?;
    if created == GroupCreation::Created {
        let note = format!("created group {:?} on stream {:?} at {}", spec.group, spec.stream, spec.start_id);
        ctx.publish(&scg.object_ref(&()), EventType::Normal, "GroupCreated", "EnsureGroup", note).await;
    }

    let dead_letter_stream = objects::dead_letter_stream(scg);
    let snapshot =
        match streamfleet_streams::health::inspect(&mut conn, &spec.stream, &spec.group, &dead_letter_stream).await {
            Ok(snapshot) => snapshot,
            Err(e) => {
                tracing::warn!(resource = %key(scg), error = %e, "inspecting the group");
                None
            }
        };
    if let Some(snapshot) = &snapshot {
        reap(scg, ctx, &mut conn, snapshot).await;
    }
    let last_recovery = match streamfleet_streams::recovery::read_report(&mut conn, &spec.stream, &spec.group).await {
        Ok(report) => report,
        Err(e) => {
            tracing::warn!(resource = %key(scg), error = %e, "reading the recovery report");
            None
        }
    };
    let last_recovery = last_recovery.map(recovery_status);
    announce_recovery(scg, ctx, last_recovery.as_ref()).await;
    let retention = match &spec.retention {
        Some(r) => {
            let max_length = r.max_length.and_then(|n| u64::try_from(n).ok());
            let max_age_ms = r.max_age_seconds.and_then(|s| u64::try_from(s).ok()).map(|s| s.saturating_mul(1000));
            let now_ms = streamfleet_streams::recovery::now_ms();
            match streamfleet_streams::retention::enforce(&mut conn, &spec.stream, max_length, max_age_ms, now_ms).await
            {
                Ok(r) => {
                    if r.trimmed > 0 {
                        tracing::info!(resource = %key(scg), trimmed = r.trimmed, floor = ?r.floor, "trimmed the stream");
                    }
                    Some(r)
                }
                Err(e) => {
                    tracing::warn!(resource = %key(scg), error = %e, "retention");
                    None
                }
            }
        }
        None => None,
    };

    let name = objects::worker_deployment_name(scg);
    let live_deployment = ctx.deployments.get(&ObjectRef::new(&name).within(&ns));
    let current = live_deployment.as_ref().and_then(|d| d.spec.as_ref().and_then(|s| s.replicas));
    let now = ctx.clock.elapsed();
    let (decision, (health, health_message)) = {
        let mut memory = ctx.memory.lock().map_err(|_| Error::InvalidSpec("internal: poisoned lock".into()))?;
        let m = memory.entry(key(scg)).or_default();
        let observed = snapshot.as_ref().map(|s| (s.lag, s.pending));
        let decision = scaling::decide(&spec.scaling, current.unwrap_or(0), observed, now, &mut m.scaling);
        if let Some(s) = &snapshot {
            m.health.record(s, now);
        }
        let health = health::classify(&health::Inputs {
            snapshot: snapshot.as_ref(),
            memory: &m.health,
            min_idle: Duration::from_millis(u64::try_from(spec.recovery.min_idle_time_ms).unwrap_or(0)),
            max_deliveries: u64::try_from(spec.recovery.max_deliveries).unwrap_or(1),
            target_per_replica: u64::try_from(spec.scaling.target_per_replica).unwrap_or(1),
            replicas: decision.replicas,
            payload_lost_recently: payload_lost_recently(last_recovery.as_ref()),
        });
        (decision, health)
    };

    let deployment = objects::worker_deployment(scg, decision.replicas)?;
    let applied = apply_owned(ctx, scg, &name, MANAGER_DEPLOYMENT, &deployment, live_deployment).await?;
    if let Some(current) = current.filter(|c| *c != decision.replicas) {
        let note = format!("workers {current} -> {}: {}", decision.replicas, decision.reason);
        ctx.publish(&scg.object_ref(&()), EventType::Normal, "Scaled", "Scale", note).await;
    }
    let cronjob = objects::recovery_cronjob(scg, &ctx.settings)?;
    let cronjob_name = objects::recovery_cronjob_name(scg);
    let live_cronjob = ctx.cronjobs.get(&ObjectRef::new(&cronjob_name).within(&ns));
    apply_owned(ctx, scg, &cronjob_name, MANAGER_CRONJOB, &cronjob, live_cronjob).await?;
    Ok(Applied {
        last_recovery,
        retention,
        desired_replicas: decision.replicas,
        available_replicas: applied.status.as_ref().and_then(|s| s.available_replicas).unwrap_or(0),
        snapshot,
        health,
        health_message,
    })
}

fn recovery_status(r: streamfleet_streams::recovery::RecoveryReport) -> RecoveryStatus {
    let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let ms = i64::try_from(r.finished_at_ms).unwrap_or(0);
    RecoveryStatus {
        time: Time(k8s_openapi::jiff::Timestamp::from_millisecond(ms).unwrap_or_default()),
        claimed: int(r.claimed),
        dead_lettered: int(r.dead_lettered),
        payload_lost: int(r.payload_lost),
    }
}

/// One Event per new recovery run: a Warning when it lost payloads or
/// dead-lettered entries (defect signals), Normal otherwise.
async fn announce_recovery(scg: &StreamConsumerGroup, ctx: &Context, latest: Option<&RecoveryStatus>) {
    let Some(latest) = latest else { return };
    let previous = scg.status.as_ref().and_then(|s| s.last_recovery.as_ref());
    if previous.is_some_and(|p| p.time == latest.time) {
        return;
    }
    let note = format!(
        "recovery claimed {}, dead-lettered {}, found {} pending entries without payload",
        latest.claimed, latest.dead_lettered, latest.payload_lost
    );
    let (kind, reason) = match (latest.payload_lost > 0, latest.dead_lettered > 0) {
        (true, _) => (EventType::Warning, "PayloadLost"),
        (false, true) => (EventType::Warning, "DeadLettered"),
        _ => (EventType::Normal, "RecoveryCompleted"),
    };
    ctx.publish(&scg.object_ref(&()), kind, reason, "Recover", note).await;
}

/// Server-side applies an owned object, unless it is exactly what this
/// operator last applied and the live object (from the watch cache) is the
/// same object with the same spec generation: a poll where nothing changed
/// makes no API write. A repair (someone edited the spec, or deleted the
/// object) changes the generation or uid and is applied again.
async fn apply_owned<K>(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    name: &str,
    manager: &'static str,
    desired: &K,
    live: Option<Arc<K>>,
) -> Result<K, Error>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(desired)?.hash(&mut hasher);
    let fingerprint = hasher.finish();
    // uid + generation: the same object, and nobody changed its spec since
    // (status updates by other controllers do not count).
    let identity = |meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        format!("{}/{}", meta.uid.as_deref().unwrap_or(""), meta.generation.unwrap_or(0))
    };
    let live_identity = live.as_ref().map(|l| identity(l.meta()));
    let unchanged = {
        let memory = ctx.memory.lock().map_err(|_| Error::InvalidSpec("internal: poisoned lock".into()))?;
        memory
            .get(&key(scg))
            .and_then(|m| m.applied.get(manager))
            .is_some_and(|(f, id)| *f == fingerprint && live_identity.as_deref() == Some(id.as_str()))
    };
    if let (true, Some(live)) = (unchanged, live) {
        return Ok((*live).clone());
    }
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &scg.namespace().unwrap_or_default());
    let applied = api.patch(name, &PatchParams::apply(manager).force(), &Patch::Apply(desired)).await?;
    ctx.metrics.api_write(manager);
    if let Ok(mut memory) = ctx.memory.lock() {
        memory.entry(key(scg)).or_default().applied.insert(manager, (fingerprint, identity(applied.meta())));
    }
    Ok(applied)
}

/// Whether the last recovery (within the hour) found payloads gone.
fn payload_lost_recently(last: Option<&RecoveryStatus>) -> bool {
    let Some(last) = last else { return false };
    let age = k8s_openapi::jiff::Timestamp::now().duration_since(last.time.0);
    last.payload_lost > 0 && age < k8s_openapi::jiff::SignedDuration::from_hours(1)
}

/// Releases the entries of consumers whose pods are gone, and deletes those
/// consumers once they own nothing (see `reaper`).
async fn reap(scg: &StreamConsumerGroup, ctx: &Context, conn: &mut StreamConnection, snapshot: &GroupSnapshot) {
    let ns = scg.namespace().unwrap_or_default();
    let live: HashSet<String> = ctx
        .pods
        .state()
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns.as_str()))
        .map(|p| p.name_any())
        .collect();
    let prefixes =
        [format!("{}-", objects::worker_deployment_name(scg)), format!("{}-", objects::recovery_cronjob_name(scg))];
    let spec = &scg.spec;
    let min_idle = Duration::from_millis(u64::try_from(spec.recovery.min_idle_time_ms).unwrap_or(0));
    let batch = usize::try_from(spec.recovery.batch_size).unwrap_or(100);
    for dead in reaper::dead_consumers(&snapshot.consumers, &live, &prefixes) {
        let result = if dead.pending > 0 {
            streamfleet_streams::consumers::release_pending(
                conn,
                &spec.stream,
                &spec.group,
                &dead.name,
                min_idle,
                batch,
            )
            .await
            .map(|n| {
                (n > 0).then(|| {
                    (
                        "DeadConsumerReleased",
                        format!("released {n} pending entries of {} (pod gone) for claiming", dead.name),
                    )
                })
            })
        } else {
            streamfleet_streams::consumers::delete_if_empty(conn, &spec.stream, &spec.group, &dead.name).await.map(
                |deleted| {
                    deleted.then(|| {
                        ("DeadConsumerDeleted", format!("deleted consumer {} (pod gone, owned nothing)", dead.name))
                    })
                },
            )
        };
        match result {
            Ok(Some((reason, note))) => {
                tracing::info!(resource = %key(scg), consumer = %dead.name, "{note}");
                ctx.publish(&scg.object_ref(&()), EventType::Normal, reason, "Reap", note).await;
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(resource = %key(scg), consumer = %dead.name, error = %e, "reaping"),
        }
    }
}

/// Reads the Redis URL (and CA) the spec references.
async fn resolve_endpoint(client: &Client, scg: &StreamConsumerGroup) -> Result<Endpoint, Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &scg.namespace().unwrap_or_default());
    let read = |r: &streamfleet_crd::SecretKeyRef| {
        let (secrets, r) = (secrets.clone(), r.clone());
        async move {
            let secret =
                secrets.get_opt(&r.name).await?.ok_or_else(|| Error::SecretNotFound { name: r.name.clone() })?;
            secret
                .data
                .and_then(|mut d| d.remove(&r.key))
                .map(|v| v.0)
                .ok_or(Error::SecretKeyNotFound { name: r.name, key: r.key })
        }
    };
    let redis = &scg.spec.redis;
    let url = String::from_utf8(read(&redis.url_secret_ref).await?)
        .map_err(|_| Error::InvalidSpec("spec.redis.urlSecretRef: the URL is not UTF-8".into()))?;
    let ca_pem = match redis.tls.as_ref().and_then(|t| t.ca_secret_ref.as_ref()) {
        Some(r) => Some(read(r).await?),
        None => None,
    };
    let mode = match redis.mode {
        RedisMode::Standalone => Mode::Standalone,
        RedisMode::Cluster => Mode::Cluster,
    };
    Ok(Endpoint { url: url.trim().to_string(), mode, ca_pem })
}

fn success_status(scg: &StreamConsumerGroup, applied: &Applied, now: &Time) -> StreamConsumerGroupStatus {
    let mut status = scg.status.clone().unwrap_or_default();
    let generation = scg.metadata.generation;
    status.observed_generation = generation;
    let group_msg = format!("group {:?} exists on stream {:?}", scg.spec.group, scg.spec.stream);
    conditions::set(&mut status.conditions, conditions::GROUP_READY, true, "GroupExists", &group_msg, generation, now);
    let workers_ok = applied.desired_replicas == 0 || applied.available_replicas > 0;
    let (reason, msg) = if workers_ok {
        (
            "WorkersAvailable",
            format!("{} of {} workers available", applied.available_replicas, applied.desired_replicas),
        )
    } else {
        ("NoWorkerAvailable", format!("0 of {} workers available", applied.desired_replicas))
    };
    conditions::set(&mut status.conditions, conditions::WORKERS_AVAILABLE, workers_ok, reason, &msg, generation, now);
    let (reason, msg) =
        if workers_ok { ("Reconciled", "group ready and workers available".to_string()) } else { (reason, msg) };
    conditions::set(&mut status.conditions, conditions::READY, workers_ok, reason, &msg, generation, now);
    let degraded = applied.health != Health::Healthy;
    let degraded_reason = match (applied.health, applied.snapshot.as_ref().map(|s| s.lag)) {
        (Health::Unknown, Some(Lag::Unknown)) => "LagUnknown".to_string(),
        (Health::Unknown, _) => "GroupNotInspected".to_string(),
        (h, _) => format!("{h:?}"),
    };
    conditions::set(
        &mut status.conditions,
        conditions::DEGRADED,
        degraded,
        &degraded_reason,
        &applied.health_message,
        generation,
        now,
    );
    if let Some(r) = &applied.retention {
        let describe =
            |id: Option<streamfleet_streams::retention::StreamId>| id.map_or("none".to_string(), |i| i.to_string());
        let message = if r.blocked {
            format!(
                "retention wants to trim below {}, held at {}: a group still has entries pending or undelivered there",
                describe(r.target),
                describe(r.floor)
            )
        } else {
            format!("trimming to {} (floor {})", describe(r.target), describe(r.floor))
        };
        let reason = if r.blocked { "HeldAtSafeFloor" } else { "WithinSafeFloor" };
        conditions::set(
            &mut status.conditions,
            conditions::RETENTION_BLOCKED,
            r.blocked,
            reason,
            &message,
            generation,
            now,
        );
    }
    status.health = Some(applied.health);
    if applied.last_recovery.is_some() {
        status.last_recovery = applied.last_recovery.clone();
    }
    status.replicas = Some(ReplicaStatus {
        desired: applied.desired_replicas,
        current: applied.available_replicas,
        summary: format!("{}/{}", applied.available_replicas, applied.desired_replicas),
    });
    if let Some(s) = &applied.snapshot {
        let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        status.lag = s.lag.floor().map(int);
        status.pending = Some(int(s.pending));
        let has_pending = s.pending > 0;
        status.oldest_pending_idle_seconds = s.oldest_pending_idle_ms.filter(|_| has_pending).map(|ms| int(ms / 1000));
        status.max_delivery_count = s.max_delivery_count.filter(|_| has_pending).map(int);
        status.stream_length = Some(int(s.stream_length));
        status.dead_letter_length = Some(int(s.dead_letter_length));
        status.consumers = Some(int(u64::try_from(s.consumers.len()).unwrap_or(u64::MAX)));
        let mut owning: Vec<ConsumerPending> = s
            .consumers
            .iter()
            .filter(|c| c.pending > 0)
            .map(|c| ConsumerPending { name: c.name.clone(), pending: int(c.pending) })
            .collect();
        owning.sort_by(|a, b| b.pending.cmp(&a.pending).then_with(|| a.name.cmp(&b.name)));
        owning.truncate(10);
        status.consumer_pending = owning;
    }
    status
}

fn failure_status(scg: &StreamConsumerGroup, error: &Error, now: &Time) -> StreamConsumerGroupStatus {
    let mut status = scg.status.clone().unwrap_or_default();
    let generation = scg.metadata.generation;
    status.observed_generation = generation;
    let message = error.to_string();
    conditions::set(&mut status.conditions, conditions::GROUP_READY, false, error.reason(), &message, generation, now);
    conditions::set(&mut status.conditions, conditions::READY, false, error.reason(), &message, generation, now);
    status
}

/// Writes the status only when it differs from what is stored.
async fn write_status(
    scg: &StreamConsumerGroup,
    ctx: &Context,
    status: StreamConsumerGroupStatus,
) -> Result<(), Error> {
    ctx.metrics.observe(&scg.namespace().unwrap_or_default(), &scg.name_any(), &status);
    if scg.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let api: Api<StreamConsumerGroup> = Api::namespaced(ctx.client.clone(), &scg.namespace().unwrap_or_default());
    let patch = json!({
        "apiVersion": "streamfleet.io/v1alpha1",
        "kind": "StreamConsumerGroup",
        "status": status,
    });
    api.patch_status(&scg.name_any(), &PatchParams::apply(MANAGER_STATUS).force(), &Patch::Apply(&patch)).await?;
    ctx.metrics.api_write(MANAGER_STATUS);
    Ok(())
}

/// Keeps our finalizer present exactly while the policy is `Delete`.
async fn sync_finalizer(scg: &StreamConsumerGroup, ctx: &Context) -> Result<(), Error> {
    let want = scg.spec.deletion_policy == DeletionPolicy::Delete;
    let has = scg.finalizers().iter().any(|f| f == FINALIZER);
    if want == has {
        return Ok(());
    }
    let mut finalizers: Vec<String> = scg.finalizers().iter().filter(|f| *f != FINALIZER).cloned().collect();
    if want {
        finalizers.push(FINALIZER.into());
    }
    set_finalizers(scg, ctx, finalizers).await
}

async fn set_finalizers(scg: &StreamConsumerGroup, ctx: &Context, finalizers: Vec<String>) -> Result<(), Error> {
    let api: Api<StreamConsumerGroup> = Api::namespaced(ctx.client.clone(), &scg.namespace().unwrap_or_default());
    // The resourceVersion makes this a compare-and-swap against concurrent edits.
    let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": scg.resource_version()}});
    api.patch(&scg.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    ctx.metrics.api_write("finalizer");
    Ok(())
}

/// Deletion: with `Delete`, destroy the group, then let the resource go.
/// Owned objects are removed by the garbage collector through owner references.
async fn cleanup(scg: &StreamConsumerGroup, ctx: &Context) -> Result<Action, Error> {
    if !scg.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    if scg.spec.deletion_policy == DeletionPolicy::Delete {
        let destroyed = async {
            let endpoint = resolve_endpoint(&ctx.client, scg).await?;
            let mut conn = ctx.connections.get(&endpoint).await?;
            Ok::<_, Error>(streamfleet_streams::destroy_group(&mut conn, &scg.spec.stream, &scg.spec.group).await?)
        }
        .await;
        match destroyed {
            Ok(existed) => {
                tracing::info!(resource = %key(scg), existed, "consumer group destroyed");
            }
            Err(e) => {
                ctx.publish(&scg.object_ref(&()), EventType::Warning, e.reason(), "DestroyGroup", e.to_string()).await;
                return Err(e);
            }
        }
    }
    let finalizers = scg.finalizers().iter().filter(|f| *f != FINALIZER).cloned().collect();
    set_finalizers(scg, ctx, finalizers).await?;
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scg() -> StreamConsumerGroup {
        serde_json::from_value(json!({
            "apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
            "metadata": {"name": "orders", "namespace": "shop", "generation": 4},
            "spec": {"redis": {"urlSecretRef": {"name": "r", "key": "url"}}, "stream": "s", "group": "g",
                     "worker": {"template": {"spec": {"containers": [{"name": "w"}]}}}}
        }))
        .unwrap()
    }

    fn applied(desired: i32, available: i32) -> Applied {
        Applied {
            last_recovery: None,
            retention: None,
            desired_replicas: desired,
            available_replicas: available,
            snapshot: None,
            health: Health::Unknown,
            health_message: "not inspected".into(),
        }
    }

    fn at(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    #[test]
    fn success_is_ready_only_with_an_available_worker() {
        let s = success_status(&scg(), &applied(2, 0), &at(1));
        assert_eq!(s.observed_generation, Some(4));
        assert!(conditions::is_true(&s.conditions, conditions::GROUP_READY));
        assert!(!conditions::is_true(&s.conditions, conditions::READY));
        let s = success_status(&scg(), &applied(2, 1), &at(1));
        assert!(conditions::is_true(&s.conditions, conditions::READY));
        assert_eq!(s.replicas.unwrap().summary, "1/2");
    }

    #[test]
    fn failure_names_the_reason_and_recomputing_it_is_a_no_op() {
        let mut obj = scg();
        let e = Error::SecretNotFound { name: "r".into() };
        let first = failure_status(&obj, &e, &at(1));
        let ready = first.conditions.iter().find(|c| c.type_ == conditions::READY).unwrap();
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "SecretNotFound"));
        obj.status = Some(first.clone());
        // Same failure later: identical status, so nothing is written.
        assert_eq!(failure_status(&obj, &e, &at(99)), first);
    }
}
