//! Proves the Redis half of the test bed: a spawned redis-server and a real
//! Redis Cluster both run the consumer-group cycle XADD → XREADGROUP → XACK.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use redis::aio::ConnectionLike;
use redis::streams::{StreamReadOptions, StreamReadReply};
use streamfleet_testbed::{RedisCluster, RedisServer};

async fn group_cycle<C: ConnectionLike + Send + Sync>(conn: &mut C, stream: &str) -> Result<()> {
    let () = redis::cmd("XGROUP").arg("CREATE").arg(stream).arg("g").arg("0").arg("MKSTREAM").query_async(conn).await?;
    let id: String = conn.xadd(stream, "*", &[("order", "42")]).await?;
    let opts = StreamReadOptions::default().group("g", "c1").count(10);
    let reply: StreamReadReply = conn.xread_options(&[stream], &[">"], &opts).await?;
    let ids: Vec<String> = reply.keys.iter().flat_map(|k| k.ids.iter().map(|e| e.id.clone())).collect();
    assert_eq!(ids, vec![id.clone()]);
    let entry = &reply.keys[0].ids[0];
    assert_eq!(entry.get::<String>("order").as_deref(), Some("42"));

    let pending: redis::streams::StreamPendingReply = conn.xpending(stream, "g").await?;
    assert_eq!(pending.count(), 1, "delivered entry is pending until acked");
    let acked: i64 = conn.xack(stream, "g", &[&id]).await?;
    assert_eq!(acked, 1);
    let pending: redis::streams::StreamPendingReply = conn.xpending(stream, "g").await?;
    assert_eq!(pending.count(), 0);
    Ok(())
}

#[tokio::test]
async fn standalone_server_runs_the_consumer_group_cycle() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let version: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await?;
    assert!(version.contains("redis_version:"), "{version}");
    group_cycle(&mut conn, "orders").await
}

#[tokio::test]
async fn cluster_runs_the_cycle_on_streams_in_different_slots() -> Result<()> {
    let cluster = RedisCluster::start(3).await?;
    let mut conn = cluster.connection().await?;
    // Hash tags put these keys in different slots, owned by different masters.
    let keys = ["{a}orders", "{b}orders", "{c}orders"];
    let mut owners = std::collections::BTreeSet::new();
    for key in keys {
        group_cycle(&mut conn, key).await?;
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut conn).await?;
        owners.insert(owner_of(&cluster, slot).await?);
    }
    assert!(owners.len() >= 2, "keys landed on {owners:?}");
    Ok(())
}

/// The port of the master serving `slot`, from CLUSTER SLOTS.
async fn owner_of(cluster: &RedisCluster, slot: i64) -> Result<u16> {
    let mut conn = cluster.nodes[0].connection().await?;
    // Each range: [start, end, [ip, port, id, ...] (master), replicas...].
    let ranges: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut conn).await?;
    ranges
        .iter()
        .find_map(|r| {
            let lo: i64 = redis::from_redis_value_ref(r.first()?).ok()?;
            let hi: i64 = redis::from_redis_value_ref(r.get(1)?).ok()?;
            let master: Vec<redis::Value> = redis::from_redis_value_ref(r.get(2)?).ok()?;
            let port: i64 = redis::from_redis_value_ref(master.get(1)?).ok()?;
            (lo..=hi).contains(&slot).then(|| u16::try_from(port).unwrap_or(0))
        })
        .ok_or_else(|| anyhow::anyhow!("no owner for slot {slot}"))
}

/// The server matrix runs these tests again on another server
/// (`STREAMFLEET_REDIS_SERVER`); `STREAMFLEET_EXPECT_SERVER` names what it
/// must be (`redis` or `valkey`), so a matrix run that silently fell back
/// to the default server fails here.
#[tokio::test]
async fn the_server_is_the_one_the_matrix_asked_for() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await?;
    let valkey = info.lines().find_map(|l| l.strip_prefix("valkey_version:")).map(str::trim);
    let redis = info.lines().find_map(|l| l.strip_prefix("redis_version:")).map(str::trim);
    println!("server: redis_version {redis:?}, valkey_version {valkey:?}");
    match std::env::var("STREAMFLEET_EXPECT_SERVER").as_deref() {
        Ok("valkey") => assert!(valkey.is_some(), "expected Valkey: {info}"),
        Ok("redis") | Err(_) => assert!(valkey.is_none() && redis.is_some(), "expected Redis: {info}"),
        Ok(other) => panic!("STREAMFLEET_EXPECT_SERVER={other}: redis or valkey"),
    }
    Ok(())
}
