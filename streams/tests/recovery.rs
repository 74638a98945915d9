//! The recovery sweep and dead-letter replay against a real redis-server.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use std::collections::HashMap;
use std::time::Duration;
use streamfleet_streams::deadletter::{self as dl};
use streamfleet_streams::recovery::{read_report, write_report};
use streamfleet_streams::replay::{Replayed, Selection, replay};
use streamfleet_streams::sweep::{SweepSettings, sweep};
use streamfleet_streams::{Entry, ensure_group};
use streamfleet_testbed::RedisServer;

type Conn = redis::aio::MultiplexedConnection;

async fn deliver(conn: &mut Conn, consumer: &str, id: &str, times: usize) -> Result<()> {
    for _ in 0..times {
        let _: redis::Value =
            redis::cmd("XCLAIM").arg("orders").arg("g").arg(consumer).arg(0).arg(id).query_async(conn).await?;
    }
    Ok(())
}

async fn owners(conn: &mut Conn) -> Result<HashMap<String, (String, u64)>> {
    let rows: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg("orders").arg("g").arg("-").arg("+").arg(100).query_async(conn).await?;
    Ok(rows.into_iter().map(|(id, c, _, n)| (id, (c, n))).collect())
}

async fn letters(conn: &mut Conn) -> Result<Vec<(String, HashMap<String, String>)>> {
    let r: redis::streams::StreamRangeReply = conn.xrange_all("{orders}:dead").await?;
    Ok(r.ids
        .into_iter()
        .map(|e| {
            let f = streamfleet_streams::entry::fields_from_map(e.map)
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                .collect();
            (e.id, f)
        })
        .collect())
}

#[tokio::test]
async fn sweep_dead_letters_poison_records_lost_payloads_and_leaves_the_rest() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let mut ids = Vec::new();
    for name in ["young", "poison", "lost", "busy"] {
        ids.push(conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", name), ("amount_cents", "5")]).await?);
    }
    let opts = redis::streams::StreamReadOptions::default().group("g", "w1").count(10);
    let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    deliver(&mut conn, "w1", &ids[1], 4).await?; // poison: 5 deliveries
    deliver(&mut conn, "w1", &ids[3], 4).await?; // busy: 5 deliveries...
    let poison = Entry { stream: "orders".into(), id: ids[1].clone(), fields: vec![], deliveries: 5, crashes: 0 };
    dl::record_last_error(&mut conn, &poison, "g", "transient: gateway timeout").await?;
    // The poison and the lost entry's handlers started, as a worker records
    // it: their letters can name the business key without the payload.
    let starting = [(ids[1].as_str(), 5, Some("order-poison")), (ids[2].as_str(), 1, Some("order-lost"))];
    let held = streamfleet_streams::started::record_starts(
        &mut conn,
        streamfleet_streams::ConsumerRef::new("orders", "g", "w1"),
        None,
        &starting,
    )
    .await?;
    assert_eq!(held, vec![true, true]);
    let _: i64 = conn.xdel("orders", &[&ids[2]]).await?; // lost: trimmed while pending
    tokio::time::sleep(Duration::from_millis(300)).await;
    deliver(&mut conn, "w2", &ids[3], 1).await?; // ...but a live worker just took it

    let settings = SweepSettings {
        stream: "orders",
        group: "g",
        consumer: "sweep-pod",
        dead_letter_stream: "{orders}:dead",
        min_idle: Duration::from_millis(200),
        max_deliveries: 5,
        batch: 2,
    };
    let report = sweep(&mut conn, &settings).await?;
    assert_eq!((report.scanned, report.claimed, report.dead_lettered, report.payload_lost), (3, 1, 1, 1), "{report:?}");

    let pel = owners(&mut conn).await?;
    assert_eq!(pel.len(), 2);
    assert_eq!(pel[&ids[0]], ("w1".to_string(), 1), "young entry left to the workers");
    assert_eq!(pel[&ids[3]].0, "w2", "a live worker's entry is not taken");
    let found = letters(&mut conn).await?;
    let by_source = |id: &str| found.iter().find(|(_, f)| f[dl::F_SOURCE_ID] == id).map(|(_, f)| f.clone()).unwrap();
    let p = by_source(&ids[1]);
    assert_eq!(p[dl::F_REASON], "max-deliveries");
    assert_eq!(p[dl::F_ERROR], "transient: gateway timeout");
    assert_eq!(p[dl::F_DELIVERIES], "5");
    assert_eq!(p[dl::F_CONSUMER], "w1", "the last consumer that held it");
    assert_eq!(p["order_id"], "poison");
    assert_eq!(p[dl::F_BUSINESS_KEY], "order-poison");
    let l = by_source(&ids[2]);
    assert_eq!(l[dl::F_REASON], "payload-missing");
    assert_eq!(l[dl::F_BUSINESS_KEY], "order-lost", "a loss letter names the order without its payload");
    assert_eq!(l[dl::F_CONSUMER], "w1", "the consumer that last held it");
    // What left the PEL left no entry record behind.
    let records: HashMap<String, String> =
        conn.hgetall(streamfleet_streams::keys::last_error_key("orders", "g")).await?;
    assert!(records.keys().all(|f| !f.starts_with(&ids[1]) && !f.starts_with(&ids[2])), "{records:?}");
    let consumers: redis::streams::StreamInfoConsumersReply = conn.xinfo_consumers("orders", "g").await?;
    assert!(!consumers.consumers.iter().any(|c| c.name == "sweep-pod"), "the sweep's consumer is removed");

    write_report(&mut conn, streamfleet_streams::GroupRef::new("orders", "g"), &report).await?;
    assert_eq!(read_report(&mut conn, streamfleet_streams::GroupRef::new("orders", "g")).await?, Some(report));
    assert_eq!(read_report(&mut conn, streamfleet_streams::GroupRef::new("orders", "other")).await?, None);
    Ok(())
}

