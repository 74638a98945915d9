//! The delivery protocol under the interleavings that used to break it, each
//! replayed on a real redis-server: a crash mid-batch, entries queued behind
//! slow handlers, another consumer claiming an entry before its commit, a
//! drain that overruns its deadline. Failpoints (`fail` crate, feature
//! `failpoints`) stop the worker at named points as a crash would.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use streamfleet_streams::started::HOLD_PROOF_LIMIT;
use streamfleet_testbed::eventually;
use streamfleet_worker::{Stats, Worker};

mod common;
use common::*;

type Pending = Vec<(String, String, u64, u64)>;

async fn pending_rows(conn: &mut redis::aio::MultiplexedConnection) -> Result<Pending> {
    Ok(redis::cmd("XPENDING").arg("orders").arg("g").arg("-").arg("+").arg(100).query_async(conn).await?)
}

/// Failpoint: `worker::after-effect` (the 4th handler is done, nothing of it
/// committed, then the process is gone). Entries committed before the crash
/// never run again; the one caught between effect and ack runs once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_committed_before_a_crash_mid_batch_never_run_again() -> Result<()> {
    let scenario = fail::FailScenario::setup();
    let (server, mut conn) = setup().await?;
    let mut ids = Vec::new();
    for i in 0..10 {
        ids.push(add(&mut conn, &[("kind", "slow"), ("key", &format!("k{i}"))]).await?);
    }
    let handler = Scripted::default();
    let mut cfg = config(&server, "c1", 10_000, 5);
    cfg.concurrency = 1;
    fail::cfg("worker::after-effect", "3*off->return").unwrap();
    let crashed = Worker::new(cfg.clone(), handler.clone()).run(std::future::pending()).await;
    assert!(matches!(crashed, Err(streamfleet_worker::WorkerError::Failpoint(_))), "{crashed:?}");
    fail::remove("worker::after-effect");
    let left = pending_rows(&mut conn).await?;
    let calls: Vec<u32> = ids.iter().map(|id| handler.calls(id)).collect();
    assert_eq!(left.len(), 7, "three committed one by one before the crash: {left:?} {calls:?}");
    // The same consumer restarts (same pod) and takes back what it held.
    let (stop, run) = spawn(Worker::new(cfg, handler.clone()));
    eventually("all acked", T, || async { Ok((pending(&mut conn.clone()).await? == 0).then_some(())) }).await?;
    let _ = stop.send(());
    run.await??;
    let calls: Vec<u32> = ids.iter().map(|id| handler.calls(id)).collect();
    assert_eq!(calls, [1, 1, 1, 2, 1, 1, 1, 1, 1, 1], "only the entry caught between effect and ack runs again");
    scenario.teardown();
    Ok(())
}

/// Entries queued behind slow handlers (a batch of 10, one handler at a
/// time, 100 ms each: the last waits 1 s, past the 300 ms min-idle-time) are
/// held by their consumer: another consumer claims none, nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_queued_behind_slow_handlers_are_held_not_claimed() -> Result<()> {
    // Failpoints are global: every test of this file holds the scenario lock.
    let _scenario = fail::FailScenario::setup();
    let (server, mut conn) = setup().await?;
    let mut ids = Vec::new();
    for i in 0..10 {
        ids.push(add(&mut conn, &[("kind", "slow"), ("key", &format!("k{i}"))]).await?);
    }
    let (first, second) = (Scripted::default(), Scripted::default());
    let mut cfg = config(&server, "first", 300, 5);
    cfg.concurrency = 1;
    let (stop_first, run_first) =
        spawn(Worker::new(cfg, first.clone()).with_idempotency_guard(Duration::from_secs(600)));
    eventually("the batch in hand", T, || async { Ok((first.total() >= 1).then_some(())) }).await?;
    let other =
        Worker::new(config(&server, "second", 300, 5), second.clone()).with_idempotency_guard(Duration::from_secs(600));
    let other_stats: Arc<Stats> = other.stats();
    let (stop_second, run_second) = spawn(other);
    eventually("all acked", T, || async { Ok((pending(&mut conn.clone()).await? == 0).then_some(())) }).await?;
    let (_, _) = (stop_first.send(()), stop_second.send(()));
    run_first.await??;
    run_second.await??;
    assert_eq!(Stats::get(&other_stats.claimed), 0, "nothing claimed from a live holder");
    for id in &ids {
        assert_eq!(first.calls(id) + second.calls(id), 1, "{id} handled once");
    }
    Ok(())
}

