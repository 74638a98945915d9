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
use streamfleet_streams::retry::{Parked, Schedule, park};
use streamfleet_streams::{ensure_group, keys};
use streamfleet_testbed::RedisServer;
use streamfleet_testbed::redis_server::{calls_between, command_calls};

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
        // Apart in time, so the delay tells which one it was read from.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let opts = StreamReadOptions::default().group("g", "w").count(3);
    let _: StreamReadReply = conn.xread_options(&["s"], &[">"], &opts).await?;
    let schedule = Schedule::fixed(Duration::from_millis(1_500));

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
    let s = inspect(&mut conn, streamfleet_streams::GroupRef::new("s", "g"), "{s}:dead").await?.unwrap();
    assert_eq!((s.pending, s.retrying), (3, 1));
    assert_eq!((s.parked.len(), s.parked[0].deliveries, s.parked[0].entries), (1, 1, 1));
    assert_eq!(s.parked[0].last_error.as_deref(), Some("payment provider down"));
    assert!(s.consumers.iter().all(|c| c.name == "w"), "{:?}", s.consumers);
    // The delay counts the parked entry (unfinished work); the working
    // delay, which scaling reads, starts at the next one, 300 ms younger.
    let (delay, working) = (s.delay.ms().unwrap(), s.working_delay.ms().unwrap());
    assert!((250..=400).contains(&(delay - working)), "delay {delay} ms, working delay {working} ms");
    let resume = s.before_oldest_pending.unwrap();
    assert!(
        streamfleet_streams::retention::StreamId::parse(&resume)
            < streamfleet_streams::retention::StreamId::parse(&ids[0])
    );

    // Idle claims take the two others, never the parked one.
    let claimed =
        autoclaim(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, Duration::ZERO, "0-0", 10)
            .await?;
    let taken: Vec<&str> = claimed.entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(taken, vec![ids[1].as_str(), ids[2].as_str()]);
    assert_eq!(claimed.next, "0-0");

    // Due claims: nothing until its delay is over, then it, counted.
    let mut first_taken = None;
    while first_taken.is_none() {
        let due =
            claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, &schedule, 5, 10).await?;
        if let Some(e) = due.entries.first() {
            first_taken = Some((parked_at.elapsed(), e.id.clone(), e.deliveries, due.waiting));
        } else {
            assert_eq!(due.waiting, 1);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let (after, id, deliveries, waiting) = first_taken.unwrap();
    // Redis keeps delivery times in whole milliseconds: due up to 1 ms
    // before 1.5 s on a finer clock (seen: 1.4998 s under load).
    assert!(after >= Duration::from_millis(1_499), "taken {after:?} after parking, before its delay");
    assert!(after < Duration::from_millis(2_000), "taken {after:?} after parking");
    assert_eq!((id.as_str(), deliveries, waiting), (ids[0].as_str(), 2, 0));
    let s = inspect(&mut conn, streamfleet_streams::GroupRef::new("s", "g"), "{s}:dead").await?.unwrap();
    assert_eq!((s.retrying, s.parked.len()), (0, 0));
    Ok(())
}