/// Poison entries the sweep settles, one with a field name that is not
/// UTF-8 (redis-rs's typed replies refuse the whole page for it): each is
/// dead-lettered, that one with its field name as it was. Before, the pass
/// stopped at its page, every run, and nothing behind it was ever swept.
#[tokio::test]
async fn a_poison_entry_with_a_binary_field_name_is_dead_lettered_as_it_was_and_the_sweep_goes_on() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let binary: String =
        redis::cmd("XADD").arg("orders").arg("*").arg(b"order\xff".as_slice()).arg("1").query_async(&mut conn).await?;
    let mut ids = vec![binary.clone()];
    for i in 0..4 {
        ids.push(conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", format!("o{i}"))]).await?);
    }
    read_raw(&mut conn, "w1").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = sweep(&mut conn, &poison_sweep()).await?;
    assert_eq!((report.scanned, report.dead_lettered), (5, 5), "{report:?}");
    assert!(report.left_pending.is_empty(), "{report:?}");
    assert!(owners(&mut conn).await?.is_empty(), "all settled");
    let letters: redis::Value =
        redis::cmd("XRANGE").arg("{orders}:dead").arg("-").arg("+").query_async(&mut conn).await?;
    let letters = streamfleet_streams::entry::entries_from_value(letters)?;
    let mut lettered: Vec<String> = letters
        .iter()
        .map(|(_, f)| {
            f.iter().find(|(k, _)| k == dl::F_SOURCE_ID).map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        })
        .collect::<Option<_>>()
        .unwrap();
    lettered.sort();
    assert_eq!(lettered, ids, "every page swept");
    // On the server, the letter's field name is the entry's own bytes.
    let raw: Vec<(String, Vec<Vec<u8>>)> =
        redis::cmd("XRANGE").arg("{orders}:dead").arg("-").arg("+").query_async(&mut conn).await?;
    let with_raw_name = raw.iter().filter(|(_, f)| f.iter().step_by(2).any(|k| k.as_slice() == b"order\xff")).count();
    assert_eq!(with_raw_name, 1, "the binary entry's letter keeps its field name as it was");
    Ok(())
}

/// Reads every new entry as `consumer`, without decoding the reply.
async fn read_raw(conn: &mut Conn, consumer: &str) -> Result<()> {
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg(consumer)
        .arg("COUNT")
        .arg(100)
        .arg("STREAMS")
        .arg("orders")
        .arg(">")
        .query_async(conn)
        .await?;
    Ok(())
}