/// Failpoint: `worker::commit-refused`, four times (Redis refusing the
/// commit: out of memory, a reset). The done entry stays held by its
/// consumer through the retries (about 3 s, ten times min-idle-time): a
/// second consumer claims nothing, the handler ran once, the entry is acked
/// when the commit goes through. Were a refused commit to hand the entry
/// back (its mark gone, claimable at once), the second consumer would run
/// it again past the guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_commit_keeps_done_work_held_and_it_runs_once() -> Result<()> {
    let _scenario = fail::FailScenario::setup();
    let (server, mut conn) = setup().await?;
    let id = add(&mut conn, &[("kind", "ok"), ("key", "order-1")]).await?;
    let (first, second) = (Scripted::default(), Scripted::default());
    fail::cfg("worker::commit-refused", "4*return").unwrap();
    let (stop_first, run_first) = spawn(
        Worker::new(config(&server, "first", 300, 5), first.clone()).with_idempotency_guard(Duration::from_secs(600)),
    );
    eventually("the handler ran", T, || async { Ok((first.calls(&id) == 1).then_some(())) }).await?;
    let ran = Instant::now();
    let other =
        Worker::new(config(&server, "second", 300, 5), second.clone()).with_idempotency_guard(Duration::from_secs(600));
    let other_stats: Arc<Stats> = other.stats();
    let (stop_second, run_second) = spawn(other);
    // The fault happened: a commit that went through acks within
    // milliseconds; a second past the handler (three min-idle-times) the
    // entry is still pending, and still the first consumer's.
    tokio::time::sleep(Duration::from_secs(1).saturating_sub(ran.elapsed())).await;
    let held = pending_rows(&mut conn).await?;
    assert_eq!(held.len(), 1, "the refused commit acked nothing: {held:?}");
    assert_eq!(held[0].1, "first", "a done entry stays with its holder while its commit is retried");
    eventually("acked once the commit goes through", T, || async {
        Ok((pending(&mut conn.clone()).await? == 0).then_some(()))
    })
    .await?;
    let (_, _) = (stop_first.send(()), stop_second.send(()));
    run_first.await??;
    run_second.await??;
    assert_eq!((first.calls(&id), second.calls(&id)), (1, 0), "run once, by its first holder");
    assert_eq!(Stats::get(&other_stats.claimed), 0, "nothing claimed from a holder retrying its commit");
    Ok(())
}

/// At failpoint `point`, once: the worker pauses past its proof of the hold
/// (`started::HeldSince`, [`HOLD_PROOF_LIMIT`] at most), then entry `id`
/// is claimed for consumer "thief", as a claim after a long pause would
/// (one that waits for the whole min-idle-time only makes the pause longer).
/// Returns whether it has happened.
fn claim_away_at(point: &str, server: &streamfleet_testbed::RedisServer, id: &str) -> Arc<AtomicBool> {
    let (url, id) = (server.url(), id.to_string());
    let (claimed, fired) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let seen = fired.clone();
    fail::cfg_callback(point, move || {
        if claimed.swap(true, Ordering::SeqCst) {
            return;
        }
        std::thread::sleep(HOLD_PROOF_LIMIT + Duration::from_millis(100));
        let mut sync = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
        let _: redis::Value =
            redis::cmd("XCLAIM").arg("orders").arg("g").arg("thief").arg(0).arg(&id).query(&mut sync).unwrap();
        seen.store(true, Ordering::SeqCst);
    })
    .unwrap();
    fired
}

