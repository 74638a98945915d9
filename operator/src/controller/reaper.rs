//! Dead-consumer reaping. Consumer names are pod names; a consumer named like
//! a pod of this resource's Deployment or recovery Jobs, whose pod no longer
//! exists, is dead: its pending entries are made claimable at once and, once
//! it owns nothing, it is deleted. Consumers the operator cannot attribute to
//! its own workloads are never touched, and neither is any consumer whose
//! pod still exists, however slow.

use std::collections::HashSet;
use streamfleet_streams::health::ConsumerState;

/// How long a consumer must have been silent in Redis (`XINFO CONSUMERS`
/// idle) before it can be dead: a first filter only. A live worker also
/// records a heartbeat every 0.5 s whether or not it reads anything
/// (`consumers::heartbeat`), and the release itself declares nobody dead
/// who beat within this long (`consumers::declare_dead`): idle time alone
/// is no proof (on Redis 7.0 an idle reader's empty reads do not refresh
/// it), nor is a pod missing from the cache (a kubelet still runs a
/// force-deleted pod's process through its grace period).
pub const SILENT_FOR_MS: u64 = 2_000;
const _: () = assert!(SILENT_FOR_MS == streamfleet_streams::consumers::SILENT_FOR.as_millis() as u64);

/// The consumers to reap: attributable to this resource's workloads by name,
/// no live pod with that identity (`<pod name>.<pod UID>`, or the bare pod
/// name of consumers from before the UID), and silent past `SILENT_FOR_MS`.
/// `live_pods` must be complete (a synced cache): with partial knowledge,
/// call nothing dead.
pub fn dead_consumers<'a>(
    consumers: &'a [ConsumerState],
    live_pods: &HashSet<String>,
    owned_prefixes: &[String],
) -> Vec<&'a ConsumerState> {
    consumers
        .iter()
        .filter(|c| owned_prefixes.iter().any(|p| c.name.starts_with(p.as_str())))
        .filter(|c| !live_pods.contains(&c.name))
        .filter(|c| c.idle_ms >= SILENT_FOR_MS)
        .collect()
}

/// Whether a consumer of this resource's workloads without a pod still
/// holds entries and was active in Redis lately (`XINFO` idle under twice
/// `SILENT_FOR_MS`): its process probably just died, and its silence runs
/// out within seconds. The resource is looked at again soon rather than a
/// poll interval later, so its entries are released as soon as they may
/// be. Bounded: `XINFO` idle only grows once the process is gone.
pub fn awaiting_silence(consumers: &[ConsumerState], live_pods: &HashSet<String>, owned_prefixes: &[String]) -> bool {
    consumers.iter().any(|c| {
        c.pending > 0
            && c.idle_ms < 2 * SILENT_FOR_MS
            && owned_prefixes.iter().any(|p| c.name.starts_with(p.as_str()))
            && !live_pods.contains(&c.name)
    })
}

/// The identities a live pod's consumer may carry.
pub fn identities(name: &str, uid: Option<&str>) -> impl Iterator<Item = String> {
    std::iter::once(name.to_string()).chain(uid.map(|uid| format!("{name}.{uid}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(name: &str, pending: u64) -> ConsumerState {
        ConsumerState { name: name.into(), pending, idle_ms: 999_999 }
    }

    #[test]
    fn a_consumer_is_dead_only_without_a_pod_of_its_very_identity_and_silent() {
        let mut silent_recently = c("orders-worker-abc-3.uid-3", 2);
        silent_recently.idle_ms = SILENT_FOR_MS - 1;
        let consumers = vec![
            c("orders-worker-abc-1.uid-1", 3),
            // Same pod name, another pod (an earlier incarnation).
            c("orders-worker-abc-1.uid-0", 1),
            // A force-deleted pod whose process still reads.
            silent_recently,
        ];
        let live: HashSet<String> = identities("orders-worker-abc-1", Some("uid-1")).collect();
        let prefixes = vec!["orders-worker-".to_string()];
        let dead: Vec<&str> = dead_consumers(&consumers, &live, &prefixes).iter().map(|c| c.name.as_str()).collect();
        assert_eq!(dead, vec!["orders-worker-abc-1.uid-0"]);
    }

    #[test]
    fn a_podless_consumer_active_lately_with_entries_is_awaited() {
        let prefixes = vec!["orders-worker-".to_string()];
        let live: HashSet<String> = identities("orders-worker-abc-1", Some("uid-1")).collect();
        let with = |name: &str, pending: u64, idle_ms: u64| vec![ConsumerState { name: name.into(), pending, idle_ms }];
        let awaited = |consumers: &[ConsumerState]| awaiting_silence(consumers, &live, &prefixes);
        assert!(awaited(&with("orders-worker-abc-2.uid-2", 4, 300)), "just killed, entries held");
        assert!(!awaited(&with("orders-worker-abc-2.uid-2", 0, 300)), "nothing to release");
        assert!(
            !awaited(&with("orders-worker-abc-2.uid-2", 4, 2 * SILENT_FOR_MS)),
            "long silent: the next poll will do"
        );
        assert!(!awaited(&with("orders-worker-abc-1.uid-1", 4, 300)), "its pod lives");
        assert!(!awaited(&with("external-app", 4, 300)), "not ours");
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