/// A Redis server with `n` entries (`order_id` `o0`, `o1`, …) read by `w1`
/// and pending: the server (stopped when dropped), a connection, their IDs.
async fn pending_orders(n: usize) -> Result<(RedisServer, Conn, Vec<String>)> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", format!("o{i}"))]).await?);
    }
    read_raw(&mut conn, "w1").await?;
    Ok((server, conn, ids))
}

/// A sweep in pages of two that dead-letters whatever was delivered once.
fn poison_sweep() -> SweepSettings<'static> {
    SweepSettings {
        stream: "orders",
        group: "g",
        consumer: "sweep-pod",
        dead_letter_stream: "{orders}:dead",
        min_idle: Duration::from_millis(200),
        max_deliveries: 1,
        batch: 2,
    }
}

/// A real connection that refuses the first script call carrying `needle`.
#[derive(Clone)]
struct RefusesOnce {
    conn: Conn,
    needle: &'static str,
    refused: bool,
}

impl redis::aio::ConnectionLike for RefusesOnce {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, redis::Value> {
        if !self.refused && String::from_utf8_lossy(&cmd.get_packed_command()).contains(self.needle) {
            self.refused = true;
            return Box::pin(async {
                Err(redis::RedisError::from((
                    redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                    "OOM injected",
                )))
            });
        }
        self.conn.req_packed_command(cmd)
    }
    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        if !self.refused && String::from_utf8_lossy(&cmd.get_packed_pipeline()).contains(self.needle) {
            self.refused = true;
            return Box::pin(async {
                Err(redis::RedisError::from((
                    redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
                    "OOM injected",
                )))
            });
        }
        self.conn.req_packed_commands(cmd, offset, count)
    }
    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

/// A page whose script fails (here the client's call is refused) is left
/// pending and named; the pages after it are still swept. Before, the whole
/// pass ended there. The next run, at once, settles it.
#[tokio::test]
async fn a_page_that_cannot_be_settled_is_left_pending_and_named_while_the_sweep_goes_on() -> Result<()> {
    let (_server, mut conn, ids) = pending_orders(5).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The first page's dead letters are the first script to write one.
    let mut refusing = RefusesOnce { conn: conn.clone(), needle: dl::F_SOURCE_ID, refused: false };
    let report = sweep(&mut refusing, &poison_sweep()).await?;
    assert!(refusing.refused, "the failure was injected");
    assert_eq!((report.scanned, report.dead_lettered), (5, 3), "{report:?}");
    assert_eq!(report.left_pending.len(), 1, "{report:?}");
    assert!(report.left_pending[0].contains(&ids[0]) && report.left_pending[0].contains("OOM injected"), "{report:?}");
    let pel = owners(&mut conn).await?;
    let mut left: Vec<&String> = pel.keys().collect();
    left.sort();
    assert_eq!(left, [&ids[0], &ids[1]], "the refused page is still pending, the rest settled");
    let again = sweep(&mut conn, &poison_sweep()).await?;
    assert_eq!((again.scanned, again.dead_lettered), (2, 2), "found again at once: {again:?}");
    assert!(owners(&mut conn).await?.is_empty());
    Ok(())
}

