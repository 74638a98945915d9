//! The scaling policy: a pure function of the spec, the replicas running,
//! the group's lag and pending count, and a short memory of past decisions.
//!
//! * desired = clamp(ceil((lag + pending) / targetPerReplica), min, max),
//!   where pending leaves out entries parked for a retry (`retry`): more
//!   workers would only call a failing downstream more often;
//! * never zero while entries wait for a retry: someone must take them
//!   when they are due;
//! * from zero, only when lag + pending exceeds `activationThreshold`;
//! * up at once; down to the highest recommendation of the last
//!   `scaleDownStabilizationSeconds` (as the HPA does);
//! * to zero only when `minReplicas` is 0 and lag and pending have both been
//!   known to be zero for `cooldownSeconds`;
//! * unknown lag never scales down (a NULL lag is not an idle group);
//! * no metrics, or `paused`: hold what runs.

use std::collections::VecDeque;
use std::time::Duration;
use streamfleet_crd::ScalingSpec;
use streamfleet_streams::health::Lag;

/// What the policy remembers between polls of one resource.
#[derive(Clone, Debug, Default)]
pub struct ScalingMemory {
    recommendations: VecDeque<(Duration, i32)>,
    idle_since: Option<Duration>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub replicas: i32,
    /// Why, with the numbers (goes into the scaling Event).
    pub reason: String,
}

/// `observed`: (lag, pending, of those pending how many are parked for a
/// retry) from this poll, `None` when inspection failed. `now`: a
/// monotonic clock reading.
pub fn decide(
    spec: &ScalingSpec,
    current: i32,
    observed: Option<(Lag, u64, u64)>,
    now: Duration,
    memory: &mut ScalingMemory,
) -> Decision {
    let hold = |why: &str| Decision { replicas: current, reason: why.to_string() };
    if spec.paused {
        return hold("scaling paused");
    }
    let Some((lag, all_pending, retrying)) = observed else {
        return hold("group metrics unavailable: holding replicas");
    };
    let retrying = retrying.min(all_pending);
    let pending = all_pending - retrying;
    let min = spec.min_replicas.max(0);
    let max = spec.max_replicas.max(min).max(1);
    let target = u64::try_from(spec.target_per_replica.max(1)).unwrap_or(1);
    let per_target = |work: u64| i32::try_from(work.div_ceil(target)).unwrap_or(i32::MAX);

    let idle = lag.is_known_zero() && all_pending == 0;
    if idle {
        memory.idle_since.get_or_insert(now);
    } else {
        memory.idle_since = None;
    }
    let idle_for = memory.idle_since.map(|since| now.saturating_sub(since)).unwrap_or_default();
    let cooldown = secs(spec.cooldown_seconds);

    let (raw, reason) = match lag.floor() {
        None => (
            per_target(pending).max(current).max(min).max(1),
            format!("lag unknown, pending={pending}: never scaling down"),
        ),
        Some(lag_n) => {
            let work = lag_n.saturating_add(pending);
            let lag_text = match lag {
                Lag::AtLeast(_) => format!(">={lag_n}"),
                _ => lag_n.to_string(),
            };
            let retrying_text = if retrying > 0 { format!(" retrying={retrying}") } else { String::new() };
            let numbers = format!("lag={lag_text} pending={pending}{retrying_text} target={target}/replica");
            let activation = u64::try_from(spec.activation_threshold.max(0)).unwrap_or(0);
            if current == 0 && min == 0 && work <= activation && retrying == 0 {
                (0, format!("{numbers}: at zero, below activation threshold {activation}"))
            } else if work == 0 && min == 0 && idle && idle_for >= cooldown {
                // The cooldown is the stabilization for the last step to zero.
                memory.recommendations.clear();
                return Decision {
                    replicas: 0,
                    reason: format!("{numbers}: idle for {}s, scaling to zero", idle_for.as_secs()),
                };
            } else {
                (per_target(work).max(min).max(1).min(max), numbers)
            }
        }
    };
    let raw = raw.min(max);

    let window = secs(spec.scale_down_stabilization_seconds);
    memory.recommendations.push_back((now, raw));
    while memory.recommendations.front().is_some_and(|(at, _)| now.saturating_sub(*at) > window) {
        memory.recommendations.pop_front();
    }
    if raw >= current {
        return Decision { replicas: raw, reason };
    }
    let stabilized = memory.recommendations.iter().map(|(_, r)| *r).max().unwrap_or(raw).min(current);
    Decision { replicas: stabilized, reason: format!("{reason} (stabilized over {}s)", window.as_secs()) }
}

