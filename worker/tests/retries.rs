//! Retries on a schedule kept in the PEL (`streams::retry`), on a real
//! redis-server: a downstream outage while entries arrive, shorter and
//! longer than the schedule's horizon, at two batch sizes.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use anyhow::Result;
use common::{add, dead_letters, pending, setup};
use redis::AsyncCommands as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use streamfleet_contract as env;
use streamfleet_streams::deadletter as dl;
use streamfleet_streams::retry::{Backoff, Schedule};
use streamfleet_testbed::RedisServer;
use streamfleet_worker::{Entry, Handler, Outcome, Worker, WorkerConfig};

/// Per entry ID: (delivery count, when) of each attempt.
type Attempts = HashMap<String, Vec<(u64, Instant)>>;

/// A handler whose downstream is down until a moment: every attempt before
/// it fails transiently, every one after succeeds. Records each attempt.
#[derive(Clone)]
struct Downstream {
    up_at: Arc<Mutex<Instant>>,
    attempts: Arc<Mutex<Attempts>>,
}

impl Downstream {
    fn down_for(outage: Duration) -> Self {
        Self { up_at: Arc::new(Mutex::new(Instant::now() + outage)), attempts: Arc::default() }
    }
    fn attempts(&self) -> Attempts {
        self.attempts.lock().unwrap().clone()
    }
}

impl Handler for Downstream {
    async fn handle(&self, entry: &Entry) -> Outcome {
        let deliveries = streamfleet_worker::current_delivery().map_or(0, |d| d.deliveries);
        let now = Instant::now();
        self.attempts.lock().unwrap().entry(entry.id.clone()).or_default().push((deliveries, now));
        if now < *self.up_at.lock().unwrap() {
            Outcome::Transient("payment provider: connection refused".into())
        } else {
            Outcome::Done
        }
    }
}

fn config(server: &RedisServer, schedule: &[(&str, &str)], max_deliveries: u64, batch: usize) -> WorkerConfig {
    let mut vars: HashMap<&str, String> = HashMap::from([
        (env::REDIS_URL, server.url()),
        (env::STREAMS, "orders".into()),
        (env::GROUP, "g".into()),
        (env::CONSUMER, "w1".into()),
        (env::MIN_IDLE_MS, "400".into()),
        (env::MAX_DELIVERIES, max_deliveries.to_string()),
        (env::BATCH_SIZE, batch.to_string()),
        (env::CONCURRENCY, batch.min(10).to_string()),
    ]);
    vars.extend(schedule.iter().map(|(k, v)| (*k, v.to_string())));
    let mut c = WorkerConfig::from_lookup(|k| vars.get(k).cloned()).unwrap();
    c.block = Duration::from_millis(100);
    c
}

fn spawn(
    worker: Worker<Downstream>,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Result<(), streamfleet_worker::WorkerError>>) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    (
        tx,
        tokio::spawn(worker.run(async move {
            let _ = rx.await;
        })),
    )
}

/// Every pair of consecutive attempts of an entry on different deliveries
/// is at least the schedule's delay apart (never early), and at most that
/// plus its jitter and a claim cycle's slack (never much late).
fn assert_on_schedule(attempts: &Attempts, schedule: &Schedule, slack: Duration) {
    for (id, tries) in attempts {
        let firsts: Vec<(u64, Instant)> =
            tries.iter().enumerate().filter(|(i, (n, _))| *i == 0 || tries[i - 1].0 != *n).map(|(_, t)| *t).collect();
        for pair in firsts.windows(2) {
            let ((n, _), (next, to)) = (pair[0], pair[1]);
            assert_eq!(next, n + 1, "{id}: deliveries go up by one: {firsts:?}");
            // The last attempt of delivery n, not its first, parks it.
            let parked_at = tries.iter().filter(|(d, _)| *d == n).map(|(_, at)| *at).max().unwrap();
            let gap = to - parked_at;
            let (least, most) = (schedule.base(n), schedule.threshold(n) + slack);
            assert!(
                gap + Duration::from_millis(15) >= least && gap <= most,
                "{id}: delivery {next} came {gap:?} after delivery {n} failed, not within {least:?}..{most:?}"
            );
        }
    }
}