/// A letter Redis refuses (out of memory) acks nothing: the entries stay
/// pending, with no letter and no loss, and the call fails saying why.
#[tokio::test]
async fn dead_letters_redis_refuses_leave_their_entries_pending() -> Result<()> {
    let (_server, mut conn, ids) = pending_orders(2).await?;
    let entries: Vec<Entry> = ids
        .iter()
        .map(|id| Entry { stream: "orders".into(), id: id.clone(), fields: vec![], deliveries: 1, crashes: 0 })
        .collect();
    let letter = |reason| dl::Letter {
        group: "g",
        consumer: "w1",
        reason,
        error: "refused",
        business_key: None,
        while_pending: true,
    };
    let (refused, lost) = (letter(dl::Reason::Permanent), letter(dl::Reason::PayloadMissing));
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(1).query_async(&mut conn).await?;
    let sent: redis::RedisResult<redis::Value> =
        dl::command("{orders}:dead", &[(&entries[0], &refused), (&entries[1], &lost)]).query_async(&mut conn).await;
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(0).query_async(&mut conn).await?;
    let error = sent.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("OOM"), "refused, saying why: {error:?}");
    assert_eq!(owners(&mut conn).await?.len(), 2, "both still pending");
    let letters: u64 = conn.xlen("{orders}:dead").await?;
    assert_eq!(letters, 0, "no letter");
    let loss =
        streamfleet_streams::payload_loss::read(&mut conn, streamfleet_streams::GroupRef::new("orders", "g")).await?;
    assert_eq!(loss.total, 0, "no loss counted");
    // Once Redis accepts writes again, the same call settles both.
    let written: Vec<String> =
        dl::command("{orders}:dead", &[(&entries[0], &refused), (&entries[1], &lost)]).query_async(&mut conn).await?;
    assert!(written.iter().all(|id| !id.is_empty()), "{written:?}");
    assert!(owners(&mut conn).await?.is_empty(), "both acked");
    Ok(())
}

/// Pending entries far apart (many acked entries between them): the span
/// read stops early, and the entries past it are still checked one by one.
#[tokio::test]
async fn sweep_finds_lost_payloads_among_scattered_pending_entries() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let mut pending = Vec::new();
    for i in 0..3 {
        pending.push(conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", format!("p{i}"))]).await?);
        for j in 0..10 {
            let _: String = conn.xadd("orders", "*", &[("order_id", format!("acked-{i}-{j}"))]).await?;
        }
    }
    let opts = redis::streams::StreamReadOptions::default().group("g", "w1").count(100);
    let read: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let acked: Vec<String> = read.keys[0].ids.iter().map(|e| e.id.clone()).filter(|id| !pending.contains(id)).collect();
    let _: i64 = conn.xack("orders", "g", &acked).await?;
    let _: i64 = conn.xdel("orders", &[&pending[1]]).await?;
    let settings = SweepSettings {
        stream: "orders",
        group: "g",
        consumer: "sweep-pod",
        dead_letter_stream: "{orders}:dead",
        min_idle: Duration::ZERO,
        max_deliveries: 5,
        batch: 2,
    };
    let report = sweep(&mut conn, &settings).await?;
    assert_eq!((report.scanned, report.payload_lost, report.dead_lettered), (3, 1, 0), "{report:?}");
    let pel = owners(&mut conn).await?;
    assert_eq!(
        pel.keys().cloned().collect::<std::collections::BTreeSet<_>>(),
        [pending[0].clone(), pending[2].clone()].into()
    );
    let found = letters(&mut conn).await?;
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].1[dl::F_SOURCE_ID], pending[1]);
    Ok(())
}

/// A poison entry with more fields than a script can pass at once is
/// dead-lettered packed, and comes back as it was.
#[tokio::test]
async fn a_huge_poison_entry_is_dead_lettered_packed_and_reads_back_whole() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let fields: Vec<(String, String)> = (0..5_000).map(|i| (format!("f{i:05}"), format!("v{i}"))).collect();
    let id: String = conn.xadd("orders", "*", &fields).await?;
    read_raw(&mut conn, "w1").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = sweep(&mut conn, &poison_sweep()).await?;
    assert_eq!((report.dead_lettered, report.left_pending.len()), (1, 0), "{report:?}");
    let found = letters(&mut conn).await?;
    assert_eq!(found.len(), 1);
    let letter = &found[0].1;
    assert_eq!(letter[dl::F_SOURCE_ID], id);
    let own: Vec<(&String, &String)> = letter.iter().filter(|(k, _)| !k.starts_with(dl::PREFIX)).collect();
    assert_eq!(own.len(), 5_000, "every field, unpacked on reading");
    assert!(fields.iter().all(|(k, v)| letter.get(k) == Some(v)));
    Ok(())
}

