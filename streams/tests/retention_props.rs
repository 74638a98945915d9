//! Safe retention as a property, against a real redis-server: random
//! interleavings of XADD, XREADGROUP (new and own-history reads, several
//! consumers), XACK of pending IDs, XCLAIM, XDEL, XGROUP SETID (earlier and
//! later), a group created late, and the two ways streamfleet trims
//! (`enforce`, the whole pass, and `trim_to` of an arbitrary point, which the
//! operator sends with a floor that may be stale by then).
//!
//! After every trim: no entry that was pending in any group, or not yet
//! delivered to any group (after its last-delivered ID, wherever SETID put
//! it), is gone; and the trim removed exactly the entries below the lower of
//! the point asked for and that floor (no more, and no less: a trim that
//! keeps everything would satisfy safety alone).
//!
//! 64 cases of 30–50 operations by default (`PROPTEST_CASES` for more); each
//! case on a fresh stream key of one server.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use streamfleet_streams::retention::{self, StreamId};
use streamfleet_testbed::RedisServer;

type Conn = redis::aio::MultiplexedConnection;

const CONSUMERS: usize = 3;
const MAX_GROUPS: usize = 3;

/// Where XGROUP SETID / CREATE puts a group.
#[derive(Clone, Debug)]
enum Position {
    /// `0`: everything is undelivered again.
    Start,
    /// `$`: the stream's last ID.
    End,
    /// An existing entry's ID.
    Entry(Index),
    /// The ID just before an existing entry (`ms-1` and the largest
    /// sequence number, when the entry's sequence is 0).
    Before(Index),
    /// Past the stream's last entry by this many milliseconds.
    Beyond(u8),
}

/// The point `trim_to` is asked for.
#[derive(Clone, Debug)]
enum Point {
    Entry(Index),
    /// Past the last entry: asks to trim everything.
    Beyond(u8),
    Zero,
}

#[derive(Clone, Debug)]
enum Op {
    /// XADD the next ID: the same millisecond (next sequence) when `gap` is 0,
    /// else that many milliseconds later; `seq_max` uses the largest sequence
    /// number of its millisecond.
    Add {
        gap: u8,
        seq_max: bool,
    },
    /// XREADGROUP `>` (new entries) or `0` (the consumer's own pending ones).
    Read {
        group: Index,
        consumer: usize,
        count: usize,
        history: bool,
    },
    /// XACK some of a group's pending IDs (and sometimes one never delivered).
    Ack {
        group: Index,
        picks: Vec<Index>,
        stray: bool,
    },
    /// XDEL an entry (pending or not).
    Del {
        pick: Index,
    },
    /// XCLAIM a pending entry to another consumer.
    Claim {
        group: Index,
        pick: Index,
        to: usize,
    },
    SetId {
        group: Index,
        to: Position,
    },
    /// A third group joins (no-op once there are three).
    CreateGroup {
        at: Position,
    },
    /// `retention::enforce`: `maxLength` / `maxAge` at a clock of the last
    /// entry's millisecond plus `clock`.
    Enforce {
        max_length: Option<u64>,
        max_age_ms: Option<u64>,
        clock: u8,
    },
    /// `retention::trim_to` of an arbitrary point.
    TrimTo {
        to: Point,
    },
}

fn position() -> impl Strategy<Value = Position> {
    prop_oneof![
        1 => Just(Position::Start),
        1 => Just(Position::End),
        3 => any::<Index>().prop_map(Position::Entry),
        2 => any::<Index>().prop_map(Position::Before),
        1 => (1u8..5).prop_map(Position::Beyond),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        30 => (0u8..3, prop::bool::weighted(0.04)).prop_map(|(gap, seq_max)| Op::Add { gap, seq_max }),
        20 => (any::<Index>(), 0..CONSUMERS, 1usize..6, prop::bool::weighted(0.2))
            .prop_map(|(group, consumer, count, history)| Op::Read { group, consumer, count, history }),
        15 => (any::<Index>(), prop::collection::vec(any::<Index>(), 1..4), prop::bool::weighted(0.1))
            .prop_map(|(group, picks, stray)| Op::Ack { group, picks, stray }),
        5 => any::<Index>().prop_map(|pick| Op::Del { pick }),
        4 => (any::<Index>(), any::<Index>(), 0..CONSUMERS).prop_map(|(group, pick, to)| Op::Claim { group, pick, to }),
        7 => (any::<Index>(), position()).prop_map(|(group, to)| Op::SetId { group, to }),
        2 => position().prop_map(|at| Op::CreateGroup { at }),
        10 => (prop::option::of(1u64..20), prop::option::of(1u64..15), 0u8..4)
            .prop_map(|(max_length, max_age_ms, clock)| Op::Enforce { max_length, max_age_ms, clock }),
        6 => prop_oneof![
            3 => any::<Index>().prop_map(Point::Entry),
            1 => (1u8..4).prop_map(Point::Beyond),
            1 => Just(Point::Zero),
        ]
        .prop_map(|to| Op::TrimTo { to }),
    ]
}

