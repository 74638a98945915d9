//! Safe retention against a real redis-server: trimming never passes the
//! oldest pending or first undelivered entry of any group, managed or not.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use streamfleet_streams::ensure_group;
use streamfleet_streams::retention::{StreamId, enforce};
use streamfleet_testbed::RedisServer;

type Conn = redis::aio::MultiplexedConnection;

async fn read(conn: &mut Conn, group: &str, n: usize) -> Result<Vec<String>> {
    let opts = redis::streams::StreamReadOptions::default().group(group, "c").count(n);
    let r: redis::streams::StreamReadReply = conn.xread_options(&["s"], &[">"], &opts).await?;
    Ok(r.keys.into_iter().flat_map(|k| k.ids.into_iter().map(|e| e.id)).collect())
}

async fn ack(conn: &mut Conn, group: &str, ids: &[String]) -> Result<()> {
    if !ids.is_empty() {
        let _: i64 = conn.xack("s", group, ids).await?;
    }
    Ok(())
}

async fn first_id(conn: &mut Conn) -> Result<String> {
    let r: redis::streams::StreamRangeReply = conn.xrange_count("s", "-", "+", 1).await?;
    Ok(r.ids[0].id.clone())
}

#[tokio::test]
async fn trimming_is_held_at_the_floor_of_every_group() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    for i in 1..=100 {
        let _: String = conn.xadd("s", format!("{i}-0"), &[("i", i)]).await?;
    }
    ensure_group(&mut conn, "s", "managed", "0").await?;
    ensure_group(&mut conn, "s", "other-team", "0").await?;
    let done = read(&mut conn, "managed", 60).await?;
    ack(&mut conn, "managed", &done).await?;
    // The other team read 40 and acked the first 29: 30-0..40-0 still pending.
    let theirs = read(&mut conn, "other-team", 40).await?;
    ack(&mut conn, "other-team", &theirs[..29]).await?;

    let r = enforce(&mut conn, "s", Some(10), None, 0).await?;
    assert_eq!(r.target, Some(StreamId { ms: 91, seq: 0 }));
    assert_eq!(r.floor, Some(StreamId { ms: 30, seq: 0 }));
    assert!(r.blocked);
    assert_eq!(r.trimmed, 29);
    assert_eq!(first_id(&mut conn).await?, "30-0", "the oldest pending entry of any group stays");
    let pending: redis::streams::StreamPendingReply = conn.xpending("s", "other-team").await?;
    assert_eq!(pending.count(), 11);

    // The other team catches up on everything: the managed group's first
    // undelivered entry (60-1 onwards) is now the floor.
    ack(&mut conn, "other-team", &theirs[29..]).await?;
    let rest = read(&mut conn, "other-team", 100).await?;
    ack(&mut conn, "other-team", &rest).await?;
    let r = enforce(&mut conn, "s", Some(10), None, 0).await?;
    assert!(r.blocked);
    assert_eq!(first_id(&mut conn).await?, "61-0", "undelivered entries stay");

    // Everyone is done: the policy applies in full.
    let done = read(&mut conn, "managed", 100).await?;
    ack(&mut conn, "managed", &done).await?;
    let r = enforce(&mut conn, "s", Some(10), None, 0).await?;
    assert!(!r.blocked);
    let len: usize = conn.xlen("s").await?;
    assert_eq!(len, 10);

    // maxAge: entries older than the age go, within the same floor.
    let r = enforce(&mut conn, "s", None, Some(5), 96).await?;
    assert_eq!(r.target, Some(StreamId { ms: 91, seq: 0 }));
    let r = enforce(&mut conn, "s", None, Some(3), 100).await?;
    assert_eq!((r.trimmed, r.blocked), (6, false));
    assert_eq!(first_id(&mut conn).await?, "97-0");
    Ok(())
}

/// Found by `retention_props`: a group whose last-delivered ID has the
/// largest sequence number of its millisecond (`XGROUP CREATE`/`SETID` just
/// before an `N-0` entry, or an entry added at `N-18446744073709551615`) made
/// the trim script step to `N-18446744073709551616`, which `XTRIM` refuses:
/// every later trim of the stream failed.
#[tokio::test]
async fn a_group_at_the_largest_sequence_number_does_not_wedge_trimming() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    for i in 1..=5 {
        let _: String = conn.xadd("s", format!("{i}-0"), &[("i", i)]).await?;
    }
    // Everything from 3-0 on is undelivered to this group.
    ensure_group(&mut conn, "s", "g", "2-18446744073709551615").await?;
    let r = enforce(&mut conn, "s", Some(1), None, 0).await?;
    assert_eq!((r.floor, r.blocked, r.trimmed), (Some(StreamId { ms: 3, seq: 0 }), true, 2));
    assert_eq!(first_id(&mut conn).await?, "3-0");
    // An entry at the largest sequence number, delivered and acked.
    let _: String = conn.xadd("s", "6-18446744073709551615", &[("i", 6)]).await?;
    let done = read(&mut conn, "g", 10).await?;
    ack(&mut conn, "g", &done).await?;
    let trimmed = streamfleet_streams::retention::trim_to(&mut conn, "s", StreamId { ms: 99, seq: 0 }).await?;
    assert_eq!(trimmed, 4, "everything delivered and acked goes");
    let len: usize = conn.xlen("s").await?;
    assert_eq!(len, 0);
    Ok(())
}

/// Dead letters older than the age bound go, by their IDs against the
/// server's clock; younger ones and a missing stream are left alone.
#[tokio::test]
async fn dead_letters_past_their_age_are_dropped_and_younger_ones_kept() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let (secs, _micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let now_ms = secs * 1000;
    for (i, age_s) in [(0, 300), (1, 120), (2, 61), (3, 30), (4, 1)] {
        let _: String = conn.xadd("{s}:dead:g", format!("{}-{i}", now_ms - age_s * 1000), &[("i", i)]).await?;
    }
    let max_age = std::time::Duration::from_secs(60);
    let dropped = streamfleet_streams::dlq::expire(&mut conn, "{s}:dead:g", max_age).await?;
    assert_eq!(dropped, 3);
    let kept: redis::streams::StreamRangeReply = conn.xrange_all("{s}:dead:g").await?;
    let kept: Vec<String> = kept.ids.into_iter().map(|e| e.id).collect();
    assert_eq!(kept, [format!("{}-3", now_ms - 30_000), format!("{}-4", now_ms - 1000)]);
    assert_eq!(streamfleet_streams::dlq::expire(&mut conn, "{s}:dead:g", max_age).await?, 0, "nothing more is old");
    assert_eq!(streamfleet_streams::dlq::expire(&mut conn, "{s}:dead:none", max_age).await?, 0);
    Ok(())
}
