//! Health inspection against a real redis-server: the snapshot equals what
//! Redis itself says, NULL lag is counted another way, and the command count
//! does not grow with the PEL.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use redis::streams::{StreamReadOptions, StreamReadReply};
use streamfleet_streams::health::{LAG_COUNT_BOUND, Lag, inspect};
use streamfleet_streams::{ensure_group, keys};
use streamfleet_testbed::RedisServer;
use streamfleet_testbed::redis_server::{calls_between, command_calls};

/// Commands one inspection sent, as the server counted them.
async fn inspection_commands(conn: &mut redis::aio::MultiplexedConnection) -> Result<u64> {
    let before = command_calls(conn).await?;
    inspect(conn, "s", "g", "{s}:dead").await?;
    Ok(calls_between(&before, &command_calls(conn).await?).values().sum())
}

async fn read(conn: &mut redis::aio::MultiplexedConnection, consumer: &str, n: usize) -> Result<Vec<String>> {
    let opts = StreamReadOptions::default().group("g", consumer).count(n);
    let r: StreamReadReply = conn.xread_options(&["s"], &[">"], &opts).await?;
    Ok(r.keys.into_iter().flat_map(|k| k.ids.into_iter().map(|e| e.id)).collect())
}

#[tokio::test]
async fn snapshot_matches_redis() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    assert_eq!(inspect(&mut conn, "s", "g", "{s}:dead").await?, None, "no stream yet");
    ensure_group(&mut conn, "s", "g", "0").await?;
    for i in 0..10 {
        let _: String = conn.xadd("s", "*", &[("i", i)]).await?;
    }
    let _: String = conn.xadd(keys::dead_letter_stream("s"), "*", &[("x", 1)]).await?;
    let ids = read(&mut conn, "c1", 4).await?;
    let _: i64 = conn.xack("s", "g", &[&ids[0]]).await?;
    read(&mut conn, "c2", 1).await?;
    // Redeliver the oldest pending entry: its delivery count becomes 2.
    let _: redis::Value =
        redis::cmd("XCLAIM").arg("s").arg("g").arg("c2").arg(0).arg(&ids[1]).query_async(&mut conn).await?;

    let snap = inspect(&mut conn, "s", "g", "{s}:dead").await?.unwrap();
    let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups("s").await?;
    let g = &info.groups[0];
    assert_eq!(snap.lag, Lag::Known(u64::try_from(g.lag.unwrap())?));
    assert_eq!(snap.lag, Lag::Known(5));
    assert_eq!(snap.pending, 4);
    assert_eq!(snap.pending, u64::try_from(g.pending)?);
    assert_eq!(snap.last_delivered_id, g.last_delivered_id);
    assert_eq!(snap.stream_length, 10);
    assert_eq!(snap.dead_letter_length, 1);
    assert_eq!(snap.max_delivery_count, Some(2));
    assert!(snap.oldest_pending_idle_ms.is_some());
    let mut consumers: Vec<(String, u64)> = snap.consumers.iter().map(|c| (c.name.clone(), c.pending)).collect();
    consumers.sort();
    assert_eq!(consumers, vec![("c1".to_string(), 2), ("c2".to_string(), 2)]);
    assert_eq!(inspection_commands(&mut conn).await?, 5, "counted by the server");
    assert_eq!(inspect(&mut conn, "s", "other", "{s}:dead").await?, None, "no such group");
    Ok(())
}

#[tokio::test]
async fn null_lag_is_counted_or_reported_unknown_never_zero() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(conn.xadd::<_, _, _, _, String>("s", "*", &[("i", i)]).await?);
    }
    // A group created at an arbitrary ID: Redis cannot tell its lag.
    ensure_group(&mut conn, "s", "g", &ids[4]).await?;
    let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups("s").await?;
    assert_eq!(info.groups[0].lag, None, "Redis reports NULL lag here");
    let snap = inspect(&mut conn, "s", "g", "{s}:dead").await?.unwrap();
    assert_eq!(snap.lag, Lag::Known(15));
    assert_eq!(inspection_commands(&mut conn).await?, 6, "one bounded XRANGE more");

    // Beyond the counting bound: a floor, never a made-up exact figure.
    let mut pipe = redis::pipe();
    for i in 0..(LAG_COUNT_BOUND + 50) {
        pipe.cmd("XADD").arg("s").arg("*").arg("i").arg(i).ignore();
    }
    let () = pipe.query_async(&mut conn).await?;
    let snap = inspect(&mut conn, "s", "g", "{s}:dead").await?.unwrap();
    assert_eq!(snap.lag, Lag::AtLeast(u64::try_from(LAG_COUNT_BOUND)?));
    assert!(!snap.lag.is_known_zero());
    Ok(())
}

#[tokio::test]
async fn command_count_does_not_grow_with_the_pel() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "s", "g", "0").await?;
    let mut counts = Vec::new();
    for size in [10usize, 5_000] {
        let mut pipe = redis::pipe();
        for i in 0..size {
            pipe.cmd("XADD").arg("s").arg("*").arg("i").arg(i).ignore();
        }
        let () = pipe.query_async(&mut conn).await?;
        read(&mut conn, "c", size).await?;
        counts.push(inspection_commands(&mut conn).await?);
    }
    assert_eq!(counts[0], counts[1]);
    Ok(())
}
