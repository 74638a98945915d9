//! Health classification: a pure function of this poll's snapshot and a
//! short history of earlier ones. First match wins:
//!
//! | health | when |
//! |---|---|
//! | `Unknown` | the group could not be inspected, or its lag is unknown |
//! | `PayloadLost` | pending entries were found with their payload gone (by anyone), and not all are acknowledged |
//! | `Stalled` | work is waiting and nothing moves: the oldest pending entry not waiting for a retry has been idle for over twice min-idle-time, an entry waiting for a retry is past due by that much, or lag > 0 and the group's read counter has not moved for ≥ 30 s over ≥ 3 polls |
//! | `Retrying` | at least 10 entries wait for a retry after failing transiently: a downstream is likely failing |
//! | `PoisonForming` | a pending entry has been delivered at least max(2, maxDeliveries − 1) times |
//! | `Backlogged` | lag + pending exceed what the running replicas are meant to carry |
//! | `Healthy` | otherwise |

use std::time::Duration;
use streamfleet_crd::Health;
use streamfleet_streams::health::{GroupSnapshot, Lag};

const STALL_MIN_SPAN: Duration = Duration::from_secs(30);
/// Entries waiting for a retry from which the pipeline is `Retrying`: a
/// few failures are everyday life, this many at once is an outage.
pub const RETRYING_MANY: u64 = 10;
/// Polls that must agree before reading is called stopped.
const STALL_MIN_POLLS: usize = 3;

/// Where the group's reading stood, and since when it has stood still. Kept
/// by time, not by a count of polls: a reconcile that a watch event triggers
/// (a recovery Job starting) is one more observation, never a shorter view
/// that would flip the health back and forth.
#[derive(Clone, Debug, Default)]
pub struct HealthMemory {
    /// (entries read, last delivered ID) at the latest poll.
    position: Option<(Option<u64>, String)>,
    /// When `position` was first seen, and the latest poll.
    since: Duration,
    latest: Duration,
    /// Polls that saw `position`.
    polls: usize,
}

impl HealthMemory {
    pub fn record(&mut self, snapshot: &GroupSnapshot, now: Duration) {
        let position = (snapshot.entries_read, snapshot.last_delivered_id.clone());
        if self.position.as_ref() == Some(&position) {
            self.polls += 1;
        } else {
            self.position = Some(position);
            self.since = now;
            self.polls = 1;
        }
        self.latest = now;
    }

    /// True when reading has stood still long enough, over enough polls.
    fn reading_stopped(&self) -> bool {
        self.polls >= STALL_MIN_POLLS && self.latest.saturating_sub(self.since) >= STALL_MIN_SPAN
    }
}

pub struct Inputs<'a> {
    pub snapshot: Option<&'a GroupSnapshot>,
    pub memory: &'a HealthMemory,
    pub min_idle: Duration,
    pub max_deliveries: u64,
    pub target_per_replica: u64,
    pub replicas: i32,
    /// Lost payloads not yet acknowledged by the user.
    pub payload_lost_unacknowledged: u64,
    /// How long the most overdue entry waiting for a retry is past its due
    /// time (no consumer takes it); zero when none is.
    pub retry_overdue: Duration,
}

