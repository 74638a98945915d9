//! Health classification: a pure function of this poll's snapshot and a
//! short history of earlier ones, judged over a window rather than against
//! counts (as Burrow judges Kafka consumers). First match wins:
//!
//! | health | when |
//! |---|---|
//! | `Unknown` | the group could not be inspected, or its lag is unknown |
//! | `PayloadLost` | pending entries were found with their payload gone (by anyone), and not all are acknowledged |
//! | `Stopped` | work waits (lag, or pending not waiting for a retry), workers have been wanted for 30 s, and no consumer of the group has touched it in that time |
//! | `Stalled` | work waits and nothing moves: the oldest pending entry not waiting for a retry has been idle for over twice min-idle-time, an entry waiting for a retry is past due by that much, or workers are wanted, lag > 0 and the group's read counter has not moved for ≥ 30 s over ≥ 3 polls |
//! | `Rewound` | shard 0's last delivered ID is behind the furthest it reached, with entries after it: they are delivered again |
//! | `Retrying` | at least 10 entries wait for a retry after failing transiently: a downstream is likely failing |
//! | `PoisonForming` | a pending entry has been delivered at least max(2, maxDeliveries − 1) times |
//! | `Lagging` | over ≥ 30 s and ≥ 3 polls the delay (entries waiting for a retry left out) never fell and rose by ≥ 5 s, while entries were completed; it stays `Lagging` until the delay falls at two polls in a row, or rises by less than 5 s over the window |
//! | `Healthy` | otherwise |

use std::collections::VecDeque;
use std::time::Duration;
use streamfleet_crd::Health;
use streamfleet_streams::health::{GroupSnapshot, Lag};
use streamfleet_streams::millis;
use streamfleet_streams::retention::StreamId;

const STALL_MIN_SPAN: Duration = Duration::from_secs(30);
/// Entries waiting for a retry from which the pipeline is `Retrying`: a
/// few failures are everyday life, this many at once is an outage.
pub const RETRYING_MANY: u64 = 10;
/// Polls that must agree before reading is called stopped.
const STALL_MIN_POLLS: usize = 3;
/// How much the delay must rise over the window to read `Lagging`.
const LAGGING_RISE_MS: u64 = 5_000;

/// One poll's delay (entries waiting for a retry left out) and completions.
#[derive(Clone, Copy, Debug)]
struct Reading {
    at: Duration,
    delay_ms: Option<u64>,
    /// Entries read less pending: completed (acknowledged or dead-lettered).
    finished: Option<u64>,
}

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
    /// The delay and completions of the polls of the last window (and the
    /// newest one older than it).
    readings: VecDeque<Reading>,
    /// Read as `Lagging`, until the delay falls twice in a row.
    lagging: bool,
    /// The furthest last delivered ID seen.
    furthest: Option<StreamId>,
    /// Since when work has waited, workers wanted, with no consumer
    /// touching the group.
    unattended_since: Option<Duration>,
    /// Workers were wanted at the latest poll.
    wanted: bool,
}

/// Work more workers could do: lag and pending, less entries waiting for a retry.
fn work(s: &GroupSnapshot) -> Option<u64> {
    Some(s.lag.floor()?.saturating_add(s.pending.saturating_sub(s.retrying)))
}

/// No consumer has touched the group for this long (or there is none).
fn unattended(s: &GroupSnapshot) -> bool {
    let stale_ms = millis(STALL_MIN_SPAN);
    work(s).is_some_and(|w| w > 0) && s.consumers.iter().all(|c| c.idle_ms > stale_ms)
}

impl HealthMemory {
    /// Records a poll; `wanted`: workers are wanted (a pipeline at zero
    /// replicas, or suspended, waits by design).
    pub fn record(&mut self, snapshot: &GroupSnapshot, now: Duration, wanted: bool) {
        let position = (snapshot.entries_read, snapshot.last_delivered_id.clone());
        if self.position.as_ref() == Some(&position) {
            self.polls += 1;
        } else {
            self.position = Some(position);
            self.since = now;
            self.polls = 1;
        }
        self.latest = now;
        let finished = snapshot.entries_read.map(|read| read.saturating_sub(snapshot.pending));
        self.readings.push_back(Reading { at: now, delay_ms: snapshot.working_delay.ms(), finished });
        // Back to the newest reading at least a window old, and never fewer
        // than three (a poll interval over the window still sees a trend).
        while self.readings.len() > STALL_MIN_POLLS
            && self.readings.get(1).is_some_and(|second| now.saturating_sub(second.at) >= STALL_MIN_SPAN)
        {
            self.readings.pop_front();
        }
        self.lagging = if self.lagging { !self.delay_fell_twice() && self.delay_rose() } else { self.delay_rising() };
        // Nothing after the last delivered ID: nothing to deliver again.
        if let Some(id) = StreamId::parse(&snapshot.last_delivered_id) {
            self.furthest =
                Some(if snapshot.lag.is_known_zero() { id } else { self.furthest.map_or(id, |f| f.max(id)) });
        }
        self.unattended_since = if wanted && unattended(snapshot) { self.unattended_since.or(Some(now)) } else { None };
        self.wanted = wanted;
    }