/// Due claims read the due-time index, not the parked entries: with many
/// parked and none due, a claim sends no `XPENDING` at all; when due, one
/// per entry taken. The PEL stays the truth: an index that says "due"
/// early is corrected, not obeyed; IDs no longer parked leave the index;
/// entries parked without it (an older worker, or the index lost) are
/// still claimed when due, by a scan.
#[tokio::test]
async fn due_claims_read_the_index_and_the_pel_stays_the_truth() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let mut counter = server.connection().await?;
    ensure_group(&mut conn, "s", "g", "0").await?;
    let mut ids = Vec::new();
    for i in 0..205 {
        let id: String = conn.xadd("s", "*", &[("i", i)]).await?;
        ids.push(id);
    }
    let opts = StreamReadOptions::default().group("g", "w").count(205);
    let _: StreamReadReply = conn.xread_options(&["s"], &[">"], &opts).await?;
    let fixed = |ms| Schedule::fixed(Duration::from_millis(ms));
    // One schedule; `soon` is it with a 1 s retryFor horizon, which cuts
    // an entry's delay short: due in 1 s under the same thresholds.
    let hour = fixed(3_600_000);
    let soon = Schedule { retry_for: Some(Duration::from_millis(1_000)), ..hour.clone() };
    let index = keys::retry_due_key("s", "g");
    // 200 parked for an hour at delivery 1; the claims use that schedule.
    for id in &ids[..200] {
        assert!(matches!(park(&mut conn, &entry(id, 1), "g", "w", &LOSS, &hour, "down", 0.0).await?, Parked::Until(_)));
    }
    let before = command_calls(&mut counter).await?;
    let due = claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, &hour, 5, 10).await?;
    let calls = calls_between(&before, &command_calls(&mut counter).await?);
    assert_eq!((due.entries.len(), due.waiting, due.indexed), (0, 200, true));
    assert_eq!(calls.get("xpending"), None, "no scan of the parked entries: {calls:?}");

    // An index that says "due now" (idle since 1970) is checked against the
    // PEL: not taken, put back at the time the PEL says.
    let span = streamfleet_streams::retry::INDEX_SPAN_MS;
    let (secs, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let _: () = conn.zadd(&index, &ids[0], span).await?;
    let due = claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, &hour, 5, 10).await?;
    assert!(due.entries.is_empty(), "taken early on the index's word");
    let score: u64 = conn.zscore(&index, &ids[0]).await?;
    assert!((span + (secs - 5) * 1000..=span + (secs + 5) * 1000).contains(&score), "re-scored: {score}");

    // Two parked beside them (the same parking consumer) for 1 s: taken
    // when due, one XPENDING each.
    for id in &ids[200..202] {
        park(&mut conn, &entry(id, 1), "g", "w", &LOSS, &soon, "down", 0.0).await?;
    }
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let before = command_calls(&mut counter).await?;
    let due = claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, &hour, 5, 10).await?;
    let calls = calls_between(&before, &command_calls(&mut counter).await?);
    // (In due order: two parked in the same millisecond tie, then go by ID text.)
    let mut taken: Vec<(&str, u64)> = due.entries.iter().map(|e| (e.id.as_str(), e.deliveries)).collect();
    taken.sort_by_key(|(id, _)| ids.iter().position(|i| i == id));
    assert_eq!(taken, vec![(ids[200].as_str(), 2), (ids[201].as_str(), 2)]);
    assert_eq!((due.waiting, due.indexed), (200, true));
    assert_eq!(calls.get("xpending"), Some(&2), "{calls:?}");
    assert_eq!(conn.zcard::<_, u64>(&index).await?, 200, "taken IDs leave the index");

    // Stale IDs ahead of a due one (acked or dead-lettered while parked)
    // do not hold it back: they leave the index as they are looked at.
    for k in 1..=15u64 {
        let _: () = conn.zadd(&index, format!("1-{k}"), span + k).await?;
    }
    park(&mut conn, &entry(&ids[202], 1), "g", "w", &LOSS, &soon, "down", 0.0).await?;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let due = claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, &hour, 5, 10).await?;
    let taken: Vec<&str> = due.entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!((taken, due.indexed), (vec![ids[202].as_str()], true));
    assert_eq!(conn.zcard::<_, u64>(&index).await?, 200, "the stale IDs dropped");

    // The index lost: parked entries are indexed again from the PEL, and
    // claimed when due by a scan meanwhile.
    ensure_group(&mut conn, "t", "g", "0").await?;
    let mut lone = Vec::new();
    for i in 0..2 {
        let id: String = conn.xadd("t", "*", &[("i", i)]).await?;
        lone.push(id);
    }
    let _: StreamReadReply = conn.xread_options(&["t"], &[">"], &opts).await?;
    let t_index = keys::retry_due_key("t", "g");
    for id in &lone {
        park(&mut conn, &Entry { stream: "t".into(), ..entry(id, 1) }, "g", "w", &LOSS, &soon, "down", 0.0).await?;
    }
    let _: () = conn.del(&t_index).await?;
    let due = claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("t", "g", "x"), &LOSS, &hour, 5, 10).await?;
    assert_eq!((due.entries.len(), due.waiting, due.indexed), (0, 2, false), "none due yet");
    assert_eq!(conn.zcard::<_, u64>(&t_index).await?, 2, "indexed again from the PEL");
    let _: () = conn.del(&t_index).await?;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let due = claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("t", "g", "x"), &LOSS, &hour, 5, 10).await?;
    let taken: Vec<&String> = due.entries.iter().map(|e| &e.id).collect();
    assert_eq!((taken, due.indexed), (lone.iter().collect(), false));
    assert_eq!(conn.zcard::<_, u64>(&t_index).await?, 0, "taken, not left in the index");

    // Nothing parked any more (acked by hand): the stale index is dropped.
    let pending: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg("s").arg("g").arg("-").arg("+").arg(1000).query_async(&mut conn).await?;
    let parked: Vec<&String> = pending.iter().filter(|p| p.1.starts_with("streamfleet:")).map(|p| &p.0).collect();
    assert_eq!(parked.len(), 200);
    let _: u64 = conn.xack("s", "g", &parked).await?;
    assert_eq!(conn.zcard::<_, u64>(&index).await?, 200, "stale IDs in the index");
    let due = claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, &hour, 5, 10).await?;
    assert_eq!((due.entries.len(), due.waiting), (0, 0));
    assert!(!conn.exists::<_, bool>(&index).await?, "the stale index dropped");
    Ok(())
}

