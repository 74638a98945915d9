//! The StreamConsumerGroup controller. Each reconcile is one pass of named
//! steps, so data flows one way:
//!
//! 1. [`validate`]: the raw spec becomes a typed, checked [`validate::ValidSpec`];
//! 2. [`observe`]: reads only (the Secret, one Redis snapshot, watch caches);
//! 3. [`decide`]: a pure function returning a [`decide::Plan`];
//! 4. [`act`]: Redis writes, server-side applies, Events;
//! 5. [`status`]: the status, built purely and written only when it changed.
//!
//! [`decide`]'s policies are pure modules of their own: [`scaling`],
//! [`health`], [`reaper`], [`throughput`]. [`finalizer`] handles deletion.
//! This file wires the steps and the watches.

pub mod act;
#[cfg(test)]
mod api_tests;
pub mod claimant_index;
pub mod decide;
pub mod finalizer;
#[cfg(test)]
mod fixtures;
pub mod health;
pub mod observe;
pub mod reaper;
pub mod recovery_runs;
pub mod scaling;
pub mod secrets;
pub mod slim;
pub mod status;
pub mod throughput;
pub mod validate;

use crate::error::Error;
use crate::events::{EventPublisher, EventType};
use crate::metrics::Metrics;
use crate::objects::{self, ObjectSettings};
use claimant_index::key;
use decide::{Plan, PolicyMemory};
use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Resource as _, ResourceExt as _};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_streams::{Connections, Endpoint, StreamConnection};
use tracing::Instrument as _;

pub use finalizer::FINALIZER;

const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// After creating a missing group, look again this soon.
const AFTER_GROUP_CREATED: Duration = Duration::from_millis(200);

/// How soon a resource is looked at again while a consumer without a pod
/// may become releasable (`Convergence::reap_soon`): its entries wait no
/// longer than this past its silence.
const REAP_SOON: Duration = Duration::from_millis(500);

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub events: EventPublisher,
    pub connections: Connections,
    pub settings: ObjectSettings,
    pub metrics: Arc<Metrics>,
    /// Watch caches of the objects this operator owns: no API reads per poll.
    deployments: Store<Deployment>,
    cronjobs: Store<CronJob>,
    /// The recovery runs' Jobs: how each ended (`RecoveryFailing`).
    jobs: Store<Job>,
    /// Pods of the workloads this operator owns, for reaping.
    pods: Store<Pod>,
    /// Every StreamConsumerGroup this operator serves (the controller's own
    /// cache), to find two that name the same group.
    resources: Store<DeserializeGuard<StreamConsumerGroup>>,
    /// Which of them name which stream and group.
    claimant_index: Arc<Mutex<claimant_index::ClaimantIndex>>,
    /// The referenced Secrets, read only when they change.
    pub(crate) secrets: secrets::SecretCache,
    /// The Redis endpoint each resource last resolved to.
    endpoints: Mutex<HashMap<String, Endpoint>>,
    caches_synced: Arc<AtomicBool>,
    failures: Mutex<HashMap<String, u32>>,
    memory: Memory,
    relisted: Relisted,
    clock: Instant,
}

struct Stores {
    deployments: Store<Deployment>,
    cronjobs: Store<CronJob>,
    jobs: Store<Job>,
    pods: Store<Pod>,
    resources: Store<DeserializeGuard<StreamConsumerGroup>>,
    claimant_index: Arc<Mutex<claimant_index::ClaimantIndex>>,
    secrets: Store<secrets::SecretMeta>,
}

/// What a field manager last applied to one owned object.
struct Applied {
    /// Of the object as applied.
    fingerprint: u64,
    /// The uid/generation the API server gave it.
    identity: String,
    /// Its available replicas in the apply's reply.
    replicas: i32,
    at: Instant,
}

impl Applied {
    fn new(fingerprint: u64, identity: String, replicas: i32) -> Self {
        Self { fingerprint, identity, replicas, at: Instant::now() }
    }
}

