//! A write sent twice has one effect. A client can send a script again when
//! the reply to the first send was lost (the Redis Cluster client re-sends
//! after a dropped connection or a timeout, when the script may already
//! have run), and two callers can race on one entry (the sweep and a
//! worker's claim both finding a lost payload; two people replaying one
//! dead letter). Each script below runs twice with the same arguments, on a
//! real redis-server, and the second run changes nothing.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use redis::streams::{StreamReadOptions, StreamReadReply};
use std::time::Duration;
use streamfleet_streams::claim::LossRecord;
use streamfleet_streams::deadletter::{self as dl};
use streamfleet_streams::replay::{Replayed, Selection, replay};
use streamfleet_streams::retry::{Parked, Schedule, park};
use streamfleet_streams::sweep::{PageReply, SweepSettings, page_command};
use streamfleet_streams::{Entry, ensure_group, payload_loss};
use streamfleet_testbed::RedisServer;

type Conn = redis::aio::MultiplexedConnection;

/// `n` entries of `orders` read by consumer `w` (pending, delivered once).
async fn pending_entries(conn: &mut Conn, n: usize) -> Result<Vec<String>> {
    ensure_group(conn, "orders", "g", "0").await?;
    let mut ids = Vec::new();
    for i in 0..n {
        let id: String = conn.xadd("orders", "*", &[("order_id", format!("o{i}"))]).await?;
        ids.push(id);
    }
    let opts = StreamReadOptions::default().group("g", "w").count(n);
    let _: StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    Ok(ids)
}

fn entry(id: &str, deliveries: u64) -> Entry {
    Entry { stream: "orders".into(), id: id.into(), fields: Vec::new(), deliveries, crashes: 0 }
}

#[tokio::test]
async fn a_dead_letter_sent_twice_is_written_and_a_loss_counted_once() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let ids = pending_entries(&mut conn, 2).await?;
    let letter =
        |reason| dl::Letter { group: "g", consumer: "w", reason, error: "no", business_key: None, while_pending: true };
    let refused = letter(dl::Reason::Permanent);
    let first = dl::dead_letter(&mut conn, "{orders}:dead", &entry(&ids[0], 1), &refused).await?;
    let second = dl::dead_letter(&mut conn, "{orders}:dead", &entry(&ids[0], 1), &refused).await?;
    assert!(first.is_some());
    assert_eq!(second, None, "no second letter");
    // A lost payload recorded by two callers: one letter, one loss.
    let lost = letter(dl::Reason::PayloadMissing);
    for _ in 0..2 {
        dl::dead_letter(&mut conn, "{orders}:dead", &entry(&ids[1], 1), &lost).await?;
    }
    let letters: u64 = conn.xlen("{orders}:dead").await?;
    assert_eq!(letters, 2, "one letter per entry");
    let loss = payload_loss::read(&mut conn, streamfleet_streams::GroupRef::new("orders", "g")).await?;
    assert_eq!((loss.total, loss.latest), (1, vec![ids[1].clone()]), "the loss counted once");
    Ok(())
}

/// The acks of a call's letters go out together after its letters: an
/// entry named twice in one call (a lost payload the sweep and a claim
/// both found) still gets one letter and one loss.
#[tokio::test]
async fn an_entry_named_twice_in_one_call_is_dead_lettered_and_its_loss_counted_once() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let ids = pending_entries(&mut conn, 2).await?;
    let lost = dl::Letter {
        group: "g",
        consumer: "w",
        reason: dl::Reason::PayloadMissing,
        error: "gone",
        business_key: None,
        while_pending: true,
    };
    let (first, second) = (entry(&ids[0], 1), entry(&ids[1], 1));
    let letters = [(&first, &lost), (&first, &lost), (&second, &lost)];
    let written: Vec<String> = dl::command("{orders}:dead", &letters).query_async(&mut conn).await?;
    assert_eq!(written.len(), 3);
    assert!(!written[0].is_empty() && written[1].is_empty() && !written[2].is_empty(), "{written:?}");
    let letters: u64 = conn.xlen("{orders}:dead").await?;
    assert_eq!(letters, 2, "one letter per entry");
    let loss = payload_loss::read(&mut conn, streamfleet_streams::GroupRef::new("orders", "g")).await?;
    assert_eq!(loss.total, 2, "each loss counted once");
    assert_eq!(loss.latest, vec![ids[1].clone(), ids[0].clone()], "the latest first");
    let pending: redis::streams::StreamPendingReply = conn.xpending("orders", "g").await?;
    assert_eq!(pending.count(), 0, "both acked");
    Ok(())
}

