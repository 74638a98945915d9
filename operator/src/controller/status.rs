//! Step 5, status: what the resource's status should say, built by pure
//! functions from the plan and what acting on it did (or from the error
//! that stopped the pass), and written only when it changed.

use super::Context;
use super::act::Outcome;
use super::decide::{Conflict, Retrying, StatusFigures};
use super::recovery_runs::{self, LastRun};
use crate::conditions;
use crate::error::Error;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::Patch;
use kube::{Api, ResourceExt as _};
use serde_json::json;
use streamfleet_crd::{
    ConsumerPending, Health, ReplicaStatus, RetryingAtDelivery, RetryingStatus, StreamConsumerGroup,
    StreamConsumerGroupStatus, ThroughputStatus,
};
use streamfleet_streams::health::{Delay, GroupSnapshot, Lag};
use streamfleet_streams::retention::{Retention, StreamId};
use streamfleet_streams::version::{Eviction, Persistence};

const MANAGER_STATUS: &str = "streamfleet-status";

/// The status after a pass that inspected the group.
pub fn converged(
    scg: &StreamConsumerGroup,
    plan: &StatusFigures,
    outcome: &Outcome,
    now: &Time,
) -> StreamConsumerGroupStatus {
    let mut status = scg.status.clone().unwrap_or_default();
    let generation = scg.metadata.generation;
    status.observed_generation = generation;
    let set = |status: &mut StreamConsumerGroupStatus, type_: &str, ok: bool, reason: &str, msg: &str| {
        conditions::set(&mut status.conditions, type_, ok, reason, msg, generation, now);
    };
    let group_msg = format!("group {:?} exists on stream {:?}", scg.spec.group, scg.spec.stream);
    set(&mut status, conditions::GROUP_READY, true, "GroupExists", &group_msg);
    let (desired, available) = (plan.scaling.replicas, outcome.available_replicas);
    let workers_ok = desired == 0 || available > 0;
    let (reason, msg) = if workers_ok {
        ("WorkersAvailable", format!("{available} of {desired} workers available"))
    } else {
        ("NoWorkerAvailable", format!("0 of {desired} workers available"))
    };
    set(&mut status, conditions::WORKERS_AVAILABLE, workers_ok, reason, &msg);
    match outcome.refused.first() {
        Some(refused) => set(&mut status, conditions::READY, false, refused.reason(), &refused.to_string()),
        None if workers_ok => {
            set(&mut status, conditions::READY, true, "Reconciled", "group ready and workers available")
        }
        None => set(&mut status, conditions::READY, false, reason, &msg),
    }
    let degraded_reason = match (plan.health, plan.snapshot.lag) {
        (Health::Unknown, Lag::Unknown) => "LagUnknown".to_string(),
        (h, _) => format!("{h:?}"),
    };
    let degraded = !matches!(plan.health, Health::Healthy | Health::Suspended);
    set(&mut status, conditions::DEGRADED, degraded, &degraded_reason, &plan.health_message);
    if status.conditions.iter().any(|c| c.type_ == conditions::CONFLICT) {
        set(&mut status, conditions::CONFLICT, false, "NoConflict", "this resource runs the group");
    }
    match &plan.retention {
        Some(r) => {
            let (reason, message) = retention_condition(r);
            set(&mut status, conditions::RETENTION_BLOCKED, r.blocked, reason, &message);
        }
        // No retention, or its bounds unread this poll: nothing to claim.
        None => status.conditions.retain(|c| c.type_ != conditions::RETENTION_BLOCKED),
    }
    match plan.dead_letter_cap_reached {
        Some(reached) => {
            let (reason, message) = if reached {
                ("AtCap", "a dead-letter stream is at spec.recovery.deadLetterMaxLength: older letters are dropped")
            } else {
                ("BelowCap", "every dead-letter stream is below spec.recovery.deadLetterMaxLength")
            };
            set(&mut status, conditions::DEAD_LETTER_CAP_REACHED, reached, reason, message);
        }
        None => status.conditions.retain(|c| c.type_ != conditions::DEAD_LETTER_CAP_REACHED),
    }
    match plan.snapshot.delay {
        Delay::NotTimes => set(
            &mut status,
            conditions::DELAY_UNKNOWN,
            true,
            "IdsNotTimes",
            "the oldest unfinished entry's ID is not a time (a producer sets explicit stream IDs, or the ID is over a \
             minute ahead of the server's clock): the delay cannot be read from IDs; lag and pending still hold",
        ),
        Delay::Known(_) => status.conditions.retain(|c| c.type_ != conditions::DELAY_UNKNOWN),
    }
    match &plan.safety.eviction {
        Eviction::Possible { policy, maxmemory } => set(
            &mut status,
            conditions::EVICTION_POSSIBLE,
            true,
            "MaxmemoryPolicy",
            &super::decide::eviction_message(policy, *maxmemory),
        ),
        Eviction::Never => status.conditions.retain(|c| c.type_ != conditions::EVICTION_POSSIBLE),
        // Never read (INFO refused): nothing to claim either way.
        Eviction::Unknown => {}
    }
    match plan.safety.persistence {
        Persistence::NoAppendOnly => set(
            &mut status,
            conditions::LOSS_ON_RESTART_POSSIBLE,
            true,
            "AppendOnlyFileOff",
            super::decide::PERSISTENCE_MESSAGE,
        ),
        Persistence::AppendOnly => status.conditions.retain(|c| c.type_ != conditions::LOSS_ON_RESTART_POSSIBLE),
        Persistence::Unknown => {}
    }
    if plan.unknown_template_fields.is_empty() {
        status.conditions.retain(|c| c.type_ != conditions::TEMPLATE_FIELDS_UNKNOWN);
    } else {
        let message = super::decide::template_message(&plan.unknown_template_fields);
        set(&mut status, conditions::TEMPLATE_FIELDS_UNKNOWN, true, "UnknownFields", &message);
    }
    match &plan.recovery_deadline_short {
        None => status.conditions.retain(|c| c.type_ != conditions::RECOVERY_DEADLINE_TOO_SHORT),
        Some(message) => {
            set(&mut status, conditions::RECOVERY_DEADLINE_TOO_SHORT, true, "HandlerTimeoutPastDeadline", message)
        }
    }
    match &plan.recovery_run {
        // Suspended, no run is due: a failure before it pages no one.
        _ if scg.spec.suspend => status.conditions.retain(|c| c.type_ != conditions::RECOVERY_FAILING),
        run @ LastRun::Failed { .. } => {
            let message = recovery_runs::failed_message(run).unwrap_or_default();
            set(&mut status, conditions::RECOVERY_FAILING, true, "LastRunFailed", &message);
        }
        // The same words every run: a run that succeeds like the last one
        // costs no status write of its own (`lastRecovery` says when).
        LastRun::Succeeded => {
            set(&mut status, conditions::RECOVERY_FAILING, false, "LastRunSucceeded", "the last recovery run succeeded")
        }
        // None finished yet: nothing to say.
        LastRun::NotYet => {}
    }
    status.health = Some(plan.health);
    if plan.last_recovery.is_some() {
        status.last_recovery = plan.last_recovery.clone();
    }
    status.payload_lost = Some(plan.payload_lost.clone());
    status.resume_id =
        Some(plan.snapshot.before_oldest_pending.clone().unwrap_or_else(|| plan.snapshot.last_delivered_id.clone()));
    status.replicas = Some(ReplicaStatus { desired, current: available, summary: format!("{available}/{desired}") });
    set_figures(&mut status, Some(&plan.snapshot));
    status.throughput = plan.throughput.map(|t| throughput_status(&t, &plan.snapshot));
    status.retrying = Some(retrying_status(&plan.retrying, now));
    status.shards = plan.shard_figures.clone();
    status
}