/// The groups a case starts with, and its operations.
fn case() -> impl Strategy<Value = (Vec<Position>, Vec<Op>)> {
    (prop::collection::vec(position(), 2..=3), prop::collection::vec(op(), 30..=50))
}

fn id(s: &str) -> StreamId {
    StreamId::parse(s).unwrap_or_else(|| panic!("not a stream ID: {s:?}"))
}

/// The smallest ID after `id`, as a floor must step it: the sequence
/// number's successor, or the next millisecond's first ID.
fn successor(id: StreamId) -> StreamId {
    match id.seq.checked_add(1) {
        Some(seq) => StreamId { ms: id.ms, seq },
        None => StreamId { ms: id.ms + 1, seq: 0 },
    }
}

/// One case's stream and what it knows of it.
struct Case {
    conn: Conn,
    key: String,
    groups: Vec<String>,
    /// The last ID added (the next XADD must be above it).
    last: StreamId,
    trims: usize,
}

impl Case {
    async fn q<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> Result<T, TestCaseError> {
        cmd.query_async(&mut self.conn).await.map_err(|e| TestCaseError::fail(format!("{cmd:?}: {e}")))
    }

    async fn entries(&mut self) -> Result<Vec<StreamId>, TestCaseError> {
        let rows: Vec<(String, redis::Value)> = self.q(redis::cmd("XRANGE").arg(&self.key).arg("-").arg("+")).await?;
        Ok(rows.iter().map(|(i, _)| id(i)).collect())
    }

    async fn pending(&mut self, group: &str) -> Result<Vec<(StreamId, String)>, TestCaseError> {
        let rows: Vec<(String, String, u64, u64)> =
            self.q(redis::cmd("XPENDING").arg(&self.key).arg(group).arg("-").arg("+").arg(100_000)).await?;
        Ok(rows.into_iter().map(|(i, owner, ..)| (id(&i), owner)).collect())
    }

    /// Each group's last-delivered ID, by name.
    async fn last_delivered(&mut self) -> Result<BTreeMap<String, StreamId>, TestCaseError> {
        let reply: redis::streams::StreamInfoGroupsReply =
            self.q(redis::cmd("XINFO").arg("GROUPS").arg(&self.key)).await?;
        Ok(reply.groups.into_iter().map(|g| (g.name, id(&g.last_delivered_id))).collect())
    }

    async fn resolve(&mut self, at: &Position) -> Result<String, TestCaseError> {
        let entries = self.entries().await?;
        Ok(match at {
            Position::Start => "0".into(),
            Position::End => "$".into(),
            Position::Entry(i) if !entries.is_empty() => entries[i.index(entries.len())].to_string(),
            Position::Before(i) if !entries.is_empty() => entries[i.index(entries.len())].prev().to_string(),
            Position::Entry(_) | Position::Before(_) => "0".into(),
            Position::Beyond(ms) => StreamId { ms: self.last.ms + u64::from(*ms), seq: 0 }.to_string(),
        })
    }