/// How long an applied object missing from the watch cache is taken as not
/// yet shown rather than deleted. Under load the cache is seconds behind:
/// the reconcile the Deployment's own event wakes finds no CronJob there
/// yet. A deletion the watch reports is forgotten at once, and one a relist
/// may have hidden makes the next miss an apply (`OwnedWatch`).
const CACHE_CATCH_UP: Duration = Duration::from_secs(10);

/// The shared memory of every resource, by key.
type Memory = Arc<Mutex<HashMap<String, ResourceMemory>>>;

/// When each owned kind's watch last (re)listed, by field manager: a
/// relist drops a deleted object from the cache without a Delete event.
type Relisted = Arc<Mutex<HashMap<&'static str, Instant>>>;

/// What the controller remembers about one resource between polls.
#[derive(Default)]
struct ResourceMemory {
    policy: PolicyMemory,
    /// Per field manager: the object it last applied.
    applied: HashMap<&'static str, Applied>,
    /// A digest of the status last written, and the resource version the
    /// resource had in the cache when it was: while the cache still shows
    /// that version, it has not seen the write yet. (A digest: a copy of
    /// every status was a large part of the memory of a big fleet.)
    status: Option<(String, u64)>,
}

impl Context {
    fn new(
        client: Client,
        settings: ObjectSettings,
        metrics: Arc<Metrics>,
        instance: Option<String>,
        stores: Stores,
        memory: Memory,
        relisted: Relisted,
    ) -> Self {
        Self {
            events: EventPublisher::new(client.clone(), "streamfleet", instance),
            client,
            connections: Connections::default(),
            settings,
            metrics,
            deployments: stores.deployments,
            cronjobs: stores.cronjobs,
            jobs: stores.jobs,
            pods: stores.pods,
            resources: stores.resources,
            claimant_index: stores.claimant_index,
            secrets: secrets::SecretCache::new(stores.secrets),
            endpoints: Mutex::new(HashMap::new()),
            caches_synced: Arc::new(AtomicBool::new(false)),
            failures: Mutex::new(HashMap::new()),
            memory,
            relisted,
            clock: Instant::now(),
        }
    }

