//! Step 4, act: carries out a [`Plan`](super::decide::Plan): Redis writes
//! (group creation, reaping, trimming), server-side applies of the owned
//! objects, and the planned Events. A refused apply does not stop the rest:
//! it is returned in the [`Outcome`] so the status still reports health.

use super::Context;
use super::decide::{Conflict, Convergence, OwnedObjects, PlannedEvent, Reap, RedisWrites};
use super::validate::ValidSpec;
use crate::error::Error;
use crate::events::EventType;
use crate::objects;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource as _, ResourceExt as _};
use std::sync::Arc;
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_streams::{ConsumerRef, GroupCreation, StreamConnection};

/// Field managers, one per call site, so `managedFields` says who set what.
pub(super) const MANAGER_DEPLOYMENT: &str = "streamfleet-worker-deployment";
pub(super) const MANAGER_CRONJOB: &str = "streamfleet-recovery-cronjob";
const MANAGER_DELETION_COST: &str = "streamfleet-pod-deletion-cost";

/// Server-side apply as `manager`, with the server's field validation off:
/// every patch is serialized by serde (typed structs, and the few fields of
/// a status or an annotation patch, which the tests check field by field),
/// so it has no duplicate field, and the check parses the whole patch as
/// YAML a second time: a share of the API server's CPU as large as the
/// apply's own merge when a fleet comes up (its CPU profile). Values are
/// still validated against the schema.
pub(super) fn apply_params(manager: &str) -> PatchParams {
    PatchParams::apply(manager).validation_ignore()
}

/// Read by the ReplicaSet controller when it scales down: pods with the
/// lowest cost go first.
const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// What acting on a convergence plan did.
#[derive(Default)]
pub struct Outcome {
    pub available_replicas: i32,
    /// Entries trimmed by retention.
    pub trimmed: u64,
    /// Owned objects the API server refused, with its message.
    pub refused: Vec<Error>,
}

/// Creates the missing group at `start`; a group that `vanished` is a Warning.
pub async fn create_group(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    conn: &mut StreamConnection,
    spec: &ValidSpec,
    start: &str,
    vanished: bool,
) -> Result<(), Error> {
    let vanished = vanished.then(|| {
        format!(
            " (stream deleted, or Redis restarted without persistence): created again at {start}, where it was, so \
             nothing unacknowledged is skipped; entries pending before are delivered again, entries trimmed with the \
             stream are gone"
        )
    });
    ensure_group_announced(ctx, scg, conn, &spec.group, &spec.stream, start, vanished).await
}

/// Creates `group` on `stream` at `start` if it is missing, with an Event:
/// a Warning saying what happened (`vanished`) when it existed before (its
/// old entries' records dropped first), else a Normal one.
async fn ensure_group_announced(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    conn: &mut StreamConnection,
    group: &str,
    stream: &str,
    start: &str,
    vanished: Option<String>,
) -> Result<(), Error> {
    let created = match vanished {
        Some(_) => streamfleet_streams::recreate_group(conn, stream, group, start).await?,
        None => streamfleet_streams::ensure_group(conn, stream, group, start).await?,
    };
    if created != GroupCreation::Created {
        return Ok(());
    }
    let event = match vanished {
        Some(what) => PlannedEvent {
            type_: EventType::Warning,
            reason: "GroupRecreated",
            action: "EnsureGroup",
            note: format!("group {group:?} on stream {stream:?} had vanished{what}"),
        },
        None => PlannedEvent {
            type_: EventType::Normal,
            reason: "GroupCreated",
            action: "EnsureGroup",
            note: format!("created group {group:?} on stream {stream:?} at {start}"),
        },
    };
    publish(ctx, scg, &event).await;
    Ok(())
}

/// Another resource runs the group: scale what this one has to zero and
/// suspend its recovery; create nothing. Returns refused objects.
pub async fn stand_down(ctx: &Context, scg: &StreamConsumerGroup, plan: &Conflict) -> Vec<Error> {
    let mut refused = Vec::new();
    if let Some(deployment) = &plan.deployment {
        let name = objects::worker_deployment_name(scg);
        let live = ctx.deployments.get(&ObjectRef::new(&name).within(&namespace(scg)));
        if let Err(e) = apply_owned(ctx, scg, &name, MANAGER_DEPLOYMENT, deployment, live, available).await {
            refused.push(e.refused("Deployment"));
        }
    }
    if let Some(cronjob) = &plan.cronjob {
        let name = objects::recovery_cronjob_name(scg);
        let live = ctx.cronjobs.get(&ObjectRef::new(&name).within(&namespace(scg)));
        if let Err(e) = apply_owned(ctx, scg, &name, MANAGER_CRONJOB, cronjob, live, |_| 0).await {
            refused.push(e.refused("CronJob"));
        }
    }
    for event in &plan.events {
        publish(ctx, scg, event).await;
    }
    refused
}

