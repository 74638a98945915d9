//! Hostile replies: every function of this crate that reads Redis replies
//! (stream entries, dead letters, payload-loss and recovery records, group
//! and consumer inspection, pending lists, claim and script replies, the
//! server version) is run against a connection that answers with random
//! `redis::Value` trees — nested arrays and maps, bulk strings of arbitrary
//! bytes, entry IDs at the limits of u64, numbers of every sign and size,
//! nil, doubles, booleans and server errors (`NOSCRIPT` included, so
//! scripts take their load-and-retry path) — some of them shaped like the
//! real reply with hostile leaves, so decoding gets past the first check.
//! None may panic: each returns a value or an error. The pure decoders
//! (entry fields, dead letters, stream IDs, the dead-letter filter) are
//! checked for what they must keep, too.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use redis::Value;
use redis::aio::ConnectionLike;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use streamfleet_streams::deadletter::{self, Letter, Reason};
use streamfleet_streams::dlq::{self, DeadLetter, Filter};
use streamfleet_streams::health::{self, GroupSnapshot, Lag};
use streamfleet_streams::retention::StreamId;
use streamfleet_streams::{Entry, claim, consumers, entry, payload_loss, recovery, replay, retention, sweep, version};

/// Answers each command with the next scripted reply, and with a dropped
/// connection once they run out (so every loop ends). Clones share the
/// replies, as clones of a real connection share it.
#[derive(Clone)]
struct Hostile {
    replies: std::sync::Arc<std::sync::Mutex<VecDeque<Value>>>,
}

impl Hostile {
    fn next(&mut self) -> redis::RedisResult<Value> {
        let next = self.replies.lock().map(|mut replies| replies.pop_front()).ok().flatten();
        next.ok_or_else(|| {
            redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "no more replies"))
        })
    }
}

impl ConnectionLike for Hostile {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        let mut args = cmd.args_iter().filter_map(|a| match a {
            redis::Arg::Simple(bytes) => Some(bytes),
            _ => None,
        });
        let reply = match (args.next(), args.next(), args.next()) {
            // Every server answers SCRIPT LOAD with the script's SHA1 (and
            // redis-rs debug-asserts that it does).
            (Some(b"SCRIPT"), Some(b"LOAD"), Some(code)) => {
                let _ = self.next();
                Ok(Value::BulkString(redis::Script::new(&String::from_utf8_lossy(code)).get_hash().into()))
            }
            _ => self.next(),
        };
        Box::pin(async move { reply })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        _: &'a redis::Pipeline,
        _offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        let replies = (0..count).map(|_| self.next()).collect();
        Box::pin(async move { replies })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

/// Words the decoders look for, so that random maps sometimes match.
const WORDS: &[&str] = &[
    "name",
    "consumers",
    "pending",
    "last-delivered-id",
    "entries-read",
    "lag",
    "idle",
    "inactive",
    "count",
    "finished-at-ms",
    "scanned",
    "claimed",
    "dead-lettered",
    "payload-lost",
    "0-0",
    "-",
    "+",
    "1",
    "0",
    "# Server\r\nredis_version:8.4.0\r\n",
    "redis_version:99999999999.1",
    "completed",
    "processing:c1:7",
    "payload-missing",
    deadletter::F_SOURCE_STREAM,
    deadletter::F_SOURCE_ID,
    deadletter::F_GROUP,
    deadletter::F_REASON,
    deadletter::F_AT,
    deadletter::F_BUSINESS_KEY,
    deadletter::F_DELIVERIES,
];

fn text() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..12),
        any::<String>().prop_map(String::into_bytes),
        (any::<u64>(), any::<u64>()).prop_map(|(ms, seq)| format!("{ms}-{seq}").into_bytes()),
        (0u64..4, 0u64..3).prop_map(|(ms, seq)| format!("{ms}-{seq}").into_bytes()),
        Just(b"18446744073709551615-18446744073709551615".to_vec()),
        Just(b"18446744073709551616-0".to_vec()),
        any::<i64>().prop_map(|n| n.to_string().into_bytes()),
        prop::sample::select(WORDS).prop_map(|w| w.as_bytes().to_vec()),
    ]
}

