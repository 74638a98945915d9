//! Status conditions, kept with `lastTransitionTime` stable while unchanged.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

pub const READY: &str = "Ready";
pub const GROUP_READY: &str = "GroupReady";
pub const WORKERS_AVAILABLE: &str = "WorkersAvailable";
pub const DEGRADED: &str = "Degraded";
pub const RETENTION_BLOCKED: &str = "RetentionBlocked";
pub const CONFLICT: &str = "Conflict";
pub const DEAD_LETTER_CAP_REACHED: &str = "DeadLetterCapReached";
/// True only while the stream's IDs are not times (explicit IDs): no delay.
pub const DELAY_UNKNOWN: &str = "DelayUnknown";
/// True while the Redis server may evict keys (`maxmemory-policy`).
pub const EVICTION_POSSIBLE: &str = "EvictionPossible";
/// True while the Redis server keeps no append-only file: a restart loses
/// what was written since its last snapshot.
pub const LOSS_ON_RESTART_POSSIBLE: &str = "LossOnRestartPossible";
/// True while the worker template has fields a pod template does not have.
pub const TEMPLATE_FIELDS_UNKNOWN: &str = "TemplateFieldsUnknown";
/// True while the recovery CronJob's last finished run failed.
pub const RECOVERY_FAILING: &str = "RecoveryFailing";
/// True while, in `Worker` recovery mode, a handler may run as long as a
/// recovery run is allowed to (the operator's recovery deadline).
pub const RECOVERY_DEADLINE_TOO_SHORT: &str = "RecoveryDeadlineTooShort";

/// Sets condition `type_` in `conditions`; its transition time changes only
/// when its status does.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    ok: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: &Time,
) {
    let status = if ok { "True" } else { "False" };
    let transition = conditions
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| now.clone());
    conditions.retain(|c| c.type_ != type_);
    conditions.push(Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.chars().take(1024).collect(),
        observed_generation: generation,
        last_transition_time: transition,
    });
    conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
}

pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions.iter().any(|c| c.type_ == type_ && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let mut c = Vec::new();
        set(&mut c, READY, false, "RedisUnreachable", "down", Some(1), &at(10));
        set(&mut c, READY, false, "RedisUnreachable", "still down", Some(1), &at(20));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].last_transition_time, at(10));
        assert_eq!(c[0].message, "still down");
        set(&mut c, READY, true, "Reconciled", "", Some(2), &at(30));
        assert_eq!(c[0].last_transition_time, at(30));
        assert!(is_true(&c, READY));
        set(&mut c, GROUP_READY, true, "GroupExists", "", Some(2), &at(30));
        assert_eq!(c.iter().map(|c| c.type_.as_str()).collect::<Vec<_>>(), vec![GROUP_READY, READY]);
    }
}