fn secs(s: i32) -> Duration {
    Duration::from_secs(u64::try_from(s.max(0)).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(min: i32, max: i32) -> ScalingSpec {
        ScalingSpec {
            min_replicas: min,
            max_replicas: max,
            target_per_replica: 100,
            activation_threshold: 0,
            scale_down_stabilization_seconds: 60,
            cooldown_seconds: 300,
            poll_interval_seconds: 10,
            paused: false,
        }
    }

    fn at(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn run(spec: &ScalingSpec, current: i32, lag: Lag, pending: u64, now: u64, m: &mut ScalingMemory) -> i32 {
        decide(spec, current, Some((lag, pending, 0)), at(now), m).replicas
    }

    #[test]
    fn target_per_replica_with_min_and_max() {
        let s = spec(1, 5);
        let mut m = ScalingMemory::default();
        assert_eq!(run(&s, 1, Lag::Known(250), 0, 0, &mut m), 3, "ceil(250/100)");
        assert_eq!(run(&s, 3, Lag::Known(150), 100, 1, &mut m), 3, "lag + pending");
        assert_eq!(run(&s, 3, Lag::Known(10_000), 0, 2, &mut m), 5, "max");
        let mut m = ScalingMemory::default();
        assert_eq!(run(&spec(2, 5), 2, Lag::Known(0), 0, 0, &mut m), 2, "min");
    }

    #[test]
    fn scales_up_at_once_and_down_only_after_stabilization() {
        let s = spec(1, 10);
        let mut m = ScalingMemory::default();
        assert_eq!(run(&s, 1, Lag::Known(800), 0, 0, &mut m), 8);
        assert_eq!(run(&s, 8, Lag::Known(100), 0, 10, &mut m), 8, "within the window");
        assert_eq!(run(&s, 8, Lag::Known(100), 0, 50, &mut m), 8);
        assert_eq!(run(&s, 8, Lag::Known(100), 0, 61, &mut m), 1, "window passed");
    }

    #[test]
    fn activation_from_zero_needs_work_above_threshold() {
        let mut s = spec(0, 5);
        s.activation_threshold = 50;
        let mut m = ScalingMemory::default();
        assert_eq!(run(&s, 0, Lag::Known(50), 0, 0, &mut m), 0);
        assert_eq!(run(&s, 0, Lag::Known(51), 0, 1, &mut m), 1);
        let mut m = ScalingMemory::default();
        assert_eq!(run(&spec(1, 5), 0, Lag::Known(0), 0, 0, &mut m), 1, "a new pipeline starts at min");
    }

    #[test]
    fn scale_to_zero_only_after_cooldown_with_lag_and_pending_zero() {
        let s = spec(0, 5);
        let mut m = ScalingMemory::default();
        assert_eq!(run(&s, 1, Lag::Known(0), 0, 0, &mut m), 1, "cooldown starts");
        assert_eq!(run(&s, 1, Lag::Known(0), 3, 200, &mut m), 1, "pending work resets it");
        assert_eq!(run(&s, 1, Lag::Known(0), 0, 201, &mut m), 1);
        assert_eq!(run(&s, 1, Lag::Known(0), 0, 500, &mut m), 1, "299s idle");
        assert_eq!(run(&s, 1, Lag::Known(0), 0, 502, &mut m), 0, "300s idle");
        assert_eq!(run(&s, 0, Lag::Known(0), 0, 503, &mut m), 0, "stays at zero");
        assert_eq!(run(&s, 0, Lag::Known(1), 0, 504, &mut m), 1, "wakes on work");
    }

    #[test]
    fn unknown_lag_never_scales_down_or_to_zero() {
        let s = spec(0, 5);
        let mut m = ScalingMemory::default();
        assert_eq!(run(&s, 3, Lag::Unknown, 0, 0, &mut m), 3);
        assert_eq!(run(&s, 3, Lag::Unknown, 0, 10_000, &mut m), 3);
        assert_eq!(run(&s, 0, Lag::Unknown, 0, 10_001, &mut m), 1, "not provably idle: wake");
        assert_eq!(run(&s, 1, Lag::Unknown, 450, 10_002, &mut m), 5, "pending still drives scale-up");
        let d = decide(&s, 3, Some((Lag::Unknown, 0, 0)), at(0), &mut ScalingMemory::default());
        assert!(d.reason.contains("lag unknown"), "{}", d.reason);
    }

    #[test]
    fn a_lag_floor_scales_up_like_a_known_lag() {
        let mut m = ScalingMemory::default();
        assert_eq!(run(&spec(0, 20), 1, Lag::AtLeast(1000), 0, 0, &mut m), 10);
    }

    #[test]
    fn paused_and_metric_errors_hold_replicas() {
        let mut s = spec(1, 10);
        let mut m = ScalingMemory::default();
        assert_eq!(decide(&s, 4, None, at(0), &mut m).replicas, 4);
        s.paused = true;
        assert_eq!(run(&s, 4, Lag::Known(10_000), 0, 1, &mut m), 4);
        assert_eq!(run(&s, 4, Lag::Known(0), 0, 1000, &mut m), 4);
    }

    #[test]
    fn reason_carries_the_numbers() {
        let d = decide(&spec(1, 10), 1, Some((Lag::Known(250), 7, 0)), at(0), &mut ScalingMemory::default());
        assert_eq!(d.replicas, 3);
        assert!(d.reason.contains("lag=250") && d.reason.contains("pending=7"), "{}", d.reason);
    }

    #[test]
    fn entries_waiting_for_a_retry_add_no_replicas_but_keep_one() {
        let s = spec(0, 10);
        let mut m = ScalingMemory::default();
        // A downstream outage: 900 entries parked, 50 being read.
        let d = decide(&s, 1, Some((Lag::Known(50), 950, 900)), at(0), &mut m);
        assert_eq!(d.replicas, 1, "{}", d.reason);
        assert!(d.reason.contains("pending=50 retrying=900"), "{}", d.reason);
        // Nothing else to do, long past the cooldown: one stays to take them when due.
        for t in [400, 800] {
            assert_eq!(decide(&s, 1, Some((Lag::Known(0), 900, 900)), at(t), &mut m).replicas, 1);
        }
        assert_eq!(decide(&s, 0, Some((Lag::Known(0), 900, 900)), at(900), &mut m).replicas, 1, "woken at zero");
    }
}
