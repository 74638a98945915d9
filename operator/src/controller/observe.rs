//! Step 2, observe: reads only. The Redis endpoint from the referenced
//! Secret, one Redis snapshot of the group (pipelined inspection, the last
//! recovery report, the retention bounds), and the owned objects and pods
//! from the watch caches. Nothing here writes.

use super::Context;
use super::decide::Claimant;
use super::validate::{ValidRedis, ValidSpec};
use crate::error::Error;
use crate::objects;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::{CronJob, Job};
use kube::ResourceExt as _;
use kube::runtime::reflector::ObjectRef;
use std::collections::HashSet;
use std::sync::Arc;
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_streams::health::GroupSnapshot;
use streamfleet_streams::payload_loss::{self, PayloadLoss};
use streamfleet_streams::recovery::RecoveryReport;
use streamfleet_streams::retention::{self, StreamId};
use streamfleet_streams::version::Safety;
use streamfleet_streams::{Endpoint, StreamConnection};

/// Everything one reconcile knows about the world.
pub struct Observation {
    /// The group as Redis reports it, over every shard that has it (see
    /// `GroupSnapshot::merge`); `None`: shard 0 has no group (yet).
    pub group: Option<GroupSnapshot>,
    /// Each shard's own snapshot, shard 0 first (`None`: no group there).
    pub shards: Vec<(String, Option<GroupSnapshot>)>,
    pub last_recovery: Option<RecoveryReport>,
    /// The group's payload-loss record (read with the group).
    pub payload_loss: PayloadLoss,
    /// Per shard with a group, where the retention policy wants to trim and
    /// how low it safely may; empty when the spec sets no retention, and a
    /// shard whose bounds could not be read is left out (never a blind trim).
    pub retention: Vec<(String, RetentionBounds)>,
    pub deployment: Option<Arc<Deployment>>,
    pub cronjob: Option<Arc<CronJob>>,
    /// This resource's recovery Jobs, finished or not (from a cache).
    pub recovery_jobs: Vec<Arc<Job>>,
    /// Identities of this resource's pods that exist (from a synced cache;
    /// only its workloads' pods, whose consumers it may reap).
    pub live_pods: HashSet<String>,
    /// This resource's pods that exist: (name, UID).
    pub pods: Vec<(String, Option<String>)>,
    /// Other resources naming the same stream and group on the same Redis.
    pub claimants: Vec<Claimant>,
    /// Whether the server may evict keys (read at most once a minute).
    pub safety: Safety,
    /// A digest of the Secret values `spec.redis` names, as read for this
    /// poll (`redis_endpoint::secrets_digest`): stamped on the worker pods,
    /// so a rotated password or client certificate rolls them, and nothing
    /// else about the Secrets (a label) does. `None`: no Secret named.
    pub secrets_digest: Option<String>,
}

/// Where a retention policy wants to trim, and how low it safely may.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionBounds {
    pub target: Option<StreamId>,
    pub floor: Option<StreamId>,
}

/// Reads the world. An unreachable Redis, a refused password or a failed
/// inspection is an error: the group's state is then unknown.
pub async fn observe(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    spec: &ValidSpec,
) -> Result<(StreamConnection, Observation), Error> {
    let (endpoint, secrets_digest) = resolve_endpoint(ctx, scg, &spec.redis).await?;
    ctx.remember_endpoint(scg, &endpoint);
    let (conn, safety) = ctx.connections.get_checked(&endpoint).await?;
    // Every shard at once: the requests share the multiplexed connection,
    // so each node gets them pipelined, and a poll costs about one shard's
    // round trips however many shards there are.
    let looks = spec.streams.iter().map(|stream| observe_shard(conn.clone(), scg, spec, stream));
    let looks = futures::future::try_join_all(looks).await?;
    let group = match looks.first() {
        Some(first) if first.snapshot.is_some() => {
            GroupSnapshot::merge(&looks.iter().filter_map(|l| l.snapshot.clone()).collect::<Vec<_>>())
        }
        _ => None,
    };
    let (mut last_recovery, mut retention, mut payload_loss) = (None, Vec::new(), PayloadLoss::default());
    let mut shards = Vec::with_capacity(looks.len());
    for look in looks {
        if group.is_some() {
            last_recovery = last_recovery.or(look.last_recovery);
            retention.extend(look.retention.map(|bounds| (look.stream.clone(), bounds)));
            payload_loss.total = payload_loss.total.saturating_add(look.payload_loss.total);
            payload_loss.latest.extend(look.payload_loss.latest);
        }
        shards.push((look.stream, look.snapshot));
    }
    payload_loss.latest.truncate(payload_loss::LATEST);
    let ns = scg.namespace().unwrap_or_default();
    let pods = our_pods(ctx, scg, &ns);
    let observation = Observation {
        group,
        shards,
        last_recovery,
        payload_loss,
        retention,
        deployment: ctx.deployments.get(&ObjectRef::new(&objects::worker_deployment_name(scg)).within(&ns)),
        cronjob: ctx.cronjobs.get(&ObjectRef::new(&objects::recovery_cronjob_name(scg)).within(&ns)),
        recovery_jobs: recovery_jobs(ctx, scg, &ns),
        live_pods: pods
            .iter()
            .flat_map(|(name, uid)| crate::controller::reaper::identities(name, uid.as_deref()))
            .collect(),
        pods,
        claimants: ctx.claimants(scg, &endpoint),
        safety,
        secrets_digest,
    };
    Ok((conn, observation))
}

