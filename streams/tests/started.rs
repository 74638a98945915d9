//! Start records against a real redis-server: written only for the entries
//! the consumer holds, read from its PEL over the IDs' span.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use streamfleet_streams::ensure_group;
use streamfleet_streams::keys::last_error_key;
use streamfleet_streams::started::{record_starts, run_field};
use streamfleet_testbed::RedisServer;

/// Asked out of order, with entries it holds between them (more than one
/// page of the span) and one another consumer claimed, the script writes a
/// record for exactly the held ones and says which.
#[tokio::test]
async fn start_records_are_written_for_exactly_the_entries_the_consumer_holds() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let mut ids = Vec::new();
    for i in 0..8 {
        ids.push(conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", i.to_string())]).await?);
    }
    let opts = redis::streams::StreamReadOptions::default().group("g", "w").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let _: redis::Value =
        redis::cmd("XCLAIM").arg("orders").arg("g").arg("other").arg(0).arg(&ids[6]).query_async(&mut conn).await?;
    // Three asked, six of w's entries between the lowest and the highest.
    let starting = [(ids[7].as_str(), 1, None), (ids[0].as_str(), 1, Some("k0")), (ids[6].as_str(), 1, None)];
    let held =
        record_starts(&mut conn, streamfleet_streams::ConsumerRef::new("orders", "g", "w"), None, &starting).await?;
    assert_eq!(held, vec![true, true, false], "held: the last and the first; the claimed one is not");
    let records: std::collections::HashMap<String, String> = conn.hgetall(last_error_key("orders", "g")).await?;
    let mut fields: Vec<&str> = records.keys().map(String::as_str).collect();
    fields.sort_unstable();
    let mut expected = vec![run_field(&ids[0]), format!("{}:key", ids[0]), run_field(&ids[7])];
    expected.sort_unstable();
    assert_eq!(fields, expected, "records for the held entries only");
    Ok(())
}

/// `XPENDING` calls so far, by the server's own count.
async fn xpending_calls(conn: &mut redis::aio::MultiplexedConnection) -> Result<u64> {
    let stats: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await?;
    let line = stats.lines().find(|l| l.starts_with("cmdstat_xpending:")).unwrap_or("calls=0,");
    let calls = line.split("calls=").nth(1).and_then(|rest| rest.split(',').next()).unwrap_or("0");
    Ok(calls.parse()?)
}

/// With a proof that the hold is young (the server's time before the read,
/// within half min-idle-time), the script takes the entries as held with one
/// point lookup (the lowest one) instead of a page of the PEL; a proof that
/// has run out is no proof, and the PEL says which are held.
#[tokio::test]
async fn a_young_hold_is_taken_as_proven_and_an_old_one_is_checked() -> Result<()> {
    use streamfleet_streams::started::{HeldSince, server_ms_command};
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let read_at: u64 = server_ms_command("orders").query_async(&mut conn).await?;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", i.to_string())]).await?);
    }
    let opts = redis::streams::StreamReadOptions::default().group("g", "w").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let who = streamfleet_streams::ConsumerRef::new("orders", "g", "w");
    // Taken by another consumer at once: a claim none makes (every claim
    // waits min-idle-time), here only to tell a page read from none.
    let steal = |id: String, mut conn: redis::aio::MultiplexedConnection| async move {
        redis::cmd("XCLAIM")
            .arg("orders")
            .arg("g")
            .arg("other")
            .arg(0)
            .arg(id)
            .query_async::<redis::Value>(&mut conn)
            .await
    };
    steal(ids[1].clone(), conn.clone()).await?;
    // (A window wider than a worker's, so a slow machine does not outlast it.)
    let young = HeldSince { at_ms: read_at, window_ms: 10_000 };
    let before = xpending_calls(&mut conn).await?;
    let held =
        record_starts(&mut conn, who, Some(young), &[(ids[0].as_str(), 1, None), (ids[1].as_str(), 1, None)]).await?;
    assert_eq!(held, vec![true, true], "taken as held: no page of the PEL was read");
    assert_eq!(xpending_calls(&mut conn).await?, before + 1, "one point lookup");
    let records: std::collections::HashMap<String, String> = conn.hgetall(last_error_key("orders", "g")).await?;
    assert!(records.contains_key(&run_field(&ids[0])) && records.contains_key(&run_field(&ids[1])));
    // A proof that has run out: the PEL says the stolen one is not held.
    steal(ids[3].clone(), conn.clone()).await?;
    let old = HeldSince { at_ms: read_at.saturating_sub(20_000), window_ms: 10_000 };
    let held =
        record_starts(&mut conn, who, Some(old), &[(ids[2].as_str(), 1, None), (ids[3].as_str(), 1, None)]).await?;
    assert_eq!(held, vec![true, false], "checked in the PEL: the claimed one is not held");
    Ok(())
}

/// A young proof is no proof once the read is gone from the consumer's PEL:
/// the group deleted and created again (as after a restart without
/// persistence, or a failover that lost the read), and another consumer
/// read the entries anew. The one entry looked up tells, and the PEL says
/// which are held: none.
#[tokio::test]
async fn a_young_proof_does_not_outlive_the_read_it_came_with() -> Result<()> {
    use streamfleet_streams::started::{HeldSince, server_ms_command};
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let read_at: u64 = server_ms_command("orders").query_async(&mut conn).await?;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", i.to_string())]).await?);
    }
    let read = |consumer: &'static str| redis::streams::StreamReadOptions::default().group("g", consumer).count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &read("w")).await?;
    let _: () = redis::cmd("XGROUP").arg("DESTROY").arg("orders").arg("g").query_async(&mut conn).await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &read("other")).await?;
    let young = HeldSince { at_ms: read_at, window_ms: 10_000 };
    let who = streamfleet_streams::ConsumerRef::new("orders", "g", "w");
    let starting: Vec<(&str, u64, Option<&str>)> = ids.iter().map(|id| (id.as_str(), 1, None)).collect();
    let held = record_starts(&mut conn, who, Some(young), &starting).await?;
    assert_eq!(held, vec![false, false, false], "another consumer holds them now");
    let records: u64 = conn.hlen(last_error_key("orders", "g")).await?;
    assert_eq!(records, 0, "no record for entries it does not hold");
    Ok(())
}