/// Failpoint: `worker::before-commit` (a callback claims the entry for
/// another consumer, as a claim after a long pause would). The first
/// consumer's commit writes the completion (its effect happened) but does
/// not ack an entry it no longer owns: the new owner settles it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_claimed_away_before_its_commit_is_not_acked_by_the_old_holder() -> Result<()> {
    let scenario = fail::FailScenario::setup();
    let (server, mut conn) = setup().await?;
    let id = add(&mut conn, &[("kind", "ok"), ("key", "k1")]).await?;
    claim_away_at("worker::before-commit", &server, &id);
    let handler = Scripted::default();
    let worker =
        Worker::new(config(&server, "c1", 10_000, 5), handler.clone()).with_idempotency_guard(Duration::from_secs(600));
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("commit attempted", T, || async { Ok((Stats::get(&stats.ownership_lost) == 1).then_some(())) }).await?;
    let _ = stop.send(());
    run.await??;
    fail::remove("worker::before-commit");
    let rows = pending_rows(&mut conn).await?;
    assert_eq!(rows.len(), 1, "still pending for its new owner");
    assert_eq!((rows[0].0.as_str(), rows[0].1.as_str()), (id.as_str(), "thief"));
    let record: Option<String> =
        redis::cmd("GET").arg(format!("{{orders}}:done:g:{id}")).query_async(&mut conn).await?;
    assert_eq!(record.as_deref(), Some("completed"), "the effect happened: its redelivery is suppressed");
    scenario.teardown();
    Ok(())
}

/// Failpoint: `worker::before-start` (a callback claims the entry for
/// another consumer, as a claim after a lapsed hold would). The old holder
/// neither runs its handler nor leaves a started record behind (an orphan
/// nothing would ever delete): the new holder runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_claimed_away_before_its_start_is_not_run_by_the_old_holder() -> Result<()> {
    let scenario = fail::FailScenario::setup();
    let (server, mut conn) = setup().await?;
    let id = add(&mut conn, &[("kind", "ok"), ("key", "k1")]).await?;
    let fired = claim_away_at("worker::before-start", &server, &id);
    let handler = Scripted::default();
    let (stop, run) = spawn(Worker::new(config(&server, "c1", 10_000, 5), handler.clone()));
    eventually("claimed away before the start", T, || async { Ok(fired.load(Ordering::SeqCst).then_some(())) }).await?;
    // A drain settles what the worker holds: its decision on the entry is made.
    let _ = stop.send(());
    run.await??;
    fail::remove("worker::before-start");
    assert_eq!(handler.calls(&id), 0, "the old holder ran a handler on an entry it no longer held");
    let rows = pending_rows(&mut conn).await?;
    assert_eq!(rows.len(), 1, "still pending for its new owner");
    assert_eq!((rows[0].0.as_str(), rows[0].1.as_str()), (id.as_str(), "thief"));
    let record: bool = redis::cmd("HEXISTS")
        .arg(streamfleet_streams::keys::last_error_key("orders", "g"))
        .arg(streamfleet_streams::started::run_field(&id))
        .query_async(&mut conn)
        .await?;
    assert!(!record, "a started record left by a consumer that did not hold the entry");
    scenario.teardown();
    Ok(())
}

/// A handler still running at the drain deadline is abandoned: the worker
/// stops within the deadline and hands the entry back (claimable at once, its
/// mark released), so the next holder need not wait out min-idle-time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_overruns_its_deadline_hands_the_entry_back() -> Result<()> {
    let _scenario = fail::FailScenario::setup();
    let (server, mut conn) = setup().await?;
    let id = add(&mut conn, &[("kind", "wait"), ("key", "k1")]).await?;
    let handler = Scripted::default();
    let mut cfg = config(&server, "c1", 10_000, 5);
    cfg.drain_timeout = Duration::from_millis(300);
    let (stop, run) = spawn(Worker::new(cfg, handler.clone()).with_idempotency_guard(Duration::from_secs(600)));
    eventually("handler running", T, || async { Ok((handler.calls(&id) == 1).then_some(())) }).await?;
    let stopping = Instant::now();
    let _ = stop.send(());
    run.await??;
    assert!(stopping.elapsed() < Duration::from_secs(2), "stopped at the drain deadline: {:?}", stopping.elapsed());
    let rows = pending_rows(&mut conn).await?;
    assert_eq!(rows.len(), 1);
    assert!(rows[0].2 >= 10_000, "claimable at once (idle {} ms)", rows[0].2);
    assert_eq!(rows[0].3, 1, "the delivery that ran still counts");
    let mark: Option<String> = redis::cmd("GET").arg("{orders}:idem:g:k1").query_async(&mut conn).await?;
    assert_eq!(mark, None, "its mark released");
    Ok(())
}