#[tokio::test]
async fn one_dead_letter_replayed_by_many_at_once_is_requeued_once() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let ids = pending_entries(&mut conn, 1).await?;
    let letter = dl::Letter {
        group: "g",
        consumer: "w",
        reason: dl::Reason::Permanent,
        error: "no",
        business_key: None,
        while_pending: true,
    };
    let fields = vec![("order_id".to_string(), b"o0".to_vec())];
    let id =
        dl::dead_letter(&mut conn, "{orders}:dead", &Entry { fields, ..entry(&ids[0], 1) }, &letter).await?.unwrap();
    let before: u64 = conn.xlen("orders").await?;
    // Eight replays at once over one multiplexed connection: each reads the
    // letter before any requeues it.
    let mut replays = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let mut conn = conn.clone();
        let selection = Selection::Ids(vec![id.clone()]);
        replays.spawn(async move { replay(&mut conn, "{orders}:dead", &selection, false).await });
    }
    let mut outcomes = Vec::new();
    while let Some(outcome) = replays.join_next().await {
        outcomes.push(outcome??);
    }
    let requeued = outcomes.iter().flatten().filter(|r| matches!(r, Replayed::Requeued { .. })).count();
    let after: u64 = conn.xlen("orders").await?;
    assert_eq!((requeued, after - before), (1, 1), "{outcomes:?}");
    Ok(())
}

/// A sweep's page script sent twice (a client re-sending after a lost
/// reply): the first run letters both poison entries and records the lost
/// one, the second finds nothing pending, so each has one letter and the
/// loss is counted once.
#[tokio::test]
async fn a_sweep_page_sent_twice_writes_each_letter_once() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let ids = pending_entries(&mut conn, 3).await?;
    let _: i64 = conn.xdel("orders", &[&ids[2]]).await?;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let settings = SweepSettings {
        stream: "orders",
        group: "g",
        consumer: "sweeper",
        dead_letter_stream: "{orders}:dead",
        min_idle: Duration::from_millis(10),
        max_deliveries: 1,
        batch: 10,
    };
    let command = page_command(&settings, 10, "-");
    let first: PageReply = command.query_async(&mut conn).await?;
    let second: PageReply = command.query_async(&mut conn).await?;
    assert_eq!(first, (ids[2].clone(), 3, ids[..2].to_vec(), vec![ids[2].clone()], String::new()));
    assert_eq!(second, (String::new(), 0, vec![], vec![], String::new()), "nothing is pending any more");
    let letters: u64 = conn.xlen("{orders}:dead").await?;
    assert_eq!(letters, 3, "one letter each");
    let loss =
        streamfleet_streams::payload_loss::read(&mut conn, streamfleet_streams::GroupRef::new("orders", "g")).await?;
    assert_eq!(loss.total, 1, "the loss counted once");
    Ok(())
}

#[tokio::test]
async fn a_park_sent_twice_leaves_the_entry_parked_once() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let ids = pending_entries(&mut conn, 1).await?;
    let schedule = Schedule::fixed(Duration::from_secs(60));
    let loss = LossRecord { dead_letter_stream: "{orders}:dead", consumer: "w", why: "gone" };
    let first = park(&mut conn, &entry(&ids[0], 1), "g", "w", &loss, &schedule, "down", 0.0).await?;
    let second = park(&mut conn, &entry(&ids[0], 1), "g", "w", &loss, &schedule, "down", 0.0).await?;
    assert_eq!(first, Parked::Until(Duration::from_secs(60)));
    assert!(
        matches!(second, Parked::Until(left) if left <= Duration::from_secs(60) && left > Duration::from_secs(59)),
        "what is left of the same delay, not 'no longer ours': {second:?}"
    );
    let pending: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg("orders").arg("g").arg("-").arg("+").arg(10).query_async(&mut conn).await?;
    assert_eq!((pending[0].1.as_str(), pending[0].3), ("streamfleet:retry:1", 1));
    let indexed: u64 = conn.zcard(streamfleet_streams::keys::retry_due_key("orders", "g")).await?;
    assert_eq!(indexed, 1);
    Ok(())
}