/// A time in Unix milliseconds, to the second (`None` out of range).
pub fn time_of_ms(ms: u64) -> Option<Time> {
    k8s_openapi::jiff::Timestamp::from_second(i64::try_from(ms / 1000).ok()?).ok().map(Time)
}

/// The rates to a tenth, and the drain time of the lag and pending at them.
fn throughput_status(t: &crate::controller::throughput::Throughput, s: &GroupSnapshot) -> ThroughputStatus {
    let tenth = |x: f64| (x * 10.0).round() / 10.0;
    let outstanding = s.lag.floor().map(|lag| lag.saturating_add(s.pending));
    ThroughputStatus {
        in_per_second: tenth(t.in_per_second),
        out_per_second: tenth(t.out_per_second),
        drains_in_seconds: outstanding
            .and_then(|n| t.drain_seconds(n))
            .map(|secs| i64::try_from(secs).unwrap_or(i64::MAX)),
    }
}

/// The status of entries waiting for a retry. The next due time is an
/// instant (the inspection's time plus what is left, negative when
/// overdue) rounded to the second: the same from one poll to the next, so
/// the status is not rewritten for it.
fn retrying_status(r: &Retrying, now: &Time) -> RetryingStatus {
    let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let next_attempt_time = r.due_after_ms.and_then(|after| {
        let due_ms = now.0.as_millisecond().saturating_add(after);
        k8s_openapi::jiff::Timestamp::from_second(due_ms.saturating_add(500).div_euclid(1000)).ok().map(Time)
    });
    RetryingStatus {
        entries: int(r.entries),
        on_last_attempt: int(r.on_last_attempt),
        next_attempt_time,
        last_error: r.last_error.as_deref().map(|e| crate::events::cut(e, 256)),
        // The highest delivery counts (the nearest their horizon) when more.
        by_delivery: r
            .by_delivery
            .iter()
            .skip(r.by_delivery.len().saturating_sub(32))
            .map(|(deliveries, entries)| RetryingAtDelivery { deliveries: int(*deliveries), entries: int(*entries) })
            .collect(),
    }
}