    /// A context whose caches are empty and stay so, over `client`: for
    /// tests of the steps' API requests against a mocked API server.
    #[cfg(test)]
    fn for_tests(client: Client) -> Self {
        let stores = Stores {
            deployments: reflector::store().0,
            cronjobs: reflector::store().0,
            jobs: reflector::store().0,
            pods: reflector::store().0,
            resources: reflector::store().0,
            claimant_index: Arc::default(),
            secrets: reflector::store().0,
        };
        Self::new(
            client,
            ObjectSettings::default(),
            Arc::new(Metrics::default()),
            None,
            stores,
            Memory::default(),
            Relisted::default(),
        )
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

    /// Health set outside `decide` (a failed pass, a conflict): the next
    /// transition is announced from it.
    fn health_written(&self, scg: &StreamConsumerGroup, health: streamfleet_crd::Health) {
        let _ = self.with_policy(&key(scg), |memory| memory.health_announced = Some(health));
    }

    /// Runs `f` on the policies' memory of `key`.
    fn with_policy<T>(&self, key: &str, f: impl FnOnce(&mut PolicyMemory) -> T) -> Result<T, Error> {
        let mut memory = self.memory.lock().map_err(|_| Error::Internal("poisoned memory lock".into()))?;
        Ok(f(&mut memory.entry(key.to_string()).or_default().policy))
    }

    /// Whether `manager` last applied exactly `fingerprint` to the object
    /// that is still live as `live_identity`, or applied it a moment ago,
    /// after the watch last relisted, and the cache has not shown it yet
    /// (`None`). If so, the object's replicas as the apply's reply gave them.
    fn applied_unchanged(
        &self,
        key: &str,
        manager: &str,
        fingerprint: u64,
        live_identity: Option<&str>,
    ) -> Option<i32> {
        let relisted = self.relisted.lock().ok()?.get(manager).copied();
        let memory = self.memory.lock().ok()?;
        let applied = memory.get(key)?.applied.get(manager)?;
        let unchanged = applied.fingerprint == fingerprint
            && match live_identity {
                Some(live) => live == applied.identity,
                None => applied.at.elapsed() < CACHE_CATCH_UP && relisted.is_none_or(|at| at < applied.at),
            };
        unchanged.then_some(applied.replicas)
    }

    fn remember_applied(&self, key: &str, manager: &'static str, applied: Applied) {
        if let Ok(mut memory) = self.memory.lock() {
            memory.entry(key.to_string()).or_default().applied.insert(manager, applied);
        }
    }

    /// Whether `status` was just written and the cache (still at
    /// `cached_version`) has only not caught up with it.
    pub(crate) fn status_written(
        &self,
        key: &str,
        cached_version: &str,
        status: &streamfleet_crd::StreamConsumerGroupStatus,
    ) -> bool {
        let Ok(memory) = self.memory.lock() else { return false };
        memory
            .get(key)
            .and_then(|m| m.status.as_ref())
            .is_some_and(|(version, written)| version == cached_version && *written == status_digest(status))
    }

    pub(crate) fn remember_status(
        &self,
        key: &str,
        cached_version: String,
        status: &streamfleet_crd::StreamConsumerGroupStatus,
    ) {
        if let Ok(mut memory) = self.memory.lock() {
            memory.entry(key.to_string()).or_default().status = Some((cached_version, status_digest(status)));
        }
    }

    /// Drops what is kept about a resource that is going away.
    fn forget(&self, scg: &StreamConsumerGroup) {
        self.forget_key(&scg.namespace().unwrap_or_default(), &scg.name_any());
    }

    fn forget_key(&self, namespace: &str, name: &str) {
        let key = claimant_index::named(namespace, name);
        if let Ok(mut memory) = self.memory.lock() {
            memory.remove(&key);
        }
        if let Ok(mut endpoints) = self.endpoints.lock() {
            endpoints.remove(&key);
        }
        self.reset_backoff(&key);
        self.metrics.forget(namespace, name);
    }

    /// Resources gone from the cache (deleted without a finalizer to see it)
    /// are forgotten: their memory, endpoint, backoff and metric series.
    fn prune_vanished(&self) {
        let live: std::collections::HashSet<String> =
            self.resources.state().iter().filter_map(|r| r.0.as_ref().ok().map(key)).collect();
        let mut known: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
        known.extend(self.memory.lock().map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default());
        known.extend(self.endpoints.lock().map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default());
        known.extend(self.failures.lock().map(|m| m.keys().cloned().collect::<Vec<_>>()).unwrap_or_default());
        for gone in known.iter().filter(|k| !live.contains(*k)) {
            if let Some((namespace, name)) = gone.split_once('/') {
                self.forget_key(namespace, name);
            }
        }
        self.secrets.prune();
    }

    /// Whether the resource cache holds `scg` itself: until it does, it is
    /// not complete enough to tell who else claims the group.
    fn knows(&self, scg: &StreamConsumerGroup) -> bool {
        let reference = ObjectRef::new(&scg.name_any()).within(&scg.namespace().unwrap_or_default());
        self.resources.get(&reference).is_some()
    }

    fn remember_endpoint(&self, scg: &StreamConsumerGroup, endpoint: &Endpoint) {
        if let Ok(mut endpoints) = self.endpoints.lock() {
            endpoints.insert(key(scg), endpoint.clone());
        }
    }

    /// The other resources this operator serves that name the same stream
    /// and group on the same Redis (or on a Redis not yet known).
    pub(crate) fn claimants(&self, scg: &StreamConsumerGroup, endpoint: &Endpoint) -> Vec<decide::Claimant> {
        let me = key(scg);
        let named = self.claimant_index.lock().map(|index| index.naming_the_group_of(scg)).unwrap_or_default();
        let Ok(endpoints) = self.endpoints.lock() else { return Vec::new() };
        named
            .iter()
            .filter(|k| **k != me)
            .filter_map(|k| {
                let (namespace, name) = k.split_once('/')?;
                self.resources.get(&ObjectRef::new(name).within(namespace))
            })
            .filter_map(|r| r.0.as_ref().ok().cloned())
            // The cache is at least as new as the index: check again.
            .filter(|o| o.spec.stream == scg.spec.stream && o.spec.group == scg.spec.group)
            .filter(|o| o.metadata.deletion_timestamp.is_none())
            .filter_map(|o| {
                let known = endpoints.get(&key(&o));
                known.is_none_or(|e| e.same_server(endpoint)).then(|| decide::Claimant {
                    key: key(&o),
                    created: o.metadata.creation_timestamp.clone(),
                    same_endpoint_known: known.is_some(),
                })
            })
            .collect()
    }

    async fn publish(&self, reference: &ObjectReference, type_: EventType, reason: &str, action: &str, note: String) {
        if let Err(e) = self.events.publish(reference, type_, reason, action, &note).await {
            tracing::warn!(error = %e, "publishing event");
        }
    }
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    client: Client,
    concurrency: u16,
    settings: ObjectSettings,
    metrics: Arc<Metrics>,
    instance: Option<String>,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    // DeserializeGuard: one object that fails to parse is reported, and the
    // watch carries on for all the others.
    let scgs: Api<DeserializeGuard<StreamConsumerGroup>> = scoped_api(&client, namespace.as_deref());
    let owned = watcher::Config::default().labels("app.kubernetes.io/managed-by=streamfleet");
    // Each owned kind is watched once: the watch fills a cache the reconciler
    // reads (no GET per poll) and triggers the owner's reconcile on change.
    let (memory, relisted) = (Memory::default(), Relisted::default());
    let (deployments, deployment_events) = cached_watch::<Deployment>(
        &client,
        namespace.as_deref(),
        &owned,
        slim::deployment,
        OwnedWatch::new(&memory, &relisted, act::MANAGER_DEPLOYMENT).hook(),
    );
    let (cronjobs, cronjob_events) = cached_watch::<CronJob>(
        &client,
        namespace.as_deref(),
        &owned,
        slim::cronjob,
        OwnedWatch::new(&memory, &relisted, act::MANAGER_CRONJOB).hook(),
    );
    // The recovery runs' Jobs (the CronJob's, labelled like it): a run that
    // ends is looked at at once.
    let (jobs, job_events) = cached_watch::<Job>(&client, namespace.as_deref(), &owned, slim::job, |_| ());
    // Pods: a worker's deletion is acted on at once (reaping).
    let (pods, pod_events) = cached_watch::<Pod>(&client, namespace.as_deref(), &owned, slim::pod, |_| ());
    // Secrets: metadata only, to know when a referenced one changed.
    let (secret_metadata, secret_writer) = reflector::store();
    let secret_events = reflector::reflector(
        secret_writer,
        watcher(scoped_api::<secrets::SecretMeta>(&client, namespace.as_deref()), watcher::Config::default())
            .modify(secrets::strip),
    )
    .default_backoff()
    .touched_objects()
    .boxed();
    let (resources, resource_writer) = reflector::store();
    let claimant_index = Arc::new(Mutex::new(claimant_index::ClaimantIndex::default()));
    let indexing = claimant_index.clone();
    let resource_events = reflector::reflector(
        resource_writer,
        watcher(scgs, watcher::Config::default().any_semantic()).modify(slim::resource),
    )
    .inspect(move |event| {
        if let (Ok(event), Ok(mut index)) = (event, indexing.lock()) {
            index.observe(event);
        }
    })
    .default_backoff()
    .applied_objects()
    // The operator's own status writes (and anyone's) wake no reconcile:
    // the poll reads the status anyway. What a user changes does.
    .predicate_filter(wakes_a_reconcile, Default::default());
    let controller = Controller::for_stream(resource_events, resources.clone())
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency));
    let stores = Stores {
        deployments,
        cronjobs,
        jobs,
        pods,
        resources: resources.clone(),
        claimant_index,
        secrets: secret_metadata,
    };
    let ctx = Arc::new(Context::new(client, settings, metrics, instance, stores, memory, relisted));
    tokio::spawn(mark_synced(ctx.clone()));
    tokio::spawn(prune_vanished(ctx.clone()));
    controller
        .owns_stream(deployment_events)
        .owns_stream(cronjob_events)
        .watches_stream(pod_events, |pod: Pod| {
            let name = pod.labels().get(objects::GROUP_LABEL)?.clone();
            Some(ObjectRef::new(&name).within(&pod.namespace()?))
        })
        .watches_stream(job_events, |job: Job| {
            let name = job.labels().get(objects::GROUP_LABEL)?.clone();
            Some(ObjectRef::new(&name).within(&job.namespace()?))
        })
        // A changed Secret is re-read by the resources that reference it.
        .watches_stream(secret_events, move |secret| {
            let namespace = secret.namespace();
            resources
                .state()
                .iter()
                .filter_map(|r| r.0.as_ref().ok())
                .filter(|r| r.namespace() == namespace && secrets::references(r, &secret.name_any()))
                .map(|r| ObjectRef::new(&r.name_any()).within(&r.namespace().unwrap_or_default()))
                .collect::<Vec<_>>()
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

/// A digest of a status, to tell one just written from another. Without the
/// conditions' transition times: a pass that comes before the watch shows a
/// write stamps its conditions again from the older cached status, a
/// second later under load, and the same status restamped is not news.
fn status_digest(status: &streamfleet_crd::StreamConsumerGroupStatus) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut unstamped = status.clone();
    for condition in &mut unstamped.conditions {
        condition.last_transition_time =
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_vec(&unstamped).unwrap_or_default().hash(&mut hasher);
    hasher.finish()
}

/// What of a resource a change to which is acted on at once: its spec
/// (the generation), labels, annotations (the payload-loss
/// acknowledgement), finalizers and deletion. Not its status.
fn wakes_a_reconcile(object: &DeserializeGuard<StreamConsumerGroup>) -> Option<u64> {
    use std::hash::{Hash as _, Hasher as _};
    // One that does not parse always wakes one: whatever change fixes it
    // (its status included) is looked at.
    object.0.as_ref().ok()?;
    let meta = object.meta();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (&meta.uid, meta.generation, &meta.labels, &meta.annotations, &meta.finalizers, meta.deletion_timestamp.is_some())
        .hash(&mut hasher);
    Some(hasher.finish())
}

fn scoped_api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

type Touched<K> = futures::stream::BoxStream<'static, Result<K, watcher::Error>>;

/// A watch of `K` feeding a cache of what `slim` leaves of each object, and
/// the stream of objects it touched.
fn cached_watch<K>(
    client: &Client,
    namespace: Option<&str>,
    config: &watcher::Config,
    slim: fn(&mut K),
    on_event: impl Fn(&watcher::Event<K>) + Send + 'static,
) -> (Store<K>, Touched<K>)
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let events = reflector::reflector(writer, watcher(scoped_api::<K>(client, namespace), config.clone()).modify(slim))
        .inspect(move |event| {
            if let Ok(event) = event {
                on_event(event);
            }
        })
        .default_backoff()
        .touched_objects()
        .boxed();
    (store, events)
}

/// What one owned kind's watch tells the apply memo, before the reconcile
/// its event wakes: a Delete forgets what `manager` applied to that object
/// (that reconcile repairs it, not taking the gap for a lagging cache); a
/// relist's end is remembered (it drops deleted objects silently).
struct OwnedWatch {
    memory: Memory,
    relisted: Relisted,
    manager: &'static str,
}

impl OwnedWatch {
    fn new(memory: &Memory, relisted: &Relisted, manager: &'static str) -> Self {
        Self { memory: memory.clone(), relisted: relisted.clone(), manager }
    }

    fn hook<K: kube::Resource>(self) -> impl Fn(&watcher::Event<K>) + Send + 'static {
        move |event| match event {
            watcher::Event::Delete(object) => self.deleted(object.meta()),
            watcher::Event::InitDone => {
                if let Ok(mut relisted) = self.relisted.lock() {
                    relisted.insert(self.manager, Instant::now());
                }
            }
            _ => {}
        }
    }

    fn deleted(&self, meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) {
        let owner = meta.owner_references.iter().flatten().find(|o| o.kind == "StreamConsumerGroup");
        let Some(owner) = owner else { return };
        let key = claimant_index::named(meta.namespace.as_deref().unwrap_or_default(), &owner.name);
        // Only the object applied: a late Delete of an older one changes nothing.
        let uid = format!("{}/", meta.uid.as_deref().unwrap_or_default());
        if let Ok(mut memory) = self.memory.lock()
            && let Some(resource) = memory.get_mut(&key)
            && resource.applied.get(self.manager).is_some_and(|a| a.identity.starts_with(&uid))
        {
            resource.applied.remove(self.manager);
        }
    }
}