/// The convergence's steps: Redis writes, the owned objects, its Events.
pub async fn converge(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    conn: &mut StreamConnection,
    spec: &ValidSpec,
    plan: &Convergence,
) -> Outcome {
    let trimmed = write_redis(ctx, scg, conn, spec, &plan.redis).await;
    let (available_replicas, refused) = apply_objects(ctx, scg, &plan.owned).await;
    for event in &plan.events {
        publish(ctx, scg, event).await;
    }
    Outcome { available_replicas, trimmed, refused }
}

/// Shards' groups created, dead consumers reaped, the streams and the
/// dead-letter streams trimmed. Returns how many entries retention trimmed.
/// A write that fails is logged: the next pass tries again.
async fn write_redis(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    conn: &mut StreamConnection,
    spec: &ValidSpec,
    writes: &RedisWrites,
) -> u64 {
    for (stream, vanished) in &writes.create_shards {
        create_shard_group(ctx, scg, conn, spec, stream, *vanished).await;
    }
    for stream in &spec.streams {
        for reap in &writes.reap {
            reap_consumer(ctx, scg, conn, spec, stream, reap).await;
        }
    }
    let mut trimmed = 0;
    for (stream, id) in &writes.trims {
        trimmed += streamfleet_streams::retention::trim_to(conn, stream, *id)
            .await
            .inspect(|n| {
                if *n > 0 {
                    tracing::info!(stream, trimmed = n, to = %id, "trimmed the stream")
                }
            })
            .inspect_err(|e| tracing::warn!(stream, error = %e, "retention"))
            .unwrap_or(0);
    }
    for (stream, cap) in &writes.dead_letter_trims {
        match streamfleet_streams::dlq::cap(conn, stream, *cap).await {
            Ok(n) => {
                tracing::warn!(stream, dropped = n, cap, "dead-letter stream over its cap: oldest letters dropped")
            }
            Err(e) => tracing::warn!(stream, error = %e, "trimming the dead-letter stream to its cap"),
        }
    }
    for (stream, max_age) in &writes.dead_letter_expiry {
        match streamfleet_streams::dlq::expire(conn, stream, *max_age).await {
            Ok(0) => {}
            Ok(n) => {
                let note = format!(
                    "dropped {n} letters of {stream} dead-lettered over {} s ago (spec.recovery.deadLetterMaxAgeSeconds)",
                    max_age.as_secs()
                );
                let event =
                    PlannedEvent { type_: EventType::Normal, reason: "DeadLettersExpired", action: "Trim", note };
                publish(ctx, scg, &event).await;
            }
            Err(e) => tracing::warn!(stream, error = %e, "dropping expired dead letters"),
        }
    }
    trimmed
}

/// The pods priced for a scale-down, then the Deployment and the CronJob
/// applied. Returns the Deployment's available replicas and what the API
/// server refused.
pub(super) async fn apply_objects(ctx: &Context, scg: &StreamConsumerGroup, owned: &OwnedObjects) -> (i32, Vec<Error>) {
    // Before the Deployment shrinks: the pods holding least go first.
    for (pod, cost) in &owned.deletion_costs {
        price_pod(ctx, scg, pod, *cost).await;
    }
    let mut refused = Vec::new();
    let name = objects::worker_deployment_name(scg);
    let live = ctx.deployments.get(&ObjectRef::new(&name).within(&namespace(scg)));
    let available_replicas =
        match apply_owned(ctx, scg, &name, MANAGER_DEPLOYMENT, &owned.deployment, live, available).await {
            Ok(available) => available,
            Err(e) => {
                refused.push(e.refused("Deployment"));
                0
            }
        };
    let name = objects::recovery_cronjob_name(scg);
    let live = ctx.cronjobs.get(&ObjectRef::new(&name).within(&namespace(scg)));
    if let Err(e) = apply_owned(ctx, scg, &name, MANAGER_CRONJOB, &owned.cronjob, live, |_| 0).await {
        refused.push(e.refused("CronJob"));
    }
    (available_replicas, refused)
}

/// Sets a worker pod's deletion cost; a failure only means the ReplicaSet
/// chooses on its own, so it is logged, never fatal.
async fn price_pod(ctx: &Context, scg: &StreamConsumerGroup, pod: &str, cost: i32) {
    let api: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(ctx.client.clone(), &namespace(scg));
    let patch = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod, "annotations": {DELETION_COST: cost.to_string()}},
    });
    match api.patch(pod, &apply_params(MANAGER_DELETION_COST), &Patch::Apply(&patch)).await {
        Ok(_) => ctx.metrics.api_write(MANAGER_DELETION_COST),
        Err(e) => tracing::warn!(pod, error = %e, "setting the pod's deletion cost before a scale-down"),
    }
}

fn namespace(scg: &StreamConsumerGroup) -> String {
    scg.namespace().unwrap_or_default()
}