/// Only this resource's pods: every pod of the namespace would make each
/// reconcile cost as much as the fleet (it was a third of the operator's CPU
/// at 1,000 resources).
fn our_pods(ctx: &Context, scg: &StreamConsumerGroup, ns: &str) -> Vec<(String, Option<String>)> {
    let prefixes = objects::pod_name_prefixes(scg);
    let ours = |name: &str| prefixes.iter().any(|p| name.starts_with(p.as_str()));
    ctx.pods
        .state()
        .iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(ns))
        .filter(|p| p.metadata.name.as_deref().is_some_and(ours))
        .map(|p| (p.name_any(), p.metadata.uid.clone()))
        .collect()
}

/// This resource's recovery Jobs: its CronJob's runs and Jobs made from it
/// (`kubectl create job --from`), which carry the template's labels.
fn recovery_jobs(ctx: &Context, scg: &StreamConsumerGroup, ns: &str) -> Vec<Arc<Job>> {
    let name = scg.name_any();
    ctx.jobs
        .state()
        .into_iter()
        .filter(|j| j.metadata.namespace.as_deref() == Some(ns))
        .filter(|j| {
            j.metadata.labels.as_ref().is_some_and(|l| {
                l.get(objects::GROUP_LABEL) == Some(&name)
                    && l.get(objects::COMPONENT_LABEL).map(String::as_str) == Some("recovery")
            })
        })
        .collect()
}

/// What one poll reads of one shard.
struct ShardLook {
    stream: String,
    snapshot: Option<GroupSnapshot>,
    last_recovery: Option<RecoveryReport>,
    retention: Option<RetentionBounds>,
    payload_loss: PayloadLoss,
}

/// One shard's inspection and, where it has the group, its recovery report,
/// retention bounds and payload-loss record.
async fn observe_shard(
    mut conn: StreamConnection,
    scg: &StreamConsumerGroup,
    spec: &ValidSpec,
    stream: &str,
) -> Result<ShardLook, Error> {
    let dead_letter_stream = spec.dead_letter_stream_of(stream);
    let snapshot = streamfleet_streams::health::inspect(&mut conn, spec.group_on(stream), &dead_letter_stream).await?;
    let mut look = ShardLook {
        stream: stream.to_string(),
        snapshot,
        last_recovery: None,
        retention: None,
        payload_loss: PayloadLoss::default(),
    };
    if look.snapshot.is_some() {
        // A recovery run writes its total to every shard: shard 0's is the run's.
        if stream == spec.stream {
            look.last_recovery = read_recovery_report(&mut conn, scg, stream, &spec.group).await;
        }
        look.retention = read_retention_bounds(&mut conn, scg, spec, stream).await;
        // Part of the group's state: if it cannot be read, nothing is known.
        look.payload_loss = payload_loss::read(&mut conn, spec.group_on(stream)).await?;
    }
    Ok(look)
}

/// A report that cannot be read is logged and treated as absent: it only
/// annotates the status.
async fn read_recovery_report(
    conn: &mut StreamConnection,
    scg: &StreamConsumerGroup,
    stream: &str,
    group: &str,
) -> Option<RecoveryReport> {
    streamfleet_streams::recovery::read_report(conn, streamfleet_streams::GroupRef::new(stream, group))
        .await
        .inspect_err(|e| tracing::warn!(resource = %super::key(scg), error = %e, "reading the recovery report"))
        .ok()
        .flatten()
}

/// Bounds that cannot be read mean no trim this poll (never a blind one).
async fn read_retention_bounds(
    conn: &mut StreamConnection,
    scg: &StreamConsumerGroup,
    spec: &ValidSpec,
    stream: &str,
) -> Option<RetentionBounds> {
    let limits = spec.retention?;
    let now_ms = streamfleet_streams::recovery::now_ms();
    let bounds = async {
        let target = retention::target(conn, stream, limits.max_length, limits.max_age_ms, now_ms).await?;
        let floor = retention::safe_floor(conn, stream).await?;
        Ok::<_, streamfleet_streams::StreamError>(RetentionBounds { target, floor })
    };
    bounds.await.inspect_err(|e| tracing::warn!(resource = %super::key(scg), error = %e, "retention bounds")).ok()
}

/// The endpoint `redis` names, its Secrets read through the Secret cache,
/// and the digest of what was read.
async fn resolve_endpoint(
    ctx: &Context,
    scg: &StreamConsumerGroup,
    redis: &ValidRedis,
) -> Result<(Endpoint, Option<String>), Error> {
    let namespace = scg.namespace().unwrap_or_default();
    let mut values = Vec::new();
    for r in crate::redis_endpoint::secret_keys(redis) {
        let value = ctx.secrets.read(&ctx.client, &namespace, &r).await?;
        values.push((r, value));
    }
    Ok((
        crate::redis_endpoint::endpoint(redis, &values)?,
        crate::redis_endpoint::secrets_digest(&ctx.settings.digest_key, &values),
    ))
}

/// The endpoint and a connection to it, for deletion (which needs no snapshot).
pub async fn endpoint(ctx: &Context, scg: &StreamConsumerGroup) -> Result<(Endpoint, StreamConnection), Error> {
    let redis = super::validate::validate_redis(&scg.spec.redis)?;
    let (endpoint, _) = resolve_endpoint(ctx, scg, &redis).await?;
    let conn = ctx.connections.get(&endpoint).await?;
    Ok((endpoint, conn))
}