    /// Work has waited with no consumer for the whole window.
    fn stopped(&self) -> bool {
        self.unattended_since.is_some_and(|since| self.latest.saturating_sub(since) >= STALL_MIN_SPAN)
    }

    /// True when reading has stood still long enough, over enough polls,
    /// with workers wanted.
    fn reading_stopped(&self) -> bool {
        self.wanted && self.polls >= STALL_MIN_POLLS && self.latest.saturating_sub(self.since) >= STALL_MIN_SPAN
    }

    /// Over the window the delay rose by `LAGGING_RISE_MS` (known throughout).
    fn delay_rose(&self) -> bool {
        let delays: Option<Vec<u64>> = self.readings.iter().map(|r| r.delay_ms).collect();
        delays.is_some_and(|d| {
            d.last().zip(d.first()).is_some_and(|(last, first)| last.saturating_sub(*first) >= LAGGING_RISE_MS)
        })
    }

    /// Over the window: the delay never fell and rose by `LAGGING_RISE_MS`,
    /// and entries were completed.
    fn delay_rising(&self) -> bool {
        let (Some(first), Some(last)) = (self.readings.front(), self.readings.back()) else { return false };
        if self.readings.len() < STALL_MIN_POLLS || last.at.saturating_sub(first.at) < STALL_MIN_SPAN {
            return false;
        }
        let delays: Option<Vec<u64>> = self.readings.iter().map(|r| r.delay_ms).collect();
        let Some(delays) = delays else { return false };
        let never_fell = delays.windows(2).all(|w| w[1] >= w[0]);
        let completed = first.finished.zip(last.finished).is_some_and(|(f, l)| l > f);
        never_fell && self.delay_rose() && completed
    }

    /// The delay fell at the last two polls (or there is none).
    fn delay_fell_twice(&self) -> bool {
        let n = self.readings.len();
        let delay = |i: usize| self.readings.get(i).and_then(|r| r.delay_ms);
        if delay(n.saturating_sub(1)) == Some(0) {
            return true;
        }
        n >= 3 && matches!((delay(n - 3), delay(n - 2), delay(n - 1)), (Some(a), Some(b), Some(c)) if b < a && c < b)
    }

    /// The furthest last delivered ID seen, when the group is now behind it.
    fn rewound_from(&self, snapshot: &GroupSnapshot) -> Option<StreamId> {
        let now = StreamId::parse(&snapshot.last_delivered_id)?;
        self.furthest.filter(|furthest| now < *furthest)
    }
}

pub struct Inputs<'a> {
    pub snapshot: Option<&'a GroupSnapshot>,
    pub memory: &'a HealthMemory,
    pub min_idle: Duration,
    pub max_deliveries: u64,
    /// Worker replicas wanted.
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
    // Wanted workers only (`record`): a pipeline at zero below its
    // activation threshold waits by design.
    if unattended(s) && i.memory.stopped() {
        let why = if s.consumers.is_empty() { "no consumer in the group" } else { "no consumer touched the group" };
        return (Health::Stopped, format!("lag {lag}, pending {}: {why} for 30s", s.pending));
    }
    let stuck_ms = millis(i.min_idle).saturating_mul(2);
    if let Some(idle) = s.oldest_pending_idle_ms.filter(|idle| *idle > stuck_ms) {
        return (Health::Stalled, format!("the oldest pending entry has been idle {}s", idle / 1000));
    }
    if millis(i.retry_overdue) > stuck_ms {
        return (
            Health::Stalled,
            format!("an entry waiting for a retry is {}s past due: no consumer takes it", i.retry_overdue.as_secs()),
        );
    }
    if lag > 0 && i.memory.reading_stopped() {
        return (Health::Stalled, format!("lag {lag} and nothing read for the last polls"));
    }
    if let Some(furthest) = i.memory.rewound_from(s) {
        return (
            Health::Rewound,
            format!(
                "the group was set back to {} from {furthest}: entries after it are delivered again",
                s.last_delivered_id
            ),
        );
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
    let delay = s.working_delay.ms().map_or("unknown".to_string(), |ms| format!("{}s", ms / 1000));
    if i.memory.lagging {
        return (
            Health::Lagging,
            format!(
                "the delay ({delay}) has been rising while entries are completed: lag {lag}, pending {}",
                s.pending
            ),
        );
    }
    (Health::Healthy, format!("delay {delay}, lag {lag}, pending {}", s.pending))
}