fn retention_condition(r: &Retention) -> (&'static str, String) {
    let describe = |id: Option<StreamId>| id.map_or("none".to_string(), |i| i.to_string());
    if r.blocked {
        (
            "HeldAtSafeFloor",
            format!(
                "retention wants to trim below {}, held at {}: a group still has entries pending or undelivered there",
                describe(r.target),
                describe(r.floor)
            ),
        )
    } else {
        ("WithinSafeFloor", format!("trimming to {} (floor {})", describe(r.target), describe(r.floor)))
    }
}

/// The measured fields from a snapshot; with none, they are cleared: an
/// uninspected group shows no figures rather than the last good ones.
fn set_figures(status: &mut StreamConsumerGroupStatus, snapshot: Option<&GroupSnapshot>) {
    let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let Some(s) = snapshot else {
        status.shards.clear();
        status.oldest_unfinished_time = None;
        status.throughput = None;
        status.lag = None;
        status.pending = None;
        status.oldest_pending_idle_seconds = None;
        status.oldest_pending_idle_since = None;
        status.max_delivery_count = None;
        status.stream_length = None;
        status.dead_letter_length = None;
        status.consumers = None;
        status.consumer_pending = Vec::new();
        status.payload_lost = None;
        status.retrying = None;
        return;
    };
    status.oldest_unfinished_time = s.oldest_unfinished_ms.and_then(time_of_ms);
    status.lag = s.lag.floor().map(int);
    status.pending = Some(int(s.pending));
    let has_pending = s.pending > 0;
    status.oldest_pending_idle_seconds = s.oldest_pending_idle_ms.filter(|_| has_pending).map(|ms| int(ms / 1000));
    status.oldest_pending_idle_since =
        s.oldest_pending_idle_ms.filter(|_| has_pending).and_then(|idle| time_of_ms(s.server_ms.saturating_sub(idle)));
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

/// The status of a resource that stands down because another runs its
/// group: `Conflict`, no workers; the group's figures as observed.
pub fn conflicted(
    scg: &StreamConsumerGroup,
    plan: &Conflict,
    refused: &[Error],
    now: &Time,
) -> StreamConsumerGroupStatus {
    let mut status = scg.status.clone().unwrap_or_default();
    let generation = scg.metadata.generation;
    status.observed_generation = generation;
    let message = super::decide::conflict_message(scg, &plan.owner);
    let mut set = |type_: &str, ok: bool, reason: &str, msg: &str| {
        conditions::set(&mut status.conditions, type_, ok, reason, msg, generation, now);
    };
    set(conditions::CONFLICT, true, "GroupRunByAnother", &message);
    match refused.first() {
        Some(e) => set(conditions::READY, false, e.reason(), &e.to_string()),
        None => set(conditions::READY, false, "Conflict", &message),
    }
    set(conditions::WORKERS_AVAILABLE, false, "Conflict", "no workers: another resource runs the group");
    set(conditions::DEGRADED, true, "Conflict", &message);
    status.health = Some(Health::Unknown);
    status.replicas = Some(ReplicaStatus { desired: 0, current: 0, summary: "0/0".into() });
    set_figures(&mut status, plan.snapshot.as_ref());
    // Not read against the schedule here: unknown, not the last good figures.
    status.retrying = None;
    status.throughput = None;
    status.payload_lost = None;
    // Its recovery is suspended: its past runs page no one.
    status.conditions.retain(|c| c.type_ != conditions::RECOVERY_FAILING);
    status
}

/// The status after a pass that failed before the group could be inspected:
/// health `Unknown`, figures cleared, and the reason on the conditions.
pub fn failed(scg: &StreamConsumerGroup, error: &Error, now: &Time) -> StreamConsumerGroupStatus {
    let mut status = scg.status.clone().unwrap_or_default();
    let generation = scg.metadata.generation;
    status.observed_generation = generation;
    let message = error.to_string();
    for type_ in [conditions::GROUP_READY, conditions::READY] {
        conditions::set(&mut status.conditions, type_, false, error.reason(), &message, generation, now);
    }
    let unknown = format!("the group could not be inspected: {message}");
    conditions::set(&mut status.conditions, conditions::DEGRADED, true, "GroupNotInspected", &unknown, generation, now);
    status.health = Some(Health::Unknown);
    // Unknown, not the last good verdict.
    status.conditions.retain(|c| {
        ![
            conditions::RETENTION_BLOCKED,
            conditions::DEAD_LETTER_CAP_REACHED,
            conditions::DELAY_UNKNOWN,
            conditions::EVICTION_POSSIBLE,
            conditions::LOSS_ON_RESTART_POSSIBLE,
        ]
        .contains(&c.type_.as_str())
    });
    set_figures(&mut status, None);
    status
}

/// Writes the status only when it differs from what is stored.
pub async fn write(ctx: &Context, scg: &StreamConsumerGroup, status: StreamConsumerGroupStatus) -> Result<(), Error> {
    ctx.metrics.observe(scg, &status);
    let key = super::key(scg);
    let cached_version = scg.resource_version().unwrap_or_default();
    // Unchanged, or written a moment ago and not yet seen by the watch (a
    // watch event can bring the next reconcile before its own update).
    if scg.status.as_ref() == Some(&status) || ctx.status_written(&key, &cached_version, &status) {
        return Ok(());
    }
    let api: Api<StreamConsumerGroup> = Api::namespaced(ctx.client.clone(), &scg.namespace().unwrap_or_default());
    let patch = json!({
        "apiVersion": "streamfleet.io/v1alpha1",
        "kind": "StreamConsumerGroup",
        "status": status,
    });
    api.patch_status(&scg.name_any(), &super::act::apply_params(MANAGER_STATUS).force(), &Patch::Apply(&patch)).await?;
    ctx.metrics.api_write(MANAGER_STATUS);
    ctx.remember_status(&key, cached_version, &status);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::decide::Convergence;
    use super::super::decide::Plan;
    use super::super::fixtures::{observed, run, scg, snapshot};
    use super::*;

    fn at(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    fn plan(scg: &StreamConsumerGroup, lag: u64) -> Convergence {
        match run(scg, &observed(Some(snapshot(lag, 2, &[])), None)) {
            Plan::Converge(plan) => *plan,
            _ => panic!("the group exists and is ours"),
        }
    }

    fn outcome(available: i32, refused: Vec<Error>) -> Outcome {
        Outcome { available_replicas: available, trimmed: 0, refused }
    }

    fn condition<'a>(s: &'a StreamConsumerGroupStatus, type_: &str) -> (&'a str, &'a str, &'a str) {
        let c = s.conditions.iter().find(|c| c.type_ == type_).unwrap();
        (c.status.as_str(), c.reason.as_str(), c.message.as_str())
    }

    #[test]
    fn ready_only_with_an_available_worker() {
        let resource = scg();
        let s = converged(&resource, &plan(&resource, 5).figures, &outcome(0, vec![]), &at(1));
        assert_eq!(s.observed_generation, Some(2));
        assert_eq!(condition(&s, conditions::GROUP_READY).0, "True");
        assert_eq!(condition(&s, conditions::READY).1, "NoWorkerAvailable");
        let s = converged(&resource, &plan(&resource, 5).figures, &outcome(1, vec![]), &at(1));
        assert_eq!(condition(&s, conditions::READY), ("True", "Reconciled", "group ready and workers available"));
        assert_eq!((s.lag, s.pending, s.stream_length), (Some(5), Some(2), Some(1000)));
        assert_eq!(s.replicas.unwrap().summary, "1/1");
    }

    #[test]
    fn a_refused_object_is_a_condition_and_health_is_still_reported() {
        let resource = scg();
        let refused = Error::Refused { kind: "CronJob", message: "spec.schedule: Invalid value: \"0 0 0 * *\"".into() };
        let s = converged(&resource, &plan(&resource, 5).figures, &outcome(1, vec![refused]), &at(1));
        let (status, reason, message) = condition(&s, conditions::READY);
        assert_eq!((status, reason), ("False", "CronJobRefused"));
        assert!(message.contains("0 0 0 * *"), "{message}");
        assert_eq!((s.health, s.lag), (Some(Health::Healthy), Some(5)));
    }

    #[test]
    fn a_failure_is_unknown_with_figures_cleared_and_recomputing_it_is_a_no_op() {
        let mut resource = scg();
        let good = converged(&resource, &plan(&resource, 5).figures, &outcome(1, vec![]), &at(1));
        resource.status = Some(good);
        let e = Error::SecretNotFound { name: "r".into() };
        let first = failed(&resource, &e, &at(2));
        assert_eq!(condition(&first, conditions::READY).1, "SecretNotFound");
        assert_eq!(condition(&first, conditions::DEGRADED).1, "GroupNotInspected");
        assert_eq!(first.health, Some(Health::Unknown));
        assert_eq!((first.lag, first.pending, first.stream_length, first.consumers), (None, None, None, None));
        assert_eq!(first.oldest_unfinished_time, None, "unknown, not the last good delay");
        resource.status = Some(first.clone());
        // Same failure later: identical status, so nothing is written.
        assert_eq!(failed(&resource, &e, &at(99)), first);
    }

    /// `Oldest` shows a duration: a time the column turns into an age.
    #[test]
    fn the_oldest_pending_idle_time_is_shown_as_since_when() {
        let resource = scg();
        let mut p = plan(&resource, 5);
        p.figures.snapshot.pending = 3;
        p.figures.snapshot.server_ms = 1_796_000_065_400;
        p.figures.snapshot.oldest_pending_idle_ms = Some(65_000);
        let s = converged(&resource, &p.figures, &outcome(1, vec![]), &at(1));
        assert_eq!(s.oldest_pending_idle_seconds, Some(65));
        assert_eq!(s.oldest_pending_idle_since, Some(at(1_796_000_000)), "to the second");
        p.figures.snapshot.pending = 0;
        let s = converged(&resource, &p.figures, &outcome(1, vec![]), &at(2));
        assert_eq!((s.oldest_pending_idle_seconds, s.oldest_pending_idle_since), (None, None), "nothing pending");
    }

    #[test]
    fn the_delay_is_shown_as_the_oldest_unfinished_time_and_ids_that_are_not_times_are_said_not_guessed() {
        let resource = scg();
        let mut p = plan(&resource, 5);
        p.figures.snapshot.delay = Delay::Known(12_999);
        p.figures.snapshot.oldest_unfinished_ms = Some(1_796_000_000_999);
        let s = converged(&resource, &p.figures, &outcome(1, vec![]), &at(1));
        assert_eq!(s.oldest_unfinished_time, Some(at(1_796_000_000)), "to the second");
        assert!(s.conditions.iter().all(|c| c.type_ != conditions::DELAY_UNKNOWN));
        p.figures.snapshot.delay = Delay::NotTimes;
        p.figures.snapshot.oldest_unfinished_ms = None;
        let mut resource = resource;
        resource.status = Some(s);
        let s = converged(&resource, &p.figures, &outcome(1, vec![]), &at(2));
        assert_eq!(s.oldest_unfinished_time, None);
        let (status, reason, message) = condition(&s, conditions::DELAY_UNKNOWN);
        assert_eq!((status, reason), ("True", "IdsNotTimes"));
        assert!(message.contains("explicit stream IDs"), "{message}");
        // Times again: the condition goes.
        p.figures.snapshot.delay = Delay::Known(0);
        resource.status = Some(s);
        let s = converged(&resource, &p.figures, &outcome(1, vec![]), &at(3));
        assert_eq!(s.oldest_unfinished_time, None, "nothing unfinished");
        assert!(s.conditions.iter().all(|c| c.type_ != conditions::DELAY_UNKNOWN));
    }
}