fn server_error() -> impl Strategy<Value = Value> {
    prop::sample::select(&["NOSCRIPT", "ERR", "NOPERM", "BUSYGROUP", "WRONGTYPE", "LOADING", "MOVED 1 127.0.0.1:1"][..])
        .prop_map(|code| redis::parse_redis_value(format!("-{code} hostile\r\n").as_bytes()).unwrap())
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        2 => Just(Value::Nil),
        2 => any::<i64>().prop_map(Value::Int),
        2 => prop::sample::select(&[0, 1, -1, 2, i64::MAX, i64::MIN][..]).prop_map(Value::Int),
        6 => text().prop_map(Value::BulkString),
        2 => text().prop_map(|t| Value::SimpleString(String::from_utf8_lossy(&t).into_owned())),
        1 => Just(Value::Okay),
        1 => any::<f64>().prop_map(Value::Double),
        1 => any::<bool>().prop_map(Value::Boolean),
        1 => text().prop_map(|t| Value::VerbatimString {
            format: redis::VerbatimFormat::Text,
            text: String::from_utf8_lossy(&t).into_owned()
        }),
        1 => server_error(),
    ]
}

fn tree() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 8, |inner| {
        prop_oneof![
            4 => prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            2 => prop::collection::vec((inner.clone(), inner.clone()), 0..5).prop_map(Value::Map),
            1 => prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Set),
            1 => (inner.clone(), prop::collection::vec((inner.clone(), inner), 0..2))
                .prop_map(|(data, attributes)| Value::Attribute { data: Box::new(data), attributes }),
        ]
    })
}

fn bulk(s: &str) -> Value {
    Value::BulkString(s.as_bytes().to_vec())
}

/// An entry ID, mostly well formed.
fn entry_id() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (0u64..6, 0u64..3).prop_map(|(ms, seq)| bulk(&format!("{ms}-{seq}"))),
        1 => (any::<u64>(), any::<u64>()).prop_map(|(ms, seq)| bulk(&format!("{ms}-{seq}"))),
        1 => leaf(),
    ]
}

/// A flat field/value list, as Redis sends an entry's fields or a hash.
fn pairs() -> impl Strategy<Value = Value> {
    let name = prop_oneof![prop::sample::select(WORDS).prop_map(bulk), text().prop_map(Value::BulkString)];
    prop::collection::vec((name, leaf()), 0..6)
        .prop_map(|kv| Value::Array(kv.into_iter().flat_map(|(k, v)| [k, v]).collect()))
}

/// `[[id, [field, value, ...]], ...]`: XRANGE, XREADGROUP per stream, XCLAIM.
fn entries() -> impl Strategy<Value = Value> {
    prop::collection::vec(
        prop_oneof![
            4 => (entry_id(), pairs()).prop_map(|(id, fields)| Value::Array(vec![id, fields])),
            1 => (entry_id(), Just(Value::Nil)).prop_map(|(id, nil)| Value::Array(vec![id, nil])),
            1 => tree(),
        ],
        0..5,
    )
    .prop_map(Value::Array)
}

/// `[[key, value, ...], ...]`: XINFO GROUPS / CONSUMERS.
fn records() -> impl Strategy<Value = Value> {
    prop::collection::vec(pairs(), 0..4).prop_map(Value::Array)
}

/// `[[id, consumer, idle, deliveries], ...]`: extended XPENDING.
fn pending_rows() -> impl Strategy<Value = Value> {
    let row = (entry_id(), text().prop_map(Value::BulkString), any::<i64>(), 0i64..4)
        .prop_map(|(id, owner, idle, n)| Value::Array(vec![id, owner, Value::Int(idle), Value::Int(n)]));
    prop::collection::vec(prop_oneof![5 => row, 1 => tree()], 0..5).prop_map(Value::Array)
}

