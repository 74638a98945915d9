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
    let held = record_starts(&mut conn, streamfleet_streams::ConsumerRef::new("orders", "g", "w"), &starting).await?;
    assert_eq!(held, vec![true, true, false], "held: the last and the first; the claimed one is not");
    let records: std::collections::HashMap<String, String> = conn.hgetall(last_error_key("orders", "g")).await?;
    let mut fields: Vec<&str> = records.keys().map(String::as_str).collect();
    fields.sort_unstable();
    let mut expected = vec![run_field(&ids[0]), format!("{}:key", ids[0]), run_field(&ids[7])];
    expected.sort_unstable();
    assert_eq!(fields, expected, "records for the held entries only");
    Ok(())
}
