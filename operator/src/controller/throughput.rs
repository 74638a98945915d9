//! Arrival and completion rates over a sliding window, per shard, from
//! counters Redis keeps: entries added to the stream (`XINFO GROUPS`' read
//! counter plus its lag, which is exactly how Redis derives the lag) and
//! entries finished (read, less pending: acknowledged or dead-lettered),
//! each read at the server's `TIME`. A shard's own clock times its own
//! counters, so shards on different servers never mix clocks. A promoted
//! replica's read counter is behind, but it moves by what is read: its
//! deltas hold.

use std::collections::{HashMap, VecDeque};
use streamfleet_streams::health::GroupSnapshot;

/// How far back the rates look: from the newest reading at least this old.
pub const WINDOW_MS: u64 = 30_000;
/// The shortest span a rate is computed over.
const SHORTEST_MS: u64 = 1_000;

/// One reading of a shard's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Sample {
    at_ms: u64,
    added: u64,
    finished: u64,
}

/// What the rates remember between polls of one resource: each shard's
/// readings within the window.
#[derive(Clone, Debug, Default)]
pub struct ThroughputMemory {
    shards: HashMap<String, VecDeque<Sample>>,
}

/// Entries per second in and out, over `window_ms`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Throughput {
    pub in_per_second: f64,
    pub out_per_second: f64,
    /// The span the rates were measured over (the shortest of the shards').
    pub window_ms: u64,
}

impl Throughput {
    /// Seconds until the work outstanding is done at these rates: `None`
    /// when it does not shrink (or nothing is outstanding: `Some(0)`).
    pub fn drain_seconds(&self, outstanding: u64) -> Option<u64> {
        if outstanding == 0 {
            return Some(0);
        }
        let net = self.out_per_second - self.in_per_second;
        (net > 0.0).then(|| (outstanding as f64 / net).ceil() as u64)
    }
}

/// A shard's counters, when Redis gives them (its read counter and its lag
/// both reported).
fn sample(s: &GroupSnapshot) -> Option<Sample> {
    let added = s.entries_added?;
    let read = s.entries_read?;
    Some(Sample { at_ms: s.server_ms, added, finished: read.saturating_sub(s.pending) })
}

