//! Parking for a retry (`retry`) against a real redis-server: a parked
//! entry keeps its ID and delivery count, idle claims and the health sample
//! pass it by, a recreated group would still resume before it, and it comes
//! back exactly when its delay is over.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use redis::streams::{StreamReadOptions, StreamReadReply};
use std::time::{Duration, Instant};
use streamfleet_streams::claim::{LossRecord, autoclaim, claim_due};
use streamfleet_streams::entry::Entry;
use streamfleet_streams::health::inspect;
use streamfleet_streams::retry::{Backoff, Parked, Schedule, park};
use streamfleet_streams::{ensure_group, keys};
use streamfleet_testbed::RedisServer;

const LOSS: LossRecord<'static> = LossRecord { dead_letter_stream: "{s}:dead", consumer: "x", why: "gone" };

fn entry(id: &str, deliveries: u64) -> Entry {
    Entry { stream: "s".into(), id: id.into(), fields: Vec::new(), deliveries, crashes: 0 }
}

#[tokio::test]
async fn a_parked_entry_waits_out_its_delay_unseen_by_idle_claims_and_keeps_its_place() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "s", "g", "0").await?;
    let mut ids = Vec::new();
    for i in 0..3 {
        let id: String = conn.xadd("s", "*", &[("i", i)]).await?;
        ids.push(id);
    }
    let opts = StreamReadOptions::default().group("g", "w").count(3);
    let _: StreamReadReply = conn.xread_options(&["s"], &[">"], &opts).await?;
    let schedule = Schedule {
        backoff: Backoff::Fixed,
        initial: Duration::from_millis(1_500),
        max: Duration::from_millis(1_500),
        jitter_percent: 0,
        retry_for: None,
    };

    // Not ours: left alone.
    let parked = park(&mut conn, &entry(&ids[0], 1), "g", "someone-else", &LOSS, &schedule, "down", 0.0).await?;
    assert_eq!(parked, Parked::NotOurs);
    // The oldest entry fails at its first delivery: parked for 1.5 s.
    let parked_at = Instant::now();
    let parked = park(&mut conn, &entry(&ids[0], 1), "g", "w", &LOSS, &schedule, "payment provider down", 0.0).await?;
    assert_eq!(parked, Parked::Until(Duration::from_millis(1_500)));
    let pending: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg("s").arg("g").arg("-").arg("+").arg(10).query_async(&mut conn).await?;
    assert_eq!(
        (pending[0].0.as_str(), pending[0].1.as_str(), pending[0].3),
        (ids[0].as_str(), "streamfleet:retry:1", 1)
    );
    let error: Option<String> = conn.hget(keys::last_error_key("s", "g"), &ids[0]).await?;
    assert_eq!(error.as_deref(), Some("payment provider down"));

    // The health snapshot: one retrying, with its error; the oldest sample
    // without it; a recreated group would still resume before it.
    let s = inspect(&mut conn, "s", "g", "{s}:dead").await?.unwrap();
    assert_eq!((s.pending, s.retrying), (3, 1));
    assert_eq!((s.parked.len(), s.parked[0].deliveries, s.parked[0].entries), (1, 1, 1));
    assert_eq!(s.parked[0].last_error.as_deref(), Some("payment provider down"));
    assert!(s.consumers.iter().all(|c| c.name == "w"), "{:?}", s.consumers);
    let resume = s.before_oldest_pending.unwrap();
    assert!(
        streamfleet_streams::retention::StreamId::parse(&resume)
            < streamfleet_streams::retention::StreamId::parse(&ids[0])
    );

    // Idle claims take the two others, never the parked one.
    let claimed = autoclaim(&mut conn, "s", "g", "x", &LOSS, Duration::ZERO, "0-0", 10).await?;
    let taken: Vec<&str> = claimed.entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(taken, vec![ids[1].as_str(), ids[2].as_str()]);
    assert_eq!(claimed.next, "0-0");

    // Due claims: nothing until its delay is over, then it, counted.
    let mut first_taken = None;
    while first_taken.is_none() {
        let due = claim_due(&mut conn, "s", "g", "x", &LOSS, &schedule, 5, 10).await?;
        if let Some(e) = due.entries.first() {
            first_taken = Some((parked_at.elapsed(), e.id.clone(), e.deliveries, due.waiting));
        } else {
            assert_eq!(due.waiting, 1);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let (after, id, deliveries, waiting) = first_taken.unwrap();
    assert!(after >= Duration::from_millis(1_500), "taken {after:?} after parking, before its delay");
    assert!(after < Duration::from_millis(2_000), "taken {after:?} after parking");
    assert_eq!((id.as_str(), deliveries, waiting), (ids[0].as_str(), 2, 0));
    let s = inspect(&mut conn, "s", "g", "{s}:dead").await?.unwrap();
    assert_eq!((s.retrying, s.parked.len()), (0, 0));
    Ok(())
}