/// Reaping needs complete pod knowledge; applies need the owned caches.
async fn mark_synced(ctx: Arc<Context>) {
    let ready = ctx.pods.wait_until_ready().await.is_ok()
        && ctx.deployments.wait_until_ready().await.is_ok()
        && ctx.cronjobs.wait_until_ready().await.is_ok()
        && ctx.jobs.wait_until_ready().await.is_ok()
        && ctx.secrets.wait_until_ready().await;
    tracing::info!(ready, "owned-object caches synced");
    ctx.caches_synced.store(ready, Ordering::SeqCst);
}

async fn prune_vanished(ctx: Arc<Context>) {
    let mut every = tokio::time::interval(Duration::from_secs(30));
    loop {
        every.tick().await;
        ctx.prune_vanished();
    }
}

fn error_policy(obj: Arc<DeserializeGuard<StreamConsumerGroup>>, error: &Error, ctx: Arc<Context>) -> Action {
    let Ok(scg) = &obj.0 else {
        return Action::await_change();
    };
    ctx.metrics.failed(&scg.namespace().unwrap_or_default(), &scg.name_any(), error.reason());
    let mut backoff = ctx.next_backoff(&key(scg));
    if error.is_outage() {
        let poll = u64::try_from(scg.spec.scaling.poll_interval_seconds).unwrap_or(1).max(1);
        backoff = backoff.min(Duration::from_secs(poll));
    }
    tracing::warn!(resource = %key(scg), reason = error.reason(), error = %error, retry_in = ?backoff, "reconcile failed");
    Action::requeue(backoff)
}