/// A pending entry whose payload is gone while its owner renews holds
/// (a producer's `MAXLEN` trim under a live worker) is in that worker's
/// hands: the sweep records no loss. Once the owner falls silent, it does.
#[tokio::test]
async fn a_gone_payload_whose_owner_lives_is_not_a_loss_for_the_sweep() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let id: String = conn.xadd("orders", "*", &[("order_id", "o1")]).await?;
    read_raw(&mut conn, "w1").await?;
    let _: i64 = conn.xdel("orders", &[&id]).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let now_ms = secs * 1000 + micros / 1000;
    let alive = streamfleet_streams::keys::alive_key("orders", "g");
    let _: i64 = conn.zadd(&alive, "w1", now_ms).await?;
    let settings = SweepSettings { max_deliveries: 5, ..poison_sweep() };
    let report = sweep(&mut conn, &settings).await?;
    assert_eq!((report.scanned, report.payload_lost), (1, 0), "{report:?}");
    assert_eq!(owners(&mut conn).await?.len(), 1, "still the owner's");
    // w1 last beat a second ago; w2 beats now (a group with nobody beating
    // would be a stalled server's, and wait).
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let now_ms = secs * 1000 + micros / 1000;
    let _: i64 = conn.zadd(&alive, "w1", now_ms - 1_000).await?;
    let _: i64 = conn.zadd(&alive, "w2", now_ms).await?;
    let report = sweep(&mut conn, &settings).await?;
    assert_eq!(report.payload_lost, 1, "silent for min-idle-time: lost, {report:?}");
    assert!(owners(&mut conn).await?.is_empty());
    Ok(())
}

/// Redis refuses the letters (out of memory): the page stays pending and
/// is named, nothing is counted as written, no loss is recorded; once Redis
/// takes writes again the next run settles it.
#[tokio::test]
async fn letters_redis_refuses_leave_the_sweeps_page_pending_and_counted_as_nothing() -> Result<()> {
    let (_server, mut conn, ids) = pending_orders(2).await?;
    // A first look, settling nothing, records the server's epoch (a write
    // Redis would refuse first otherwise): then the letters are the
    // script's first write.
    let look =
        sweep(&mut conn, &SweepSettings { min_idle: Duration::ZERO, max_deliveries: 9, ..poison_sweep() }).await?;
    assert_eq!((look.scanned, look.dead_lettered), (2, 0));
    // The first entry lost (its letter is the loss record's), the second poison.
    let _: i64 = conn.xdel("orders", &[&ids[0]]).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(1).query_async(&mut conn).await?;
    let refused = sweep(&mut conn, &poison_sweep()).await;
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(0).query_async(&mut conn).await?;
    let refused = refused?;
    assert_eq!((refused.dead_lettered, refused.payload_lost), (0, 0), "{refused:?}");
    assert_eq!(refused.left_pending.len(), 1, "{refused:?}");
    let why = &refused.left_pending[0];
    assert!(why.contains("a dead letter was refused") && why.contains("OOM"), "named, saying why: {refused:?}");
    assert_eq!(owners(&mut conn).await?.len(), 2, "both still pending");
    let letters: u64 = conn.xlen("{orders}:dead").await?;
    assert_eq!(letters, 0);
    let again = sweep(&mut conn, &poison_sweep()).await?;
    assert_eq!((again.dead_lettered, again.payload_lost), (1, 1), "{again:?}");
    assert!(owners(&mut conn).await?.is_empty());
    Ok(())
}