/// When more entries are due than a claim takes, the most overdue go first,
/// whatever their delivery count (the parking consumers come in name order:
/// `streamfleet:retry:10` before `streamfleet:retry:2`).
#[tokio::test]
async fn the_most_overdue_retries_are_taken_first_across_delivery_counts() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "s", "g", "0").await?;
    let a: String = conn.xadd("s", "*", &[("i", "a")]).await?;
    let b: String = conn.xadd("s", "*", &[("i", "b")]).await?;
    let opts = StreamReadOptions::default().group("g", "w").count(2);
    let _: StreamReadReply = conn.xread_options(&["s"], &[">"], &opts).await?;
    let hour = Schedule::fixed(Duration::from_secs(3600));
    // Both due 1 s after parking (their retryFor horizon): a at delivery 2,
    // then b at delivery 10, 600 ms later.
    let soon = Schedule { retry_for: Some(Duration::from_secs(1)), ..hour.clone() };
    park(&mut conn, &entry(&a, 2), "g", "w", &LOSS, &soon, "down", 0.0).await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    park(&mut conn, &entry(&b, 10), "g", "w", &LOSS, &soon, "down", 0.0).await?;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let first = claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, &hour, 10, 1).await?;
    let second =
        claim_due(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, &hour, 10, 1).await?;
    let taken: Vec<&str> = first.entries.iter().chain(&second.entries).map(|e| e.id.as_str()).collect();
    assert_eq!(taken, vec![a.as_str(), b.as_str()], "the longer overdue first");
    Ok(())
}