/// The classification and a sentence saying why.
pub fn classify(i: &Inputs<'_>) -> (Health, String) {
    let Some(s) = i.snapshot else {
        return (Health::Unknown, "the group could not be inspected".into());
    };
    let Some(lag) = s.lag.floor().filter(|_| s.lag != Lag::Unknown) else {
        return (Health::Unknown, "lag unknown: Redis reports none and it could not be counted".into());
    };
    if i.payload_lost_unacknowledged > 0 {
        return (
            Health::PayloadLost,
            format!(
                "{} pending entries had their payload trimmed or deleted (not acknowledged)",
                i.payload_lost_unacknowledged
            ),
        );
    }
    // Entries waiting for a retry are not work more workers could do.
    let work = lag.saturating_add(s.pending.saturating_sub(s.retrying));
    let stuck_ms = u64::try_from(i.min_idle.as_millis()).unwrap_or(u64::MAX).saturating_mul(2);
    if let Some(idle) = s.oldest_pending_idle_ms.filter(|idle| *idle > stuck_ms) {
        return (Health::Stalled, format!("the oldest pending entry has been idle {}s", idle / 1000));
    }
    if i.retry_overdue.as_millis() > u128::from(stuck_ms) {
        return (
            Health::Stalled,
            format!("an entry waiting for a retry is {}s past due: no consumer takes it", i.retry_overdue.as_secs()),
        );
    }
    if lag > 0 && i.memory.reading_stopped() {
        return (Health::Stalled, format!("lag {lag} and nothing read for the last polls"));
    }
    if s.retrying >= RETRYING_MANY {
        let error = s.parked.iter().max_by_key(|p| p.most_idle_ms).and_then(|p| p.last_error.as_deref());
        let error = error.map(|e| format!("; last error: {}", crate::events::cut(e, 200))).unwrap_or_default();
        return (Health::Retrying, format!("{} entries wait for a retry after failing transiently{error}", s.retrying));
    }
    let poison_at = i.max_deliveries.saturating_sub(1).max(2);
    if let Some(count) = s.max_delivery_count.filter(|c| *c >= poison_at) {
        return (
            Health::PoisonForming,
            format!("an entry was delivered {count} times (dead-lettered after {})", i.max_deliveries),
        );
    }
    let capacity = i.target_per_replica.saturating_mul(u64::try_from(i.replicas.max(0)).unwrap_or(0));
    if work > capacity {
        return (
            Health::Backlogged,
            format!("lag + pending = {work} above what {} replicas carry ({capacity})", i.replicas),
        );
    }
    (Health::Healthy, format!("lag {lag}, pending {}", s.pending))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(lag: Lag, pending: u64) -> GroupSnapshot {
        GroupSnapshot {
            lag,
            pending,
            entries_read: Some(10),
            entries_added: None,
            server_ms: 0,
            last_delivered_id: "10-0".into(),
            oldest_pending_idle_ms: (pending > 0).then_some(1_000),
            max_delivery_count: (pending > 0).then_some(1),
            consumers: vec![],
            before_oldest_pending: None,
            stream_length: 100,
            dead_letter_length: 0,
            retrying: 0,
            parked: Vec::new(),
            delay: streamfleet_streams::health::Delay::Known(0),
            oldest_unfinished_ms: None,
            working_delay: streamfleet_streams::health::Delay::Known(0),
        }
    }

    fn classify_one(s: Option<&GroupSnapshot>, memory: &HealthMemory, lost: bool) -> Health {
        classify(&Inputs {
            snapshot: s,
            memory,
            min_idle: Duration::from_secs(10),
            max_deliveries: 5,
            target_per_replica: 100,
            replicas: 2,
            payload_lost_unacknowledged: u64::from(lost),
            retry_overdue: Duration::ZERO,
        })
        .0
    }

    #[test]
    fn many_entries_waiting_for_a_retry_read_retrying_and_are_no_backlog() {
        let m = HealthMemory::default();
        let parked = |entries, error: &str| streamfleet_streams::health::ParkedState {
            deliveries: 2,
            entries,
            most_idle_ms: 500,
            last_error: Some(error.into()),
        };
        let mut s = snap(Lag::Known(0), 400);
        s.retrying = 390;
        s.parked = vec![parked(390, "transient: payment provider down")];
        let (health, message) = classify(&Inputs {
            snapshot: Some(&s),
            memory: &m,
            min_idle: Duration::from_secs(10),
            max_deliveries: 5,
            target_per_replica: 100,
            replicas: 2,
            payload_lost_unacknowledged: 0,
            retry_overdue: Duration::ZERO,
        });
        assert_eq!(health, Health::Retrying);
        assert!(message.contains("390 entries") && message.contains("payment provider down"), "{message}");
        // A few are everyday life, and waiting entries are not a backlog.
        s.retrying = RETRYING_MANY - 1;
        s.parked = vec![parked(RETRYING_MANY - 1, "x")];
        s.pending = 200 + s.retrying;
        assert_eq!(classify_one(Some(&s), &m, false), Health::Healthy);
    }

    #[test]
    fn table() {
        let m = HealthMemory::default();
        assert_eq!(classify_one(None, &m, false), Health::Unknown);
        assert_eq!(classify_one(Some(&snap(Lag::Unknown, 0)), &m, false), Health::Unknown);
        assert_eq!(classify_one(Some(&snap(Lag::Known(0), 0)), &m, true), Health::PayloadLost);
        assert_eq!(classify_one(Some(&snap(Lag::Known(50), 10)), &m, false), Health::Healthy);
        assert_eq!(classify_one(Some(&snap(Lag::Known(250), 0)), &m, false), Health::Backlogged);
        assert_eq!(classify_one(Some(&snap(Lag::AtLeast(1000), 0)), &m, false), Health::Backlogged);
        let mut stuck = snap(Lag::Known(0), 1);
        stuck.oldest_pending_idle_ms = Some(25_000);
        assert_eq!(classify_one(Some(&stuck), &m, false), Health::Stalled);
        let mut poison = snap(Lag::Known(0), 1);
        poison.max_delivery_count = Some(4);
        assert_eq!(classify_one(Some(&poison), &m, false), Health::PoisonForming);
        poison.max_delivery_count = Some(3);
        assert_eq!(classify_one(Some(&poison), &m, false), Health::Healthy);
    }

    #[test]
    fn no_reads_across_the_history_with_lag_is_stalled() {
        let s = snap(Lag::Known(5), 0);
        let mut m = HealthMemory::default();
        for t in [0, 10, 20] {
            m.record(&s, Duration::from_secs(t));
        }
        assert_eq!(classify_one(Some(&s), &m, false), Health::Healthy, "20s is too short to call");
        m.record(&s, Duration::from_secs(30));
        assert_eq!(classify_one(Some(&s), &m, false), Health::Stalled);
        let mut moved = s.clone();
        moved.last_delivered_id = "11-0".into();
        moved.entries_read = Some(11);
        m.record(&moved, Duration::from_secs(40));
        assert_eq!(classify_one(Some(&moved), &m, false), Health::Healthy);
        let idle = snap(Lag::Known(0), 0);
        let mut m = HealthMemory::default();
        for t in [0, 20, 40, 60] {
            m.record(&idle, Duration::from_secs(t));
        }
        assert_eq!(classify_one(Some(&idle), &m, false), Health::Healthy, "idle is not stalled");
    }

    #[test]
    fn extra_reconciles_do_not_shorten_the_view_of_a_stall() {
        let s = snap(Lag::Known(5), 0);
        let mut m = HealthMemory::default();
        for t in [0, 10, 20, 30] {
            m.record(&s, Duration::from_secs(t));
        }
        assert_eq!(classify_one(Some(&s), &m, false), Health::Stalled);
        // A recovery Job's start and end trigger reconciles between polls.
        for t in [30, 31, 31, 32, 32, 33, 33, 34] {
            m.record(&s, Duration::from_secs(t));
            assert_eq!(classify_one(Some(&s), &m, false), Health::Stalled, "at {t}s");
        }
    }
}