/// `[count, smallest, largest, [[consumer, count], ...]]`: XPENDING summary.
fn pending_summary() -> impl Strategy<Value = Value> {
    (leaf(), entry_id(), entry_id(), tree()).prop_map(|(n, a, b, c)| Value::Array(vec![n, a, b, c]))
}

/// A reply: shaped like one of the real ones (hostile leaves inside), or anything.
fn reply() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => tree(),
        3 => entries(),
        2 => (entry_id(), entries(), prop::collection::vec(entry_id(), 0..3))
            .prop_map(|(next, claimed, deleted)| Value::Array(vec![next, claimed, Value::Array(deleted)])),
        2 => (entries(), prop::collection::vec(entry_id(), 0..3))
            .prop_map(|(claimed, gone)| Value::Array(vec![claimed, Value::Array(gone)])),
        3 => records(),
        2 => pairs(),
        3 => pending_rows(),
        2 => pending_summary(),
        1 => (0i64..2, text()).prop_map(|(done, detail)| Value::Array(vec![Value::Int(done), Value::BulkString(detail)])),
        1 => Just(Value::Okay),
        1 => server_error(),
    ]
}

fn replies() -> impl Strategy<Value = Vec<Value>> {
    prop::collection::vec(reply(), 0..16)
}

/// What a reply holds, for the readers' expected sequences of replies.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// XINFO GROUPS.
    Groups,
    /// XINFO CONSUMERS.
    Consumers,
    Int,
    /// A count that may be missing (HGET).
    MaybeInt,
    /// A hash of counts (HGETALL).
    Counts,
    /// XRANGE, XCLAIM.
    Entries,
    /// Extended XPENDING.
    Pending,
    /// XPENDING's summary form.
    Summary,
    /// A list of IDs.
    Ids,
    /// The idle-claim script: cursor, claimed entries, lost IDs, delivery counts, deferred.
    Autoclaim,
    /// The sweep's page script: last ID, rows, poison IDs, lost IDs, a refusal.
    SweepPage,
    /// The health script: time, pending, last delivered ID, read counter,
    /// lag, entries after, the first of them, length, the oldest pending.
    Positions,
    Any,
}

/// The replies some readers expect, in order: each one shaped so (with
/// hostile leaves), now and then anything at all. The sweep and a whole
/// retention pass choose their next command by what came back, so their
/// sequences line up only some of the time.
const SHAPED: &[(&str, &[Shape])] = {
    use Shape::*;
    &[
        ("health::inspect", &[Int, Positions, Consumers, Pending, Any]),
        ("payload_loss::read", &[MaybeInt, Ids]),
        ("recovery::read_report", &[Counts]),
        ("retention::safe_floor", &[Groups, Summary, Summary, Summary]),
        ("retention::target", &[Int, Entries]),
        ("retention::trim_to", &[Int]),
        ("retention::enforce", &[Int, Entries, Groups, Summary, Int, Int]),
        ("sweep::sweep", &[SweepPage, SweepPage, Pending, Int]),
        ("claim::autoclaim", &[Autoclaim]),
        ("consumers::pending_of", &[Pending]),
        ("consumers::delete_if_empty", &[Int]),
        ("dlq::cap", &[Int]),
        ("dlq::expire", &[Int]),
        ("dlq::purge", &[Int]),
        ("destroy_group", &[Int, Int, Int, Int, Int, Int, Int, Int, Int, Int]),
    ]
};

fn maybe_int() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (0i64..5).prop_map(Value::Int),
        1 => any::<i64>().prop_map(Value::Int),
        1 => Just(Value::Nil),
        1 => (0u64..5).prop_map(|n| bulk(&n.to_string())),
        1 => leaf(),
    ]
}