/// The recovery sweep leaves an entry waiting for its retry alone, even one
/// whose delivery count reached its `maxDeliveries` (lowered since it was
/// parked): its next delivery decides, not the sweep.
#[tokio::test]
async fn the_sweep_never_dead_letters_an_entry_waiting_for_its_retry() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "s", "g", "0").await?;
    let id: String = conn.xadd("s", "*", &[("i", 1)]).await?;
    let opts = StreamReadOptions::default().group("g", "w").count(1);
    let _: StreamReadReply = conn.xread_options(&["s"], &[">"], &opts).await?;
    let schedule = Schedule::fixed(Duration::from_millis(100));
    let parked = park(&mut conn, &entry(&id, 1), "g", "w", &LOSS, &schedule, "down", 0.0).await?;
    assert_eq!(parked, Parked::Until(Duration::from_millis(100)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let settings = streamfleet_streams::sweep::SweepSettings {
        stream: "s",
        group: "g",
        consumer: "sweep",
        dead_letter_stream: "{s}:dead",
        min_idle: Duration::from_millis(100),
        max_deliveries: 1,
        batch: 10,
    };
    let report = streamfleet_streams::sweep::sweep(&mut conn, &settings).await?;
    assert_eq!((report.claimed, report.dead_lettered, report.payload_lost), (0, 0, 0));
    let letters: usize = conn.xlen("{s}:dead").await?;
    assert_eq!(letters, 0);
    let pending: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg("s").arg("g").arg("-").arg("+").arg(10).query_async(&mut conn).await?;
    assert_eq!((pending[0].1.as_str(), pending[0].3), ("streamfleet:retry:1", 1), "still parked, uncounted");
    Ok(())
}

/// Idle claims walk consumer by consumer, a page at a time: across several
/// consumers, the one the cursor points into emptied and deleted between
/// two steps (its entries moved to a consumer later in the order), and a
/// parking consumer among them, every idle entry is claimed exactly once,
/// the cursor comes back to `0-0`, and the parked entry is never taken.
#[tokio::test]
async fn idle_claims_page_through_every_consumer_once_and_skip_the_parked() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "s", "g", "0").await?;
    let mut owned: Vec<(String, String)> = Vec::new();
    for consumer in ["a", "b", "c", "w"] {
        for i in 0..3 {
            let id: String = conn.xadd("s", "*", &[("i", i)]).await?;
            owned.push((consumer.to_string(), id));
        }
        let opts = StreamReadOptions::default().group("g", consumer).count(3);
        let _: StreamReadReply = conn.xread_options(&["s"], &[">"], &opts).await?;
    }
    let of = |c: &str| owned.iter().filter(|(o, _)| o == c).map(|(_, id)| id.clone()).collect::<Vec<_>>();
    let schedule = Schedule::fixed(Duration::from_secs(3600));
    // One of w's entries fails and is parked for an hour.
    let parked_id = of("w")[0].clone();
    park(&mut conn, &entry(&parked_id, 1), "g", "w", &LOSS, &schedule, "down", 0.0).await?;
    // Idle past min-idle-time (what the claimer takes is fresh again).
    tokio::time::sleep(Duration::from_millis(400)).await;
    let min_idle = Duration::from_millis(300);
    let mut taken: Vec<String> = Vec::new();
    let mut cursor = "0-0".to_string();
    let mut steps = 0;
    loop {
        let claimed =
            autoclaim(&mut conn, streamfleet_streams::ConsumerRef::new("s", "g", "x"), &LOSS, min_idle, &cursor, 2)
                .await?;
        taken.extend(claimed.entries.iter().map(|e| e.id.clone()));
        steps += 1;
        if steps == 2 {
            assert!(claimed.next.starts_with("b\n"), "the cursor points into b: {:?}", claimed.next);
            // b's two others move to y (still idle), and b goes.
            let rest: Vec<String> = of("b")[1..].to_vec();
            let _: Vec<String> = redis::cmd("XCLAIM")
                .arg("s")
                .arg("g")
                .arg("y")
                .arg(0)
                .arg(&rest)
                .arg("IDLE")
                .arg(5_000)
                .arg("JUSTID")
                .query_async(&mut conn)
                .await?;
            let _: i64 =
                redis::cmd("XGROUP").arg("DELCONSUMER").arg("s").arg("g").arg("b").query_async(&mut conn).await?;
        }
        if claimed.next == "0-0" {
            break;
        }
        assert!(steps < 20, "the cursor never came back: {:?}", claimed.next);
        cursor = claimed.next;
    }
    let mut expected: Vec<String> = owned.iter().map(|(_, id)| id.clone()).filter(|id| *id != parked_id).collect();
    expected.sort();
    let mut got = taken.clone();
    got.sort();
    assert_eq!(got, expected, "every idle entry once, in {steps} steps: {taken:?}");
    Ok(())
}
