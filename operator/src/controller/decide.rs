//! Step 3, decide: a pure function of the validated spec, the observation
//! and what the policies remember, returning a [`Plan`]: the group to
//! create, desired replicas, health, the trim point, consumers to release or
//! delete, the objects to apply and the Events to publish. No I/O.

use super::observe::Observation;
use super::recovery_runs::{self, LastRun};
use super::validate::ValidSpec;
use crate::controller::health::{self, HealthMemory};
use crate::controller::reaper;
use crate::controller::scaling::{self, ScalingMemory};
use crate::error::Error;
use crate::events::EventType;
use crate::objects::{self, ObjectSettings};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt as _;
use std::time::Duration;
use streamfleet_crd::{
    Health, PAYLOAD_LOST_ACKNOWLEDGED, PayloadLostStatus, RecoveryMode, RecoveryStatus, ShardStatus,
    StreamConsumerGroup,
};
use streamfleet_streams::health::{GroupSnapshot, Lag, ParkedState};
use streamfleet_streams::payload_loss::PayloadLoss;
use streamfleet_streams::recovery::RecoveryReport;
use streamfleet_streams::retention::{self, Retention, StreamId};
use streamfleet_streams::retry::Schedule;
use streamfleet_streams::version::{Eviction, Persistence, Safety};

/// What the policies remember about one resource between polls.
#[derive(Default)]
pub struct PolicyMemory {
    pub scaling: ScalingMemory,
    pub throughput: crate::controller::throughput::ThroughputMemory,
    pub health: HealthMemory,
    /// The payload-loss total already announced (the status forgets it while
    /// the group cannot be inspected).
    pub payload_lost_announced: i64,
    /// The time of the recovery run last announced: the cached status may
    /// not show it yet when a watch event brings the next reconcile first.
    pub recovery_announced: Option<Time>,
    /// The health last announced, for the same reason: a transition is
    /// announced once even when the next reconcile reads a stale status.
    pub health_announced: Option<Health>,
    /// Whether a server that may evict keys was announced, for the same
    /// reason (`None`: not known yet, the status decides).
    pub eviction_announced: Option<bool>,
    /// Whether a server without an append-only file was announced, likewise.
    pub persistence_announced: Option<bool>,
    /// The unknown template fields last announced (`TemplateFieldsUnknown`).
    pub template_announced: Option<String>,
    /// The `RecoveryDeadlineTooShort` message last announced.
    pub recovery_deadline_announced: Option<String>,
    /// The failed recovery Job last announced.
    pub recovery_failure_announced: Option<String>,
    /// Consumers without a pod found still alive (`<stream>/<consumer>`,
    /// per shard), logged once each: they are looked at every half second
    /// until they fall silent.
    pub alive_without_pod: std::collections::HashSet<String>,
}

/// What one reconcile will do.
pub enum Plan {
    /// An older resource names the same stream and group, and its Redis is
    /// not known yet: do nothing until it is (never stand down on a guess).
    Wait,
    /// Another resource runs this group: run no workers.
    Conflict(Box<Conflict>),
    /// The group does not exist: create it at `start`, then look again.
    /// `vanished`: it existed before (its position comes from the status).
    CreateGroup { start: String, vanished: bool },
    /// The group exists: converge everything else.
    Converge(Box<Convergence>),
}

/// Another resource that names the same stream and group on the same Redis.
#[derive(Clone, Debug, PartialEq)]
pub struct Claimant {
    /// `namespace/name`.
    pub key: String,
    pub created: Option<Time>,
    /// Whether it is known to use the same Redis (else: not resolved yet).
    pub same_endpoint_known: bool,
}

/// This resource stands down: the group belongs to `owner`, the resource
/// created first. Objects it already has are scaled to zero and suspended;
/// none are created.
pub struct Conflict {
    pub owner: String,
    pub snapshot: Option<GroupSnapshot>,
    pub deployment: Option<Deployment>,
    pub cronjob: Option<CronJob>,
    pub events: Vec<PlannedEvent>,
}

/// What converging does, split by what acts on it: Redis writes, the owned
/// objects, Events (`act`), and the figures the status reports (`status`).
pub struct Convergence {
    pub redis: RedisWrites,
    pub owned: OwnedObjects,
    pub events: Vec<PlannedEvent>,
    pub figures: StatusFigures,
    /// A consumer without a pod may become releasable within seconds
    /// (`reaper::awaiting_silence`): look again soon.
    pub reap_soon: bool,
}

/// The Redis writes of a convergence, in the order `act` makes them.
pub struct RedisWrites {
    /// Shards (beyond shard 0) without the group: created at `0`, so nothing
    /// a producer sent there before is skipped. `true`: it had the group before.
    pub create_shards: Vec<(String, bool)>,
    pub reap: Vec<Reap>,
    /// Where each shard is trimmed to.
    pub trims: Vec<(String, StreamId)>,
    /// Dead-letter streams over their cap: (stream, cap), trimmed to it.
    pub dead_letter_trims: Vec<(String, u64)>,
    /// Dead-letter streams with letters, whose letters older than the age
    /// bound (`spec.recovery.deadLetterMaxAgeSeconds`) are dropped.
    pub dead_letter_expiry: Vec<(String, Duration)>,
}

/// The objects a convergence applies.
pub struct OwnedObjects {
    /// On a scale-down, each worker pod's deletion cost (the entries its
    /// consumer holds), so the ReplicaSet removes the idlest pods first.
    pub deletion_costs: Vec<(String, i32)>,
    pub deployment: Deployment,
    pub cronjob: CronJob,
}

/// What the status reports of a convergence.
pub struct StatusFigures {
    pub snapshot: GroupSnapshot,
    /// The worker Deployment's replicas now (`None`: no Deployment yet).
    pub current_replicas: Option<i32>,
    pub scaling: scaling::Decision,
    pub health: Health,
    pub health_message: String,
    pub last_recovery: Option<RecoveryStatus>,
    pub payload_lost: PayloadLostStatus,
    /// The retention verdict over every shard (its `trimmed` is filled in by `act`).
    pub retention: Option<Retention>,
    /// Per-shard figures for the status (empty for one shard).
    pub shard_figures: Vec<ShardStatus>,
    /// Arrival and completion rates over every shard (`None`: not yet, or unreadable).
    pub throughput: Option<crate::controller::throughput::Throughput>,
    /// Whether a dead-letter stream is at its cap (`None`: no cap).
    pub dead_letter_cap_reached: Option<bool>,
    /// The server's eviction and persistence settings, for the
    /// `EvictionPossible` and `LossOnRestartPossible` conditions.
    pub safety: Safety,
    /// Fields of the worker template that were dropped (typos): the
    /// `TemplateFieldsUnknown` condition.
    pub unknown_template_fields: Vec<String>,
    /// Why a recovery run cannot finish a handler that runs its full time:
    /// the `RecoveryDeadlineTooShort` condition (`None`: it can).
    pub recovery_deadline_short: Option<String>,
    /// How the recovery CronJob's last run ended: the `RecoveryFailing` condition.
    pub recovery_run: LastRun,
    /// Entries waiting for a retry, read against the schedule.
    pub retrying: Retrying,
}

/// Entries parked for a retry on the schedule (`streams::retry`), as the
/// status shows them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retrying {
    pub entries: u64,
    /// Entries whose next attempt is their last (`maxDeliveries`).
    pub on_last_attempt: u64,
    /// When the next of them is due, from the inspection, in ms (of the
    /// sampled ones; negative: overdue by that much, no consumer took it).
    pub due_after_ms: Option<i64>,
    /// That entry's last error.
    pub last_error: Option<String>,
    /// (delivery count failed at, entries), by delivery count.
    pub by_delivery: Vec<(u64, u64)>,
}

/// What the snapshot's parked entries mean under the schedule: each
/// parking consumer releases an entry at its threshold, so the most idle of
/// its entries is the next due.
pub fn retrying(snapshot: &GroupSnapshot, schedule: &Schedule, max_deliveries: u64) -> Retrying {
    let due_after = |p: &ParkedState| {
        let threshold =
            i64::try_from(streamfleet_streams::millis(schedule.threshold(p.deliveries))).unwrap_or(i64::MAX);
        threshold.saturating_sub(i64::try_from(p.most_idle_ms).unwrap_or(i64::MAX))
    };
    let soonest = snapshot.parked.iter().min_by_key(|p| due_after(p));
    Retrying {
        entries: snapshot.retrying,
        on_last_attempt: snapshot
            .parked
            .iter()
            .filter(|p| p.deliveries.saturating_add(1) >= max_deliveries)
            .map(|p| p.entries)
            .fold(0, u64::saturating_add),
        due_after_ms: soonest.map(due_after),
        last_error: soonest.and_then(|p| p.last_error.clone()),
        by_delivery: snapshot.parked.iter().map(|p| (p.deliveries, p.entries)).collect(),
    }
}