fn record(fields: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let name = prop_oneof![4 => Just(bulk("g")), 2 => Just(bulk("c1")), 1 => leaf()];
    (name, prop::collection::vec(prop_oneof![3 => maybe_int(), 1 => entry_id()], fields.len())).prop_map(
        move |(name, values)| {
            let mut out = vec![bulk("name"), name];
            for (field, value) in fields.iter().zip(values) {
                out.push(bulk(field));
                out.push(value);
            }
            Value::Array(out)
        },
    )
}

fn shaped(shape: Shape) -> BoxedStrategy<Value> {
    let real = match shape {
        Shape::Groups => prop::collection::vec(
            record(&["consumers", "pending", "last-delivered-id", "entries-read", "lag"]).prop_map(|mut r| {
                // The last-delivered ID as an ID.
                if let Value::Array(items) = &mut r {
                    items[7] = bulk("1-0");
                }
                r
            }),
            0..3,
        )
        .prop_map(Value::Array)
        .boxed(),
        Shape::Consumers => {
            prop::collection::vec(record(&["pending", "idle", "inactive"]), 0..3).prop_map(Value::Array).boxed()
        }
        Shape::Int => prop_oneof![4 => (0i64..5).prop_map(Value::Int), 1 => any::<i64>().prop_map(Value::Int)].boxed(),
        Shape::MaybeInt => maybe_int().boxed(),
        Shape::Counts => prop::collection::vec(
            (
                prop::sample::select(&["finished-at-ms", "scanned", "claimed", "dead-lettered", "payload-lost"][..]),
                maybe_int(),
            ),
            0..6,
        )
        .prop_map(|kv| Value::Array(kv.into_iter().flat_map(|(k, v)| [bulk(k), v]).collect()))
        .boxed(),
        Shape::Entries => entries().boxed(),
        Shape::Pending => pending_rows().boxed(),
        Shape::Summary => pending_summary().boxed(),
        Shape::Ids => prop::collection::vec(entry_id(), 0..3).prop_map(Value::Array).boxed(),
        Shape::Autoclaim => (
            entry_id(),
            entries(),
            prop::collection::vec(entry_id(), 0..3),
            prop::collection::vec(maybe_int(), 0..3),
            prop::collection::vec((0i64..3).prop_map(Value::Int), 0..3),
            maybe_int(),
        )
            .prop_map(|(next, claimed, deleted, counts, crashes, deferred)| {
                let lists = [Value::Array(deleted), Value::Array(counts), Value::Array(crashes)];
                Value::Array([vec![next, claimed], lists.to_vec(), vec![deferred]].concat())
            })
            .boxed(),
        Shape::SweepPage => (
            entry_id(),
            maybe_int(),
            prop::collection::vec(entry_id(), 0..3),
            prop::collection::vec(entry_id(), 0..3),
            prop_oneof![Just(bulk("")), leaf()],
        )
            .prop_map(|(last, rows, poison, lost, refused)| {
                Value::Array(vec![last, rows, Value::Array(poison), Value::Array(lost), refused])
            })
            .boxed(),
        Shape::Positions => (prop::collection::vec(maybe_int(), 8), entry_id(), entry_id(), pending_rows())
            .prop_map(|(ints, last, first, oldest)| {
                let mut out = ints;
                out[2] = last;
                out[6] = first;
                out.push(oldest);
                Value::Array(out)
            })
            .boxed(),
        Shape::Any => reply().boxed(),
    };
    prop_oneof![6 => real, 1 => tree()].boxed()
}

/// One sequence of replies per reader of [`SHAPED`], in its order.
fn shaped_replies() -> impl Strategy<Value = Vec<Vec<Value>>> {
    SHAPED.iter().map(|(_, shapes)| shapes.iter().map(|s| shaped(*s)).collect::<Vec<_>>()).collect::<Vec<_>>()
}

fn runner(cases: u32) -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(cases);
    TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() })
}

fn letter(reason: Reason) -> Letter<'static> {
    Letter { group: "g", consumer: "c1", reason, error: "boom", business_key: Some("k"), while_pending: false }
}

