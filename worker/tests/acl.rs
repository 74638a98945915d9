//! The Redis ACL user of `docs/redis-acl.txt` is enough for streamfleet, and
//! no more: on a real redis-server, the user that line creates runs every
//! Redis flow of the worker library (guard on), the recovery sweep, the
//! operator (group lifecycle, health poll, payload-loss and recovery
//! records, retention, dead-letter cap, reaping) and the dead-letter tool;
//! Redis's `ACL LOG` records no refusal (so not even an error some caller
//! swallows), every command the line allows was used, and commands outside
//! it are refused; again with the keys narrowed as the docs describe. On a
//! Redis Cluster the same user runs a pipeline and follows a slot
//! migration. The line is read from the file the docs show, and the
//! commands the code sends are checked against it.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::aio::MultiplexedConnection;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;
use streamfleet_streams::deadletter as dl;
use streamfleet_streams::dlq::{self, Filter};
use streamfleet_streams::health::{self, Lag};
use streamfleet_streams::replay::{Replayed, Selection, replay};
use streamfleet_streams::retention::{self, StreamId};
use streamfleet_streams::sweep::{SweepSettings, sweep};
use streamfleet_streams::{
    GroupCreation, RunMode, StreamConnection, consumers, payload_loss, recovery, shard, version,
};
use streamfleet_testbed::redis_server::{calls_between, command_calls};
use streamfleet_testbed::{RedisServer, eventually};
use streamfleet_worker::{Stats, Worker};

mod common;
use common::{Scripted, T, config_at as config, spawn};

const PASSWORD: &str = "s3cr3t-acl-test";
const DEAD: &str = "{orders}:dead:g";
/// Commands only a Redis Cluster connection sends (redis-rs: `PING` on each
/// new node connection, `CLUSTER SLOTS` for the slot map, `ASKING` to follow
/// an `ASK` redirection); a standalone run cannot use them.
const CLUSTER_ONLY: &[&str] = &["ping", "cluster|slots", "asking"];
/// Commands the client library sends on its own for the code's scripts.
const LIBRARY: &[&str] = &["evalsha", "script|load"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The ACL line, as `docs/redis-acl.txt` keeps it.
fn acl_line() -> String {
    let text = std::fs::read_to_string(root().join("docs/redis-acl.txt")).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("ACL SETUSER ")).collect();
    assert_eq!(lines.len(), 1, "docs/redis-acl.txt holds exactly one ACL line");
    lines[0].trim().to_string()
}

/// The commands (and `command|subcommand`s) the line allows.
fn allowed(line: &str) -> BTreeSet<String> {
    line.split_whitespace().filter_map(|w| w.strip_prefix('+')).map(str::to_lowercase).collect()
}

/// `ACL SETUSER` arguments for `user`, from the line: the password filled
/// in, and the keys narrowed to `keys` when given.
fn setuser_args(line: &str, user: &str, keys: Option<&[&str]>) -> Vec<String> {
    let mut words = line.split_whitespace();
    assert_eq!((words.next(), words.next(), words.next()), (Some("ACL"), Some("SETUSER"), Some("streamfleet")));
    let mut args = vec![user.to_string()];
    for w in words {
        match (w, keys) {
            (">PASSWORD", _) => args.push(format!(">{PASSWORD}")),
            ("~*", Some(keys)) => args.extend(keys.iter().map(|k| format!("~{k}"))),
            _ => args.push(w.to_string()),
        }
    }
    args
}

#[test]
fn the_docs_show_the_acl_line_of_the_file() {
    let line = acl_line();
    let page = std::fs::read_to_string(root().join("docs/security.md")).unwrap();
    assert!(page.lines().any(|l| l.trim() == line), "docs/security.md must show the line of docs/redis-acl.txt");
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(readme.contains("docs/security.md"), "the README links the page");
    assert!(line.contains(">PASSWORD") && line.contains(" -@all "), "{line}");
}

