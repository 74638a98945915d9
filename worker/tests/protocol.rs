//! The worker protocol against a real redis-server: ack after the handler,
//! bounded retries, atomic dead letters with metadata, claims of abandoned
//! entries, payload-missing, the idempotency guard and graceful drain.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use streamfleet_streams::deadletter as dl;
use streamfleet_testbed::eventually;
use streamfleet_worker::{Entry, Stats, Worker};

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_successes_and_dead_letters_refusals_atomically_with_metadata() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let mut ok_ids = Vec::new();
    for i in 0..5 {
        ok_ids.push(add(&mut conn, &[("kind", "ok"), ("key", &format!("o{i}"))]).await?);
    }
    let refused = add(&mut conn, &[("kind", "refused"), ("key", "o-refused"), ("amount", "12")]).await?;
    let garbled = add(&mut conn, &[("kind", "???")]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 60_000, 5), handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("all settled", T, || async {
        Ok((Stats::get(&stats.processed) == 5 && Stats::get(&stats.dead_lettered) == 2).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;

    assert_eq!(pending(&mut conn).await?, 0, "everything acked or dead-lettered");
    for id in &ok_ids {
        assert_eq!(handler.calls(id), 1);
    }
    let letters = dead_letters(&mut conn).await?;
    assert_eq!(letters.len(), 2);
    let by_id = |id: &str| letters.iter().find(|l| l[dl::F_SOURCE_ID] == id).cloned().unwrap();
    let r = by_id(&refused);
    assert_eq!(r[dl::F_REASON], "permanent");
    assert_eq!(r[dl::F_ERROR], "business rule says no");
    assert_eq!(r[dl::F_SOURCE_STREAM], "orders");
    assert_eq!(r[dl::F_GROUP], "g");
    assert_eq!(r[dl::F_CONSUMER], "c1");
    assert_eq!(r[dl::F_DELIVERIES], "1");
    assert_eq!(r[dl::F_BUSINESS_KEY], "o-refused");
    assert_eq!(r["amount"], "12", "original fields are kept");
    assert!(r[dl::F_AT].parse::<u64>()? > 0);
    assert_eq!(by_id(&garbled)[dl::F_REASON], "malformed");
    Ok(())
}

/// Field names are binary on the server. One that is not UTF-8 no longer
/// fails the whole read: before, redis-rs refused the reply, so the batch
/// sat unheld in the PEL and every claim of its page failed the same way,
/// for ever. The handler sees it as `streamfleet-raw-name:<hex>`; its dead
/// letter and its replay carry the name as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_with_a_binary_field_name_is_handled_dead_lettered_and_replayed_as_it_was() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let before = add(&mut conn, &[("kind", "ok")]).await?;
    let refused: String = redis::cmd("XADD")
        .arg("orders")
        .arg("*")
        .arg("kind")
        .arg("refused")
        .arg(b"note\xff".as_slice())
        .arg("x")
        .query_async(&mut conn)
        .await?;
    let after = add(&mut conn, &[("kind", "ok")]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 60_000, 5), handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("all settled", T, || async {
        Ok((Stats::get(&stats.processed) == 2 && Stats::get(&stats.dead_lettered) == 1).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;
    assert_eq!(pending(&mut conn).await?, 0);
    assert_eq!((handler.calls(&before), handler.calls(&refused), handler.calls(&after)), (1, 1, 1));
    let letters = dead_letters(&mut conn).await?;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0][dl::F_REASON], "permanent");
    assert_eq!(letters[0]["streamfleet-raw-name:6e6f7465ff"], "x", "read as its hex");
    let has_raw_name = |entries: &[(String, Vec<Vec<u8>>)]| {
        entries.iter().any(|(_, f)| f.chunks(2).any(|kv| kv[0].as_slice() == b"note\xff" && kv[1].as_slice() == b"x"))
    };
    let raw: Vec<(String, Vec<Vec<u8>>)> =
        redis::cmd("XRANGE").arg("{orders}:dead:g").arg("-").arg("+").query_async(&mut conn).await?;
    assert!(has_raw_name(&raw), "the letter keeps the name's own bytes");
    let replayed = streamfleet_streams::replay::replay(
        &mut conn,
        "{orders}:dead:g",
        &streamfleet_streams::replay::Selection::All,
        false,
    )
    .await?;
    assert_eq!(replayed.len(), 1);
    let requeued: Vec<(String, Vec<Vec<u8>>)> =
        redis::cmd("XREVRANGE").arg("orders").arg("+").arg("-").arg("COUNT").arg(1).query_async(&mut conn).await?;
    assert_ne!(requeued[0].0, after, "requeued as a new entry");
    assert!(has_raw_name(&requeued), "the replay writes the name's own bytes");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failures_retry_in_process_with_backoff() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let id = add(&mut conn, &[("kind", "flaky")]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 10_000, 5), handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("processed", T, || async { Ok((Stats::get(&stats.processed) == 1).then_some(())) }).await?;
    let _ = stop.send(());
    run.await??;
    assert_eq!(handler.calls(&id), 3, "two transient failures, then success, in one delivery");
    assert_eq!(Stats::get(&stats.retried), 2);
    assert_eq!(pending(&mut conn).await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistently_failing_entry_is_redelivered_then_dead_lettered_as_retries_exhausted() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let id = add(&mut conn, &[("kind", "down"), ("key", "o-down")]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 400, 3), handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("dead-lettered", T, || async { Ok((Stats::get(&stats.dead_lettered) == 1).then_some(())) }).await?;
    let _ = stop.send(());
    run.await??;
    let letters = dead_letters(&mut conn).await?;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0][dl::F_SOURCE_ID], id);
    assert_eq!(letters[0][dl::F_REASON], "retries-exhausted");
    assert_eq!(letters[0][dl::F_DELIVERIES], "3");
    let error = &letters[0][dl::F_ERROR];
    assert!(error.starts_with("transient: dependency down (gave up: 3 attempts"), "{error}");
    assert_eq!(pending(&mut conn).await?, 0);
    assert!(handler.calls(&id) >= 3, "each of the 3 deliveries ran the handler");
    // The last-error bookkeeping went with the dead letter.
    let left: HashMap<String, String> = conn.hgetall(streamfleet_streams::keys::last_error_key("orders", "g")).await?;
    assert!(left.is_empty(), "{left:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_abandoned_by_a_dead_consumer_are_claimed_and_payload_loss_is_reported() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(add(&mut conn, &[("kind", "ok"), ("key", &format!("k{i}"))]).await?);
    }
    // A consumer reads them and dies without acking.
    let opts = redis::streams::StreamReadOptions::default().group("g", "dead-pod").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    assert_eq!(pending(&mut conn).await?, 4);
    // One payload is deleted while pending.
    let _: i64 = conn.xdel("orders", &[&ids[3]]).await?;

    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "survivor", 300, 5), handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("claimed and settled", T, || async {
        Ok((Stats::get(&stats.processed) == 3 && Stats::get(&stats.payload_missing) == 1).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;
    for id in &ids[..3] {
        assert_eq!(handler.calls(id), 1);
    }
    assert_eq!(handler.calls(&ids[3]), 0, "nothing to handle: the payload is gone");
    assert_eq!(pending(&mut conn).await?, 0);
    let letters = dead_letters(&mut conn).await?;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0][dl::F_REASON], "payload-missing");
    assert_eq!(letters[0][dl::F_SOURCE_ID], ids[3]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_suppresses_a_completed_event() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let event = [("kind", "ok"), ("key", "order-7"), ("streamfleet.event-id", "order-7-charged")];
    let first = add(&mut conn, &event).await?;
    // The producer retried: the same event arrives twice (in one batch: the
    // second waits on its key's lock until min-idle-time, then is suppressed).
    let again = add(&mut conn, &event).await?;
    let handler = Scripted::default();
    let worker =
        Worker::new(config(&server, "c1", 1_000, 5), handler.clone()).with_idempotency_guard(Duration::from_secs(600));
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("settled", T, || async { Ok((Stats::get(&stats.suppressed) == 1).then_some(())) }).await?;
    let _ = stop.send(());
    run.await??;
    assert_eq!(handler.calls(&first), 1);
    assert_eq!(handler.calls(&again), 0, "the duplicate never reached the handler");
    assert_eq!(Stats::get(&stats.processed), 1);
    assert_eq!(pending(&mut conn).await?, 0, "the duplicate was acked");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_batch_in_hand_and_stops_reading() -> Result<()> {
    let (server, mut conn) = setup().await?;
    for i in 0..20 {
        add(&mut conn, &[("kind", "ok"), ("key", &format!("k{i}"))]).await?;
    }
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 10_000, 5), handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("first batch", T, || async { Ok((Stats::get(&stats.processed) == 20).then_some(())) }).await?;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), run).await???;
    // Work added after the drain is left for the next worker: not read, so
    // not pending either.
    add(&mut conn, &[("kind", "ok")]).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pending(&mut conn).await?, 0);
    assert_eq!(handler.total(), 20);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_once_is_explicit_and_never_leaves_anything_pending() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let ok = add(&mut conn, &[("kind", "ok")]).await?;
    let down = add(&mut conn, &[("kind", "down")]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 400, 5), handler.clone())
        .at_most_once()
        .with_idempotency_guard(Duration::from_secs(60));
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("both handled", T, || async {
        Ok((handler.calls(&ok) == 1 && Stats::get(&stats.failed) >= 1).then_some(()))
    })
    .await?;
    // Well past min-idle-time: the failed entry is not redelivered, nor claimed.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let _ = stop.send(());
    run.await??;
    assert_eq!(pending(&mut conn).await?, 0, "NOACK: nothing ever entered the PEL");
    let calls_down = handler.calls(&down);
    assert!(calls_down >= 1, "handled once, with in-process retries only");
    assert_eq!(Stats::get(&stats.claimed), 0);
    assert_eq!(Stats::get(&stats.suppressed), 0, "no guard in at-most-once mode");
    assert!(dead_letters(&mut conn).await?.is_empty());
    Ok(())
}