/// A consumer whose pod is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reap {
    /// It still owns entries: make them claimable at once.
    Release(String),
    /// It owns nothing: delete it.
    Delete(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct PlannedEvent {
    pub type_: EventType,
    pub reason: &'static str,
    pub action: &'static str,
    pub note: String,
}

/// The inputs of [`decide`] besides the spec and the observation.
pub struct Situation<'a> {
    pub scg: &'a StreamConsumerGroup,
    pub settings: &'a ObjectSettings,
    /// A monotonic clock reading.
    pub now: Duration,
}

/// The plan for one reconcile, as named steps: who owns the group, then
/// the figures (scaling, health, retries), then the Events they call for,
/// then what to write to Redis and Kubernetes.
pub fn decide(
    spec: &ValidSpec,
    observed: &Observation,
    memory: &mut PolicyMemory,
    at: &Situation<'_>,
) -> Result<Plan, Error> {
    if let Some(owner) = earlier_claimant(at.scg, &observed.claimants) {
        if !owner.same_endpoint_known {
            return Ok(Plan::Wait);
        }
        return conflict(spec, at, observed, owner);
    }
    let Some(snapshot) = observed.group.clone() else {
        return Ok(create_group(spec, at.scg));
    };
    let (dead_letter_trims, cap_events, dead_letter_cap_reached) = dead_letter_cap(spec, observed);
    let (retention, trims) = retention_plan(observed);
    let figures = status_figures(spec, observed, snapshot, (retention, dead_letter_cap_reached), memory, at);
    let events = announce(spec, observed, &figures, cap_events, memory, at);
    Ok(Plan::Converge(Box::new(Convergence {
        redis: RedisWrites {
            create_shards: missing_shards(at.scg, observed),
            reap: reap_plan(at.scg, &figures.snapshot, observed),
            trims,
            dead_letter_trims,
            dead_letter_expiry: dead_letter_expiry(spec, observed),
        },
        owned: owned_objects(spec, observed, &figures, at.settings)?,
        events,
        reap_soon: reaper::awaiting_silence(
            &figures.snapshot.consumers,
            &observed.live_pods,
            &objects::pod_name_prefixes(at.scg),
        ),
        figures,
    })))
}

/// The worker Deployment's replicas now (`None`: no Deployment yet).
fn current_replicas(observed: &Observation) -> Option<i32> {
    observed.deployment.as_ref().and_then(|d| d.spec.as_ref().and_then(|s| s.replicas))
}

/// How many workers the pipeline needs: lag, entries in hand against what
/// the available workers can hold, and the delay objective.
fn scale(
    spec: &ValidSpec,
    observed: &Observation,
    snapshot: &GroupSnapshot,
    throughput: Option<crate::controller::throughput::Throughput>,
    memory: &mut ScalingMemory,
    now: Duration,
) -> scaling::Decision {
    if spec.suspend {
        return scaling::Decision { replicas: 0, reason: "suspended (spec.suspend)".into() };
    }
    let available = observed.deployment.as_ref().and_then(|d| d.status.as_ref()?.available_replicas).unwrap_or(0);
    let in_hand = snapshot.pending.saturating_sub(snapshot.retrying);
    let concurrency =
        u64::from(spec.worker_env.options.concurrency.unwrap_or(streamfleet_contract::DEFAULT_CONCURRENCY));
    let pace = scaling::Pace {
        working_delay_ms: snapshot.working_delay.ms(),
        throughput,
        available,
        busy: snapshot.lag.floor().is_none_or(|lag| lag > 0)
            || in_hand > u64::try_from(available).unwrap_or(0).saturating_mul(concurrency),
    };
    scaling::decide(
        &spec.scaling,
        current_replicas(observed).unwrap_or(0),
        Some((snapshot.lag, snapshot.pending, snapshot.retrying)),
        &pace,
        now,
        memory,
    )
}

/// What the status shows: scaling, health, retries, recovery, losses.
fn status_figures(
    spec: &ValidSpec,
    observed: &Observation,
    snapshot: GroupSnapshot,
    (retention, dead_letter_cap_reached): (Option<Retention>, Option<bool>),
    memory: &mut PolicyMemory,
    at: &Situation<'_>,
) -> StatusFigures {
    let throughput = memory.throughput.observe(&observed.shards);
    let scaling = scale(spec, observed, &snapshot, throughput, &mut memory.scaling, at.now);
    memory.health.record(&snapshot, at.now, scaling.replicas > 0);
    let retrying = retrying(&snapshot, &spec.retry, spec.max_deliveries);
    let payload_lost = payload_lost_status(at.scg, &observed.payload_loss);
    let (health, health_message) = health::classify(&health::Inputs {
        snapshot: Some(&snapshot),
        memory: &memory.health,
        min_idle: spec.min_idle,
        max_deliveries: spec.max_deliveries,
        replicas: scaling.replicas,
        payload_lost_unacknowledged: u64::try_from(payload_lost.unacknowledged).unwrap_or(0),
        retry_overdue: Duration::from_millis(
            retrying.due_after_ms.filter(|ms| *ms < 0).map_or(0, |ms| ms.unsigned_abs()),
        ),
    });
    let (health, health_message) = suspended_health(spec.suspend, health, health_message, &snapshot);
    StatusFigures {
        current_replicas: current_replicas(observed),
        scaling,
        health,
        health_message,
        last_recovery: observed.last_recovery.clone().map(recovery_status),
        payload_lost,
        retention,
        shard_figures: shard_figures(observed),
        throughput,
        dead_letter_cap_reached,
        safety: observed.safety.clone(),
        unknown_template_fields: spec.unknown_template_fields.clone(),
        recovery_deadline_short: recovery_deadline_message(
            spec,
            spec.workload.recovery_mode,
            at.settings.sweep_deadline_seconds,
        ),
        recovery_run: recovery_runs::last_run(&observed.recovery_jobs),
        retrying,
        snapshot,
    }
}

/// The Events the figures call for, each announced once per change
/// (`memory` remembers what was announced).
fn announce(
    spec: &ValidSpec,
    observed: &Observation,
    figures: &StatusFigures,
    cap_events: Vec<PlannedEvent>,
    memory: &mut PolicyMemory,
    at: &Situation<'_>,
) -> Vec<PlannedEvent> {
    let mut events: Vec<PlannedEvent> = scaling_event(figures.current_replicas, &figures.scaling).into_iter().collect();
    events.extend(recovery_event(at.scg, figures.last_recovery.as_ref(), memory.recovery_announced.as_ref()));
    if let Some(latest) = &figures.last_recovery {
        memory.recovery_announced = Some(latest.time.clone());
    }
    events.extend(payload_loss_event(at.scg, &figures.payload_lost, memory.payload_lost_announced));
    memory.payload_lost_announced = memory.payload_lost_announced.max(figures.payload_lost.total);
    let before = memory.health_announced.or_else(|| at.scg.status.as_ref().and_then(|s| s.health));
    events.extend(health_event(before, figures.health, &figures.health_message));
    memory.health_announced = Some(figures.health);
    events.extend(cap_events);
    let eviction = match &observed.safety.eviction {
        Eviction::Possible { policy, maxmemory } => Some(Some(eviction_message(policy, *maxmemory))),
        Eviction::Never => Some(None),
        Eviction::Unknown => None,
    };
    events.extend(setting_event(at.scg, EVICTION_EVENT, eviction, &mut memory.eviction_announced));
    let persistence = match observed.safety.persistence {
        Persistence::NoAppendOnly => Some(Some(PERSISTENCE_MESSAGE.to_string())),
        Persistence::AppendOnly => Some(None),
        Persistence::Unknown => None,
    };
    events.extend(setting_event(at.scg, PERSISTENCE_EVENT, persistence, &mut memory.persistence_announced));
    let template = (!spec.unknown_template_fields.is_empty()).then(|| template_message(&spec.unknown_template_fields));
    events.extend(announce_once(at.scg, TEMPLATE_EVENT, template, &mut memory.template_announced));
    events.extend(announce_once(
        at.scg,
        RECOVERY_DEADLINE_EVENT,
        figures.recovery_deadline_short.clone(),
        &mut memory.recovery_deadline_announced,
    ));
    events.extend(recovery_failure_event(at.scg, &figures.recovery_run, &mut memory.recovery_failure_announced));
    events
}