/// The downstream is down for 3 s while 20 entries arrive; the schedule
/// (first retry after 400 ms, doubling to 1.6 s, 6 deliveries) spans 6 s.
/// Every entry waits parked between attempts (`streamfleet:retry:<n>`,
/// counted as retrying, not as stuck), keeps its ID, is charged once after
/// the outage, and nothing is dead-lettered. The same at batch 1 and at
/// batch 20 with 10 handlers: the schedule, not the batch, sets the pace.
/// Before this, each entry retried in process for min-idle-time and was
/// taken again right after: the horizon moved with batch size and
/// concurrency, and the health snapshot showed retrying entries as stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_shorter_than_the_horizon_dead_letters_nothing_at_any_batch_size() -> Result<()> {
    for batch in [1, 20] {
        let (server, mut conn) = setup().await?;
        let settings = [(env::RETRY_MAX_DELAY_MS, "1600"), (env::RETRY_JITTER_PERCENT, "25")];
        let config = config(&server, &settings, 6, batch);
        let schedule = config.retry.clone();
        assert_eq!((schedule.backoff, schedule.initial), (Backoff::Exponential, Duration::from_millis(400)));
        let downstream = Downstream::down_for(Duration::from_secs(3));
        // (The schedule alone: the breaker would spare calls, and the
        // attempts recorded here are calls.)
        let (stop, running) = spawn(Worker::new(config, downstream.clone()).without_circuit_breaker());
        let mut ids = Vec::new();
        for i in 0..20 {
            ids.push(add(&mut conn, &[("order", &i.to_string())]).await?);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Mid-outage: the entries wait parked, and the group says so.
        let snapshot = streamfleet_testbed::eventually("entries parked", common::T, || async {
            let s = streamfleet_streams::health::inspect(
                &mut conn.clone(),
                streamfleet_streams::GroupRef::new("orders", "g"),
                "{orders}:dead:g",
            )
            .await?;
            Ok(s.filter(|s| s.retrying >= 3))
        })
        .await?;
        assert!(snapshot.consumers.iter().all(|c| !c.name.starts_with("streamfleet:")), "{:?}", snapshot.consumers);
        let parked: Vec<redis::Value> =
            redis::cmd("XINFO").arg("CONSUMERS").arg("orders").arg("g").query_async(&mut conn).await?;
        assert!(format!("{parked:?}").contains("streamfleet:retry:"), "{parked:?}");
        streamfleet_testbed::eventually("all charged", common::T, || async {
            let attempts = downstream.attempts();
            let done = ids.iter().all(|id| {
                attempts
                    .get(id)
                    .is_some_and(|a| a.last().is_some_and(|(_, at)| *at >= *downstream.up_at.lock().unwrap()))
            });
            Ok((done && pending(&mut conn.clone()).await? == 0).then_some(()))
        })
        .await?;
        let _ = stop.send(());
        running.await??;
        assert!(dead_letters(&mut conn).await?.is_empty(), "batch {batch}: nothing dead-lettered");
        let attempts = downstream.attempts();
        let up_at = *downstream.up_at.lock().unwrap();
        for id in &ids {
            let after = attempts[id].iter().filter(|(_, at)| *at >= up_at).count();
            assert_eq!(after, 1, "batch {batch}: {id} charged once after the outage: {:?}", attempts[id]);
            let deliveries = attempts[id].last().unwrap().0;
            // (At batch 1 the last orders may first be read after the outage.)
            assert!((1..=6).contains(&deliveries), "batch {batch}: {id} took {deliveries} deliveries");
        }
        let retried = attempts.values().filter(|a| a.last().is_some_and(|(n, _)| *n >= 3)).count();
        assert!(retried >= 10, "batch {batch}: most entries went through several deliveries: {retried}");
        assert_on_schedule(&attempts, &schedule, Duration::from_millis(1_500));
        let records: HashMap<String, String> =
            conn.hgetall(streamfleet_streams::keys::last_error_key("orders", "g")).await?;
        assert!(records.is_empty(), "batch {batch}: records left behind: {records:?}");
    }
    Ok(())
}