/// The user's own store: here an in-memory map standing in for a table
/// with a unique key in the business database.
#[derive(Clone, Default)]
struct MemoryStore {
    states: Arc<Mutex<HashMap<String, &'static str>>>,
}

impl streamfleet_worker::IdempotencyStore for MemoryStore {
    fn begin<'a>(
        &'a self,
        keys: &'a [(&'a str, &'a str)],
    ) -> streamfleet_worker::StoreFuture<'a, Vec<streamfleet_worker::GuardState>> {
        Box::pin(async move {
            let mut states = self.states.lock().unwrap();
            Ok(keys
                .iter()
                .map(|(_, k)| match states.get(*k).copied() {
                    Some("completed") => streamfleet_worker::GuardState::Completed,
                    Some(_) => streamfleet_worker::GuardState::Busy,
                    None => {
                        states.insert(k.to_string(), "processing");
                        streamfleet_worker::GuardState::Acquired
                    }
                })
                .collect())
        })
    }
    fn complete<'a>(&'a self, keys: &'a [(&'a str, &'a str)]) -> streamfleet_worker::StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut states = self.states.lock().unwrap();
            for (_, k) in keys {
                states.insert(k.to_string(), "completed");
            }
            Ok(())
        })
    }
    fn release<'a>(&'a self, _stream: &'a str, key: &'a str) -> streamfleet_worker::StoreFuture<'a, ()> {
        Box::pin(async move {
            self.states.lock().unwrap().remove(key);
            Ok(())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_own_idempotency_store_is_used_in_place_of_the_redis_guard() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let store = MemoryStore::default();
    store.states.lock().unwrap().insert("order-already-charged".into(), "completed");
    // The store keeps events: here named by the producer (`streamfleet.event-id`).
    let fresh = add(&mut conn, &[("kind", "ok"), ("key", "k1"), ("streamfleet.event-id", "order-new")]).await?;
    let old =
        add(&mut conn, &[("kind", "ok"), ("key", "k2"), ("streamfleet.event-id", "order-already-charged")]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 1_000, 5), handler.clone()).with_idempotency_store(store.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("settled", T, || async {
        Ok((Stats::get(&stats.processed) == 1 && Stats::get(&stats.suppressed) == 1).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;
    assert_eq!((handler.calls(&fresh), handler.calls(&old)), (1, 0));
    assert_eq!(store.states.lock().unwrap().get("order-new").copied(), Some("completed"));
    assert_eq!(pending(&mut conn).await?, 0);
    let mut redis_keys: Vec<String> = conn.keys("*idem*").await?;
    redis_keys.extend(conn.keys::<_, Vec<String>>("*done*").await?);
    assert!(redis_keys.is_empty(), "the Redis guard was not used: {redis_keys:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_of_a_consumer_declared_dead_are_handled_at_once_despite_its_guard_marks() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(add(&mut conn, &[("kind", "ok"), ("key", &format!("k{i}"))]).await?);
    }
    // A guarded worker read them, marked them processing, and its pod died.
    let opts = redis::streams::StreamReadOptions::default().group("g", "dead-pod").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    for i in 0..3 {
        let _: () = conn.set_ex(format!("{{orders}}:idem:g:k{i}"), "processing:dead-pod", 60).await?;
    }
    // One more it held lost its payload to an outside XDEL.
    let gone = add(&mut conn, &[("kind", "ok"), ("key", "gone")]).await?;
    let opts = redis::streams::StreamReadOptions::default().group("g", "dead-pod").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let _: i64 = conn.xdel("orders", &[&gone]).await?;
    // The operator's reaper releases its entries (min-idle-time 60 s); the
    // lost one is recorded, not silently dropped. Not while they are fresh:
    // a process still running behind a deleted pod may have just read them.
    let dead_pod = streamfleet_streams::ConsumerRef::new("orders", "g", "dead-pod");
    let release = |mut conn: redis::aio::MultiplexedConnection| async move {
        streamfleet_streams::consumers::release_pending(
            &mut conn,
            dead_pod,
            "{orders}:dead:g",
            Duration::from_secs(60),
            10,
        )
        .await
    };
    let fresh = release(conn.clone()).await?;
    assert_eq!((fresh.released, fresh.payload_lost), (0, 0), "fresh entries are left for a later pass");
    tokio::time::sleep(streamfleet_streams::started::HOLD_PROOF_LIMIT).await;
    let released = release(conn.clone()).await?;
    assert_eq!((released.released, released.payload_lost), (3, 1));
    let lost: HashMap<String, u64> = conn.hgetall("{orders}:payload-lost:g").await?;
    assert_eq!(lost.get("count"), Some(&1));
    assert_eq!(dead_letters(&mut conn).await?[0][dl::F_SOURCE_ID], gone);
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "live-pod", 60_000, 5), handler.clone())
        .with_idempotency_guard(Duration::from_secs(600));
    let stats = worker.stats();
    let started = std::time::Instant::now();
    let (stop, run) = spawn(worker);
    eventually("handled", T, || async { Ok((Stats::get(&stats.processed) == 3).then_some(())) }).await?;
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    let _ = stop.send(());
    run.await??;
    assert_eq!(pending(&mut conn).await?, 0);
    for id in &ids {
        assert_eq!(handler.calls(id), 1);
    }
    // A live consumer's mark is still respected.
    let live = add(&mut conn, &[("kind", "ok"), ("key", "k-live")]).await?;
    let _: () = conn.set_ex("{orders}:idem:g:k-live", "processing:other-live-pod", 60).await?;
    let worker = Worker::new(config(&server, "live-pod", 60_000, 5), handler.clone())
        .with_idempotency_guard(Duration::from_secs(600));
    let (stop, run) = spawn(worker);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _ = stop.send(());
    run.await??;
    assert_eq!(handler.calls(&live), 0, "held by a live consumer: left pending");
    assert_eq!(pending(&mut conn).await?, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_consumer_handles_its_own_pending_entries_first() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let mine = add(&mut conn, &[("kind", "ok"), ("key", "mine")]).await?;
    let gone = add(&mut conn, &[("kind", "ok"), ("key", "gone")]).await?;
    // The container read them, marked one processing, and restarted (same pod name).
    let opts = redis::streams::StreamReadOptions::default().group("g", "pod-a").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let _: () = conn.set_ex("{orders}:idem:g:mine", "processing:pod-a", 60).await?;
    let _: i64 = conn.xdel("orders", &[&gone]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "pod-a", 60_000, 5), handler.clone())
        .with_idempotency_guard(Duration::from_secs(600));
    let stats = worker.stats();
    let started = std::time::Instant::now();
    let (stop, run) = spawn(worker);
    eventually("own entries settled", T, || async {
        Ok((Stats::get(&stats.processed) == 1 && Stats::get(&stats.payload_missing) == 1).then_some(()))
    })
    .await?;
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    let _ = stop.send(());
    run.await??;
    assert_eq!(handler.calls(&mine), 1);
    assert_eq!(pending(&mut conn).await?, 0);
    let lost: HashMap<String, u64> = conn.hgetall("{orders}:payload-lost:g").await?;
    assert_eq!(lost.get("count"), Some(&1), "the lost payload is on record");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_run_concurrently_but_never_two_with_one_business_key() -> Result<()> {
    let (server, mut conn) = setup().await?;
    // 40 slow entries over 20 keys: two per key.
    for i in 0..40 {
        add(&mut conn, &[("kind", "slow"), ("key", &format!("k{}", i % 20))]).await?;
    }
    let handler = Scripted::default();
    let mut config = config(&server, "c1", 10_000, 5);
    config.concurrency = 10;
    let worker = Worker::new(config, handler.clone());
    let stats = worker.stats();
    let started = std::time::Instant::now();
    let (stop, run) = spawn(worker);
    eventually("all handled", T, || async { Ok((Stats::get(&stats.processed) == 40).then_some(())) }).await?;
    let took = started.elapsed();
    let _ = stop.send(());
    run.await??;
    let most = handler.in_flight.lock().unwrap().1;
    assert!(most > 1 && most <= 10, "{most} handlers at once");
    assert_eq!(*handler.overlapping_keys.lock().unwrap(), 0, "one business key ran twice at once");
    // 40 x 100 ms one at a time would take 4 s.
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert_eq!(pending(&mut conn).await?, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_entry_is_acked_when_its_handler_is_done_not_with_the_batch() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let quick = add(&mut conn, &[("kind", "ok"), ("key", "quick")]).await?;
    let slow = add(&mut conn, &[("kind", "wait"), ("key", "slow")]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 10_000, 5), handler.clone());
    let (stop, run) = spawn(worker);
    // The quick entry is acked while the other handler of its batch still runs.
    eventually("quick entry acked", T, || async {
        let mut c = conn.clone();
        let left: Vec<(String, String, u64, u64)> =
            redis::cmd("XPENDING").arg("orders").arg("g").arg("-").arg("+").arg(10).query_async(&mut c).await?;
        let ids: Vec<&str> = left.iter().map(|(id, ..)| id.as_str()).collect();
        Ok((ids == [slow.as_str()] && handler.calls(&quick) == 1).then_some(()))
    })
    .await?;
    handler.release.notify_one();
    eventually("slow entry acked", T, || async { Ok((pending(&mut conn.clone()).await? == 0).then_some(())) }).await?;
    let _ = stop.send(());
    run.await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_hung_handler_or_key_extractor_fails_its_entry_only() -> Result<()> {
    let (server, mut conn) = setup().await?;
    // Never finishes: dropped at its deadline (min-idle-time).
    let hung = add(&mut conn, &[("kind", "wait"), ("key", "hung")]).await?;
    let fine = add(&mut conn, &[("kind", "ok"), ("key", "fine")]).await?;
    let buggy = add(&mut conn, &[("kind", "panic"), ("key", "buggy")]).await?;
    let unreadable = add(&mut conn, &[("kind", "ok"), ("key", "explode")]).await?;
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 300, 2), handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("settled", T, || async {
        Ok((Stats::get(&stats.dead_lettered) == 3 && pending(&mut conn.clone()).await? == 0).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;
    assert_eq!(handler.calls(&fine), 1);
    assert_eq!(handler.calls(&unreadable), 0, "never handled without its key");
    let letters = dead_letters(&mut conn).await?;
    let by_id: HashMap<&str, &HashMap<String, String>> =
        letters.iter().map(|l| (l[dl::F_SOURCE_ID].as_str(), l)).collect();
    assert_eq!(by_id[buggy.as_str()][dl::F_REASON], "retries-exhausted");
    assert!(by_id[buggy.as_str()][dl::F_ERROR].contains("handler panicked: handler bug"));
    assert_eq!(by_id[hung.as_str()][dl::F_REASON], "retries-exhausted");
    assert!(by_id[hung.as_str()][dl::F_ERROR].contains("handler timed out"), "{:?}", by_id[hung.as_str()]);
    assert_eq!(by_id[unreadable.as_str()][dl::F_REASON], "malformed");
    assert!(by_id[unreadable.as_str()][dl::F_ERROR].contains("cannot read this key"));
    Ok(())
}

/// `spec.worker.handlerTimeoutSeconds` (`STREAMFLEET_HANDLER_TIMEOUT_MS`)
/// bounds each attempt instead of min-idle-time, either way: a shorter one
/// gives a hung handler up sooner, a longer one lets a slow handler finish
/// (its entry held meanwhile) where min-idle-time would have dropped it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipelines_handler_timeout_bounds_each_attempt_instead_of_min_idle_time() -> Result<()> {
    // Shorter: min-idle-time 10 s, timeout 300 ms, one delivery allowed.
    let (server, mut conn) = setup().await?;
    let hung = add(&mut conn, &[("kind", "wait"), ("key", "hung")]).await?;
    let mut told = config(&server, "c1", 10_000, 1);
    told.options.handler_timeout_ms = Some(300);
    let worker = Worker::new(told, Scripted::default());
    let stats = worker.stats();
    let started = std::time::Instant::now();
    let (stop, run) = spawn(worker);
    eventually("the hung attempt given up", Duration::from_secs(8), || async {
        Ok((Stats::get(&stats.dead_lettered) == 1 && pending(&mut conn.clone()).await? == 0).then_some(()))
    })
    .await?;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "given up after {took:?}, min-idle-time is 10 s");
    let _ = stop.send(());
    run.await??;
    let letters = dead_letters(&mut conn).await?;
    assert_eq!(letters[0][dl::F_SOURCE_ID], hung);
    assert!(letters[0][dl::F_ERROR].contains("handler timed out after 300ms"), "{:?}", letters[0]);
    drop(server);

    // Longer: min-idle-time 500 ms, timeout 10 s; the handler takes 2 s.
    let (server, mut conn) = setup().await?;
    let slow = add(&mut conn, &[("kind", "wait"), ("key", "slow")]).await?;
    let handler = Scripted::default();
    let mut told = config(&server, "c1", 500, 5);
    told.options.handler_timeout_ms = Some(10_000);
    let worker = Worker::new(told, handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    let release = handler.release.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        release.notify_one();
    });
    eventually("the slow entry acked", T, || async {
        Ok((Stats::get(&stats.processed) == 1 && pending(&mut conn.clone()).await? == 0).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;
    assert_eq!(handler.calls(&slow), 1, "one attempt, not dropped at min-idle-time");
    assert_eq!(Stats::get(&stats.failed), 0);
    assert!(dead_letters(&mut conn).await?.is_empty());
    Ok(())
}

/// `spec.worker.prefetch` (`STREAMFLEET_PREFETCH`): one read, or one claim
/// of idle entries, takes that many, so a worker whose handlers are busy
/// holds no more than that, and the rest stay for an idle worker. Unset, a
/// read takes the batch size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_bounds_the_entries_a_busy_worker_holds() -> Result<()> {
    for (prefetch, held) in [(Some(3), 3), (None, 10)] {
        let (server, mut conn) = setup().await?;
        for i in 0..10 {
            add(&mut conn, &[("kind", "wait"), ("key", &format!("k{i}"))]).await?;
        }
        let handler = Scripted::default();
        let mut told = config(&server, "c1", 60_000, 5);
        told.options.prefetch = prefetch;
        let worker = Worker::new(told, handler.clone());
        let stats = worker.stats();
        let (stop, run) = spawn(worker);
        eventually("handlers waiting", T, || async { Ok((handler.total() as usize == held).then_some(())) }).await?;
        // Its handlers busy, the worker reads nothing more.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(pending(&mut conn).await?, held, "prefetch {prefetch:?}");
        assert_eq!(handler.total() as usize, held, "prefetch {prefetch:?}: handlers started");
        eventually("every entry done", T, || async {
            handler.release.notify_waiters();
            Ok((Stats::get(&stats.processed) == 10).then_some(()))
        })
        .await?;
        let _ = stop.send(());
        run.await??;
        assert_eq!(pending(&mut conn).await?, 0);
    }
    // Idle entries of a vanished consumer: a claim takes 3 of them.
    let (server, mut conn) = setup().await?;
    for i in 0..10 {
        add(&mut conn, &[("kind", "wait"), ("key", &format!("k{i}"))]).await?;
    }
    let opts = redis::streams::StreamReadOptions::default().group("g", "ghost").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let handler = Scripted::default();
    let mut told = config(&server, "c1", 200, 5);
    told.options.prefetch = Some(3);
    // The handlers wait longer than min-idle-time: held, not timed out.
    told.options.handler_timeout_ms = Some(60_000);
    let worker = Worker::new(told, handler.clone());
    let (stop, run) = spawn(worker);
    eventually("claimed handlers waiting", T, || async { Ok((handler.total() == 3).then_some(())) }).await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let held: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg("orders")
        .arg("g")
        .arg("-")
        .arg("+")
        .arg(100)
        .arg("c1")
        .query_async(&mut conn)
        .await?;
    assert_eq!((held.len(), handler.total()), (3, 3), "a claim took more than prefetch");
    handler.release.notify_waiters();
    let _ = stop.send(());
    run.await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_cannot_be_written_leaves_its_entry_pending() -> Result<()> {
    let (_server, mut conn) = setup().await?;
    let id = add(&mut conn, &[("kind", "refused"), ("key", "k")]).await?;
    let opts = redis::streams::StreamReadOptions::default().group("g", "c1").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    // The dead-letter key holds something else: XADD fails.
    let _: () = conn.set("{orders}:dead:g", "not a stream").await?;
    let entry = Entry { stream: "orders".into(), id: id.clone(), fields: vec![], deliveries: 1, crashes: 0 };
    let letter = dl::Letter {
        group: "g",
        consumer: "c1",
        reason: dl::Reason::Permanent,
        error: "no",
        business_key: None,
        while_pending: true,
    };
    let moved = dl::dead_letter(&mut conn, "{orders}:dead:g", &entry, &letter).await;
    assert!(moved.is_err(), "{moved:?}");
    assert_eq!(pending(&mut conn).await?, 1, "not acked: the entry is not lost");
    Ok(())
}

/// In a worker, an entry whose dead letter cannot be written fails alone:
/// it stays pending, the worker runs on and the rest of its batch is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_dead_letter_fails_its_entry_only() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let _: () = conn.set("{orders}:dead:g", "not a stream").await?;
    let refused = add(&mut conn, &[("kind", "refused"), ("key", "k1")]).await?;
    let fine: Vec<String> = [
        add(&mut conn, &[("kind", "ok"), ("key", "k2")]).await?,
        add(&mut conn, &[("kind", "ok"), ("key", "k3")]).await?,
    ]
    .into();
    let handler = Scripted::default();
    let worker = Worker::new(config(&server, "c1", 10_000, 5), handler.clone());
    let stats = worker.stats();
    let (stop, run) = spawn(worker);
    eventually("the rest acked", T, || async {
        Ok((pending(&mut conn.clone()).await? == 1 && fine.iter().all(|id| handler.calls(id) == 1)).then_some(()))
    })
    .await?;
    assert_eq!(Stats::get(&stats.dead_letter_failed), 1);
    assert!(!run.is_finished(), "the worker runs on");
    let _ = stop.send(());
    run.await??;
    let left: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg("orders").arg("g").arg("-").arg("+").arg(10).query_async(&mut conn).await?;
    assert_eq!(left[0].0, refused);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_starts_no_new_handler_and_releases_what_it_did_not_start() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let started = add(&mut conn, &[("kind", "wait"), ("key", "started")]).await?;
    let mut waiting = Vec::new();
    for i in 0..3 {
        // Queued behind it in the same batch (one handler at a time).
        waiting.push(add(&mut conn, &[("kind", "ok"), ("key", &format!("later-{i}"))]).await?);
    }
    let handler = Scripted::default();
    let mut config = config(&server, "c1", 10_000, 5);
    config.concurrency = 1;
    let worker = Worker::new(config, handler.clone()).with_idempotency_guard(Duration::from_secs(600));
    let (stop, run) = spawn(worker);
    eventually("first handler running", T, || async { Ok((handler.calls(&started) == 1).then_some(())) }).await?;
    let _ = stop.send(());
    tokio::time::sleep(Duration::from_millis(300)).await;
    handler.release.notify_one();
    tokio::time::timeout(Duration::from_secs(5), run).await???;
    assert_eq!(handler.total(), 1, "nothing started after the shutdown signal");
    // The running one finished and was acked; the others wait for the next
    // worker, their guard marks released so it need not wait them out.
    let left: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg("orders").arg("g").arg("-").arg("+").arg(10).query_async(&mut conn).await?;
    let left: Vec<String> = left.into_iter().map(|(id, ..)| id).collect();
    assert_eq!(left, waiting);
    for i in 0..3 {
        let mark: Option<String> = conn.get(format!("{{orders}}:idem:g:later-{i}")).await?;
        assert_eq!(mark, None, "mark of an entry never started is released");
    }
    // Handed back: claimable at once, and the delivery that never ran does
    // not count: the next claim delivers each as its first delivery.
    let rows: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg("orders").arg("g").arg("-").arg("+").arg(10).query_async(&mut conn).await?;
    for (id, _, idle, _) in rows {
        assert!(idle >= 10_000, "{id} claimable at once (idle {idle} ms)");
    }
    let loss =
        streamfleet_streams::claim::LossRecord { dead_letter_stream: "{orders}:dead:g", consumer: "c2", why: "gone" };
    // (With no min idle: on a server younger than min-idle-time a claim
    // waits for holders to renew, `claim::claim_rules_lua`.)
    let claimed = streamfleet_streams::claim::autoclaim(
        &mut conn,
        streamfleet_streams::ConsumerRef::new("orders", "g", "c2"),
        &loss,
        Duration::ZERO,
        "0-0",
        10,
    )
    .await?;
    let deliveries: Vec<(String, u64)> = claimed.entries.into_iter().map(|e| (e.id, e.deliveries)).collect();
    assert_eq!(deliveries, waiting.iter().map(|id| (id.clone(), 1)).collect::<Vec<_>>());
    Ok(())
}

/// Replay is for the dead letter's group only, and never re-applies work
/// that another delivery completed after the letter was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_runs_in_its_own_group_only_and_never_after_a_completion() -> Result<()> {
    use streamfleet_streams::replay::{Replayed, Selection, replay};
    let (server, mut conn) = setup().await?;
    add(&mut conn, &[("kind", "refused"), ("key", "k1")]).await?;
    let k2 = add(&mut conn, &[("kind", "refused"), ("key", "k2")]).await?;
    let handler = Scripted::default();
    let (stop, run) = spawn(
        Worker::new(config(&server, "c1", 10_000, 5), handler.clone()).with_idempotency_guard(Duration::from_secs(600)),
    );
    eventually("both dead-lettered", T, || async {
        Ok((dead_letters(&mut conn.clone()).await?.len() == 2).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;
    // Another delivery of k2 completed it after its letter was written.
    let _: () = conn.set(format!("{{orders}}:done:g:{k2}"), "completed").await?;
    // A second group on the stream, from now on.
    streamfleet_streams::ensure_group(&mut conn, "orders", "other", "$").await?;
    let replayed = replay(&mut conn, "{orders}:dead:g", &Selection::All, false).await?;
    let new_id = match &replayed[..] {
        [Replayed::Requeued { new_id, business_key, .. }, Replayed::Skipped { why, .. }] => {
            assert_eq!(business_key.as_deref(), Some("k1"));
            assert!(why.contains("completed"), "{why}");
            new_id.clone()
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(dead_letters(&mut conn).await?.len(), 1, "the skipped letter stays");
    // The other group acks the replay without running its handler.
    let other = Scripted::default();
    let mut other_config = config(&server, "o1", 10_000, 5);
    other_config.group = "other".into();
    let other_worker = Worker::new(other_config, other.clone());
    let other_stats = other_worker.stats();
    let (stop, run) = spawn(other_worker);
    eventually("replay skipped by the other group", T, || async {
        Ok((Stats::get(&other_stats.foreign_replays) == 1).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;
    assert_eq!(other.calls(&new_id), 0);
    let p: redis::streams::StreamPendingReply = conn.xpending("orders", "other").await?;
    assert_eq!(p.count(), 0, "acked in the other group");
    // Its own group runs it.
    let (stop, run) = spawn(Worker::new(config(&server, "c2", 10_000, 5), handler.clone()));
    eventually("replay run in its group", T, || async { Ok((handler.calls(&new_id) == 1).then_some(())) }).await?;
    let _ = stop.send(());
    run.await??;
    Ok(())
}

/// A mark is released only by the acquisition that wrote it: a holder whose
/// mark expired and was taken by another cannot delete the new holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_mark_is_released_only_by_its_own_acquisition() -> Result<()> {
    use streamfleet_worker::guard::{Guard, GuardState};
    let (server, mut conn) = setup().await?;
    let first = Guard::new(&config(&server, "c1", 200, 5), Duration::from_secs(60));
    let second = Guard::new(&config(&server, "c2", 10_000, 5), Duration::from_secs(60));
    let mut sconn = streamfleet_streams::StreamConnection::connect(&config(&server, "c1", 200, 5).endpoint).await?;
    let taken = first.begin_all(&mut sconn, &[("orders", "k1", "e1")]).await?;
    assert_eq!(taken[0].state, GuardState::Acquired);
    let busy = second.begin_all(&mut sconn, &[("orders", "k1", "e1")]).await?;
    assert_eq!(busy[0].state, GuardState::Busy, "held by a live owner");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retaken = second.begin_all(&mut sconn, &[("orders", "k1", "e1")]).await?;
    assert_eq!(retaken[0].state, GuardState::Acquired, "the first mark expired");
    assert!(retaken[0].fence > taken[0].fence, "a later acquisition has a larger fence");
    // The first holder, late, releases what it thinks is its mark.
    first.release(&mut sconn, "orders", "k1", taken[0].fence.unwrap()).await?;
    let mark: Option<String> = conn.get("{orders}:idem:g:k1").await?;
    assert_eq!(mark, Some(second.mark(retaken[0].fence.unwrap())), "the new holder's mark stands");
    Ok(())
}

/// A blocking handler (`Blocking`) runs on tokio's blocking pool (here off
/// the one thread of a current-thread runtime), sees its delivery, and its
/// entries are acked like any other.
#[tokio::test(flavor = "current_thread")]
async fn a_blocking_handler_runs_on_the_blocking_pool_and_sees_its_delivery() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let ids = vec![add(&mut conn, &[("order_id", "o-1")]).await?, add(&mut conn, &[("order_id", "o-2")]).await?];
    // Per call: entry ID, its delivery as the handler saw it, off the runtime's thread.
    type Seen = Vec<(String, Option<u64>, bool)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let record = seen.clone();
    let runtime_thread = std::thread::current().id();
    let handler = streamfleet_worker::Blocking::new(move |entry: &streamfleet_worker::Entry| {
        // Blocks its thread, as a synchronous client would.
        std::thread::sleep(Duration::from_millis(50));
        let on_blocking_pool = std::thread::current().id() != runtime_thread;
        let deliveries = streamfleet_worker::current_delivery().map(|d| d.deliveries);
        record.lock().unwrap().push((entry.id.clone(), deliveries, on_blocking_pool));
        streamfleet_worker::Outcome::Done
    })
    .with_business_key(|entry| entry.field_str("order_id").map(str::to_string));
    let worker = Worker::new(config(&server, "c1", 10_000, 5), handler).with_idempotency_guard(Duration::from_secs(60));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    eventually("both acked", T, || async {
        Ok((seen.lock().unwrap().len() == 2 && pending(&mut conn.clone()).await? == 0).then_some(()))
    })
    .await?;
    let _ = tx.send(());
    running.await??;
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, ids.into_iter().map(|id| (id, Some(1), true)).collect::<Vec<_>>());
    Ok(())
}

/// Two groups on one stream (two resources) dead-letter apart by default,
/// each into its own `{orders}:dead:<group>`: a cap, a purge or a count on
/// one resource's letters never touches the other's. Before, both wrote
/// into `{orders}:dead`, and a cap on one trimmed the other's letters
/// (this test timed out at 6b11a76: both letters in `{orders}:dead`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_on_one_stream_dead_letter_into_their_own_streams() -> Result<()> {
    let (server, mut conn) = setup().await?;
    streamfleet_streams::ensure_group(&mut conn, "orders", "audit", "0").await?;
    add(&mut conn, &[("kind", "refused"), ("key", "k")]).await?;
    let mut audit = config(&server, "a1", 10_000, 5);
    audit.group = "audit".into();
    let (stop_g, run_g) = spawn(Worker::new(config(&server, "g1", 10_000, 5), Scripted::default()));
    let (stop_a, run_a) = spawn(Worker::new(audit, Scripted::default()));
    let probe = conn.clone();
    let length = move |key: &'static str| {
        let mut c = probe.clone();
        async move { Ok::<usize, anyhow::Error>(c.xlen(key).await?) }
    };
    eventually("each group dead-lettered the entry", T, || async {
        Ok((length("{orders}:dead:g").await? == 1 && length("{orders}:dead:audit").await? == 1).then_some(()))
    })
    .await?;
    for (stop, run) in [(stop_g, run_g), (stop_a, run_a)] {
        let _ = stop.send(());
        run.await??;
    }
    let mut letters_of = async |group: &str| -> Result<Vec<Option<String>>> {
        let stream = format!("{{orders}}:dead:{group}");
        let page = streamfleet_streams::dlq::page(&mut conn, &stream, &Default::default(), None, 10).await?;
        Ok(page.letters.into_iter().map(|l| l.group).collect())
    };
    for group in ["g", "audit"] {
        assert_eq!(letters_of(group).await?, vec![Some(group.to_string())], "{group}'s own letter only");
    }
    assert_eq!(length("{orders}:dead").await?, 0, "no shared stream");
    Ok(())
}

/// A commit sent twice (its reply lost, the caller trying again) changes
/// nothing the second time: the entry it acked stays acked, the completion
/// and the released lock stay as they are, and an entry another consumer
/// claimed meanwhile is reported again, never acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_sent_twice_acks_once_and_never_acks_what_another_holds() -> Result<()> {
    use streamfleet_worker::lease::{Completion, Lease};
    let (server, mut conn) = setup().await?;
    let ours = add(&mut conn, &[("kind", "ok"), ("key", "k0")]).await?;
    let taken = add(&mut conn, &[("kind", "ok"), ("key", "k1")]).await?;
    let opts = redis::streams::StreamReadOptions::default().group("g", "w").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    // A claim after a long pause: the second entry is another consumer's now.
    let _: redis::Value =
        redis::cmd("XCLAIM").arg("orders").arg("g").arg("thief").arg(0).arg(&taken).query_async(&mut conn).await?;
    let lock = |k: &str| format!("{{orders}}:idem:g:{k}");
    let mark = |k: &str| format!("processing:w:{k}");
    for k in ["k0", "k1"] {
        let _: () = conn.set(lock(k), mark(k)).await?;
    }
    let completion = |event: &str, k: &str| Completion {
        record: streamfleet_streams::keys::completion_key("orders", "g", event),
        lock: Some((lock(k), mark(k))),
    };
    let settled = [(ours.as_str(), Some(completion(&ours, "k0"))), (taken.as_str(), Some(completion(&taken, "k1")))];
    let endpoint = streamfleet_streams::Endpoint::new(server.url(), streamfleet_streams::Mode::Standalone);
    let mut stream_conn = streamfleet_streams::StreamConnection::connect(&endpoint).await?;
    let lease = Lease { holder: streamfleet_streams::ConsumerRef::new("orders", "g", "w") };
    let state = |mut c: redis::aio::MultiplexedConnection| async move {
        let pending: redis::streams::StreamPendingCountReply = c.xpending_count("orders", "g", "-", "+", 10).await?;
        let owners: Vec<(String, String)> = pending.ids.into_iter().map(|p| (p.id, p.consumer)).collect();
        let locks: Vec<Option<String>> = vec![c.get(lock("k0")).await?, c.get(lock("k1")).await?];
        anyhow::Ok((owners, locks))
    };
    let first = lease.commit(&mut stream_conn, 60_000, None, &settled).await?;
    assert_eq!(first, vec![taken.clone()], "the claimed entry is reported, not acked");
    let after_first = state(conn.clone()).await?;
    assert_eq!(after_first.0, vec![(taken.clone(), "thief".to_string())], "ours acked, the thief's left");
    assert_eq!(after_first.1, vec![None, None], "both locks released: both effects happened");
    let second = lease.commit(&mut stream_conn, 60_000, None, &settled).await?;
    assert_eq!(second, first, "sent again: the same report");
    assert_eq!(state(conn.clone()).await?, after_first, "sent again: nothing changed");
    for event in [&ours, &taken] {
        let done: Option<String> = conn.get(streamfleet_streams::keys::completion_key("orders", "g", event)).await?;
        assert_eq!(done.as_deref(), Some("completed"), "{event}");
    }
    Ok(())
}

/// Counts its calls; each blocks its thread for `block` (as a synchronous
/// client called from async code would), then succeeds.
#[derive(Clone)]
struct BlocksItsThread {
    calls: Arc<std::sync::atomic::AtomicU32>,
    block: Duration,
}

impl BlocksItsThread {
    /// Waits until its handler was first called.
    async fn started_once(&self) -> Result<()> {
        let calls = self.calls.clone();
        let started = move || {
            let calls = calls.clone();
            async move { Ok((calls.load(std::sync::atomic::Ordering::SeqCst) == 1).then_some(())) }
        };
        eventually("the first consumer's handler started", T, started).await
    }
}

/// Runs a worker on a thread of its own with a runtime of one thread (which
/// a blocking handler blocks whole); the sender stops it.
fn run_on_one_thread(
    worker: Worker<BlocksItsThread>,
) -> (tokio::sync::oneshot::Sender<()>, std::thread::JoinHandle<Result<()>>) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(worker.run(async move {
            let _ = stopped.await;
        }))?;
        anyhow::Ok(())
    });
    (stop, running)
}

impl streamfleet_worker::Handler for BlocksItsThread {
    fn handle(&self, _entry: &Entry) -> impl std::future::Future<Output = streamfleet_worker::Outcome> + Send {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let block = self.block;
        async move {
            std::thread::sleep(block);
            streamfleet_worker::Outcome::Done
        }
    }
}

/// A handler that blocks its worker's only thread for 1.8 × min-idle-time
/// keeps its entry: the hold runs on a thread of its own, so
/// a second consumer claiming idle entries all along never takes (and runs
/// again) what the first is still running. Before, the hold ran beside the
/// handlers, starved with them: the entry went idle and the second
/// consumer ran it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_blocking_its_thread_past_min_idle_keeps_its_entry() -> Result<()> {
    let (server, mut conn) = setup().await?;
    add(&mut conn, &[("kind", "ok")]).await?;
    let blocking = BlocksItsThread { calls: Arc::default(), block: Duration::from_millis(1800) };
    // The first consumer on a runtime of one thread, which its handler blocks.
    let first = Worker::new(config(&server, "c1", 1000, 5), blocking.clone());
    let (stop_first, running_first) = run_on_one_thread(first);
    blocking.started_once().await?;
    // The second claims entries idle past min-idle-time every 500 ms.
    let second = Worker::new(config(&server, "c2", 1000, 5), Scripted::default());
    let second_stats = second.stats();
    let (stop_second, running_second) = spawn(second);
    eventually("the entry acked", T, || async { Ok((pending(&mut conn.clone()).await? == 0).then_some(())) }).await?;
    let _ = stop_second.send(());
    running_second.await??;
    let _ = stop_first.send(());
    running_first.join().unwrap()?;
    assert_eq!(blocking.calls.load(std::sync::atomic::Ordering::SeqCst), 1, "run once, by the first consumer");
    assert_eq!(Stats::get(&second_stats.claimed), 0, "the second consumer never claimed it");
    assert_eq!(Stats::get(&second_stats.processed), 0);
    Ok(())
}

/// A handler hung past twice min-idle-time (it blocks its thread, so its
/// deadline cannot drop it, and its whole batch is frozen with it) lets
/// its batch go: the hold stops, and another consumer claims the entries
/// once idle and runs them, as it would a crashed worker's, the one queued
/// behind the hung handler too. When the hung handler returns, the first
/// consumer starts nothing it no longer holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_hung_past_twice_min_idle_lets_its_batch_go() -> Result<()> {
    let (server, mut conn) = setup().await?;
    add(&mut conn, &[("kind", "ok")]).await?;
    add(&mut conn, &[("kind", "ok")]).await?;
    let hung = BlocksItsThread { calls: Arc::default(), block: Duration::from_millis(2500) };
    let mut one_at_a_time = config(&server, "c1", 300, 5);
    one_at_a_time.concurrency = 1;
    let first = Worker::new(one_at_a_time, hung.clone());
    let (stop_first, running_first) = run_on_one_thread(first);
    hung.started_once().await?;
    let since_start = std::time::Instant::now();
    let second = Worker::new(config(&server, "c2", 300, 5), Scripted::default());
    let second_stats = second.stats();
    let (stop_second, running_second) = spawn(second);
    eventually("the second consumer ran and acked both", T, || async {
        Ok((Stats::get(&second_stats.processed) == 2 && pending(&mut conn.clone()).await? == 0).then_some(()))
    })
    .await?;
    // Held until the handler was hung (600 ms), then idle for min-idle-time:
    // without a hold at all the second consumer claims after ~300 ms.
    assert!(since_start.elapsed() >= Duration::from_millis(600), "claimed after {:?}", since_start.elapsed());
    // The hung handler returns at 2.5 s; the queued entry is not started by it.
    tokio::time::sleep(Duration::from_millis(2800).saturating_sub(since_start.elapsed())).await;
    let _ = stop_second.send(());
    running_second.await??;
    let _ = stop_first.send(());
    running_first.join().unwrap()?;
    assert_eq!(
        hung.calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the queued entry was not started by the first"
    );
    // (Claimed three times: the hung entry counts as a crash, so it runs
    // alone and its batch-mate is handed back and claimed again.)
    assert!(Stats::get(&second_stats.claimed) >= 2, "both claimed from the hung handler's worker");
    Ok(())
}

/// GET `path` from `addr`: (status line, body).
async fn http_get(addr: &str, path: &str) -> Result<(String, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Ok((head.lines().next().unwrap_or_default().to_string(), body.to_string()))
}

/// `STREAMFLEET_METRICS_ADDR` set: the library itself serves `/metrics`,
/// `/healthz` and `/readyz` while it runs, and nothing after; an address it
/// cannot listen on stops it before it consumes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_serves_its_metrics_and_probes_when_told_where() -> Result<()> {
    let (server, mut conn) = setup().await?;
    let id = add(&mut conn, &[("kind", "ok"), ("key", "o1")]).await?;
    let addr = format!("127.0.0.1:{}", streamfleet_testbed::process::free_port()?);
    let mut cfg = config(&server, "c1", 60_000, 5);
    cfg.metrics_addr = Some(addr.clone());
    let handler = Scripted::default();
    let (stop, run) = spawn(Worker::new(cfg.clone(), handler.clone()));
    eventually("handled", T, || async { Ok((handler.calls(&id) == 1).then_some(())) }).await?;
    let metrics = eventually("/metrics counts it", T, || async {
        let (status, body) = http_get(&addr, "/metrics").await?;
        Ok((status.contains("200") && body.contains(r#"streamfleet_worker_processed_total{group="g"} 1"#))
            .then_some(body))
    })
    .await?;
    assert!(metrics.ends_with("# EOF\n"), "{metrics}");
    for probe in ["/healthz", "/readyz"] {
        let (status, _) = http_get(&addr, probe).await?;
        assert!(status.contains("200"), "{probe}: {status}");
    }
    let _ = stop.send(());
    run.await??;
    assert!(http_get(&addr, "/metrics").await.is_err(), "nothing served once it stopped");

    // Taken: the second worker does not start.
    let taken = tokio::net::TcpListener::bind(&addr).await?;
    let (_stop, run) = spawn(Worker::new(cfg, handler.clone()));
    let refused = run.await?;
    assert!(matches!(&refused, Err(streamfleet_worker::WorkerError::Admin(a)) if a.starts_with(&addr)), "{refused:?}");
    drop(taken);
    Ok(())
}

/// A Redis older than 7.0 (6.2.14, the one `scripts/install-deps.sh`
/// builds): the worker stops at once, naming the version, having read and
/// written nothing (no heartbeat, no start record) and never been ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_older_than_7_is_refused_and_nothing_is_consumed() -> Result<()> {
    let old = streamfleet_testbed::redis_server::old_server_binary()?;
    let server = streamfleet_testbed::RedisServer::start_binary(&old).await?;
    let mut conn = server.connection().await?;
    streamfleet_streams::ensure_group(&mut conn, "orders", "g", "0").await?;
    let id = add(&mut conn, &[("kind", "ok"), ("key", "o1")]).await?;
    let mut cfg = config(&server, "c1", 60_000, 5);
    cfg.metrics_addr = Some(format!("127.0.0.1:{}", streamfleet_testbed::process::free_port()?));
    let handler = Scripted::default();
    let (_stop, run) = spawn(Worker::new(cfg, handler.clone()).with_idempotency_guard(Duration::from_secs(60)));
    let refused = tokio::time::timeout(T, run).await??;
    assert!(
        matches!(&refused, Err(streamfleet_worker::WorkerError::Unsupported(m)) if m.contains("6.2.14")),
        "{refused:?}"
    );
    assert_eq!(handler.calls(&id), 0, "nothing handled");
    assert_eq!(pending(&mut conn).await?, 0, "nothing even read");
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await?;
    assert_eq!(keys, ["orders"], "nothing written beside the stream");
    Ok(())
}

/// A batch over two streams whose guard can be taken on the first but not
/// the second (here its key's mark is a list: `WRONGTYPE`) is handed
/// back whole, and the marks already taken on the first stream go with it:
/// they do not sit until their TTL (min-idle-time, 10 s here) making the
/// first stream's keys busy. Once the second stream is repaired, both
/// entries run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_refused_on_one_stream_leaves_no_mark_on_the_others() -> Result<()> {
    use std::sync::atomic::Ordering;
    use streamfleet_streams::keys::guard_key;
    let server = streamfleet_testbed::RedisServer::start().await?;
    let mut conn = server.connection().await?;
    for stream in ["a", "b"] {
        streamfleet_streams::ensure_group(&mut conn, stream, "g", "0").await?;
        let _: String = conn.xadd(stream, "*", &[("kind", "ok"), ("key", &format!("k{stream}"))]).await?;
    }
    let broken = guard_key("b", "g", "kb");
    let _: () = conn.rpush(&broken, "not a mark").await?;
    let mut config = config(&server, "w", 10_000, 5);
    config.streams = vec!["a".into(), "b".into()];
    let handler = Scripted::default();
    let (stop, run) = spawn(Worker::new(config, handler.clone()).with_idempotency_guard(Duration::from_secs(600)));
    let mut probe = conn.clone();
    // Seen five polls in a row (100 ms apart): without the release the mark
    // stays for min-idle-time from the first attempt on, and only the
    // instant between the read and that attempt shows the entry unmarked.
    let streak = std::sync::atomic::AtomicUsize::new(0);
    eventually("the batch read, refused, and no mark left on stream a", T, || {
        let (mut c, streak) = (probe.clone(), &streak);
        async move {
            let p: redis::streams::StreamPendingReply = c.xpending("a", "g").await?;
            let marked: bool = c.exists(guard_key("a", "g", "ka")).await?;
            let seen = if p.count() == 1 && !marked { streak.fetch_add(1, Ordering::SeqCst) + 1 } else { 0 };
            if seen == 0 {
                streak.store(0, Ordering::SeqCst);
            }
            Ok((seen >= 5).then_some(()))
        }
    })
    .await?;
    assert_eq!(handler.total(), 0, "nothing ran while the guard could not be taken");
    let _: () = probe.del(&broken).await?;
    eventually("both entries handled once the guard can be taken", T, || async {
        Ok((handler.total() == 2).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    run.await??;
    Ok(())
}