/// The worker Deployment (with the pods to remove first when scaling
/// down) and the recovery CronJob.
fn owned_objects(
    spec: &ValidSpec,
    observed: &Observation,
    figures: &StatusFigures,
    settings: &ObjectSettings,
) -> Result<OwnedObjects, Error> {
    let mut deployment = objects::worker_deployment(spec, figures.scaling.replicas)?;
    objects::stamp_secrets_digest(&mut deployment, observed.secrets_digest.as_deref());
    Ok(OwnedObjects {
        deletion_costs: match figures.current_replicas {
            Some(current) if figures.scaling.replicas < current => deletion_costs(&figures.snapshot, &observed.pods),
            _ => Vec::new(),
        },
        deployment,
        cronjob: objects::recovery_cronjob(spec, settings)?,
    })
}

/// What the `EvictionPossible` condition and its Warning say of a server
/// that may evict keys.
pub fn eviction_message(policy: &str, maxmemory: u64) -> String {
    let what = if policy.starts_with("allkeys") {
        "the stream itself, with its consumer groups and every pending entry"
    } else {
        "the keys that expire: the idempotency guard's marks and completion records, before their time"
    };
    format!(
        "Redis maxmemory-policy is {policy} with maxmemory {maxmemory} bytes: when memory is full it evicts {what}; \
         set maxmemory-policy noeviction (writes then fail instead, and nothing is lost)"
    )
}

/// What the `LossOnRestartPossible` condition and its Warning say of a
/// server without an append-only file.
pub const PERSISTENCE_MESSAGE: &str = "Redis keeps no append-only file (aof_enabled:0): entries added and acks made since its \
     last RDB snapshot, if it takes any, are lost when it restarts; an entry lost is never processed, an ack lost is \
     processed again. Set appendonly yes (appendfsync everysec loses about the last second, always loses nothing), or \
     keep this only where a replica promoted in sync takes over";

const EVICTION_EVENT: ConditionEvent =
    ConditionEvent { condition: crate::conditions::EVICTION_POSSIBLE, reason: "EvictionPossible" };
const PERSISTENCE_EVENT: ConditionEvent =
    ConditionEvent { condition: crate::conditions::LOSS_ON_RESTART_POSSIBLE, reason: "LossOnRestartPossible" };

/// A Warning when a server setting is first seen to put the work at risk
/// (`risk`: `Some(Some(message))` at risk, `Some(None)` safe, `None` not
/// known): not announced since it was last safe (or, first, the condition
/// was not already true).
fn setting_event(
    scg: &StreamConsumerGroup,
    kind: ConditionEvent,
    risk: Option<Option<String>>,
    announced: &mut Option<bool>,
) -> Option<PlannedEvent> {
    let before = announced.unwrap_or_else(|| {
        scg.status
            .as_ref()
            .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == kind.condition && c.status == "True"))
    });
    match risk? {
        Some(note) => {
            *announced = Some(true);
            (!before).then_some(PlannedEvent {
                type_: EventType::Warning,
                reason: kind.reason,
                action: "Inspect",
                note,
            })
        }
        None => {
            *announced = Some(false);
            None
        }
    }
}

/// What the `TemplateFieldsUnknown` condition and its Warning say.
pub fn template_message(unknown: &[String]) -> String {
    format!(
        "the worker pod template has fields a pod template does not have, dropped (a typo?): {}; the workers run \
         without them until the resource is fixed",
        unknown.join(", ")
    )
}

/// What the `RecoveryDeadlineTooShort` condition and its Warning say, when
/// it holds: in `Worker` recovery mode a run is stopped at the operator's
/// deadline (the chart's `sweep.activeDeadlineSeconds`), so a handler
/// allowed as long or longer (`spec.worker.handlerTimeoutSeconds`, else
/// min-idle-time) may never finish in one; each stopped run hands the
/// entry back with one more delivery, until it is dead-lettered.
pub fn recovery_deadline_message(
    spec: &ValidSpec,
    mode: RecoveryMode,
    deadline_seconds: Option<i64>,
) -> Option<String> {
    let deadline = Duration::from_secs(u64::try_from(deadline_seconds?).ok()?);
    let handler = spec.worker_env.options.handler_timeout_ms.map_or(spec.min_idle, Duration::from_millis);
    (mode == RecoveryMode::Worker && handler >= deadline).then(|| {
        let source = if spec.worker_env.options.handler_timeout_ms.is_some() {
            "spec.worker.handlerTimeoutSeconds"
        } else {
            "min-idle-time, as spec.worker.handlerTimeoutSeconds is unset"
        };
        format!(
            "a recovery run (recovery.mode Worker) is stopped after {} s, the operator's recovery deadline, but a handler \
             may run {} s ({source}): one that takes that long never finishes in a recovery run, and each stopped run \
             counts a delivery until its entry is dead-lettered; lower the handler timeout below the deadline or raise \
             the deadline (the chart's sweep.activeDeadlineSeconds)",
            deadline.as_secs(),
            handler.as_secs_f64(),
        )
    })
}

/// A Warning raised by a condition that holds while the spec does not change.
pub struct ConditionEvent {
    pub condition: &'static str,
    pub reason: &'static str,
}

const TEMPLATE_EVENT: ConditionEvent =
    ConditionEvent { condition: crate::conditions::TEMPLATE_FIELDS_UNKNOWN, reason: "TemplateFieldsUnknown" };
const RECOVERY_DEADLINE_EVENT: ConditionEvent =
    ConditionEvent { condition: crate::conditions::RECOVERY_DEADLINE_TOO_SHORT, reason: "RecoveryDeadlineTooShort" };

/// A Warning when a spec-born condition holds (`note`: its message), once
/// per message: not again while the condition already says so, nor after
/// this operator said it (the cached status may lag).
fn announce_once(
    scg: &StreamConsumerGroup,
    kind: ConditionEvent,
    note: Option<String>,
    announced: &mut Option<String>,
) -> Option<PlannedEvent> {
    let Some(note) = note else {
        *announced = None;
        return None;
    };
    let shown = scg.status.as_ref().is_some_and(|s| {
        s.conditions.iter().any(|c| c.type_ == kind.condition && c.status == "True" && c.message == note)
    });
    if shown || announced.as_deref() == Some(note.as_str()) {
        return None;
    }
    *announced = Some(note.clone());
    Some(PlannedEvent { type_: EventType::Warning, reason: kind.reason, action: "Validate", note })
}

/// A Warning once per failed recovery run (not again while the condition
/// already names it).
fn recovery_failure_event(
    scg: &StreamConsumerGroup,
    run: &LastRun,
    announced: &mut Option<String>,
) -> Option<PlannedEvent> {
    let (LastRun::Failed { job, .. }, Some(note)) = (run, recovery_runs::failed_message(run)) else { return None };
    let shown = scg.status.as_ref().is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == crate::conditions::RECOVERY_FAILING
                && c.status == "True"
                && c.message.contains(&format!("Job {job},"))
        })
    });
    if shown || announced.as_ref() == Some(job) {
        return None;
    }
    *announced = Some(job.clone());
    Some(PlannedEvent { type_: EventType::Warning, reason: "RecoveryRunFailed", action: "Recover", note })
}

/// Each pod's deletion cost: the entries its consumers hold (a consumer is
/// `<pod name>.<pod UID>`, or the pod name), 0 for a pod holding none.
fn deletion_costs(snapshot: &GroupSnapshot, pods: &[(String, Option<String>)]) -> Vec<(String, i32)> {
    pods.iter()
        .map(|(name, uid)| {
            let identities: Vec<String> = crate::controller::reaper::identities(name, uid.as_deref()).collect();
            let held = snapshot
                .consumers
                .iter()
                .filter(|c| identities.contains(&c.name))
                .map(|c| c.pending)
                .fold(0, u64::saturating_add);
            (name.clone(), i32::try_from(held).unwrap_or(i32::MAX))
        })
        .collect()
}

/// A suspended pipeline reads `Suspended` with its figures, unless payloads
/// were lost: that still needs a person, suspended or not.
fn suspended_health(suspend: bool, health: Health, message: String, snapshot: &GroupSnapshot) -> (Health, String) {
    if !suspend || health == Health::PayloadLost {
        return (health, message);
    }
    let lag = match snapshot.lag {
        Lag::Known(n) => n.to_string(),
        Lag::AtLeast(n) => format!(">={n}"),
        _ => "unknown".to_string(),
    };
    let note = format!(
        "suspended (spec.suspend): no workers, no recovery runs; lag {lag}, pending {}; \
         without the suspension: {health:?}",
        snapshot.pending
    );
    (Health::Suspended, note)
}