/// One reconcile, in a span that carries the resource.
async fn reconcile(obj: Arc<DeserializeGuard<StreamConsumerGroup>>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let result = match &obj.0 {
        Ok(scg) => {
            let span = tracing::info_span!("reconcile", resource = %key(scg), generation = scg.metadata.generation);
            reconcile_resource(scg, &ctx).instrument(span).await
        }
        Err(invalid) => {
            report_invalid_object(invalid, &ctx).await;
            Ok(Action::await_change())
        }
    };
    ctx.metrics.reconciled(started.elapsed());
    result
}

async fn report_invalid_object(invalid: &kube::core::error_boundary::InvalidObject, ctx: &Context) {
    let reference = ObjectReference {
        api_version: Some("streamfleet.io/v1alpha1".into()),
        kind: Some("StreamConsumerGroup".into()),
        name: invalid.metadata.name.clone(),
        namespace: invalid.metadata.namespace.clone(),
        uid: invalid.metadata.uid.clone(),
        ..ObjectReference::default()
    };
    ctx.publish(&reference, EventType::Warning, "InvalidObject", "Reconcile", invalid.error.clone()).await;
}

/// validate → observe → decide → act → status. A failure before the group
/// is inspected is reported on the resource (health `Unknown`, a condition
/// and a Warning Event when the user can fix it) and retried with backoff.
async fn reconcile_resource(scg: &StreamConsumerGroup, ctx: &Context) -> Result<Action, Error> {
    if scg.metadata.deletion_timestamp.is_some() {
        return finalizer::cleanup(scg, ctx).await;
    }
    // Decide nothing on a half-filled cache: a missing Deployment would read
    // as zero replicas, a missing pod as a dead consumer, a missing resource
    // as no other claimant of the group.
    if !ctx.caches_synced.load(Ordering::SeqCst) || !ctx.knows(scg) {
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    finalizer::sync(scg, ctx).await?;
    let (spec, mut conn, observed) = match validate_and_observe(scg, ctx).await {
        Ok(seen) => seen,
        Err(e) => return Err(report_failure(scg, ctx, e).await),
    };
    let situation = decide::Situation { scg, settings: &ctx.settings, now: ctx.clock.elapsed() };
    let planned = ctx.with_policy(&key(scg), |memory| decide::decide(&spec, &observed, memory, &situation));
    match planned.and_then(|plan| plan) {
        Ok(Plan::Wait) => {
            ctx.metrics.observe_delay(scg, None);
            Ok(Action::requeue(Duration::from_secs(1)))
        }
        Ok(Plan::Conflict(plan)) => stand_down(scg, ctx, &spec, &plan).await,
        Ok(Plan::CreateGroup { start, vanished }) => create_group(scg, ctx, &mut conn, &spec, &start, vanished).await,
        Ok(Plan::Converge(plan)) => converge(scg, ctx, &mut conn, &spec, &plan).await,
        Err(e) => Err(report_failure(scg, ctx, e).await),
    }
}

async fn validate_and_observe(
    scg: &StreamConsumerGroup,
    ctx: &Context,
) -> Result<(validate::ValidSpec, StreamConnection, observe::Observation), Error> {
    let spec = validate::validate(scg)?;
    let (conn, observed) = observe::observe(ctx, scg, &spec).await?;
    Ok((spec, conn, observed))
}

/// Another resource runs the group: what this one has is scaled to zero.
async fn stand_down(
    scg: &StreamConsumerGroup,
    ctx: &Context,
    spec: &validate::ValidSpec,
    plan: &decide::Conflict,
) -> Result<Action, Error> {
    let refused = act::stand_down(ctx, scg, plan).await;
    ctx.metrics.observe_delay(scg, None);
    status::write(ctx, scg, status::conflicted(scg, plan, &refused, &now())).await?;
    ctx.health_written(scg, streamfleet_crd::Health::Unknown);
    match refused.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(Action::requeue(spec.poll_interval)),
    }
}

