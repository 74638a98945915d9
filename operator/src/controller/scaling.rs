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
//! * no metrics, or `paused`: hold what runs;
//! * with `delayObjectiveSeconds`, instead of `targetPerReplica` once a
//!   replica's completion rate has been measured (the best of the last 10
//!   minutes' readings taken while the workers were busy and none was
//!   starting: a rate read while they idled only says they can do at least
//!   that): replicas = ceil((arrivals/s + backlog / objective) / (0.8 ×
//!   per-replica rate)); one more than now while the delay (entries parked
//!   for a retry left out) is over the objective, arrivals outpace
//!   completions and every replica asked for runs; up by at most
//!   max(100%, 4 pods) at a time (the HPA's default); rates unknown for a
//!   poll: hold.

use crate::controller::throughput::Throughput;
use std::collections::VecDeque;
use std::time::Duration;
use streamfleet_crd::ScalingSpec;
use streamfleet_streams::health::Lag;

/// The share of a replica's measured rate the objective policy plans for:
/// a queue run at 100% grows without bound.
pub const UTILISATION: f64 = 0.8;
/// How long a measured per-replica rate counts.
const RATE_MEMORY: Duration = Duration::from_secs(600);

/// What the policy remembers between polls of one resource.
#[derive(Clone, Debug, Default)]
pub struct ScalingMemory {
    recommendations: VecDeque<(Duration, i32)>,
    idle_since: Option<Duration>,
    /// Entries per second one replica completed, read while all were
    /// busy and running, with when.
    per_replica: VecDeque<(Duration, f64)>,
}

/// How fast the pipeline goes, for the delay objective: the delay leaving
/// out entries parked for a retry (`None`: unknown), the rates (`None`: not
/// measured yet), the replicas available, and whether they are busy
/// (entries waiting to be read, or more in hand than they run at once), so
/// that what they complete is what they can.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pace {
    pub working_delay_ms: Option<u64>,
    pub throughput: Option<Throughput>,
    pub available: i32,
    pub busy: bool,
}