/// Dead-letter streams over `spec.recovery.deadLetterMaxLength` (trimmed to
/// it, each with a Warning naming what is dropped), and whether any is at it.
fn dead_letter_cap(spec: &ValidSpec, observed: &Observation) -> (Vec<(String, u64)>, Vec<PlannedEvent>, Option<bool>) {
    let Some(cap) = spec.dead_letter_max_length else {
        return (Vec::new(), Vec::new(), None);
    };
    let lengths: Vec<(String, u64)> = observed
        .shards
        .iter()
        .filter_map(|(stream, s)| Some((spec.dead_letter_stream_of(stream), s.as_ref()?.dead_letter_length)))
        .collect();
    let over: Vec<&(String, u64)> = lengths.iter().filter(|(_, n)| *n > cap).collect();
    let events = over
        .iter()
        .map(|(stream, length)| PlannedEvent {
            type_: EventType::Warning,
            reason: "DeadLetterCapReached",
            action: "Trim",
            note: format!(
                "dead-letter stream {stream} holds {length} letters, over its cap of {cap} \
                 (spec.recovery.deadLetterMaxLength): the oldest {} are dropped",
                length - cap
            ),
        })
        .collect();
    let trims = over.iter().map(|(stream, _)| (stream.clone(), cap)).collect();
    (trims, events, Some(lengths.iter().any(|(_, n)| *n >= cap)))
}

/// Each shard's dead-letter stream that has letters, with the age bound.
fn dead_letter_expiry(spec: &ValidSpec, observed: &Observation) -> Vec<(String, Duration)> {
    let Some(max_age) = spec.dead_letter_max_age else { return Vec::new() };
    observed
        .shards
        .iter()
        .filter(|(_, s)| s.as_ref().is_some_and(|s| s.dead_letter_length > 0))
        .map(|(stream, _)| (spec.dead_letter_stream_of(stream), max_age))
        .collect()
}

/// The missing group's start: never silently at `$` for a group seen before,
/// which resumes where it was.
fn create_group(spec: &ValidSpec, scg: &StreamConsumerGroup) -> Plan {
    match scg.status.as_ref().and_then(|s| s.resume_id.clone()) {
        Some(start) => Plan::CreateGroup { start, vanished: true },
        None => Plan::CreateGroup { start: spec.start_id.clone(), vanished: false },
    }
}

/// Trim each shard to the policy's target, never past its safe floor. The
/// verdict shown is the first held shard's, else shard 0's.
fn retention_plan(observed: &Observation) -> (Option<Retention>, Vec<(String, StreamId)>) {
    let mut shown: Option<Retention> = None;
    let mut trims = Vec::new();
    for (stream, bounds) in &observed.retention {
        let (point, blocked) = retention::trim_point(bounds.target, bounds.floor);
        let verdict = Retention { floor: bounds.floor, target: bounds.target, blocked, trimmed: 0 };
        if shown.as_ref().is_none_or(|s| blocked && !s.blocked) {
            shown = Some(verdict);
        }
        trims.extend(point.map(|p| (stream.clone(), p)));
    }
    (shown, trims)
}

/// Shards beyond the first whose group is missing; one the status listed
/// before had it and vanished.
fn missing_shards(scg: &StreamConsumerGroup, observed: &Observation) -> Vec<(String, bool)> {
    let known: Vec<&str> = scg.status.iter().flat_map(|s| &s.shards).map(|s| s.stream.as_str()).collect();
    observed
        .shards
        .iter()
        .skip(1)
        .filter(|(_, snapshot)| snapshot.is_none())
        .map(|(stream, _)| (stream.clone(), known.contains(&stream.as_str())))
        .collect()
}

/// Each shard's figures, when there is more than one.
fn shard_figures(observed: &Observation) -> Vec<ShardStatus> {
    if observed.shards.len() < 2 {
        return Vec::new();
    }
    let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    observed
        .shards
        .iter()
        .filter_map(|(stream, snapshot)| {
            let s = snapshot.as_ref()?;
            Some(ShardStatus {
                stream: stream.clone(),
                oldest_unfinished_time: s.oldest_unfinished_ms.and_then(super::status::time_of_ms),
                lag: match s.lag {
                    Lag::Known(n) => Some(int(n)),
                    _ => None,
                },
                pending: int(s.pending),
                oldest_pending_idle_seconds: s.oldest_pending_idle_ms.map(|ms| int(ms / 1000)),
                dead_letter_length: int(s.dead_letter_length),
            })
        })
        .collect()
}

/// A Normal Event with the numbers whenever the replicas change.
fn scaling_event(current: Option<i32>, scaling: &scaling::Decision) -> Option<PlannedEvent> {
    let current = current.filter(|c| *c != scaling.replicas)?;
    Some(PlannedEvent {
        type_: EventType::Normal,
        reason: "Scaled",
        action: "Scale",
        note: format!("workers {current} -> {}: {}", scaling.replicas, scaling.reason),
    })
}

/// The claimant that came first, if it came before this resource (ties
/// broken by name), so exactly one of them runs the group.
fn earlier_claimant<'a>(scg: &StreamConsumerGroup, claimants: &'a [Claimant]) -> Option<&'a Claimant> {
    let rank = |created: &Option<Time>, key: &str| (created.as_ref().map(|t| t.0), key.to_string());
    let me = rank(&scg.metadata.creation_timestamp, &super::claimant_index::key(scg));
    claimants.iter().filter(|c| rank(&c.created, &c.key) < me).min_by_key(|c| rank(&c.created, &c.key))
}

fn conflict(spec: &ValidSpec, at: &Situation<'_>, observed: &Observation, owner: &Claimant) -> Result<Plan, Error> {
    let deployment = match observed.deployment {
        Some(_) => {
            let mut deployment = objects::worker_deployment(spec, 0)?;
            objects::stamp_secrets_digest(&mut deployment, observed.secrets_digest.as_deref());
            Some(deployment)
        }
        None => None,
    };
    let cronjob = match observed.cronjob {
        Some(_) => {
            let mut cronjob = objects::recovery_cronjob(spec, at.settings)?;
            if let Some(spec) = cronjob.spec.as_mut() {
                spec.suspend = Some(true);
            }
            Some(cronjob)
        }
        None => None,
    };
    let before =
        at.scg.status.as_ref().is_some_and(|s| crate::conditions::is_true(&s.conditions, crate::conditions::CONFLICT));
    let events = (!before)
        .then(|| PlannedEvent {
            type_: EventType::Warning,
            reason: "Conflict",
            action: "Reconcile",
            note: conflict_message(at.scg, &owner.key),
        })
        .into_iter()
        .collect();
    Ok(Plan::Conflict(Box::new(Conflict {
        owner: owner.key.clone(),
        snapshot: observed.group.clone(),
        deployment,
        cronjob,
        events,
    })))
}

pub fn conflict_message(scg: &StreamConsumerGroup, owner: &str) -> String {
    format!(
        "stream {:?} group {:?} on this Redis is run by {owner}, created first: this resource runs no workers \
         until that one is deleted or names another group",
        scg.spec.stream, scg.spec.group
    )
}

/// Consumers of this resource's workloads whose pods are gone (see `reaper`).
fn reap_plan(scg: &StreamConsumerGroup, snapshot: &GroupSnapshot, observed: &Observation) -> Vec<Reap> {
    let prefixes = objects::pod_name_prefixes(scg);
    reaper::dead_consumers(&snapshot.consumers, &observed.live_pods, &prefixes)
        .into_iter()
        .map(|c| if c.pending > 0 { Reap::Release(c.name.clone()) } else { Reap::Delete(c.name.clone()) })
        .collect()
}

pub fn recovery_status(r: RecoveryReport) -> RecoveryStatus {
    let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    // Seconds, as the API stores a Time: a finer value would never compare
    // equal to the stored one, and every poll would rewrite the status.
    let seconds = i64::try_from(r.finished_at_ms / 1000).unwrap_or(0);
    RecoveryStatus {
        time: Time(k8s_openapi::jiff::Timestamp::from_second(seconds).unwrap_or_default()),
        claimed: int(r.claimed),
        dead_lettered: int(r.dead_lettered),
        payload_lost: int(r.payload_lost),
    }
}

/// One Event per new recovery run: a Warning when it dead-lettered entries
/// (a defect signal), Normal otherwise. Lost payloads are announced from the
/// payload-loss record, whoever found them.
fn recovery_event(
    scg: &StreamConsumerGroup,
    latest: Option<&RecoveryStatus>,
    announced: Option<&Time>,
) -> Option<PlannedEvent> {
    let latest = latest?;
    let previous = scg.status.as_ref().and_then(|s| s.last_recovery.as_ref());
    if previous.is_some_and(|p| p.time == latest.time) || announced == Some(&latest.time) {
        return None;
    }
    let (type_, reason) = if latest.dead_lettered > 0 {
        (EventType::Warning, "DeadLettered")
    } else {
        (EventType::Normal, "RecoveryCompleted")
    };
    let note = format!(
        "recovery claimed {}, dead-lettered {}, found {} pending entries without payload",
        latest.claimed, latest.dead_lettered, latest.payload_lost
    );
    Some(PlannedEvent { type_, reason, action: "Recover", note })
}