    async fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Add { gap, seq_max } => {
                let mut next = if *gap == 0 && self.last.seq < u64::MAX {
                    StreamId { ms: self.last.ms, seq: self.last.seq + 1 }
                } else {
                    StreamId { ms: self.last.ms + u64::from((*gap).max(1)), seq: 0 }
                };
                if *seq_max {
                    next.seq = u64::MAX;
                }
                let _: String =
                    self.q(redis::cmd("XADD").arg(&self.key).arg(next.to_string()).arg("f").arg("v")).await?;
                self.last = next;
            }
            Op::Read { group, consumer, count, history } => {
                let group = self.groups[group.index(self.groups.len())].clone();
                let _: redis::Value = self
                    .q(redis::cmd("XREADGROUP")
                        .arg("GROUP")
                        .arg(&group)
                        .arg(format!("c{consumer}"))
                        .arg("COUNT")
                        .arg(*count)
                        .arg("STREAMS")
                        .arg(&self.key)
                        .arg(if *history { "0" } else { ">" }))
                    .await?;
            }
            Op::Ack { group, picks, stray } => {
                let group = self.groups[group.index(self.groups.len())].clone();
                let pending = self.pending(&group).await?;
                let mut ids: BTreeSet<String> = BTreeSet::new();
                if !pending.is_empty() {
                    ids.extend(picks.iter().map(|p| pending[p.index(pending.len())].0.to_string()));
                }
                if *stray {
                    // An ack of an ID that is not pending is a no-op in Redis.
                    ids.insert(self.last.to_string());
                }
                if !ids.is_empty() {
                    let _: u64 = self.q(redis::cmd("XACK").arg(&self.key).arg(&group).arg(&ids)).await?;
                }
            }
            Op::Del { pick } => {
                let entries = self.entries().await?;
                if !entries.is_empty() {
                    let victim = entries[pick.index(entries.len())].to_string();
                    let _: u64 = self.q(redis::cmd("XDEL").arg(&self.key).arg(victim)).await?;
                }
            }
            Op::Claim { group, pick, to } => {
                let group = self.groups[group.index(self.groups.len())].clone();
                let pending = self.pending(&group).await?;
                if !pending.is_empty() {
                    let (claimed, _) = &pending[pick.index(pending.len())];
                    let _: redis::Value = self
                        .q(redis::cmd("XCLAIM")
                            .arg(&self.key)
                            .arg(&group)
                            .arg(format!("c{to}"))
                            .arg(0)
                            .arg(claimed.to_string())
                            .arg("JUSTID"))
                        .await?;
                }
            }
            Op::SetId { group, to } => {
                let group = self.groups[group.index(self.groups.len())].clone();
                let to = self.resolve(to).await?;
                let () = self.q(redis::cmd("XGROUP").arg("SETID").arg(&self.key).arg(&group).arg(to)).await?;
            }
            Op::CreateGroup { at } => {
                if self.groups.len() < MAX_GROUPS {
                    let name = format!("g{}", self.groups.len());
                    let at = self.resolve(at).await?;
                    let () = self.q(redis::cmd("XGROUP").arg("CREATE").arg(&self.key).arg(&name).arg(at)).await?;
                    self.groups.push(name);
                }
            }
            Op::Enforce { max_length, max_age_ms, clock } => {
                let now_ms = self.last.ms + u64::from(*clock);
                self.check_trim(Trim::Enforce { max_length: *max_length, max_age_ms: *max_age_ms, now_ms }).await?;
            }
            Op::TrimTo { to } => {
                let entries = self.entries().await?;
                let point = match to {
                    Point::Entry(i) if !entries.is_empty() => entries[i.index(entries.len())],
                    Point::Entry(_) | Point::Zero => StreamId { ms: 0, seq: 0 },
                    Point::Beyond(ms) => StreamId { ms: self.last.ms + u64::from(*ms), seq: 0 },
                };
                self.check_trim(Trim::To(point)).await?;
            }
        }
        Ok(())
    }

    /// Trims, and checks the property against the state just before.
    async fn check_trim(&mut self, trim: Trim) -> Result<(), TestCaseError> {
        self.trims += 1;
        let before = self.entries().await?;
        let mut protected: BTreeSet<StreamId> = BTreeSet::new();
        let mut floor: Option<StreamId> = None;
        let mut lower = |id: StreamId| floor = Some(floor.map_or(id, |f: StreamId| f.min(id)));
        for (group, last) in self.last_delivered().await? {
            // Undelivered to this group: everything after its last-delivered ID.
            protected.extend(before.iter().filter(|e| **e > last));
            lower(successor(last));
            // Pending in it (an XDEL'd one has no entry left to protect, but
            // still holds the floor, as Redis reports it as the oldest).
            for (pending, _) in self.pending(&group).await? {
                protected.insert(pending);
                lower(pending);
            }
        }
        let asked = match &trim {
            Trim::To(point) => {
                let removed = retention::trim_to(&mut self.conn, &self.key, *point)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("trim_to {point}: {e}")))?;
                (Some(*point), removed)
            }
            Trim::Enforce { max_length, max_age_ms, now_ms } => {
                let r = retention::enforce(&mut self.conn, &self.key, *max_length, *max_age_ms, *now_ms)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("enforce: {e}")))?;
                // The policy's own target, computed from the entries.
                let by_length = max_length.and_then(|keep| {
                    let excess = before.len().saturating_sub(usize::try_from(keep).unwrap());
                    (excess > 0).then(|| before[excess])
                });
                let by_age = max_age_ms.map(|age| StreamId { ms: now_ms.saturating_sub(age), seq: 0 });
                let target = by_length.max(by_age);
                prop_assert_eq!(r.target, target, "the policy's target");
                prop_assert_eq!(r.floor, floor, "the floor over every group");
                prop_assert_eq!(r.blocked, matches!((target, floor), (Some(t), Some(f)) if t > f), "blocked");
                (target, r.trimmed)
            }
        };
        let after = self.entries().await?;
        let after_set: BTreeSet<StreamId> = after.iter().copied().collect();
        let lost: Vec<&StreamId> = protected.iter().filter(|p| before.contains(p) && !after_set.contains(p)).collect();
        prop_assert!(lost.is_empty(), "{trim:?} removed entries pending in or undelivered to a group: {lost:?}");
        let point = match (asked.0, floor) {
            (Some(a), Some(f)) => Some(a.min(f)),
            (a, None) => a,
            (None, Some(_)) => None,
        };
        let expected: Vec<StreamId> = before.iter().copied().filter(|e| point.is_none_or(|p| *e >= p)).collect();
        prop_assert_eq!(&after, &expected, "{:?} should keep exactly the entries from {:?} on", trim, point);
        prop_assert_eq!(asked.1, u64::try_from(before.len() - after.len()).unwrap(), "the count removed");
        Ok(())
    }
}