/// Creates the group on a shard beyond the first, at `0`: a new shard (the
/// count grew) may already hold entries a producer sent, and a shard whose
/// group vanished is read again from its start rather than skipped.
async fn create_shard_group(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    conn: &mut StreamConnection,
    spec: &ValidSpec,
    stream: &str,
    vanished: bool,
) {
    let vanished = vanished.then(|| {
        ": created again at 0, so nothing unacknowledged is skipped; entries still in the shard are delivered again"
            .to_string()
    });
    if let Err(e) = ensure_group_announced(ctx, scg, conn, &spec.group, stream, "0", vanished).await {
        tracing::warn!(stream, error = %e, "creating the group on a shard");
    }
}

/// Releases a dead consumer's entries on one shard, or deletes it there once
/// it owns nothing.
async fn reap_consumer(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    conn: &mut StreamConnection,
    spec: &ValidSpec,
    stream: &str,
    reap: &Reap,
) {
    use streamfleet_streams::consumers;
    let result = match reap {
        Reap::Release(name) => consumers::release_pending(
            conn,
            ConsumerRef::new(stream, &spec.group, name),
            &spec.dead_letter_stream_of(stream),
            spec.min_idle,
            spec.batch,
        )
        .await
        .map(|r| {
            // No pod in the cache, silent in `XINFO`, yet it told Redis it
            // lives (a force-deleted pod's process, a partitioned node):
            // looked at every half second, said once.
            let (resource, seen) = (super::key(scg), format!("{stream}/{name}"));
            if r.alive {
                let first = ctx.with_policy(&resource, |m| m.alive_without_pod.insert(seen)).unwrap_or(true);
                if first {
                    tracing::info!(consumer = %name, stream, "a consumer without a pod is still alive: not released");
                } else {
                    tracing::debug!(consumer = %name, stream, "still alive without a pod");
                }
                return None;
            }
            let _ = ctx.with_policy(&resource, |m| m.alive_without_pod.remove(&seen));
            let lost = if r.payload_lost > 0 {
                format!("; {} had lost their payload (recorded)", r.payload_lost)
            } else {
                String::new()
            };
            (r.released + r.payload_lost > 0).then(|| {
                (
                    "DeadConsumerReleased",
                    format!(
                        "released {} pending entries of {name} (pod gone) on {stream:?} for claiming{lost}",
                        r.released
                    ),
                )
            })
        }),
        Reap::Delete(name) => {
            consumers::delete_if_empty(conn, ConsumerRef::new(stream, &spec.group, name)).await.map(|deleted| {
                deleted.then(|| ("DeadConsumerDeleted", format!("deleted consumer {name} (pod gone, owned nothing)")))
            })
        }
    };
    match result {
        Ok(Some((reason, note))) => {
            tracing::info!(?reap, "{note}");
            publish(ctx, scg, &PlannedEvent { type_: EventType::Normal, reason, action: "Reap", note }).await;
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(?reap, error = %e, "reaping"),
    }
}

pub async fn publish(ctx: &Context, scg: &StreamConsumerGroup, event: &PlannedEvent) {
    ctx.publish(&scg.object_ref(&()), event.type_, event.reason, event.action, event.note.clone()).await;
}

fn available(deployment: &Deployment) -> i32 {
    deployment.status.as_ref().and_then(|s| s.available_replicas).unwrap_or(0)
}

/// Server-side applies an owned object, unless it is exactly what this
/// operator last applied and the live object (from the watch cache) is the
/// same object with the same spec generation, or is not in the cache yet
/// after an apply a moment ago (`Context::applied_unchanged`): a poll where
/// nothing changed makes no API write. A repair (someone edited the spec,
/// or deleted the object) changes the generation or uid and is applied
/// again. Returns `replicas` of the object: the cached one's, the applied
/// one's, or while the cache has not shown an apply, the apply's reply's.
async fn apply_owned<K>(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    name: &str,
    manager: &'static str,
    desired: &K,
    live: Option<Arc<K>>,
    replicas: fn(&K) -> i32,
) -> Result<i32, Error>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let fingerprint = fingerprint(desired)?;
    let live_identity = live.as_ref().map(|l| identity(l.meta()));
    let key = super::key(scg);
    if let Some(as_applied) = ctx.applied_unchanged(&key, manager, fingerprint, live_identity.as_deref()) {
        return Ok(live.map_or(as_applied, |live| replicas(&live)));
    }
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &namespace(scg));
    let applied = api.patch(name, &apply_params(manager).force(), &Patch::Apply(desired)).await?;
    ctx.metrics.api_write(manager);
    let shown = replicas(&applied);
    ctx.remember_applied(&key, manager, super::Applied::new(fingerprint, identity(applied.meta()), shown));
    Ok(shown)
}

fn fingerprint<K: serde::Serialize>(desired: &K) -> Result<u64, Error> {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(desired)?.hash(&mut hasher);
    Ok(hasher.finish())
}

/// uid + generation: the same object, and nobody changed its spec since
/// (status updates by other controllers do not count).
fn identity(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!("{}/{}", meta.uid.as_deref().unwrap_or(""), meta.generation.unwrap_or(0))
}