/// The payload-loss record against the user's acknowledgement annotation.
fn payload_lost_status(scg: &StreamConsumerGroup, loss: &PayloadLoss) -> PayloadLostStatus {
    let total = i64::try_from(loss.total).unwrap_or(i64::MAX);
    let acknowledged = scg
        .annotations()
        .get(PAYLOAD_LOST_ACKNOWLEDGED)
        .and_then(|v| v.trim().parse::<i64>().ok())
        .unwrap_or(0)
        .clamp(0, total);
    PayloadLostStatus {
        total,
        unacknowledged: total - acknowledged,
        latest_ids: loss.latest.iter().take(5).cloned().collect(),
    }
}

/// A Warning each time the record grows, naming the count and the latest IDs.
fn payload_loss_event(scg: &StreamConsumerGroup, now: &PayloadLostStatus, announced: i64) -> Option<PlannedEvent> {
    let shown = scg.status.as_ref().and_then(|s| s.payload_lost.as_ref()).map_or(0, |p| p.total);
    let before = shown.max(announced);
    (now.total > before && now.unacknowledged > 0).then(|| PlannedEvent {
        type_: EventType::Warning,
        reason: "PayloadLost",
        action: "Inspect",
        note: format!(
            "{} more pending entries were found with their payload trimmed or deleted ({} in all, {} not acknowledged); latest IDs: {}. \
             Acknowledge with the annotation {PAYLOAD_LOST_ACKNOWLEDGED}={}",
            now.total - before,
            now.total,
            now.unacknowledged,
            now.latest_ids.join(", "),
            now.total
        ),
    })
}