/// A worker's claim step that meets a gone payload while Redis refuses
/// writes (out of memory) records nothing and fails saying why: no letter,
/// no loss counted, the entry still pending. Once Redis takes writes
/// again, the same step records it once.
#[tokio::test]
async fn a_claim_step_whose_loss_letter_is_refused_records_nothing() -> Result<()> {
    let (_server, mut conn, ids) = pending_orders(1).await?;
    // A first look records the server's epoch, so the letter is the
    // claim's first write.
    let look =
        sweep(&mut conn, &SweepSettings { min_idle: Duration::ZERO, max_deliveries: 9, ..poison_sweep() }).await?;
    assert_eq!(look.scanned, 1);
    let _: i64 = conn.xdel("orders", &[&ids[0]]).await?;
    let loss =
        streamfleet_streams::claim::LossRecord { dead_letter_stream: "{orders}:dead", consumer: "w2", why: "gone" };
    let who = streamfleet_streams::ConsumerRef::new("orders", "g", "w2");
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(1).query_async(&mut conn).await?;
    let refused = streamfleet_streams::claim::autoclaim(&mut conn, who, &loss, Duration::ZERO, "0-0", 10).await;
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(0).query_async(&mut conn).await?;
    let error = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("OOM"), "refused, saying why: {error:?}");
    let letters: u64 = conn.xlen("{orders}:dead").await?;
    assert_eq!(letters, 0, "no letter");
    let group = streamfleet_streams::GroupRef::new("orders", "g");
    assert_eq!(streamfleet_streams::payload_loss::read(&mut conn, group).await?.total, 0, "no loss counted");
    assert_eq!(owners(&mut conn).await?.len(), 1, "still pending");
    let claimed = streamfleet_streams::claim::autoclaim(&mut conn, who, &loss, Duration::ZERO, "0-0", 10).await?;
    assert_eq!(claimed.deleted, vec![ids[0].clone()]);
    assert_eq!(streamfleet_streams::payload_loss::read(&mut conn, group).await?.total, 1);
    assert!(owners(&mut conn).await?.is_empty());
    Ok(())
}

/// A page whose span read stops short (acked entries between its pending
/// ones): an entry past where it stopped that still has its payload is
/// looked up, not taken for lost; only the deleted one is recorded.
#[tokio::test]
async fn an_entry_past_a_short_span_read_is_looked_up_not_taken_for_lost() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let mut pending = Vec::new();
    for i in 0..3 {
        pending.push(conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", format!("p{i}"))]).await?);
        for j in 0..10 {
            let _: String = conn.xadd("orders", "*", &[("order_id", format!("acked-{i}-{j}"))]).await?;
        }
    }
    let opts = redis::streams::StreamReadOptions::default().group("g", "w1").count(100);
    let read: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
    let acked: Vec<String> = read.keys[0].ids.iter().map(|e| e.id.clone()).filter(|id| !pending.contains(id)).collect();
    let _: i64 = conn.xack("orders", "g", &acked).await?;
    let _: i64 = conn.xdel("orders", &[&pending[2]]).await?;
    // One page of all three; its span read (6 entries at most) stops among
    // the acked ones after p0.
    let settings = SweepSettings { min_idle: Duration::ZERO, max_deliveries: 5, batch: 3, ..poison_sweep() };
    let report = sweep(&mut conn, &settings).await?;
    assert_eq!((report.scanned, report.payload_lost, report.dead_lettered), (3, 1, 0), "{report:?}");
    let mut left: Vec<String> = owners(&mut conn).await?.into_keys().collect();
    left.sort();
    assert_eq!(left, pending[..2].to_vec(), "p1 still has its payload: the workers'");
    let found = letters(&mut conn).await?;
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].1[dl::F_SOURCE_ID], pending[2]);
    Ok(())
}