/// The downstream never comes back. With `maxDeliveries: 4` the entry is
/// dead-lettered `retries-exhausted` on its fourth failure, after the three
/// delays of the schedule (not before), the attempts in the letter. With a
/// `retryFor` of 2 s and room for many more deliveries, the last delay is
/// cut short to land on the horizon and the letter is written then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_the_horizon_dead_letters_at_the_horizon_not_before() -> Result<()> {
    for (settings, max_deliveries, horizon) in [
        (vec![(env::RETRY_BACKOFF, "Fixed"), (env::RETRY_JITTER_PERCENT, "0")], 4, Duration::from_millis(1_200)),
        (vec![(env::RETRY_JITTER_PERCENT, "0"), (env::RETRY_FOR_MS, "2000")], 20, Duration::from_millis(2_000)),
    ] {
        let (server, mut conn) = setup().await?;
        let downstream = Downstream::down_for(Duration::from_secs(3_600));
        let worker = Worker::new(config(&server, &settings, max_deliveries, 10), downstream.clone());
        let (stop, running) = spawn(worker.without_circuit_breaker());
        let id = add(&mut conn, &[("order", "1")]).await?;
        let letters = streamfleet_testbed::eventually("dead-lettered", common::T, || async {
            let letters = dead_letters(&mut conn.clone()).await?;
            Ok((!letters.is_empty()).then_some(letters))
        })
        .await?;
        let _ = stop.send(());
        running.await??;
        let attempts = downstream.attempts()[&id].clone();
        let (first, last) = (attempts[0].1, attempts.last().unwrap().1);
        assert_eq!(letters.len(), 1);
        let letter = &letters[0];
        assert_eq!(letter[dl::F_REASON], "retries-exhausted", "{letter:?}");
        assert_eq!(letter[dl::F_SOURCE_ID], id);
        assert!(
            letter[dl::F_ERROR].contains("payment provider") && letter[dl::F_ERROR].contains("gave up"),
            "{letter:?}"
        );
        let deliveries: u64 = letter[dl::F_DELIVERIES].parse()?;
        assert_eq!(deliveries, attempts.last().unwrap().0, "the attempts are in the letter");
        assert!(
            last - first + Duration::from_millis(15) >= horizon,
            "last attempt {:?} after the first: before the horizon {horizon:?}",
            last - first
        );
        assert!(
            last - first < horizon + Duration::from_millis(1_500),
            "last attempt {:?} after the first: long past the horizon {horizon:?}",
            last - first
        );
        if max_deliveries == 4 {
            assert_eq!(deliveries, 4);
        } else {
            // 400 ms, 800 ms, then 1.6 s cut to what is left: four
            // deliveries, or three when the claims ran late enough that the
            // third failed at the horizon.
            assert!((3..=4).contains(&deliveries), "{attempts:?}");
        }
        assert_eq!(pending(&mut conn).await?, 0);
    }
    Ok(())
}

/// Every call fails the same way while 60 entries arrive (the downstream
/// is down for 4 s). Without a breaker each entry is tried at every
/// delivery, several times each in process (the same run without it is the
/// comparison). With it, once most calls fail with one error, the worker
/// stops calling: deliveries fail uncalled and entries go on along their
/// schedule, one probe at a time telling when the downstream is back.
/// Every entry runs once after, nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_downstream_failing_every_call_is_spared_by_the_circuit_breaker() -> Result<()> {
    let (without, _) = calls_while_down(false).await?;
    let (with, waited) = calls_while_down(true).await?;
    println!("calls while down: {with} with the breaker ({waited} deliveries not run), {without} without");
    assert!(waited > 0, "deliveries failed uncalled while the circuit was open");
    assert!(with * 4 <= without, "calls while down: {with} with the breaker, {without} without");
    Ok(())
}

/// Calls to the downstream while it was down, and deliveries not run for
/// the breaker, for 60 entries arriving during a 4 s outage.
async fn calls_while_down(breaker: bool) -> Result<(usize, u64)> {
    let (server, mut conn) = setup().await?;
    let settings = [(env::RETRY_MAX_DELAY_MS, "1600"), (env::RETRY_JITTER_PERCENT, "0")];
    let downstream = Downstream::down_for(Duration::from_secs(4));
    let worker = Worker::new(config(&server, &settings, 20, 20), downstream.clone());
    let worker = if breaker { worker } else { worker.without_circuit_breaker() };
    let stats = worker.stats();
    let (stop, running) = spawn(worker);
    let mut ids = Vec::new();
    for i in 0..60 {
        ids.push(add(&mut conn, &[("order", &i.to_string())]).await?);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let up_at = *downstream.up_at.lock().unwrap();
    streamfleet_testbed::eventually("all charged", common::T, || async {
        let attempts = downstream.attempts();
        let done = ids.iter().all(|id| attempts.get(id).is_some_and(|a| a.last().is_some_and(|(_, at)| *at >= up_at)));
        Ok((done && pending(&mut conn.clone()).await? == 0).then_some(()))
    })
    .await?;
    let _ = stop.send(());
    running.await??;
    let attempts = downstream.attempts();
    let while_down: usize = attempts.values().map(|a| a.iter().filter(|(_, at)| *at < up_at).count()).sum();
    assert!(dead_letters(&mut conn).await?.is_empty(), "breaker {breaker}");
    for id in &ids {
        let tries = &attempts[id];
        assert_eq!(tries.iter().filter(|(_, at)| *at >= up_at).count(), 1, "{id} ran once after: {tries:?}");
    }
    Ok((while_down, streamfleet_worker::Stats::get(&stats.circuit_waited)))
}