/// A Warning on entering a bad health class, a Normal Event on getting back
/// to Healthy.
/// `before`: the health last announced (or, after a restart, the stored one).
fn health_event(before: Option<Health>, health: Health, message: &str) -> Option<PlannedEvent> {
    if before == Some(health) || (before.is_none() && health == Health::Healthy) {
        return None;
    }
    let from = before.map_or("none".to_string(), |h| format!("{h:?}"));
    let note = format!("health {from} -> {health:?}: {message}");
    Some(match health {
        Health::Suspended => PlannedEvent { type_: EventType::Normal, reason: "Suspended", action: "Suspend", note },
        _ if before == Some(Health::Suspended) => {
            PlannedEvent { type_: EventType::Normal, reason: "Resumed", action: "Resume", note }
        }
        Health::Healthy => PlannedEvent { type_: EventType::Normal, reason: "Healthy", action: "Inspect", note },
        _ => PlannedEvent { type_: EventType::Warning, reason: "HealthDegraded", action: "Inspect", note },
    })
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{observed, run, scg, snapshot};
    use super::super::observe::RetentionBounds;
    use super::*;
    use streamfleet_crd::StreamConsumerGroupStatus;

    #[test]
    fn parked_entries_are_read_against_the_schedule() {
        let schedule = Schedule::fixed(Duration::from_secs(10));
        let parked = |deliveries, entries, most_idle_ms, error: &str| ParkedState {
            deliveries,
            entries,
            most_idle_ms,
            last_error: Some(error.into()),
        };
        let mut s = snapshot(0, 5, &[]);
        s.retrying = 5;
        s.parked = vec![parked(1, 3, 4_000, "a"), parked(4, 2, 9_000, "b")];
        let r = retrying(&s, &schedule, 5);
        assert_eq!((r.entries, r.on_last_attempt), (5, 2), "delivery 5 is the last");
        assert_eq!((r.due_after_ms, r.last_error.as_deref()), (Some(1_000), Some("b")));
        assert_eq!(r.by_delivery, vec![(1, 3), (4, 2)]);
        // Overdue (no consumer took it yet): by how much.
        s.parked = vec![parked(1, 3, 60_000, "a")];
        assert_eq!(retrying(&s, &schedule, 5).due_after_ms, Some(-50_000));
        assert_eq!(retrying(&snapshot(0, 0, &[]), &schedule, 5), Retrying::default());
    }

    #[test]
    fn a_recovery_run_is_announced_once_even_before_the_cache_shows_the_status() {
        let at = |s| Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap_or_default());
        let run = |s| RecoveryStatus { time: at(s), claimed: 0, dead_lettered: 0, payload_lost: 0 };
        let stale = scg();
        assert!(recovery_event(&stale, Some(&run(60)), None).is_some(), "a new run is announced");
        assert!(
            recovery_event(&stale, Some(&run(60)), Some(&at(60))).is_none(),
            "the status in the cache is stale, the memory is not"
        );
        assert!(recovery_event(&stale, Some(&run(120)), Some(&at(60))).is_some(), "the next run is");
    }

    #[test]
    fn unknown_template_fields_are_a_condition_and_one_warning() {
        let typo: StreamConsumerGroup = serde_json::from_value(serde_json::json!({
            "apiVersion": "streamfleet.io/v1alpha1",
            "kind": "StreamConsumerGroup",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "u-1", "generation": 1},
            "spec": {
                "redis": {"urlSecretRef": {"name": "redis", "key": "url"}},
                "stream": "orders",
                "group": "billing",
                "worker": {"template": {"spec": {"containers": [{"name": "w", "image": "worker", "resoures": {}}]}}}
            }
        }))
        .unwrap();
        let plan = converge(run(&typo, &observed(Some(snapshot(0, 0, &[])), Some(1))));
        let field = "spec.worker.template.spec.containers[0].resoures";
        assert_eq!(plan.figures.unknown_template_fields, vec![field]);
        let warnings: Vec<_> = plan.events.iter().filter(|e| e.reason == "TemplateFieldsUnknown").collect();
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].note.contains(field), "{}", warnings[0].note);
        let status =
            super::super::status::converged(&typo, &plan.figures, &Default::default(), &Time(Default::default()));
        let condition = status.conditions.iter().find(|c| c.type_ == crate::conditions::TEMPLATE_FIELDS_UNKNOWN);
        assert!(condition.is_some_and(|c| c.status == "True" && c.message.contains(field)), "{condition:?}");
        // Once the status shows it, no second Warning; fixed, the condition goes.
        let mut shown = typo.clone();
        shown.status = Some(status);
        let mut memory = PolicyMemory::default();
        let note = Some(template_message(&plan.figures.unknown_template_fields));
        assert_eq!(announce_once(&shown, TEMPLATE_EVENT, note, &mut memory.template_announced), None);
        let fixed = converge(run(&scg(), &observed(Some(snapshot(0, 0, &[])), Some(1))));
        let status =
            super::super::status::converged(&shown, &fixed.figures, &Default::default(), &Time(Default::default()));
        assert!(status.conditions.iter().all(|c| c.type_ != crate::conditions::TEMPLATE_FIELDS_UNKNOWN));
    }

    /// A server without an append-only file loses, when it restarts, what
    /// was written since its last snapshot: a condition and one Warning
    /// while it is so, nothing claimed while unknown, gone once it has one.
    #[test]
    fn a_server_without_an_append_only_file_is_a_condition_and_one_warning_until_it_has_one() {
        use streamfleet_streams::version::Persistence;
        let scg = scg();
        let spec = super::super::validate::validate(&scg).unwrap();
        let settings = ObjectSettings::default();
        let at = Situation { scg: &scg, settings: &settings, now: Duration::from_secs(100) };
        let run = |persistence: Persistence, memory: &mut PolicyMemory| {
            let mut observed = observed(Some(snapshot(0, 0, &[])), Some(1));
            observed.safety.persistence = persistence;
            match decide(&spec, &observed, memory, &at).unwrap() {
                Plan::Converge(c) => *c,
                _ => panic!("expected a convergence"),
            }
        };
        let warnings = |p: &Convergence| p.events.iter().filter(|e| e.reason == "LossOnRestartPossible").count();
        let status_of = |scg: &StreamConsumerGroup, p: &Convergence| {
            super::super::status::converged(scg, &p.figures, &Default::default(), &Time(Default::default()))
        };
        let condition = |s: &streamfleet_crd::StreamConsumerGroupStatus| {
            s.conditions.iter().find(|c| c.type_ == crate::conditions::LOSS_ON_RESTART_POSSIBLE).cloned()
        };
        let mut memory = PolicyMemory::default();
        let off = run(Persistence::NoAppendOnly, &mut memory);
        assert_eq!(warnings(&off), 1);
        let status = status_of(&scg, &off);
        let said = condition(&status).expect("the condition");
        assert_eq!((said.status.as_str(), said.reason.as_str()), ("True", "AppendOnlyFileOff"));
        assert!(said.message.contains("appendonly yes"), "{}", said.message);
        assert_eq!(warnings(&run(Persistence::NoAppendOnly, &mut memory)), 0, "said once");
        let mut shown = scg.clone();
        shown.status = Some(status);
        // Not read this time: the condition stays as it was, nothing said.
        let unknown = run(Persistence::Unknown, &mut memory);
        assert_eq!(warnings(&unknown), 0);
        assert!(condition(&status_of(&shown, &unknown)).is_some());
        // An append-only file: the condition goes; off again, said again.
        let on = run(Persistence::AppendOnly, &mut memory);
        assert_eq!(condition(&status_of(&shown, &on)), None);
        assert_eq!(warnings(&run(Persistence::NoAppendOnly, &mut memory)), 1);
    }

    #[test]
    fn a_handler_timeout_past_the_recovery_deadline_is_a_condition_and_one_warning_in_worker_mode() {
        let with = |mode: &str, timeout: Option<u64>| -> StreamConsumerGroup {
            let mut scg = scg();
            let mut spec = serde_json::to_value(&scg.spec).unwrap();
            spec["recovery"]["mode"] = serde_json::json!(mode);
            if let Some(t) = timeout {
                spec["worker"]["handlerTimeoutSeconds"] = serde_json::json!(t);
            }
            scg.spec = serde_json::from_value(spec).unwrap();
            scg
        };
        let settings = ObjectSettings { sweep_deadline_seconds: Some(900), ..ObjectSettings::default() };
        let plan = |scg: &StreamConsumerGroup, memory: &mut PolicyMemory| {
            let at = Situation { scg, settings: &settings, now: Duration::from_secs(100) };
            let observed = observed(Some(snapshot(0, 0, &[])), Some(1));
            match decide(&super::super::validate::validate(scg).unwrap(), &observed, memory, &at).unwrap() {
                Plan::Converge(c) => *c,
                _ => panic!("expected a convergence"),
            }
        };
        let warnings = |p: &Convergence| p.events.iter().filter(|e| e.reason == "RecoveryDeadlineTooShort").count();

        let long = with("Worker", Some(1_200));
        let mut memory = PolicyMemory::default();
        let first = plan(&long, &mut memory);
        let message = first.figures.recovery_deadline_short.clone().unwrap_or_default();
        assert!(message.contains("900 s") && message.contains("1200 s"), "{message}");
        assert!(message.contains("spec.worker.handlerTimeoutSeconds"), "{message}");
        assert_eq!(warnings(&first), 1);
        let status =
            super::super::status::converged(&long, &first.figures, &Default::default(), &Time(Default::default()));
        let condition = status.conditions.iter().find(|c| c.type_ == crate::conditions::RECOVERY_DEADLINE_TOO_SHORT);
        assert!(condition.is_some_and(|c| c.status == "True" && c.message == message), "{condition:?}");
        assert_eq!(warnings(&plan(&long, &mut memory)), 0, "said once");

        // As long as the deadline is too long; without a timeout, min-idle-time is the bound.
        let equal = plan(&with("Worker", Some(900)), &mut PolicyMemory::default());
        assert!(equal.figures.recovery_deadline_short.is_some_and(|m| m.contains("900 s (spec.worker")));
        let mut idle_bound = with("Worker", None);
        let mut spec = serde_json::to_value(&idle_bound.spec).unwrap();
        spec["recovery"]["minIdleTimeMs"] = serde_json::json!(1_800_000);
        idle_bound.spec = serde_json::from_value(spec).unwrap();
        let message = plan(&idle_bound, &mut PolicyMemory::default()).figures.recovery_deadline_short;
        assert!(message.is_some_and(|m| m.contains("1800 s (min-idle-time")));
        // Shorter than the deadline, or a sweep (which runs no handler): nothing to say.
        for fine in [with("Worker", Some(600)), with("Sweep", Some(1_200))] {
            let p = plan(&fine, &mut PolicyMemory::default());
            assert_eq!((p.figures.recovery_deadline_short.as_deref(), warnings(&p)), (None, 0));
            let mut shown = long.clone();
            shown.status = Some(status.clone());
            let status =
                super::super::status::converged(&shown, &p.figures, &Default::default(), &Time(Default::default()));
            assert!(status.conditions.iter().all(|c| c.type_ != crate::conditions::RECOVERY_DEADLINE_TOO_SHORT));
        }
    }

    #[test]
    fn a_failed_recovery_run_is_a_condition_and_one_warning_until_a_run_succeeds() {
        use k8s_openapi::api::batch::v1::{Job, JobCondition, JobStatus};
        let t = |secs| Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap());
        // Jobs (name, created, outcome: None running, Some(true) complete, Some(false) failed).
        let with_jobs = |jobs: &[(&str, i64, Option<bool>)]| {
            let mut seen = observed(Some(snapshot(0, 0, &[])), Some(1));
            seen.recovery_jobs = jobs
                .iter()
                .map(|(name, created, outcome)| {
                    let condition = |type_: &str| JobCondition {
                        type_: type_.into(),
                        status: "True".into(),
                        reason: Some("BackoffLimitExceeded".into()).filter(|_| type_ == "Failed"),
                        message: None,
                        last_probe_time: None,
                        last_transition_time: None,
                    };
                    std::sync::Arc::new(Job {
                        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                            name: Some(name.to_string()),
                            creation_timestamp: Some(t(*created)),
                            ..Default::default()
                        },
                        status: Some(JobStatus {
                            conditions: outcome.map(|ok| vec![condition(if ok { "Complete" } else { "Failed" })]),
                            completion_time: outcome.filter(|ok| *ok).map(|_| t(created + 5)),
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                })
                .collect();
            seen
        };
        let now = Time(Default::default());
        let failing = |s: &StreamConsumerGroupStatus| {
            s.conditions.iter().find(|c| c.type_ == crate::conditions::RECOVERY_FAILING).map(|c| c.status.clone())
        };
        let plan = converge(run(&scg(), &with_jobs(&[("r-1", 300, Some(true)), ("r-2", 600, Some(false))])));
        let warnings: Vec<_> = plan.events.iter().filter(|e| e.reason == "RecoveryRunFailed").collect();
        assert_eq!(warnings.len(), 1, "{:?}", plan.events);
        assert!(warnings[0].note.contains("Job r-2, started 1970-01-01T00:10:00Z failed: BackoffLimitExceeded"));
        assert!(warnings[0].note.contains("finished at 1970-01-01T00:05:05Z"), "{}", warnings[0].note);
        let status = super::super::status::converged(&scg(), &plan.figures, &Default::default(), &now);
        assert_eq!(failing(&status).as_deref(), Some("True"));
        // Shown: no second Warning for the same run; a later failed run is announced again.
        let mut shown = scg();
        shown.status = Some(status);
        let again = converge(run(&shown, &with_jobs(&[("r-2", 600, Some(false))])));
        assert!(again.events.iter().all(|e| e.reason != "RecoveryRunFailed"));
        let later = converge(run(&shown, &with_jobs(&[("r-2", 600, Some(false)), ("r-3", 900, Some(false))])));
        assert!(later.events.iter().any(|e| e.reason == "RecoveryRunFailed"));
        // A run in progress changes nothing; a success clears it.
        let plan = converge(run(&shown, &with_jobs(&[("r-2", 600, Some(false)), ("r-3", 900, None)])));
        let status = super::super::status::converged(&shown, &plan.figures, &Default::default(), &now);
        assert_eq!(failing(&status).as_deref(), Some("True"), "still the last finished run's outcome");
        let plan = converge(run(&shown, &with_jobs(&[("r-2", 600, Some(false)), ("r-3", 900, Some(true))])));
        let status = super::super::status::converged(&shown, &plan.figures, &Default::default(), &now);
        assert_eq!(failing(&status).as_deref(), Some("False"));
        // Suspended: no run is due, the condition goes (and with it the gauge).
        let mut suspended = shown.clone();
        suspended.spec.suspend = true;
        let plan = converge(run(&suspended, &with_jobs(&[("r-2", 600, Some(false))])));
        let status = super::super::status::converged(&suspended, &plan.figures, &Default::default(), &now);
        assert_eq!(failing(&status), None);
        // Never run: no condition at all.
        let plan = converge(run(&scg(), &observed(Some(snapshot(0, 0, &[])), Some(1))));
        let status = super::super::status::converged(&scg(), &plan.figures, &Default::default(), &now);
        assert_eq!(failing(&status), None);
    }

    fn converge(plan: Plan) -> Convergence {
        match plan {
            Plan::Converge(c) => *c,
            _ => panic!("expected a convergence plan"),
        }
    }

    #[test]
    fn a_suspended_pipeline_runs_nothing_and_still_reports_its_figures() {
        let mut suspended = scg();
        suspended.spec.suspend = true;
        let plan = converge(run(&suspended, &observed(Some(snapshot(700, 30, &[])), Some(3))));
        assert_eq!(plan.figures.scaling.replicas, 0, "workers to zero, whatever the lag");
        assert_eq!(plan.owned.deployment.spec.as_ref().and_then(|s| s.replicas), Some(0));
        assert_eq!(plan.owned.cronjob.spec.as_ref().and_then(|s| s.suspend), Some(true), "no recovery runs");
        assert_eq!(plan.figures.health, Health::Suspended);
        assert!(plan.figures.health_message.contains("lag 700, pending 30"), "{}", plan.figures.health_message);
        let announced: Vec<&str> = plan.events.iter().map(|e| e.reason).collect();
        assert!(announced.contains(&"Suspended") && announced.contains(&"Scaled"), "{announced:?}");

        // Resumed: the Event says so once, the CronJob runs again.
        let mut resumed = scg();
        resumed.status =
            Some(StreamConsumerGroupStatus { health: Some(Health::Suspended), ..StreamConsumerGroupStatus::default() });
        let plan = converge(run(&resumed, &observed(Some(snapshot(700, 30, &[])), Some(0))));
        assert_eq!(plan.owned.cronjob.spec.as_ref().and_then(|s| s.suspend), Some(false));
        assert!(plan.figures.scaling.replicas > 0);
        let resumed_events: Vec<_> = plan.events.iter().filter(|e| e.reason == "Resumed").collect();
        assert_eq!(resumed_events.len(), 1, "{:?}", plan.events);
        assert_eq!(resumed_events[0].type_, EventType::Normal);
    }

    #[test]
    fn a_health_transition_is_announced_once_even_before_the_cache_shows_the_status() {
        let mut stale = scg();
        stale.spec.suspend = true;
        let settings = crate::objects::ObjectSettings::default();
        let at = Situation { scg: &stale, settings: &settings, now: Duration::from_secs(100) };
        let seen = observed(Some(snapshot(0, 0, &[])), Some(1));
        let spec = super::super::validate::validate(&stale).unwrap();
        let mut memory = PolicyMemory::default();
        let suspended = |plan: Plan| converge(plan).events.iter().filter(|e| e.reason == "Suspended").count();
        assert_eq!(suspended(decide(&spec, &seen, &mut memory, &at).unwrap()), 1);
        assert_eq!(
            suspended(decide(&spec, &seen, &mut memory, &at).unwrap()),
            0,
            "the cache is stale, the memory is not"
        );
    }

    #[test]
    fn payloads_lost_while_suspended_still_read_payload_lost() {
        let (health, _) = suspended_health(true, Health::PayloadLost, "lost".into(), &snapshot(0, 0, &[]));
        assert_eq!(health, Health::PayloadLost);
        let (health, _) = suspended_health(false, Health::Stalled, "stalled".into(), &snapshot(0, 0, &[]));
        assert_eq!(health, Health::Stalled, "not suspended: untouched");
    }

    #[test]
    fn a_dead_letter_stream_over_its_cap_is_trimmed_to_it_with_a_warning() {
        let mut capped = scg();
        capped.spec.recovery.dead_letter_max_length = Some(100);
        let mut full = snapshot(0, 0, &[]);
        full.dead_letter_length = 130;
        let plan = converge(run(&capped, &observed(Some(full.clone()), Some(1))));
        assert_eq!(plan.redis.dead_letter_trims, vec![("{orders}:dead:g".to_string(), 100)]);
        assert_eq!(plan.figures.dead_letter_cap_reached, Some(true));
        let warning = plan.events.iter().find(|e| e.reason == "DeadLetterCapReached").unwrap();
        assert_eq!(warning.type_, EventType::Warning);
        assert!(warning.note.contains("holds 130") && warning.note.contains("oldest 30"), "{}", warning.note);

        full.dead_letter_length = 100;
        let plan = converge(run(&capped, &observed(Some(full.clone()), Some(1))));
        assert!(plan.redis.dead_letter_trims.is_empty(), "at the cap: nothing to drop");
        assert_eq!(plan.figures.dead_letter_cap_reached, Some(true), "but reached");
        assert!(!plan.events.iter().any(|e| e.reason == "DeadLetterCapReached"));
        let plan = converge(run(&scg(), &observed(Some(full), Some(1))));
        assert_eq!(
            (plan.redis.dead_letter_trims.len(), plan.figures.dead_letter_cap_reached),
            (0, None),
            "no cap, no trim"
        );
    }

    #[test]
    fn a_missing_group_is_created_at_the_start_id_or_where_it_was() {
        let fresh = run(&scg(), &observed(None, Some(1)));
        assert!(matches!(fresh, Plan::CreateGroup { start, vanished: false } if start == "$"));
        let mut seen_before = scg();
        seen_before.status = Some(StreamConsumerGroupStatus { resume_id: Some("41-7".into()), ..Default::default() });
        let again = run(&seen_before, &observed(None, Some(1)));
        assert!(matches!(again, Plan::CreateGroup { start, vanished: true } if start == "41-7"));
    }

    /// A rotated password (or client certificate) changes the pod template,
    /// so the workers, which read it once at start, are rolled.
    #[test]
    fn the_worker_pods_carry_the_digest_of_the_secrets_they_read() {
        let annotation = |o: &Observation| {
            let plan = converge(run(&scg(), o));
            let template = plan.owned.deployment.spec.unwrap().template.metadata.unwrap();
            template.annotations.unwrap_or_default().get(objects::SECRETS_DIGEST_ANNOTATION).cloned()
        };
        let mut o = observed(Some(snapshot(0, 0, &[])), Some(1));
        assert_eq!(annotation(&o).as_deref(), Some("0123abcd"));
        o.secrets_digest = Some("4567ef01".into());
        assert_eq!(annotation(&o).as_deref(), Some("4567ef01"));
        o.secrets_digest = None;
        assert_eq!(annotation(&o), None, "no Secret named");
    }

    #[test]
    fn a_backlog_scales_up_at_once_with_an_event_and_a_count_alone_is_no_verdict() {
        let plan = converge(run(&scg(), &observed(Some(snapshot(350, 50, &[])), Some(1))));
        assert_eq!(plan.figures.scaling.replicas, 4);
        assert_eq!(plan.owned.deployment.spec.as_ref().and_then(|s| s.replicas), Some(4));
        assert_eq!(plan.events.len(), 1);
        assert_eq!((plan.events[0].reason, plan.events[0].note.starts_with("workers 1 -> 4")), ("Scaled", true));
        assert_eq!(plan.figures.health, Health::Healthy, "4 replicas carry 400: {}", plan.figures.health_message);
        // More than the fleet "should" carry is no verdict: health judges the
        // delay over a window, not a count.
        let plan = converge(run(&scg(), &observed(Some(snapshot(1000, 0, &[])), Some(1))));
        assert_eq!((plan.figures.scaling.replicas, plan.figures.health), (5, Health::Healthy));
    }

    #[test]
    fn a_scale_down_prices_each_pod_by_the_entries_its_consumer_holds() {
        let mut seen = observed(Some(snapshot(0, 4, &[("orders-worker-a.u1", 4)])), Some(3));
        seen.pods = vec![("orders-worker-a".into(), Some("u1".into())), ("orders-worker-b".into(), Some("u2".into()))];
        let plan = converge(run(&scg(), &seen));
        assert_eq!(plan.figures.scaling.replicas, 1);
        assert_eq!(
            plan.owned.deletion_costs,
            vec![("orders-worker-a".to_string(), 4), ("orders-worker-b".to_string(), 0)]
        );
        // No scale-down: no pod is touched.
        let plan = converge(run(&scg(), &observed(Some(snapshot(350, 50, &[])), Some(1))));
        assert!(plan.owned.deletion_costs.is_empty());
    }

    #[test]
    fn no_deployment_yet_means_no_scaling_event() {
        let plan = converge(run(&scg(), &observed(Some(snapshot(0, 0, &[])), None)));
        assert_eq!(plan.figures.scaling.replicas, 1);
        assert!(plan.events.is_empty());
    }

    #[test]
    fn consumers_whose_pods_are_gone_are_released_or_deleted() {
        let consumers =
            [("orders-worker-a", 5), ("orders-worker-b", 3), ("orders-recovery-1-x", 0), ("someone-else", 9)];
        let plan = converge(run(&scg(), &observed(Some(snapshot(0, 17, &consumers)), Some(1))));
        assert_eq!(
            plan.redis.reap,
            vec![Reap::Release("orders-worker-b".into()), Reap::Delete("orders-recovery-1-x".into())]
        );
    }

    #[test]
    fn retention_is_held_at_the_floor() {
        let mut seen = observed(Some(snapshot(0, 0, &[])), Some(1));
        let id = |ms| StreamId { ms, seq: 0 };
        let bounds = |target, floor| RetentionBounds { target: Some(id(target)), floor: Some(id(floor)) };
        seen.retention = vec![("orders".into(), bounds(90, 40))];
        let plan = converge(run(&scg(), &seen));
        assert_eq!(plan.redis.trims, vec![("orders".to_string(), id(40))]);
        assert!(plan.figures.retention.is_some_and(|r| r.blocked));
        seen.retention = vec![("orders".into(), bounds(10, 40))];
        assert_eq!(converge(run(&scg(), &seen)).redis.trims, vec![("orders".to_string(), id(10))]);
        // Per shard: each trimmed within its own floor; the held one is shown.
        seen.retention = vec![("orders".into(), bounds(10, 40)), ("orders:1".into(), bounds(90, 50))];
        let plan = converge(run(&scg(), &seen));
        assert_eq!(plan.redis.trims, vec![("orders".to_string(), id(10)), ("orders:1".to_string(), id(50))]);
        assert!(plan.figures.retention.is_some_and(|r| r.blocked && r.floor == Some(id(50))));
    }

    #[test]
    fn shards_without_the_group_are_created_and_each_shard_has_its_figures() {
        let mut seen = observed(Some(snapshot(3, 2, &[])), Some(1));
        seen.shards.push(("orders:1".into(), Some(snapshot(4, 1, &[]))));
        seen.shards.push(("orders:2".into(), None));
        let mut resource = scg();
        resource.status = Some(streamfleet_crd::StreamConsumerGroupStatus {
            shards: vec![ShardStatus { stream: "orders:2".into(), ..ShardStatus::default() }],
            ..Default::default()
        });
        let plan = converge(run(&resource, &seen));
        assert_eq!(plan.redis.create_shards, vec![("orders:2".to_string(), true)], "listed before: it vanished");
        let streams: Vec<&str> = plan.figures.shard_figures.iter().map(|s| s.stream.as_str()).collect();
        assert_eq!(streams, vec!["orders", "orders:1"]);
        assert_eq!((plan.figures.shard_figures[0].lag, plan.figures.shard_figures[1].pending), (Some(3), 1));
        resource.status = None;
        assert_eq!(converge(run(&resource, &seen)).redis.create_shards, vec![("orders:2".to_string(), false)]);
        assert!(converge(run(&scg(), &observed(Some(snapshot(0, 0, &[])), Some(1)))).figures.shard_figures.is_empty());
    }

    #[test]
    fn a_new_recovery_that_dead_lettered_is_a_warning_once() {
        let mut seen = observed(Some(snapshot(0, 0, &[])), Some(1));
        seen.last_recovery = Some(RecoveryReport {
            finished_at_ms: 999_000_123,
            scanned: 5,
            claimed: 2,
            dead_lettered: 1,
            payload_lost: 0,
            left_pending: Vec::new(),
        });
        let mut resource = scg();
        let plan = converge(run(&resource, &seen));
        let warning = plan.events.iter().find(|e| e.reason == "DeadLettered").unwrap();
        assert_eq!(warning.type_, EventType::Warning);
        // Already shown in the status: no second Event.
        resource.status = Some(StreamConsumerGroupStatus {
            last_recovery: plan.figures.last_recovery,
            health: Some(plan.figures.health),
            ..Default::default()
        });
        assert!(converge(run(&resource, &seen)).events.is_empty());
    }

    #[test]
    fn lost_payloads_read_payload_lost_until_acknowledged() {
        let mut seen = observed(Some(snapshot(0, 0, &[])), Some(1));
        seen.payload_loss = PayloadLoss { total: 50, latest: vec!["9-0".into(), "8-0".into()] };
        let mut resource = scg();
        let plan = converge(run(&resource, &seen));
        assert_eq!(plan.figures.health, Health::PayloadLost);
        assert_eq!(
            plan.figures.payload_lost,
            PayloadLostStatus { total: 50, unacknowledged: 50, latest_ids: vec!["9-0".into(), "8-0".into()] }
        );
        let lost = plan.events.iter().find(|e| e.reason == "PayloadLost").unwrap();
        assert_eq!(lost.type_, EventType::Warning);
        assert!(lost.note.starts_with("50 more") && lost.note.contains("9-0, 8-0"), "{}", lost.note);
        let degraded = plan.events.iter().find(|e| e.reason == "HealthDegraded").unwrap();
        assert!(degraded.note.starts_with("health none -> PayloadLost"), "{}", degraded.note);
        // Seen before: no new loss Event. Acknowledged in part: still lost.
        resource.status = Some(StreamConsumerGroupStatus {
            payload_lost: Some(plan.figures.payload_lost),
            health: Some(plan.figures.health),
            ..Default::default()
        });
        resource.annotations_mut().insert(PAYLOAD_LOST_ACKNOWLEDGED.into(), "20".into());
        let plan = converge(run(&resource, &seen));
        assert_eq!((plan.figures.health, plan.figures.payload_lost.unacknowledged), (Health::PayloadLost, 30));
        assert!(plan.events.is_empty(), "{:?}", plan.events);
        // All acknowledged: healthy again, with a Normal Event.
        resource.annotations_mut().insert(PAYLOAD_LOST_ACKNOWLEDGED.into(), "50".into());
        let plan = converge(run(&resource, &seen));
        assert_eq!(plan.figures.health, Health::Healthy);
        assert_eq!(plan.events.len(), 1);
        assert_eq!((plan.events[0].reason, plan.events[0].type_), ("Healthy", EventType::Normal));
    }

    fn claimant(key: &str, created_s: i64) -> Claimant {
        Claimant {
            key: key.into(),
            created: Some(Time(k8s_openapi::jiff::Timestamp::from_second(created_s).unwrap())),
            same_endpoint_known: true,
        }
    }

    fn created_at(mut scg: StreamConsumerGroup, s: i64) -> StreamConsumerGroup {
        scg.metadata.creation_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap()));
        scg
    }

    #[test]
    fn the_resource_created_first_runs_the_group_and_the_other_stands_down() {
        let resource = created_at(scg(), 200);
        let mut seen = observed(Some(snapshot(5, 0, &[])), Some(2));
        seen.claimants = vec![claimant("shop/newer", 300)];
        assert!(matches!(run(&resource, &seen), Plan::Converge(_)), "the older one runs");
        seen.claimants.push(claimant("shop/older", 100));
        let Plan::Conflict(plan) = run(&resource, &seen) else { panic!("expected a conflict") };
        assert_eq!(plan.owner, "shop/older");
        let replicas = plan.deployment.as_ref().and_then(|d| d.spec.as_ref()).and_then(|s| s.replicas);
        assert_eq!(replicas, Some(0), "its existing workers are scaled to zero");
        assert!(plan.cronjob.is_none(), "nothing is created that did not exist");
        assert_eq!((plan.events.len(), plan.events[0].reason), (1, "Conflict"));
        // No Deployment yet: none is created, and the group is not created either.
        let mut fresh = observed(None, None);
        fresh.claimants = vec![claimant("shop/older", 100)];
        let Plan::Conflict(plan) = run(&resource, &fresh) else { panic!("expected a conflict") };
        assert!(plan.deployment.is_none());
    }

    #[test]
    fn an_older_claimant_on_a_redis_not_yet_known_means_wait_not_stand_down() {
        let resource = created_at(scg(), 200);
        let mut seen = observed(Some(snapshot(0, 0, &[])), Some(1));
        seen.claimants = vec![Claimant { same_endpoint_known: false, ..claimant("shop/older", 100) }];
        assert!(matches!(run(&resource, &seen), Plan::Wait));
    }

    #[test]
    fn equal_creation_times_are_broken_by_name() {
        let resource = created_at(scg(), 100);
        let mut seen = observed(Some(snapshot(0, 0, &[])), Some(1));
        seen.claimants = vec![claimant("shop/aaa", 100)];
        assert!(matches!(run(&resource, &seen), Plan::Conflict(_)), "shop/aaa < shop/orders");
        seen.claimants = vec![claimant("shop/zzz", 100)];
        assert!(matches!(run(&resource, &seen), Plan::Converge(_)));
    }
}