#[tokio::test]
async fn replay_requeues_original_fields_and_removes_the_dead_letter() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let (mut dead, mut source_ids) = (Vec::new(), Vec::new());
    for (i, reason) in
        [dl::Reason::Permanent, dl::Reason::Permanent, dl::Reason::PayloadMissing].into_iter().enumerate()
    {
        let id = conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", format!("o{i}"))]).await?;
        source_ids.push(id.clone());
        let opts = redis::streams::StreamReadOptions::default().group("g", "w").count(1);
        let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
        let fields = if reason == dl::Reason::PayloadMissing {
            vec![]
        } else {
            vec![("order_id".to_string(), format!("o{i}").into_bytes())]
        };
        let entry = Entry { stream: "orders".into(), id, fields, deliveries: 1, crashes: 0 };
        let key = format!("o{i}");
        let letter = dl::Letter {
            group: "g",
            consumer: "w",
            reason,
            error: "no",
            business_key: Some(&key),
            while_pending: false,
        };
        dead.push(dl::dead_letter(&mut conn, "{orders}:dead", &entry, &letter).await?.unwrap());
    }
    let before: usize = conn.xlen("orders").await?;

    let dry = replay(&mut conn, "{orders}:dead", &Selection::All, true).await?;
    assert_eq!(dry.iter().filter(|r| matches!(r, Replayed::Requeued { .. })).count(), 2);
    assert_eq!(letters(&mut conn).await?.len(), 3, "a dry run changes nothing");

    let one = replay(&mut conn, "{orders}:dead", &Selection::Ids(vec![dead[0].clone(), "1-1".into()]), false).await?;
    let Replayed::Requeued { new_id, business_key, source_stream, .. } = &one[0] else { panic!("{one:?}") };
    assert_eq!((source_stream.as_str(), business_key.as_deref()), ("orders", Some("o0")));
    assert!(matches!(&one[1], Replayed::Skipped { why, .. } if why == "not found"));
    let requeued: redis::streams::StreamRangeReply = conn.xrange("orders", new_id, new_id).await?;
    let fields = streamfleet_streams::entry::fields_from_map(requeued.ids[0].map.clone());
    assert_eq!(
        fields,
        vec![
            ("order_id".to_string(), b"o0".to_vec()),
            (streamfleet_streams::entry::F_EVENT_ID.to_string(), source_ids[0].clone().into_bytes()),
            (streamfleet_streams::replay::F_REPLAY_FOR.to_string(), b"g".to_vec()),
            (streamfleet_streams::replay::F_REPLAY_OF.to_string(), dead[0].clone().into_bytes()),
        ],
        "original fields, addressed to the letter's group"
    );

    let rest =
        replay(&mut conn, "{orders}:dead", &Selection::Range { from: "-".into(), to: "+".into() }, false).await?;
    assert!(matches!(&rest[0], Replayed::Requeued { business_key, .. } if business_key.as_deref() == Some("o1")));
    assert!(matches!(&rest[1], Replayed::Skipped { why, .. } if why.contains("payload-missing")));
    let left = letters(&mut conn).await?;
    assert_eq!(left.len(), 1, "only the payload-missing record stays");
    let after: usize = conn.xlen("orders").await?;
    assert_eq!(after, before + 2);
    Ok(())
}

/// Replay clears a `processing` mark only when its owner was declared dead:
/// a live holder's mark stands, so the replay cannot run beside it.
#[tokio::test]
async fn replay_clears_only_a_dead_owners_mark() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    ensure_group(&mut conn, "orders", "g", "0").await?;
    let mut letters_by_key = Vec::new();
    for key in ["alive", "gone"] {
        let id = conn.xadd::<_, _, _, _, String>("orders", "*", &[("order_id", key)]).await?;
        let opts = redis::streams::StreamReadOptions::default().group("g", "w").count(1);
        let _: redis::streams::StreamReadReply = conn.xread_options(&["orders"], &[">"], &opts).await?;
        let entry = Entry {
            stream: "orders".into(),
            id,
            fields: vec![("order_id".into(), key.into())],
            deliveries: 1,
            crashes: 0,
        };
        let letter = dl::Letter {
            group: "g",
            consumer: "w",
            reason: dl::Reason::Permanent,
            error: "no",
            business_key: Some(key),
            while_pending: false,
        };
        letters_by_key.push(dl::dead_letter(&mut conn, "{orders}:dead", &entry, &letter).await?.unwrap());
    }
    let _: () = conn.set("{orders}:idem:g:alive", "processing:live-1:7").await?;
    let _: () = conn.set("{orders}:idem:g:gone", "processing:dead-1:8").await?;
    let _: i64 = conn.zadd(streamfleet_streams::keys::dead_consumers_key("orders", "g"), "dead-1", 1).await?;
    let replayed = replay(&mut conn, "{orders}:dead", &Selection::All, false).await?;
    assert!(replayed.iter().all(|r| matches!(r, Replayed::Requeued { .. })), "{replayed:?}");
    let alive: Option<String> = conn.get("{orders}:idem:g:alive").await?;
    let gone: Option<String> = conn.get("{orders}:idem:g:gone").await?;
    assert_eq!(alive.as_deref(), Some("processing:live-1:7"), "a live holder's mark stands");
    assert_eq!(gone, None, "a dead owner's mark is cleared");
    Ok(())
}