impl ThroughputMemory {
    /// Records this poll's shards (a shard without a snapshot is left as
    /// it was) and returns the rates over every shard: `None` until each
    /// shard has readings a second apart, or when a shard's counters are
    /// unreadable now.
    pub fn observe(&mut self, shards: &[(String, Option<GroupSnapshot>)]) -> Option<Throughput> {
        self.shards.retain(|name, _| shards.iter().any(|(s, _)| s == name));
        let mut total = Throughput { in_per_second: 0.0, out_per_second: 0.0, window_ms: u64::MAX };
        let mut known = !shards.is_empty();
        for (name, snapshot) in shards {
            let readings = self.shards.entry(name.clone()).or_default();
            let Some(now) = snapshot.as_ref().and_then(sample) else {
                known = false;
                continue;
            };
            // A counter going back (the stream recreated, a failover that
            // lost writes) or a clock going back starts the window again.
            if readings.back().is_some_and(|b| now.at_ms < b.at_ms || now.added < b.added || now.finished < b.finished)
            {
                readings.clear();
            }
            readings.push_back(now);
            // The window starts at the newest reading at least WINDOW_MS old,
            // so its span does not flip with the polls' jitter.
            while readings.get(1).is_some_and(|second| second.at_ms.saturating_add(WINDOW_MS) <= now.at_ms) {
                readings.pop_front();
            }
            let first = readings.front().copied().unwrap_or(now);
            let span = now.at_ms.saturating_sub(first.at_ms);
            if span < SHORTEST_MS {
                known = false;
                continue;
            }
            let per_second = |delta: u64| delta as f64 * 1000.0 / span as f64;
            total.in_per_second += per_second(now.added - first.added);
            total.out_per_second += per_second(now.finished - first.finished);
            total.window_ms = total.window_ms.min(span);
        }
        known.then_some(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use streamfleet_streams::health::Lag;

    fn snap(at_ms: u64, added: u64, lag: Lag, pending: u64) -> Option<GroupSnapshot> {
        Some(GroupSnapshot {
            lag,
            pending,
            entries_read: lag.floor().map(|lag| added - lag),
            entries_added: Some(added),
            server_ms: at_ms,
            stream_length: added,
            ..GroupSnapshot::default()
        })
    }

    fn one(name: &str, s: Option<GroupSnapshot>) -> Vec<(String, Option<GroupSnapshot>)> {
        vec![(name.to_string(), s)]
    }

    #[test]
    fn rates_are_counter_deltas_over_the_servers_clock() {
        let mut m = ThroughputMemory::default();
        assert_eq!(m.observe(&one("s", snap(10_000, 100, Lag::Known(0), 0))), None, "one reading is no rate");
        // 10 s later: 500 more arrived; 50 wait, 30 are in hand: 420 finished.
        let t = m.observe(&one("s", snap(20_000, 600, Lag::Known(50), 30))).unwrap();
        assert_eq!((t.in_per_second, t.out_per_second, t.window_ms), (50.0, 42.0, 10_000));
        assert_eq!(t.drain_seconds(80), None, "falling behind: no drain time");
        // Then nothing arrives and 80 finish in 4 s.
        let t = m.observe(&one("s", snap(24_000, 600, Lag::Known(0), 0))).unwrap();
        assert_eq!((t.in_per_second, t.out_per_second), (500.0 / 14.0, 500.0 / 14.0));
        // The window starts at the newest reading at least 30 s old: still
        // the one at 10 s (the next, at 20 s, is only 24 s old).
        let t = m.observe(&one("s", snap(44_000, 600, Lag::Known(0), 0))).unwrap();
        assert_eq!((t.in_per_second, t.out_per_second, t.window_ms), (500.0 / 34.0, 500.0 / 34.0, 34_000));
        // At 52 s the one at 20 s is: nothing arrived since, the 80 then in hand finished.
        let t = m.observe(&one("s", snap(52_000, 600, Lag::Known(0), 0))).unwrap();
        assert_eq!((t.in_per_second, t.out_per_second, t.window_ms), (0.0, 80.0 / 32.0, 32_000));
    }

    #[test]
    fn drain_time_is_outstanding_work_over_the_net_rate() {
        let t = Throughput { in_per_second: 40.0, out_per_second: 50.0, window_ms: WINDOW_MS };
        assert_eq!(t.drain_seconds(2_400), Some(240));
        assert_eq!(t.drain_seconds(0), Some(0));
        let t = Throughput { in_per_second: 50.0, out_per_second: 50.0, window_ms: WINDOW_MS };
        assert_eq!(t.drain_seconds(1), None);
    }

    #[test]
    fn shards_add_up_each_on_its_own_clock_and_unknown_if_any_is() {
        let mut m = ThroughputMemory::default();
        let shards = |a: u64, b: u64| {
            vec![
                ("s0".to_string(), snap(1_000 + a * 1000, a * 10, Lag::Known(0), 0)),
                // A server whose clock is an hour ahead: only its own deltas count.
                ("s1".to_string(), snap(3_600_000 + b * 1000, b * 20, Lag::Known(0), 0)),
            ]
        };
        m.observe(&shards(0, 0));
        let t = m.observe(&shards(2, 2)).unwrap();
        assert_eq!((t.in_per_second, t.out_per_second), (30.0, 30.0));
        let mut gone = shards(3, 3);
        gone[1].1.as_mut().unwrap().entries_read = None;
        assert_eq!(m.observe(&gone), None, "a shard's read counter unknown: no rate");
    }

    #[test]
    fn a_counter_going_back_starts_the_window_again() {
        let mut m = ThroughputMemory::default();
        m.observe(&one("s", snap(0, 1_000, Lag::Known(0), 0)));
        m.observe(&one("s", snap(5_000, 2_000, Lag::Known(0), 0)));
        // The stream was deleted and recreated: counters restart.
        assert_eq!(m.observe(&one("s", snap(6_000, 10, Lag::Known(0), 0))), None);
        let t = m.observe(&one("s", snap(8_000, 30, Lag::Known(0), 0))).unwrap();
        assert_eq!(t.in_per_second, 10.0);
        // Unreadable counters (NULL lag in Redis): no rate, never a made-up one.
        let mut unread = snap(9_000, 40, Lag::Known(0), 0);
        unread.as_mut().unwrap().entries_added = None;
        assert_eq!(m.observe(&one("s", unread)), None);
    }
}