/// Failpoint: `streams::retention::before-trim` (a callback creates a group
/// at `0` after the operator looked at the floor and before it trims). The
/// trim recomputes the floor in the same script: the new group loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_created_between_the_floor_and_the_trim_loses_nothing() -> Result<()> {
    let scenario = fail::FailScenario::setup();
    let (server, mut conn) = setup().await?;
    let mut last = String::new();
    for i in 0..20 {
        last = add(&mut conn, &[("kind", "ok"), ("key", &format!("k{i}"))]).await?;
    }
    // The only group has read and acked everything: the floor is past the end.
    let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("c")
        .arg("COUNT")
        .arg(100)
        .arg("STREAMS")
        .arg("orders")
        .arg(">")
        .query_async(&mut conn)
        .await?;
    let ids: Vec<String> = read.keys.into_iter().flat_map(|k| k.ids).map(|e| e.id).collect();
    let _: u64 = redis::cmd("XACK").arg("orders").arg("g").arg(&ids).query_async(&mut conn).await?;
    let url = server.url();
    fail::cfg_callback("streams::retention::before-trim", move || {
        let mut sync = redis::Client::open(url.as_str()).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("XGROUP").arg("CREATE").arg("orders").arg("late").arg("0").query(&mut sync).unwrap();
    })
    .unwrap();
    let past_end = streamfleet_streams::retention::StreamId::parse(&last).unwrap().next();
    let trimmed = streamfleet_streams::retention::trim_to(&mut conn, "orders", past_end).await?;
    fail::remove("streams::retention::before-trim");
    assert_eq!(trimmed, 0, "the late group has read nothing yet");
    let len: u64 = redis::cmd("XLEN").arg("orders").query_async(&mut conn).await?;
    assert_eq!(len, 20);
    scenario.teardown();
    Ok(())
}

/// Failpoint: `worker::after-claim` (the worker is gone right after its
/// claim returned). Pending IDs whose payload was deleted were recorded as
/// lost by the claim's own script, so the crash loses no record of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_a_claim_finds_without_payload_are_recorded_by_the_claim_itself() -> Result<()> {
    let scenario = fail::FailScenario::setup();
    let (server, mut conn) = setup().await?;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(add(&mut conn, &[("kind", "ok"), ("key", &format!("k{i}"))]).await?);
    }
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("ghost")
        .arg("COUNT")
        .arg(10)
        .arg("STREAMS")
        .arg("orders")
        .arg(">")
        .query_async(&mut conn)
        .await?;
    let _: u64 = redis::cmd("XDEL").arg("orders").arg(&ids[..2]).query_async(&mut conn).await?;
    tokio::time::sleep(Duration::from_millis(150)).await;
    fail::cfg("worker::after-claim", "return").unwrap();
    let crashed = Worker::new(config(&server, "c1", 100, 5), Scripted::default()).run(std::future::pending()).await;
    fail::remove("worker::after-claim");
    assert!(matches!(crashed, Err(streamfleet_worker::WorkerError::Failpoint(_))), "{crashed:?}");
    let loss =
        streamfleet_streams::payload_loss::read(&mut conn, streamfleet_streams::GroupRef::new("orders", "g")).await?;
    assert_eq!(loss.total, 2);
    let mut latest = loss.latest.clone();
    latest.sort();
    assert_eq!(latest, ids[..2].to_vec());
    let letters = dead_letters(&mut conn).await?;
    assert_eq!(letters.len(), 2);
    // The letter names the consumer that last held the entry, not the claimer.
    assert!(
        letters.iter().all(|l| l["streamfleet.reason"] == "payload-missing" && l["streamfleet.consumer"] == "ghost")
    );
    let rows = pending_rows(&mut conn).await?;
    assert_eq!(
        rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>(),
        vec![ids[2].clone()],
        "the live one stays pending"
    );
    scenario.teardown();
    Ok(())
}