/// Commands the library code sends, as written in it: `cmd("X")` (with its
/// subcommand for container commands), and Lua's `redis.call('X'` and
/// `{'X', ...}` argument tables.
fn commands_in(source: &str) -> BTreeSet<String> {
    const CONTAINERS: &[&str] = &["xinfo", "xgroup", "script", "cluster", "client", "config", "object", "memory"];
    let mut out = BTreeSet::new();
    let patterns: [(&str, char); 4] = [("cmd(\"", '"'), ("redis.call('", '\''), ("{'", '\''), ("{{'", '\'')];
    for (open, quote) in patterns {
        for (at, _) in source.match_indices(open) {
            let rest = &source[at + open.len()..];
            let Some(end) = rest.find(quote) else { continue };
            let name = &rest[..end];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_uppercase()) {
                continue;
            }
            let name = name.to_lowercase();
            if !CONTAINERS.contains(&name.as_str()) {
                out.insert(name);
                continue;
            }
            // The subcommand: the next quoted word.
            let after = &rest[end + 1..];
            let sub = after
                .find(quote)
                .map(|s| &after[s + 1..])
                .and_then(|s| s.find(quote).map(|e| s[..e].to_lowercase()))
                .unwrap_or_default();
            out.insert(format!("{name}|{sub}"));
        }
    }
    out
}

fn rust_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            // Example binaries are users' code, not streamfleet's.
            if path.file_name() != Some("bin".as_ref()) {
                rust_sources(&path, out);
            }
        } else if path.extension() == Some("rs".as_ref()) {
            out.push(path);
        }
    }
}

#[test]
fn every_command_the_code_sends_is_in_the_acl_line_and_nothing_else() {
    let allowed = allowed(&acl_line());
    let mut files = Vec::new();
    for dir in ["streams/src", "worker/src", "operator/src"] {
        rust_sources(&root().join(dir), &mut files);
    }
    let mut sent: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in &files {
        let source = std::fs::read_to_string(file).unwrap();
        // Unit tests may send what they like to their own servers.
        let source = source.split("#[cfg(test)]").next().unwrap_or_default();
        for command in commands_in(source) {
            sent.entry(command).or_default().push(file.display().to_string());
        }
    }
    assert!(sent.contains_key("xreadgroup") && sent.contains_key("xinfo|groups"), "the scan finds commands: {sent:?}");
    let missing: Vec<_> =
        sent.iter().filter(|(c, _)| !allowed.contains(*c) && !allowed.contains(c.split('|').next().unwrap())).collect();
    assert!(missing.is_empty(), "sent by the code but not in docs/redis-acl.txt: {missing:?}");
    let unused: Vec<_> = allowed
        .iter()
        .filter(|a| !sent.contains_key(*a) && !LIBRARY.contains(&a.as_str()) && !CLUSTER_ONLY.contains(&a.as_str()))
        .collect();
    assert!(unused.is_empty(), "allowed by docs/redis-acl.txt but sent by no code: {unused:?}");
}

/// Everything streamfleet does with Redis, as the user of `url`.
struct Flows {
    url: String,
    conn: StreamConnection,
}

impl Flows {
    /// A producer's send (`shard::send`, one shard).
    async fn add(&mut self, kind: &str, key: &str) -> Result<String> {
        Ok(shard::send(&mut self.conn, "orders", 1, key, &[("kind", kind.as_bytes()), ("key", key.as_bytes())]).await?)
    }

    /// A producer's send of one event (`shard::send_event`, which stamps
    /// `streamfleet.event-id`): sent twice, it is one event.
    async fn add_event(&mut self, kind: &str, key: &str, event: &str) -> Result<String> {
        let fields: [(&str, &[u8]); 2] = [("kind", kind.as_bytes()), ("key", key.as_bytes())];
        Ok(shard::send_event(&mut self.conn, "orders", 1, key, event, &fields).await?)
    }

    /// Some other consumer's read (a pod that then dies, say).
    async fn read_as(&mut self, consumer: &str, count: usize) -> Result<Vec<String>> {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg(consumer)
            .arg("COUNT")
            .arg(count)
            .arg("STREAMS")
            .arg("orders")
            .arg(">")
            .query_async(&mut self.conn)
            .await?;
        Ok(reply.keys.into_iter().flat_map(|k| k.ids).map(|e| e.id).collect())
    }

    async fn delete(&mut self, id: &str) -> Result<()> {
        let n: u64 = redis::cmd("XDEL").arg("orders").arg(id).query_async(&mut self.conn).await?;
        assert_eq!(n, 1);
        Ok(())
    }

    async fn pending(&mut self) -> Result<usize> {
        let p: redis::streams::StreamPendingReply =
            redis::cmd("XPENDING").arg("orders").arg("g").query_async(&mut self.conn).await?;
        Ok(p.count())
    }