/// Runs every reply-reading function of the crate, each against the
/// replies `replies` gives for its name; returns which answered with a value.
async fn every_reader(replies: impl Fn(&str) -> Vec<Value>) -> Vec<(&'static str, bool)> {
    let conn = |name: &str| Hostile { replies: std::sync::Arc::new(std::sync::Mutex::new(replies(name).into())) };
    let entry = Entry {
        stream: "s".into(),
        id: "1-0".into(),
        fields: vec![("f".into(), b"v".to_vec())],
        deliveries: 1,
        crashes: 0,
    };
    let loss = claim::LossRecord { dead_letter_stream: "{s}:dead", consumer: "c1", why: "gone" };
    let idle = Duration::from_millis(10);
    let settings = sweep::SweepSettings {
        stream: "s",
        group: "g",
        consumer: "sweeper",
        dead_letter_stream: "{s}:dead",
        min_idle: idle,
        max_deliveries: 2,
        batch: 2,
    };
    let ids = vec!["1-0".to_string(), "2-0".to_string()];
    let how = claim::ClaimIds { consumer: "c1", min_idle_ms: 0, set_idle_ms: Some(5), just_id: false };
    let filter = Filter { reasons: vec!["permanent".into()], since_ms: Some(1), ..Filter::default() };
    let mut seen = Vec::new();
    seen.push((
        "health::inspect",
        health::inspect(&mut conn("health::inspect"), streamfleet_streams::GroupRef::new("s", "g"), "{s}:dead")
            .await
            .is_ok(),
    ));
    seen.push((
        "payload_loss::read",
        payload_loss::read(&mut conn("payload_loss::read"), streamfleet_streams::GroupRef::new("s", "g")).await.is_ok(),
    ));
    seen.push((
        "recovery::read_report",
        recovery::read_report(&mut conn("recovery::read_report"), streamfleet_streams::GroupRef::new("s", "g"))
            .await
            .is_ok(),
    ));
    seen.push((
        "recovery::write_report",
        recovery::write_report(
            &mut conn("recovery::write_report"),
            streamfleet_streams::GroupRef::new("s", "g"),
            &recovery::RecoveryReport::default(),
        )
        .await
        .is_ok(),
    ));
    seen.push(("retention::safe_floor", retention::safe_floor(&mut conn("retention::safe_floor"), "s").await.is_ok()));
    seen.push((
        "retention::target",
        retention::target(&mut conn("retention::target"), "s", Some(3), Some(1000), 5000).await.is_ok(),
    ));
    seen.push((
        "retention::trim_to",
        retention::trim_to(&mut conn("retention::trim_to"), "s", StreamId { ms: 3, seq: 0 }).await.is_ok(),
    ));
    seen.push((
        "retention::enforce",
        retention::enforce(&mut conn("retention::enforce"), "s", Some(1), Some(1), u64::MAX).await.is_ok(),
    ));
    seen.push((
        "dlq::page, filtered",
        dlq::page(&mut conn("dlq::page, filtered"), "{s}:dead", &filter, None, 3).await.is_ok(),
    ));
    seen.push((
        "dlq::page, resumed",
        dlq::page(&mut conn("dlq::page, resumed"), "{s}:dead", &Filter::default(), Some("1-0"), 1).await.is_ok(),
    ));
    seen.push(("dlq::all", dlq::all(&mut conn("dlq::all"), "{s}:dead", &Filter::default()).await.is_ok()));
    seen.push(("dlq::show", dlq::show(&mut conn("dlq::show"), "{s}:dead", "1-0").await.is_ok()));
    seen.push(("dlq::cap", dlq::cap(&mut conn("dlq::cap"), "{s}:dead", 10).await.is_ok()));
    seen.push((
        "dlq::expire",
        dlq::expire(&mut conn("dlq::expire"), "{s}:dead", Duration::from_secs(60)).await.is_ok(),
    ));
    seen.push(("dlq::purge", dlq::purge(&mut conn("dlq::purge"), "{s}:dead", &ids).await.is_ok()));
    seen.push((
        "replay::replay, all",
        replay::replay(&mut conn("replay::replay, all"), "{s}:dead", &replay::Selection::All, false).await.is_ok(),
    ));
    seen.push((
        "replay::replay, by ID",
        replay::replay(&mut conn("replay::replay, by ID"), "{s}:dead", &replay::Selection::Ids(ids.clone()), false)
            .await
            .is_ok(),
    ));
    let matching = replay::Selection::Matching(filter.clone());
    seen.push((
        "replay::replay, dry run",
        replay::replay(&mut conn("replay::replay, dry run"), "{s}:dead", &matching, true).await.is_ok(),
    ));
    seen.push((
        "claim::autoclaim",
        claim::autoclaim(
            &mut conn("claim::autoclaim"),
            streamfleet_streams::ConsumerRef::new("s", "g", "c1"),
            &loss,
            idle,
            "0-0",
            10,
        )
        .await
        .is_ok(),
    ));
    seen.push((
        "claim::claim_own",
        claim::claim_own(
            &mut conn("claim::claim_own"),
            streamfleet_streams::ConsumerRef::new("s", "g", "c1"),
            &loss,
            "-",
            2,
        )
        .await
        .is_ok(),
    ));
    seen.push((
        "claim::claim_ids",
        claim::claim_ids(
            &mut conn("claim::claim_ids"),
            streamfleet_streams::GroupRef::new("s", "g"),
            &loss,
            &how,
            &["1-0", "2-0"],
        )
        .await
        .is_ok(),
    ));
    seen.push((
        "consumers::pending_of",
        consumers::pending_of(
            &mut conn("consumers::pending_of"),
            streamfleet_streams::ConsumerRef::new("s", "g", "c1"),
            "-",
            10,
        )
        .await
        .is_ok(),
    ));
    seen.push((
        "consumers::declare_dead",
        consumers::declare_dead(
            &mut conn("consumers::declare_dead"),
            streamfleet_streams::ConsumerRef::new("s", "g", "c1"),
        )
        .await
        .is_ok(),
    ));
    seen.push((
        "consumers::release_pending",
        consumers::release_pending(
            &mut conn("consumers::release_pending"),
            streamfleet_streams::ConsumerRef::new("s", "g", "c1"),
            "{s}:dead",
            idle,
            10,
        )
        .await
        .is_ok(),
    ));
    seen.push((
        "consumers::delete_if_empty",
        consumers::delete_if_empty(
            &mut conn("consumers::delete_if_empty"),
            streamfleet_streams::ConsumerRef::new("s", "g", "c1"),
        )
        .await
        .is_ok(),
    ));
    seen.push(("sweep::sweep", sweep::sweep(&mut conn("sweep::sweep"), &settings).await.is_ok()));
    seen.push(("version::server_version", version::server_version(&mut conn("version::server_version")).await.is_ok()));
    seen.push((
        "deadletter::dead_letter",
        deadletter::dead_letter(&mut conn("deadletter::dead_letter"), "{s}:dead", &entry, &letter(Reason::Permanent))
            .await
            .is_ok(),
    ));
    let batch = [(&entry, &letter(Reason::PayloadMissing)), (&entry, &letter(Reason::MaxDeliveries))];
    seen.push((
        "deadletter::command",
        deadletter::command("{s}:dead", &batch).query_async::<Value>(&mut conn("deadletter::command")).await.is_ok(),
    ));
    seen.push((
        "deadletter::record_last_error",
        deadletter::record_last_error(&mut conn("deadletter::record_last_error"), &entry, "g", "boom").await.is_ok(),
    ));
    seen.push((
        "deadletter::last_error",
        deadletter::last_error(
            &mut conn("deadletter::last_error"),
            streamfleet_streams::GroupRef::new("s", "g"),
            "1-0",
        )
        .await
        .is_ok(),
    ));
    seen.push((
        "ensure_group",
        streamfleet_streams::ensure_group(&mut conn("ensure_group"), "s", "g", "0").await.is_ok(),
    ));
    seen.push((
        "destroy_group",
        streamfleet_streams::destroy_group(&mut conn("destroy_group"), "s", "g").await.is_ok(),
    ));
    seen
}