/// The group is missing: created, then looked at again shortly.
async fn create_group(
    scg: &StreamConsumerGroup,
    ctx: &Context,
    conn: &mut StreamConnection,
    spec: &validate::ValidSpec,
    start: &str,
    vanished: bool,
) -> Result<Action, Error> {
    ctx.metrics.observe_delay(scg, None);
    if let Err(e) = act::create_group(ctx, scg, conn, spec, start, vanished).await {
        return Err(report_failure(scg, ctx, e).await);
    }
    Ok(Action::requeue(AFTER_GROUP_CREATED))
}

/// The group exists: act on the plan, then write the status.
async fn converge(
    scg: &StreamConsumerGroup,
    ctx: &Context,
    conn: &mut StreamConnection,
    spec: &validate::ValidSpec,
    plan: &decide::Convergence,
) -> Result<Action, Error> {
    let wall_now = now();
    let outcome = act::converge(ctx, scg, conn, spec, plan).await;
    ctx.metrics.observe_delay(scg, plan.figures.snapshot.delay.ms().map(Duration::from_millis));
    status::write(ctx, scg, status::converged(scg, &plan.figures, &outcome, &wall_now)).await?;
    if let Some(refused) = outcome.refused.into_iter().next() {
        // The status above says so, and health is still reported; retried with backoff.
        ctx.publish(&scg.object_ref(&()), EventType::Warning, refused.reason(), "Apply", refused.to_string()).await;
        return Err(refused);
    }
    ctx.reset_backoff(&key(scg));
    Ok(Action::requeue(if plan.reap_soon { spec.poll_interval.min(REAP_SOON) } else { spec.poll_interval }))
}

/// A pass that stopped before the group was inspected: a status with health
/// `Unknown`, and a Warning Event when the user can fix the cause.
async fn report_failure(scg: &StreamConsumerGroup, ctx: &Context, e: Error) -> Error {
    if e.is_users() {
        ctx.publish(&scg.object_ref(&()), EventType::Warning, e.reason(), "Reconcile", e.to_string()).await;
    }
    // Whoever's fault it is, the group's state is now unknown.
    ctx.metrics.observe_delay(scg, None);
    if let Err(write) = status::write(ctx, scg, status::failed(scg, &e, &now())).await {
        tracing::warn!(error = %write, "writing the failure status");
    }
    ctx.health_written(scg, streamfleet_crd::Health::Unknown);
    e
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}