    async fn letters(&mut self, reason: &str) -> Result<Vec<dlq::DeadLetter>> {
        let filter = Filter { reasons: vec![reason.into()], ..Filter::default() };
        Ok(dlq::all(&mut self.conn, DEAD, &filter).await?)
    }

    async fn run(&mut self) -> Result<()> {
        let conn = &mut self.conn;

        // The operator creates the group, and the stream with it.
        assert_eq!(streamfleet_streams::ensure_group(conn, "orders", "g", "0").await?, GroupCreation::Created);
        assert_eq!(streamfleet_streams::ensure_group(conn, "orders", "g", "0").await?, GroupCreation::AlreadyExisted);
        assert!(version::server_version(conn).await?.is_some());

        // A pod read three entries and died; one of them lost its payload.
        let abandoned = [self.add("ok", "a1").await?, self.add("ok", "a2").await?, self.add("ok", "a3").await?];
        assert_eq!(self.read_as("dead-pod", 3).await?, abandoned);
        self.delete(&abandoned[2]).await?;
        // Another dead pod, released by the operator's reaper; it had marked
        // its first entry processing, and the second lost its payload.
        let released = [self.add("ok", "b1").await?, self.add("ok", "b2").await?];
        assert_eq!(self.read_as("dead-pod-2", 2).await?, released);
        let () = redis::cmd("SET")
            .arg(streamfleet_streams::keys::guard_key("orders", "g", "b1"))
            .arg("processing:dead-pod-2:1")
            .arg("PX")
            .arg(60_000)
            .query_async(&mut self.conn)
            .await?;
        self.delete(&released[1]).await?;
        let idle = Duration::from_millis(300);
        // Released when no longer fresh (a dead pod's entries are not), and
        // not yet claimable.
        let release_idle = Duration::from_secs(1);
        tokio::time::sleep(streamfleet_streams::started::hold_proof_window(release_idle)).await;
        let r = consumers::release_pending(
            &mut self.conn,
            streamfleet_streams::ConsumerRef::new("orders", "g", "dead-pod-2"),
            DEAD,
            release_idle,
            10,
        )
        .await?;
        assert_eq!((r.released, r.payload_lost), (1, 1));
        // The worker's own entry from before it restarted.
        let own = self.add("ok", "own").await?;
        assert_eq!(self.read_as("c1", 1).await?, std::slice::from_ref(&own));
        // New work: successes, a duplicate event, a refusal, a dependency
        // that stays down, and a handler that hangs.
        let fine = [self.add_event("ok", "k1", "event-1").await?, self.add("ok", "k2").await?];
        let duplicate = self.add_event("ok", "k1", "event-1").await?;
        let refused = self.add("refused", "r1").await?;
        let down = self.add("down", "d1").await?;
        let hung = self.add("wait", "w1").await?;

        // The worker, with the guard: takes back its own entry, claims the
        // abandoned and released ones (recording the lost one), holds its
        // batch while the hung handler runs (extended every third of
        // min-idle-time, 200 ms, until its deadline at half, 300 ms),
        // retries, dead-letters, suppresses the duplicate.
        let handler = Scripted::default();
        let worker = Worker::new(config(&self.url, "c1", 600, 2), handler.clone())
            .with_idempotency_guard(Duration::from_secs(600));
        let stats = worker.stats();
        let (stop, run) = spawn(worker);
        eventually("all settled", T, || async {
            let mut conn = self.conn.clone();
            let p: redis::streams::StreamPendingReply =
                redis::cmd("XPENDING").arg("orders").arg("g").query_async(&mut conn).await?;
            let dead: u64 = redis::cmd("XLEN").arg(DEAD).query_async(&mut conn).await?;
            Ok((p.count() == 0 && dead == 5 && Stats::get(&stats.suppressed) == 1).then_some(()))
        })
        .await?;
        let _ = stop.send(());
        tokio::time::timeout(Duration::from_secs(10), run).await???;
        for id in [&abandoned[0], &abandoned[1], &released[0], &own, &fine[0], &fine[1]] {
            assert_eq!(handler.calls(id), 1, "{id}");
        }
        assert_eq!(self.letters("retries-exhausted").await?.len(), 2, "the dependency down, the hung handler");
        assert_eq!(handler.calls(&duplicate), 0, "the duplicate event is suppressed");
        assert_eq!(handler.calls(&abandoned[2]), 0);
        assert_eq!(self.letters("permanent").await?[0].source_id.as_ref(), Some(&refused));
        let gave_up: Vec<_> =
            self.letters("retries-exhausted").await?.into_iter().filter_map(|l| l.source_id).collect();
        assert_eq!(gave_up, [down, hung]);
        assert_eq!(self.letters("payload-missing").await?.len(), 2);
        assert_eq!(Stats::get(&stats.payload_missing), 1);

        // Shutdown with a handler running and two entries not started: those
        // are handed back, claimable at once.
        let held = self.add("wait", "h1").await?;
        let queued = [self.add("ok", "h2").await?, self.add("ok", "h3").await?];
        let handler = Scripted::default();
        // (Ten seconds of min-idle-time: the running handler's deadline is five.)
        let mut c = config(&self.url, "c2", 10_000, 5);
        c.concurrency = 1;
        let (stop, run) = spawn(Worker::new(c, handler.clone()).with_idempotency_guard(Duration::from_secs(600)));
        eventually("the first handler runs", T, || async { Ok((handler.calls(&held) == 1).then_some(())) }).await?;
        let _ = stop.send(());
        tokio::time::sleep(Duration::from_millis(300)).await;
        handler.release.notify_one();
        tokio::time::timeout(Duration::from_secs(10), run).await???;
        assert_eq!(self.pending().await?, 2, "the two not started are handed back");

        // Recovery mode claims them, runs them, and writes its report.
        let handler = Scripted::default();
        let mut c = config(&self.url, "recovery-pod", 300, 5);
        c.mode = RunMode::Recovery;
        let worker = Worker::new(c, handler.clone()).with_idempotency_guard(Duration::from_secs(600));
        tokio::time::timeout(T, worker.run(std::future::pending())).await??;
        for id in &queued {
            assert_eq!(handler.calls(id), 1, "{id}");
        }
        assert_eq!(self.pending().await?, 0);
        assert!(
            recovery::read_report(&mut self.conn, streamfleet_streams::GroupRef::new("orders", "g")).await?.is_some()
        );

        // The sweep: two poison entries far apart in the stream (a page
        // spanning acked entries checks payloads in a script) and a lost one.
        let poison = self.add("ok", "p1").await?;
        assert_eq!(self.read_as("dead-pod-3", 1).await?, std::slice::from_ref(&poison));
        for i in 0..5 {
            self.add("ok", &format!("f{i}")).await?;
        }
        let done = self.read_as("filler-pod", 5).await?;
        let _: u64 = redis::cmd("XACK").arg("orders").arg("g").arg(&done).query_async(&mut self.conn).await?;
        let far = self.add("ok", "p2").await?;
        assert_eq!(self.read_as("dead-pod-3", 1).await?, [far]);
        let gone = self.add("ok", "p3").await?;
        assert_eq!(self.read_as("dead-pod-3", 1).await?, std::slice::from_ref(&gone));
        self.delete(&gone).await?;
        tokio::time::sleep(Duration::from_millis(350)).await;
        let settings = SweepSettings {
            stream: "orders",
            group: "g",
            consumer: "sweeper",
            dead_letter_stream: DEAD,
            min_idle: idle,
            max_deliveries: 1,
            batch: 2,
        };
        let report = sweep(&mut self.conn, &settings).await?;
        assert_eq!((report.scanned, report.dead_lettered, report.payload_lost), (3, 2, 1));
        recovery::write_report(&mut self.conn, streamfleet_streams::GroupRef::new("orders", "g"), &report).await?;
        assert_eq!(
            recovery::read_report(&mut self.conn, streamfleet_streams::GroupRef::new("orders", "g"))
                .await?
                .map(|r| r.dead_lettered),
            Some(2)
        );

        // The operator's poll. An entry deleted before the group read it
        // makes Redis report the lag as NULL: the poll counts it.
        let late = [self.add("ok", "l1").await?, self.add("ok", "l2").await?];
        self.delete(&late[0]).await?;
        let conn = &mut self.conn;
        let snapshot = health::inspect(conn, streamfleet_streams::GroupRef::new("orders", "g"), DEAD)
            .await?
            .expect("the group exists");
        assert_eq!(snapshot.lag, Lag::Known(1));
        assert_eq!(snapshot.dead_letter_length, 8);
        assert_eq!(payload_loss::read(conn, streamfleet_streams::GroupRef::new("orders", "g")).await?.total, 3);
        let now = recovery::now_ms();
        assert!(retention::target(conn, "orders", Some(1), None, now).await?.is_some());
        assert!(retention::safe_floor(conn, "orders").await?.is_some());
        let trim = retention::enforce(conn, "orders", Some(1), Some(1), now).await?;
        assert!(trim.blocked && trim.trimmed > 0, "{trim:?}");
        assert_eq!(retention::trim_to(conn, "orders", StreamId { ms: now, seq: 0 }).await?, 0, "held at the floor");
        assert_eq!(dlq::cap(conn, DEAD, 1000).await?, 0);
        assert!(
            consumers::delete_if_empty(conn, streamfleet_streams::ConsumerRef::new("orders", "g", "dead-pod")).await?,
            "owns nothing any more"
        );

        // The dead-letter tool: list, show, stats, replay, purge.
        let page =
            dlq::page(conn, DEAD, &Filter { reasons: vec!["permanent".into()], ..Filter::default() }, None, 10).await?;
        let letter = &page.letters[0];
        assert_eq!(letter.business_key.as_deref(), Some("r1"));
        assert_eq!(dlq::show(conn, DEAD, &letter.id).await?.as_ref(), Some(letter));
        let everything = dlq::all(conn, DEAD, &Filter::default()).await?;
        assert_eq!(dlq::Stats::of(&everything).total, 8);
        let ids = Selection::Ids(vec![letter.id.clone()]);
        assert!(matches!(&replay(conn, DEAD, &ids, true).await?[..], [Replayed::Requeued { .. }]));
        let replayed = replay(conn, DEAD, &ids, false).await?;
        assert!(matches!(&replayed[..], [Replayed::Requeued { new_id, .. }] if new_id.contains('-')), "{replayed:?}");
        let lost: Vec<String> = self.letters("payload-missing").await?.into_iter().map(|l| l.id).collect();
        assert_eq!(lost.len(), 3);
        assert_eq!(dlq::purge(&mut self.conn, DEAD, &lost).await?, 3);
        assert!(self.letters(dl::Reason::Permanent.as_str()).await?.is_empty(), "the replayed letter is gone");
        assert_eq!(dlq::all(&mut self.conn, DEAD, &Filter::default()).await?.len(), 4, "the purged ones too");

        // Another team's group, and ours on deletion with `deletionPolicy: Delete`.
        let conn = &mut self.conn;
        streamfleet_streams::ensure_group(conn, "orders", "other", "$").await?;
        assert!(streamfleet_streams::destroy_group(conn, "orders", "other").await?);
        assert!(streamfleet_streams::destroy_group(conn, "orders", "g").await?);
        Ok(())
    }
}