#[cfg(test)]
mod tests {
    use super::*;
    use streamfleet_streams::health::{ConsumerState, Delay};

    fn snap(lag: Lag, pending: u64) -> GroupSnapshot {
        GroupSnapshot {
            lag,
            pending,
            entries_read: Some(10),
            entries_added: None,
            last_delivered_id: "10-0".into(),
            oldest_pending_idle_ms: (pending > 0).then_some(1_000),
            max_delivery_count: (pending > 0).then_some(1),
            consumers: vec![ConsumerState { name: "w".into(), pending, idle_ms: 100 }],
            stream_length: 100,
            ..GroupSnapshot::default()
        }
    }

    fn inputs<'a>(s: Option<&'a GroupSnapshot>, memory: &'a HealthMemory, lost: bool) -> Inputs<'a> {
        Inputs {
            snapshot: s,
            memory,
            min_idle: Duration::from_secs(10),
            max_deliveries: 5,
            replicas: 2,
            payload_lost_unacknowledged: u64::from(lost),
            retry_overdue: Duration::ZERO,
        }
    }

    fn classify_one(s: Option<&GroupSnapshot>, memory: &HealthMemory, lost: bool) -> Health {
        classify(&inputs(s, memory, lost)).0
    }

    /// A poll at `t` s with this delay (s) and these completions.
    fn poll(m: &mut HealthMemory, t: u64, delay_s: u64, finished: u64) -> (Health, String) {
        let mut s = snap(Lag::Known(50), 10);
        s.working_delay = Delay::Known(delay_s * 1000);
        s.entries_read = Some(finished + 10);
        s.last_delivered_id = format!("{}-0", finished + 10);
        m.record(&s, Duration::from_secs(t), true);
        classify(&inputs(Some(&s), m, false))
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
        let (health, message) = classify(&inputs(Some(&s), &m, false));
        assert_eq!(health, Health::Retrying);
        assert!(message.contains("390 entries") && message.contains("payment provider down"), "{message}");
        // A few are everyday life.
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
        // A count alone is no verdict.
        assert_eq!(classify_one(Some(&snap(Lag::AtLeast(1001), 0)), &m, false), Health::Healthy);
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
    fn a_delay_rising_while_entries_complete_is_lagging_until_it_falls_twice() {
        let mut m = HealthMemory::default();
        assert_eq!(poll(&mut m, 0, 2, 100).0, Health::Healthy);
        assert_eq!(poll(&mut m, 10, 4, 200).0, Health::Healthy);
        assert_eq!(poll(&mut m, 20, 8, 300).0, Health::Healthy, "20 s is too short to call");
        let (health, message) = poll(&mut m, 30, 12, 400);
        assert_eq!(health, Health::Lagging, "{message}");
        assert!(message.contains("delay (12s)"), "{message}");
        // One fall is not enough to leave (hysteresis)...
        assert_eq!(poll(&mut m, 40, 11, 500).0, Health::Lagging);
        // ...two in a row are.
        assert_eq!(poll(&mut m, 50, 10, 600).0, Health::Healthy);
        // A delay that stops rising leaves it too, with no two falls in a
        // row: up 6 s over the window still lagging, then up 2 s.
        let mut m = HealthMemory::default();
        for (t, d) in [(0, 2), (10, 4), (20, 6)] {
            poll(&mut m, t, d, 100 * t);
        }
        assert_eq!(poll(&mut m, 30, 9, 3_000).0, Health::Lagging);
        assert_eq!(poll(&mut m, 40, 10, 4_000).0, Health::Lagging, "up 6 s over the window");
        assert_eq!(poll(&mut m, 50, 8, 5_000).0, Health::Healthy, "up 2 s over the window");
        // With polls a window apart, three readings still judge.
        let mut m = HealthMemory::default();
        for (t, d) in [(0, 10), (40, 50)] {
            poll(&mut m, t, d, 100 * t);
        }
        assert_eq!(poll(&mut m, 80, 90, 8_000).0, Health::Lagging);
        // A steady delay, even a long one, is not lagging.
        let mut m = HealthMemory::default();
        for t in [0, 10, 20, 30, 40] {
            assert_eq!(poll(&mut m, t, 60, 100 * t).0, Health::Healthy, "at {t}s");
        }
        // Rising without any completion is not lagging (the stall rules judge it).
        let mut m = HealthMemory::default();
        for (t, d) in [(0, 1), (10, 11), (20, 21)] {
            poll(&mut m, t, d, 100);
        }
        assert_ne!(poll(&mut m, 30, 31, 100).0, Health::Lagging);
    }

    #[test]
    fn work_with_no_consumer_for_30s_is_stopped_unless_no_worker_is_wanted() {
        let mut s = snap(Lag::Known(5), 0);
        s.consumers.clear();
        let mut m = HealthMemory::default();
        m.record(&s, Duration::from_secs(0), true);
        assert_ne!(classify_one(Some(&s), &m, false), Health::Stopped, "a pod restarting is not stopped");
        m.record(&s, Duration::from_secs(30), true);
        let (health, message) = classify(&inputs(Some(&s), &m, false));
        assert_eq!(health, Health::Stopped, "{message}");
        assert!(message.contains("no consumer in the group"), "{message}");
        // At zero replicas below the activation threshold (or suspended),
        // waiting is the design; woken, the pods get their 30 s.
        let mut zero = HealthMemory::default();
        for t in [0, 30, 60] {
            zero.record(&s, Duration::from_secs(t), false);
            let health = classify_one(Some(&s), &zero, false);
            assert!(health != Health::Stopped && health != Health::Stalled, "at {t}s: {health:?}");
        }
        zero.record(&s, Duration::from_secs(62), true);
        assert_ne!(classify_one(Some(&s), &zero, false), Health::Stopped, "just woken");
        zero.record(&s, Duration::from_secs(92), true);
        assert_eq!(classify_one(Some(&s), &zero, false), Health::Stopped);
        // A consumer touching the group again ends it.
        s.consumers = vec![ConsumerState { name: "w".into(), pending: 0, idle_ms: 500 }];
        m.record(&s, Duration::from_secs(31), true);
        assert_ne!(classify_one(Some(&s), &m, false), Health::Stopped);
    }

    #[test]
    fn a_group_set_back_reads_rewound_until_it_passes_where_it_was() {
        let mut m = HealthMemory::default();
        let at = |id: &str| {
            let mut s = snap(Lag::Known(3), 0);
            s.last_delivered_id = id.into();
            s
        };
        m.record(&at("500-0"), Duration::from_secs(0), true);
        let back = at("100-0");
        m.record(&back, Duration::from_secs(10), true);
        // (with lag 3 after it: entries to deliver again)
        let (health, message) = classify(&inputs(Some(&back), &m, false));
        assert_eq!(health, Health::Rewound, "{message}");
        assert!(message.contains("100-0") && message.contains("500-0"), "{message}");
        let past = at("500-1");
        m.record(&past, Duration::from_secs(20), true);
        assert_eq!(classify_one(Some(&past), &m, false), Health::Healthy);
        // Set back with nothing after it (a group created again where it was
        // on an empty stream): nothing is delivered again.
        let mut empty = at("100-0");
        empty.lag = Lag::Known(0);
        m.record(&empty, Duration::from_secs(30), true);
        assert_eq!(classify_one(Some(&empty), &m, false), Health::Healthy);
    }

    #[test]
    fn no_reads_across_the_history_with_lag_is_stalled() {
        let s = snap(Lag::Known(5), 0);
        let mut m = HealthMemory::default();
        for t in [0, 10, 20] {
            m.record(&s, Duration::from_secs(t), true);
        }
        assert_eq!(classify_one(Some(&s), &m, false), Health::Healthy, "20s is too short to call");
        m.record(&s, Duration::from_secs(30), true);
        assert_eq!(classify_one(Some(&s), &m, false), Health::Stalled);
        let mut moved = s.clone();
        moved.last_delivered_id = "11-0".into();
        moved.entries_read = Some(11);
        m.record(&moved, Duration::from_secs(40), true);
        assert_eq!(classify_one(Some(&moved), &m, false), Health::Healthy);
        let idle = snap(Lag::Known(0), 0);
        let mut m = HealthMemory::default();
        for t in [0, 20, 40, 60] {
            m.record(&idle, Duration::from_secs(t), true);
        }
        assert_eq!(classify_one(Some(&idle), &m, false), Health::Healthy, "idle is not stalled");
    }

    #[test]
    fn extra_reconciles_do_not_shorten_the_view_of_a_stall() {
        let s = snap(Lag::Known(5), 0);
        let mut m = HealthMemory::default();
        for t in [0, 10, 20, 30] {
            m.record(&s, Duration::from_secs(t), true);
        }
        assert_eq!(classify_one(Some(&s), &m, false), Health::Stalled);
        // A recovery Job's start and end trigger reconciles between polls.
        for t in [30, 31, 31, 32, 32, 33, 33, 34] {
            m.record(&s, Duration::from_secs(t), true);
            assert_eq!(classify_one(Some(&s), &m, false), Health::Stalled, "at {t}s");
        }
    }
}
