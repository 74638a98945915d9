//! Dead-consumer reaping. Consumer names are pod names; a consumer named like
//! a pod of this resource's Deployment or recovery Jobs, whose pod no longer
//! exists, is dead: its pending entries are made claimable at once and, once
//! it owns nothing, it is deleted. Consumers the operator cannot attribute to
//! its own workloads are never touched, and neither is any consumer whose
//! pod still exists, however slow.

use std::collections::HashSet;
use streamfleet_streams::health::ConsumerState;

/// The consumers to reap. `live_pods` must be complete (a synced cache):
/// with partial knowledge, call nothing dead.
pub fn dead_consumers<'a>(
    consumers: &'a [ConsumerState],
    live_pods: &HashSet<String>,
    owned_prefixes: &[String],
) -> Vec<&'a ConsumerState> {
    consumers
        .iter()
        .filter(|c| owned_prefixes.iter().any(|p| c.name.starts_with(p.as_str())))
        .filter(|c| !live_pods.contains(&c.name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(name: &str, pending: u64) -> ConsumerState {
        ConsumerState { name: name.into(), pending, idle_ms: 999_999 }
    }

    #[test]
    fn only_our_consumers_without_a_pod_are_dead() {
        let consumers = vec![
            c("orders-worker-abc-1", 3),
            c("orders-worker-abc-2", 0),
            c("orders-recovery-1-x", 1),
            c("external-app", 5),
        ];
        let live: HashSet<String> = ["orders-worker-abc-1".to_string()].into();
        let prefixes = vec!["orders-worker-".to_string(), "orders-recovery-".to_string()];
        let dead: Vec<&str> = dead_consumers(&consumers, &live, &prefixes).iter().map(|c| c.name.as_str()).collect();
        assert_eq!(dead, vec!["orders-worker-abc-2", "orders-recovery-1-x"]);
    }
}