#[test]
fn no_reply_makes_a_reader_panic() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let answered = std::sync::Mutex::new(std::collections::BTreeMap::<&str, usize>::new());
    let result = runner(256).run(&(replies(), shaped_replies()), |(any, shaped)| {
        let seen = runtime.block_on(async {
            let hung = |_| panic!("a reader hung");
            // Every reader on the same random replies, then each on replies
            // shaped like the ones it expects.
            tokio::time::timeout(Duration::from_secs(10), every_reader(|_| any.clone())).await.unwrap_or_else(hung);
            let shaped = |name: &str| {
                SHAPED
                    .iter()
                    .zip(&shaped)
                    .find(|((n, _), _)| *n == name)
                    .map_or_else(|| any.clone(), |(_, r)| r.clone())
            };
            tokio::time::timeout(Duration::from_secs(10), every_reader(shaped)).await.unwrap_or_else(hung)
        });
        let mut answered = answered.lock().unwrap();
        for (name, ok) in seen {
            *answered.entry(name).or_default() += usize::from(ok);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // How many cases each reader decoded into a value (not only refused).
    let answered = answered.into_inner().unwrap();
    eprintln!("answered with a value (random and shaped replies): {answered:?}");
    for (name, _) in SHAPED.iter().filter(|(name, _)| !["sweep::sweep", "retention::enforce"].contains(name)) {
        assert!(answered[name] > 0, "{name} never got past decoding: the shapes are off");
    }
}

fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![prop::sample::select(WORDS).prop_map(str::to_string), any::<String>()]
}

#[test]
fn entry_fields_keep_every_field_and_its_bytes() {
    let fields = prop::collection::hash_map(field_name(), tree(), 0..8);
    let result = runner(512).run(&fields, |map: HashMap<String, Value>| {
        let decoded = entry::fields_from_map(map.clone());
        prop_assert_eq!(decoded.len(), map.len());
        prop_assert!(decoded.windows(2).all(|w| w[0] <= w[1]), "sorted");
        for (name, bytes) in &decoded {
            match &map[name] {
                Value::BulkString(b) => prop_assert_eq!(b, bytes),
                Value::Int(n) => prop_assert_eq!(&n.to_string().into_bytes(), bytes),
                Value::SimpleString(s) => prop_assert_eq!(s.as_bytes(), bytes.as_slice()),
                _ => prop_assert!(!bytes.is_empty(), "other values are rendered, not dropped"),
            }
        }
        let entry = Entry { stream: "s".into(), id: "1-0".into(), fields: decoded.clone(), deliveries: 1, crashes: 0 };
        for (name, bytes) in &decoded {
            prop_assert_eq!(entry.field(name), Some(bytes.as_slice()));
            prop_assert_eq!(entry.field_str(name), std::str::from_utf8(bytes).ok());
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn a_dead_letter_keeps_its_id_and_payload_whatever_its_fields() {
    let input = (
        text().prop_map(|t| String::from_utf8_lossy(&t).into_owned()),
        prop::collection::vec((field_name(), text()), 0..10),
    );
    let result = runner(512).run(&input, |(id, fields)| {
        let letter = DeadLetter::parse(id.clone(), fields.clone());
        prop_assert_eq!(&letter.id, &id);
        let payload: Vec<(String, Vec<u8>)> =
            fields.iter().filter(|(k, _)| !k.starts_with(deadletter::PREFIX)).cloned().collect();
        prop_assert_eq!(&letter.payload, &payload);
        let at = fields.iter().find(|(k, _)| k == deadletter::F_AT);
        if let Some(at) = at.and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u64>().ok()) {
            prop_assert_eq!(letter.at_ms, at);
        }
        let stats = dlq::Stats::of([&letter, &letter]);
        prop_assert_eq!(stats.total, 2);
        let _ = Filter { business_key: letter.business_key.clone(), ..Filter::default() }.matches(&letter);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn stream_ids_parse_only_what_they_print_and_step_in_order() {
    let input = (any::<u64>(), any::<u64>(), text().prop_map(|t| String::from_utf8_lossy(&t).into_owned()));
    let result = runner(2048).run(&input, |(ms, seq, junk)| {
        let id = StreamId { ms, seq };
        prop_assert_eq!(StreamId::parse(&id.to_string()), Some(id));
        prop_assert!(id.prev() <= id && id <= id.next());
        prop_assert!(id.prev() == id || id.prev().next() == id);
        if let Some(parsed) = StreamId::parse(&junk) {
            prop_assert_eq!(StreamId::parse(&parsed.to_string()), Some(parsed));
        }
        let filter = Filter { from: Some(junk.clone()), to: Some(junk), since_ms: Some(ms), ..Filter::default() };
        let _ = filter.scan_range();
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Snapshots of the shards of one pipeline merge without overflow, whatever
/// counts Redis reported.
#[test]
fn shard_snapshots_merge_whatever_their_counts() {
    let lag = prop_oneof![any::<u64>().prop_map(Lag::Known), any::<u64>().prop_map(Lag::AtLeast), Just(Lag::Unknown)];
    let part =
        (lag, any::<u64>(), prop::option::of(any::<u64>()), any::<u64>(), any::<u64>(), prop::option::of(any::<u64>()))
            .prop_map(|(lag, pending, entries_read, stream_length, dead_letter_length, idle)| GroupSnapshot {
                lag,
                pending,
                entries_read,
                entries_added: entries_read,
                server_ms: stream_length,
                last_delivered_id: "1-0".into(),
                oldest_pending_idle_ms: idle,
                max_delivery_count: idle,
                consumers: vec![health::ConsumerState { name: "c".into(), pending, idle_ms: pending }],
                before_oldest_pending: None,
                stream_length,
                retrying: dead_letter_length / 2,
                parked: Vec::new(),
                dead_letter_length,
                delay: health::Delay::Known(stream_length),
                oldest_unfinished_ms: idle,
                working_delay: health::Delay::Known(stream_length),
            });
    let result = runner(512).run(&prop::collection::vec(part, 0..4), |parts| {
        let merged = GroupSnapshot::merge(&parts);
        prop_assert_eq!(merged.is_some(), !parts.is_empty());
        if let Some(m) = merged {
            prop_assert!(parts.iter().all(|p| m.pending >= p.pending && m.stream_length >= p.stream_length));
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A sweep whose page replies do not move its cursor forward (a server, or
/// anything between, answering the same page again) ends there and names
/// it, rather than asking for ever.
#[tokio::test]
async fn a_sweep_whose_pages_do_not_move_forward_ends_naming_where() {
    let page = || Value::Array(vec![bulk("5-0"), Value::Int(2), Value::Array(vec![]), Value::Array(vec![]), bulk("")]);
    let replies = vec![page(), page(), Value::Int(0)];
    let mut conn = Hostile { replies: std::sync::Arc::new(std::sync::Mutex::new(replies.into())) };
    let settings = sweep::SweepSettings {
        stream: "s",
        group: "g",
        consumer: "sweeper",
        dead_letter_stream: "{s}:dead",
        min_idle: Duration::from_millis(10),
        max_deliveries: 2,
        batch: 2,
    };
    let report = sweep::sweep(&mut conn, &settings).await.unwrap();
    assert_eq!(report.scanned, 4, "{report:?}");
    assert_eq!(report.left_pending.len(), 1, "{report:?}");
    assert!(
        report.left_pending[0].contains("after 5-0") && report.left_pending[0].contains("ended at 5-0"),
        "{report:?}"
    );
}