/// Refusals `ACL LOG` recorded, as (reason, object), after `ACL LOG RESET`.
/// A client's `CLIENT SETINFO` on Redis 7.2+ (refused, ignored by the client,
/// see docs/security.md) is left out.
async fn refusals(admin: &mut MultiplexedConnection) -> Result<Vec<(String, String)>> {
    let entries: Vec<HashMap<String, redis::Value>> = redis::cmd("ACL").arg("LOG").query_async(admin).await?;
    let text = |e: &HashMap<String, redis::Value>, k: &str| match e.get(k) {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        other => format!("{other:?}"),
    };
    Ok(entries
        .iter()
        .map(|e| (text(e, "reason"), text(e, "object")))
        .filter(|(_, object)| object != "client|setinfo")
        .collect())
}

/// Creates the user, runs every flow as it, and checks what Redis saw.
async fn run_as_acl_user(keys: Option<&[&str]>) -> Result<()> {
    let server = RedisServer::start().await?;
    let mut admin = server.connection().await?;
    let line = acl_line();
    let () =
        redis::cmd("ACL").arg("SETUSER").arg(setuser_args(&line, "streamfleet", keys)).query_async(&mut admin).await?;
    let () = redis::cmd("ACL").arg("LOG").arg("RESET").query_async(&mut admin).await?;
    let before = command_calls(&mut admin).await?;

    let url = format!("redis://streamfleet:{PASSWORD}@127.0.0.1:{}/", server.port);
    let endpoint = streamfleet_streams::Endpoint::new(url.clone(), streamfleet_streams::Mode::Standalone);
    let conn = StreamConnection::connect(&endpoint).await?;
    let mut flows = Flows { url, conn };
    let started = std::time::Instant::now();
    if let Err(e) = flows.run().await {
        let refused = refusals(&mut admin).await?;
        return Err(e.context(format!("Redis refused the ACL user (reason, object): {refused:?}")));
    }
    eprintln!("every flow as the ACL user in {:?}", started.elapsed());

    let refused = refusals(&mut admin).await?;
    assert!(refused.is_empty(), "Redis refused the ACL user (reason, object): {refused:?}");
    let used = calls_between(&before, &command_calls(&mut admin).await?);
    // INFO is what `command_calls` itself sends, so it leaves INFO out; the
    // user's `server_version` in the flows is INFO, and it answered.
    let unused: Vec<String> = allowed(&line)
        .into_iter()
        .filter(|c| !used.contains_key(c) && !CLUSTER_ONLY.contains(&c.as_str()) && c != "info")
        .collect();
    assert!(unused.is_empty(), "allowed but never used by any flow: {unused:?} (used: {used:?})");

    // And nothing else: administration, key listing, an operation on the
    // group streamfleet never does, the same from inside a script.
    let conn = &mut flows.conn;
    let _: String = redis::cmd("XADD").arg("orders").arg("*").arg("f").arg("v").query_async(conn).await?;
    let len: u64 = redis::cmd("XLEN").arg("orders").query_async(&mut admin).await?;
    let refused = [
        redis::cmd("FLUSHALL"),
        redis::cmd("CONFIG").arg("GET").arg("maxmemory").clone(),
        redis::cmd("KEYS").arg("*").clone(),
        redis::cmd("XGROUP").arg("SETID").arg("orders").arg("g").arg("0").clone(),
        redis::cmd("EVAL").arg("return redis.call('FLUSHALL')").arg(0).clone(),
    ];
    for cmd in &refused {
        let e = cmd.query_async::<redis::Value>(conn).await.expect_err("refused");
        // NOPERM, or from a script the error the refused call raised there
        // (Redis: "can't run this command"; Valkey: "no permissions to run").
        let text = e.to_string();
        assert!(
            e.code() == Some("NOPERM")
                || text.contains("can't run this command")
                || text.contains("ACL failure in script: User streamfleet has no permissions to run"),
            "{e}"
        );
    }
    let after: u64 = redis::cmd("XLEN").arg("orders").query_async(&mut admin).await?;
    assert_eq!(after, len, "nothing was flushed");
    let mut expected = vec!["flushall", "config|get", "keys", "xgroup|setid", "flushall"];
    if keys.is_some() {
        let e = redis::cmd("GET").arg("elsewhere").query_async::<Option<String>>(conn).await.expect_err("refused");
        assert_eq!(e.code(), Some("NOPERM"), "{e}");
        expected.push("elsewhere");
    }
    let mut objects: Vec<String> = refusals(&mut admin).await?.into_iter().map(|(_, object)| object).collect();
    objects.sort();
    expected.sort_unstable();
    assert_eq!(objects, expected, "ACL LOG records each refusal");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_acl_user_runs_every_flow_and_nothing_else() -> Result<()> {
    run_as_acl_user(None).await
}

/// The narrowing `docs/security.md` describes for stream `orders`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_acl_user_confined_to_one_pipelines_keys_runs_every_flow() -> Result<()> {
    run_as_acl_user(Some(&["orders", "orders:*", "{orders}:*", "{orders:*}:*"])).await
}