#[derive(Debug)]
enum Trim {
    To(StreamId),
    Enforce { max_length: Option<u64>, max_age_ms: Option<u64>, now_ms: u64 },
}

async fn run_case(conn: Conn, n: u64, starts: &[Position], ops: &[Op]) -> Result<usize, TestCaseError> {
    let key = format!("s{n}");
    let mut case = Case { conn, key, groups: Vec::new(), last: StreamId { ms: 1, seq: 0 }, trims: 0 };
    // A first entry, so that `$`, `Entry` and `Before` mean something from the start.
    let _: String = case.q(redis::cmd("XADD").arg(&case.key).arg("1-0").arg("f").arg("v")).await?;
    for (i, at) in starts.iter().enumerate() {
        let at = case.resolve(at).await?;
        let name = format!("g{i}");
        let () = case.q(redis::cmd("XGROUP").arg("CREATE").arg(&case.key).arg(&name).arg(at)).await?;
        case.groups.push(name);
    }
    for op in ops {
        case.apply(op).await?;
    }
    // Every case ends with a full trim request.
    case.check_trim(Trim::To(StreamId { ms: case.last.ms + 1, seq: 0 })).await?;
    let () = case.q(redis::cmd("DEL").arg(&case.key)).await?;
    Ok(case.trims)
}

#[test]
fn no_interleaving_lets_a_trim_remove_a_pending_or_undelivered_entry() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let server = runtime.block_on(RedisServer::start()).unwrap();
    let conn = runtime.block_on(server.connection()).unwrap();
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(64);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let counter = AtomicU64::new(0);
    let trims = AtomicU64::new(0);
    let result = runner.run(&case(), |(starts, ops)| {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        let done = runtime.block_on(run_case(conn.clone(), n, &starts, &ops))?;
        trims.fetch_add(u64::try_from(done).unwrap(), Ordering::Relaxed);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    eprintln!("{} cases, {} trims checked", counter.load(Ordering::Relaxed), trims.load(Ordering::Relaxed));
}