/// The replicas the delay objective asks for, with the numbers; `None`
/// while a replica's rate is unknown (the count policy decides then).
fn for_objective(
    objective_s: i32,
    backlog: u64,
    pace: &Pace,
    current: i32,
    now: Duration,
    memory: &mut ScalingMemory,
) -> Option<(i32, String)> {
    // Busy workers, all of them running, complete at their capacity.
    if let Some(t) = pace.throughput
        && pace.busy
        && pace.available > 0
        && pace.available >= current
        && t.out_per_second > 0.0
    {
        memory.per_replica.push_back((now, t.out_per_second / f64::from(pace.available)));
    }
    while memory.per_replica.front().is_some_and(|(at, _)| now.saturating_sub(*at) > RATE_MEMORY) {
        memory.per_replica.pop_front();
    }
    let per_replica = memory.per_replica.iter().map(|(_, r)| *r).fold(0.0, f64::max);
    if per_replica <= 0.0 {
        return None;
    }
    let objective = f64::from(objective_s.max(1));
    let Some(t) = pace.throughput else {
        return Some((current, format!("objective {objective_s}s: rates unknown this poll, holding")));
    };
    let needed = t.in_per_second + backlog as f64 / objective;
    let mut replicas = (needed / (per_replica * UTILISATION)).ceil().min(f64::from(i32::MAX)) as i32;
    let over = pace.working_delay_ms.is_some_and(|d| d as f64 > objective * 1000.0);
    if over && t.out_per_second <= t.in_per_second && pace.available >= current {
        replicas = replicas.max(current.saturating_add(1));
    }
    let step = current.saturating_mul(2).max(current.saturating_add(4));
    let limited = if replicas > step { format!(", up by at most {}", step - current) } else { String::new() };
    let delay = pace.working_delay_ms.map_or("unknown".to_string(), |d| format!("{}s", d / 1000));
    Some((
        replicas.min(step),
        format!(
            "delay {delay} (objective {objective_s}s): in {:.1}/s, out {:.1}/s, backlog {backlog}, \
             {per_replica:.1}/s per replica{limited}",
            t.in_per_second, t.out_per_second
        ),
    ))
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
    pace: &Pace,
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
                let objective = spec.delay_objective_seconds.and_then(|objective| {
                    for_objective(objective, work, pace, current, now, memory)
                        .map(|(n, why)| (n.max(min).max(1).min(max), format!("{why}; {numbers}")))
                });
                objective.unwrap_or_else(|| (per_target(work).max(min).max(1).min(max), numbers))
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
            delay_objective_seconds: None,
        }
    }

    fn at(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn run(spec: &ScalingSpec, current: i32, lag: Lag, pending: u64, now: u64, m: &mut ScalingMemory) -> i32 {
        decide(spec, current, Some((lag, pending, 0)), &Pace::default(), at(now), m).replicas
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
        let d = decide(&s, 3, Some((Lag::Unknown, 0, 0)), &Pace::default(), at(0), &mut ScalingMemory::default());
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
        assert_eq!(decide(&s, 4, None, &Pace::default(), at(0), &mut m).replicas, 4);
        s.paused = true;
        assert_eq!(run(&s, 4, Lag::Known(10_000), 0, 1, &mut m), 4);
        assert_eq!(run(&s, 4, Lag::Known(0), 0, 1000, &mut m), 4);
    }

    #[test]
    fn reason_carries_the_numbers() {
        let d = decide(
            &spec(1, 10),
            1,
            Some((Lag::Known(250), 7, 0)),
            &Pace::default(),
            at(0),
            &mut ScalingMemory::default(),
        );
        assert_eq!(d.replicas, 3);
        assert!(d.reason.contains("lag=250") && d.reason.contains("pending=7"), "{}", d.reason);
    }

    #[test]
    fn entries_waiting_for_a_retry_add_no_replicas_but_keep_one() {
        let s = spec(0, 10);
        let mut m = ScalingMemory::default();
        // A downstream outage: 900 entries parked, 50 being read.
        let d = decide(&s, 1, Some((Lag::Known(50), 950, 900)), &Pace::default(), at(0), &mut m);
        assert_eq!(d.replicas, 1, "{}", d.reason);
        assert!(d.reason.contains("pending=50 retrying=900"), "{}", d.reason);
        // Nothing else to do, long past the cooldown: one stays to take them when due.
        for t in [400, 800] {
            assert_eq!(decide(&s, 1, Some((Lag::Known(0), 900, 900)), &Pace::default(), at(t), &mut m).replicas, 1);
        }
        assert_eq!(
            decide(&s, 0, Some((Lag::Known(0), 900, 900)), &Pace::default(), at(900), &mut m).replicas,
            1,
            "woken at zero"
        );
    }

    fn pace(delay_s: u64, in_per_second: f64, out_per_second: f64, available: i32) -> Pace {
        Pace {
            working_delay_ms: Some(delay_s * 1000),
            throughput: Some(Throughput { in_per_second, out_per_second, window_ms: 30_000 }),
            available,
            // In these tables, busy exactly while there is a backlog.
            busy: delay_s > 5,
        }
    }

    fn objective(seconds: i32, min: i32, max: i32) -> ScalingSpec {
        ScalingSpec { delay_objective_seconds: Some(seconds), ..spec(min, max) }
    }

    fn with_pace(s: &ScalingSpec, current: i32, lag: u64, p: Pace, now: u64, m: &mut ScalingMemory) -> Decision {
        decide(s, current, Some((Lag::Known(lag), 0, 0)), &p, at(now), m)
    }

    #[test]
    fn the_delay_objective_sizes_for_arrivals_plus_the_backlog_at_the_measured_rate() {
        let s = objective(20, 1, 20);
        let mut m = ScalingMemory::default();
        // Busy (a backlog to read): 2 replicas complete 40/s, so 20/s each.
        // 100/s arrive, 2,000 wait: (100 + 2000/20) / (0.8 × 20) = 12.5 -> 13,
        // but up by at most max(100%, 4 pods) at a time: 6.
        let d = with_pace(&s, 2, 2_000, pace(30, 100.0, 40.0, 2), 0, &mut m);
        assert_eq!(d.replicas, 6, "{}", d.reason);
        assert!(
            d.reason.contains("delay 30s (objective 20s)") && d.reason.contains("20.0/s per replica"),
            "{}",
            d.reason
        );
        assert!(d.reason.contains("up by at most 4"), "{}", d.reason);
        // Next poll, the 6 running and busy: (100 + 1500/20) / 16 = 10.9 -> 11.
        assert_eq!(with_pace(&s, 6, 1_500, pace(25, 100.0, 120.0, 6), 10, &mut m).replicas, 11);
        // Caught up and steady at 100/s, idle part of the time: the rate read
        // busy still counts. 100 / 16 = 6.25 -> 7, once stabilized.
        let d = with_pace(&s, 11, 0, pace(1, 100.0, 100.0, 11), 100, &mut m);
        assert_eq!(d.replicas, 7, "{}", d.reason);
        // Back to 10/s: one replica.
        assert_eq!(with_pace(&s, 7, 0, pace(0, 10.0, 10.0, 7), 200, &mut m).replicas, 1);
    }

    #[test]
    fn until_a_replica_is_measured_busy_the_count_policy_decides() {
        let s = objective(20, 1, 20);
        let mut m = ScalingMemory::default();
        // No backlog: the out rate says nothing of capacity.
        let d = with_pace(&s, 2, 0, pace(0, 5.0, 5.0, 2), 0, &mut m);
        assert_eq!(d.replicas, 1, "{}", d.reason);
        assert!(d.reason.contains("target=100/replica") && !d.reason.contains("objective"), "{}", d.reason);
        // Busy but pods still starting (2 of 3): no reading either.
        let d = with_pace(&s, 3, 450, pace(30, 50.0, 20.0, 2), 1, &mut m);
        assert!(!d.reason.contains("objective"), "{}", d.reason);
        // No rates yet at all: the count policy too.
        let d = decide(&s, 1, Some((Lag::Known(450), 0, 0)), &Pace::default(), at(2), &mut m);
        assert_eq!(d.replicas, 5, "{}", d.reason);
    }

    #[test]
    fn a_rate_read_while_idling_never_lowers_the_measured_one() {
        let s = objective(20, 1, 40);
        let mut m = ScalingMemory::default();
        with_pace(&s, 4, 500, pace(10, 60.0, 80.0, 4), 0, &mut m);
        // Busy for an instant while mostly idle: 10/s over 4 replicas reads 2.5 each.
        // Planned at the 20/s read before: 10 / 16 -> 1, not 10 / 2 -> 5 and up.
        let d = with_pace(&s, 4, 5, pace(6, 10.0, 10.0, 4), 100, &mut m);
        assert_eq!(d.replicas, 1, "{}", d.reason);
        // Ten minutes on, that reading is forgotten.
        let d = with_pace(&s, 1, 0, pace(0, 10.0, 10.0, 1), 800, &mut m);
        assert!(!d.reason.contains("objective"), "{}", d.reason);
    }

    #[test]
    fn over_the_objective_and_falling_behind_adds_a_replica_once_the_last_one_runs() {
        let s = objective(10, 1, 20);
        let mut m = ScalingMemory::default();
        // Read at 40/s per replica once; now falling behind at 25/s out of 30/s in.
        with_pace(&s, 4, 500, pace(8, 150.0, 160.0, 4), 0, &mut m);
        let d = with_pace(&s, 4, 10, pace(12, 30.0, 25.0, 4), 1, &mut m);
        assert_eq!(d.replicas, 5, "the arithmetic says 1, the delay says more: {}", d.reason);
        // The fifth not yet running: no sixth.
        assert_eq!(with_pace(&s, 5, 10, pace(14, 30.0, 25.0, 4), 2, &mut m).replicas, 5);
        // Over, but draining faster than arrivals: the arithmetic decides.
        let d = with_pace(&s, 5, 10, pace(12, 10.0, 40.0, 5), 3, &mut m);
        assert_eq!(d.replicas, 5, "stabilized at 5, not 6: {}", d.reason);
        // Never past maxReplicas.
        let s = objective(10, 1, 4);
        let mut m = ScalingMemory::default();
        with_pace(&s, 4, 500, pace(8, 150.0, 160.0, 4), 0, &mut m);
        assert_eq!(with_pace(&s, 4, 10, pace(12, 30.0, 25.0, 4), 1, &mut m).replicas, 4);
    }

    #[test]
    fn rates_unknown_for_a_poll_hold_the_replicas() {
        let s = objective(20, 1, 40);
        let mut m = ScalingMemory::default();
        with_pace(&s, 4, 500, pace(10, 60.0, 80.0, 4), 0, &mut m);
        let unknown = Pace { throughput: None, ..pace(10, 0.0, 0.0, 4) };
        let d = with_pace(&s, 4, 5_000, unknown, 1, &mut m);
        assert_eq!(d.replicas, 4, "not 50 from the count policy: {}", d.reason);
    }

    #[test]
    fn the_objective_scales_from_zero_on_any_work_and_to_zero_after_the_cooldown() {
        let s = objective(20, 0, 10);
        let mut m = ScalingMemory::default();
        assert_eq!(with_pace(&s, 0, 1, Pace::default(), 0, &mut m).replicas, 1, "woken by one entry");
        assert_eq!(with_pace(&s, 1, 0, pace(0, 0.0, 0.0, 1), 1, &mut m).replicas, 1, "cooldown starts");
        assert_eq!(with_pace(&s, 1, 0, pace(0, 0.0, 0.0, 1), 400, &mut m).replicas, 0);
    }
}