/// A Redis Cluster client sends three commands more (`PING` and
/// `CLUSTER SLOTS` on connecting, `ASKING` to follow an `ASK` redirection
/// while a slot migrates): as the same user on every node, a pipeline runs
/// on a 3-master cluster, a new stream in a migrating slot is followed to
/// its new master, and a user without `+asking` cannot follow it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_redis_cluster_the_acl_user_runs_a_pipeline_and_follows_a_slot_migration() -> Result<()> {
    let cluster = streamfleet_testbed::RedisCluster::start(3).await?;
    let line = acl_line();
    let without_asking = line.replace(" +asking", "");
    assert_ne!(without_asking, line);
    let mut admins = Vec::new();
    for node in &cluster.nodes {
        let mut admin = node.connection().await?;
        for (user, line) in [("streamfleet", &line), ("no-asking", &without_asking)] {
            let () =
                redis::cmd("ACL").arg("SETUSER").arg(setuser_args(line, user, None)).query_async(&mut admin).await?;
        }
        let () = redis::cmd("ACL").arg("LOG").arg("RESET").query_async(&mut admin).await?;
        admins.push((node.port, admin));
    }
    let url = |user: &str| format!("redis://{user}:{PASSWORD}@127.0.0.1:{}/", cluster.nodes[0].port);
    let endpoint = |user: &str| streamfleet_streams::Endpoint::new(url(user), streamfleet_streams::Mode::Cluster);
    let mut conn = StreamConnection::connect(&endpoint("streamfleet")).await?;

    // A pipeline: the group, entries, a guarded worker with a dead letter,
    // the operator's poll and retention, a sweep, the dead-letter tool.
    streamfleet_streams::ensure_group(&mut conn, "orders", "g", "0").await?;
    for i in 0..10 {
        let (kind, key) = (if i == 3 { "refused" } else { "ok" }, format!("k{i}"));
        shard::send(&mut conn, "orders", 1, &key, &[("kind", kind.as_bytes()), ("key", key.as_bytes())]).await?;
    }
    let mut c = config(&url("streamfleet"), "c1", 1000, 5);
    c.endpoint.mode = streamfleet_streams::Mode::Cluster;
    let handler = Scripted::default();
    let (stop, run) = spawn(Worker::new(c, handler.clone()).with_idempotency_guard(Duration::from_secs(600)));
    eventually("all settled", T, || async {
        let mut conn = conn.clone();
        let snapshot = health::inspect(&mut conn, streamfleet_streams::GroupRef::new("orders", "g"), DEAD).await?;
        Ok(snapshot.filter(|s| handler.total() == 10 && s.pending == 0 && s.dead_letter_length == 1))
    })
    .await?;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), run).await???;
    let settings = SweepSettings {
        stream: "orders",
        group: "g",
        consumer: "sweeper",
        dead_letter_stream: DEAD,
        min_idle: Duration::from_secs(1),
        max_deliveries: 5,
        batch: 10,
    };
    assert_eq!(sweep(&mut conn, &settings).await?.scanned, 0);
    retention::enforce(&mut conn, "orders", Some(1), None, recovery::now_ms()).await?;
    assert_eq!(dlq::all(&mut conn, DEAD, &Filter::default()).await?.len(), 1);

    // The slot of a new stream starts migrating to another master.
    let key = "{moving}orders";
    let from = cluster.master_of(key).await?;
    let to = cluster.nodes.iter().map(|n| n.port).find(|p| *p != from).expect("another master");
    let admin = |port: u16| admins.iter().find(|(p, _)| *p == port).map(|(_, c)| c.clone()).expect("node");
    let (mut source, mut target) = (admin(from), admin(to));
    let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut source).await?;
    let source_id: String = redis::cmd("CLUSTER").arg("MYID").query_async(&mut source).await?;
    let target_id: String = redis::cmd("CLUSTER").arg("MYID").query_async(&mut target).await?;
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("IMPORTING")
        .arg(&source_id)
        .query_async(&mut target)
        .await?;
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("MIGRATING")
        .arg(&target_id)
        .query_async(&mut source)
        .await?;
    // Its old master answers ASK for a key it does not have: the client asks the new one.
    assert_eq!(streamfleet_streams::ensure_group(&mut conn, key, "g", "0").await?, GroupCreation::Created);
    shard::send(&mut conn, key, 1, "m1", &[("kind", b"ok")]).await?;
    let keys_in_slot = |mut c: MultiplexedConnection| async move {
        redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot).query_async::<u64>(&mut c).await
    };
    assert_eq!((keys_in_slot(source).await?, keys_in_slot(target).await?), (0, 1), "created on the new master");
    // Without +asking, the same redirection is refused.
    let mut other = StreamConnection::connect(&endpoint("no-asking")).await?;
    // (Following the ASK, its ASKING is refused; ACL LOG says so too.)
    let e = streamfleet_streams::ensure_group(&mut other, "{moving}other", "g", "0").await.expect_err("refused");
    assert!(e.to_string().contains("'asking'"), "{e}");

    // Only that refusal, on the new master.
    let mut seen = Vec::new();
    for (port, admin) in &mut admins {
        seen.extend(refusals(admin).await?.into_iter().map(|r| (*port, r)));
    }
    assert_eq!(seen, [(to, ("command".to_string(), "asking".to_string()))]);
    Ok(())
}
