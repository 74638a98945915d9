//! What the cluster connection sends again, on a real three-node Redis
//! Cluster: a command the server refused unrun (`MOVED`) is re-sent and
//! lands; a command whose reply was lost (the connection dropped after the
//! server ran it) is never re-sent, so a script runs once. Before, the
//! cluster client re-sent it twice more: a read, a claim or a counter ran
//! three times for one call.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::{Context as _, Result, ensure};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use streamfleet_streams::{Endpoint, Mode, StreamConnection};
use streamfleet_testbed::{RedisCluster, eventually};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(30);

/// A TCP proxy to `upstream` that forwards everything, except that once a
/// client sends `marker` it forwards that request, then drops the
/// connection without forwarding the reply: the server ran the command, the
/// client never hears of it. `hits` counts the marked requests that reached
/// the server.
struct LosingProxy {
    port: u16,
    hits: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
}

impl LosingProxy {
    async fn start(upstream: u16, marker: &'static [u8]) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let hits = Arc::new(AtomicUsize::new(0));
        let connections = Arc::new(AtomicUsize::new(0));
        let (h, n) = (hits.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else { continue };
                n.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(relay(client, server, marker, h.clone()));
            }
        });
        Ok(Self { port, hits, connections })
    }
}

async fn relay(client: TcpStream, server: TcpStream, marker: &'static [u8], hits: Arc<AtomicUsize>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let losing = Arc::new(AtomicBool::new(false));
    let lose = losing.clone();
    let replies = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            // The marked request's reply, and anything after it, is lost.
            if lose.load(Ordering::SeqCst) || client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match client_read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let marked = buf[..n].windows(marker.len()).any(|w| w == marker);
        if marked {
            losing.store(true, Ordering::SeqCst);
        }
        if server_write.write_all(&buf[..n]).await.is_err() {
            break;
        }
        if marked {
            hits.fetch_add(1, Ordering::SeqCst);
            // Let the server run it and answer into the void, then hang up.
            tokio::time::sleep(Duration::from_millis(300)).await;
            break;
        }
    }
    replies.abort();
}

async fn slot_of(cluster: &RedisCluster, key: &str) -> Result<u16> {
    let mut conn = cluster.nodes[0].connection().await?;
    Ok(redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut conn).await?)
}

async fn node_id(cluster: &RedisCluster, port: u16) -> Result<String> {
    let node = cluster.nodes.iter().find(|n| n.port == port).context("no such node")?;
    let mut conn = node.connection().await?;
    Ok(redis::cmd("CLUSTER").arg("MYID").query_async(&mut conn).await?)
}

async fn cluster_connection(cluster: &RedisCluster) -> Result<StreamConnection> {
    let endpoint = Endpoint::new(cluster.nodes[0].url(), Mode::Cluster);
    Ok(StreamConnection::connect(&endpoint).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_whose_reply_was_lost_is_not_sent_again() -> Result<()> {
    let cluster = RedisCluster::start(3).await?;
    let key = "{lost}counter";
    let owner = cluster.master_of(key).await?;
    let proxy = LosingProxy::start(owner, b"lose-this-reply").await?;
    // The slot's master announces the proxy: the client reaches it only through it.
    let node = cluster.nodes.iter().find(|n| n.port == owner).context("owner")?;
    let mut direct = node.connection().await?;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("cluster-announce-bus-port")
        .arg(owner + 10_000)
        .arg("cluster-announce-port")
        .arg(proxy.port)
        .query_async(&mut direct)
        .await?;
    eventually("the cluster routes the slot through the proxy", T, || async {
        Ok((cluster.master_of(key).await? == proxy.port).then_some(()))
    })
    .await?;

    let mut conn = cluster_connection(&cluster).await?;
    let () = redis::cmd("SET").arg("{lost}other").arg("1").query_async(&mut conn).await?;
    ensure!(proxy.connections.load(Ordering::SeqCst) > 0, "the client goes through the proxy");

    // One script: increments, and its reply is lost on the way back.
    let sent = redis::cmd("EVAL")
        .arg("redis.call('INCR', KEYS[1]) return ARGV[1]")
        .arg(1)
        .arg(key)
        .arg("lose-this-reply")
        .query_async::<String>(&mut conn)
        .await;
    let hits = proxy.hits.load(Ordering::SeqCst);
    assert!(sent.is_err(), "the reply was lost: the caller is told, {sent:?} (sent {hits} times)");
    // Give a re-send, if any, time to land.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let runs: u64 = redis::cmd("GET").arg(key).query_async(&mut direct).await?;
    assert_eq!(proxy.hits.load(Ordering::SeqCst), 1, "the script reached the server once");
    assert_eq!(runs, 1, "the script ran once");

    // The connection is usable again afterwards.
    let again: u64 = redis::cmd("INCR").arg(key).query_async(&mut conn).await?;
    assert_eq!(again, 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_refused_with_moved_is_sent_again_to_the_slots_new_master() -> Result<()> {
    let cluster = RedisCluster::start(3).await?;
    let key = "{moved}k";
    let slot = slot_of(&cluster, key).await?;
    let from = cluster.master_of(key).await?;
    let to = cluster.nodes.iter().map(|n| n.port).find(|p| *p != from).context("another master")?;
    let mut conn = cluster_connection(&cluster).await?;
    let before: Option<String> = redis::cmd("GET").arg(key).query_async(&mut conn).await?;
    assert_eq!(before, None, "the client has mapped the slot to its first master");

    // The (empty) slot moves, the standard way; the client's map is now stale.
    let (from_id, to_id) = (node_id(&cluster, from).await?, node_id(&cluster, to).await?);
    let node = |port: u16| cluster.nodes.iter().find(|n| n.port == port).context("node");
    let mut source = node(from)?.connection().await?;
    let mut target = node(to)?.connection().await?;
    let setslot = |state: &str, id: &str| {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SETSLOT").arg(slot).arg(state).arg(id);
        cmd
    };
    let () = setslot("IMPORTING", &from_id).query_async(&mut target).await?;
    let () = setslot("MIGRATING", &to_id).query_async(&mut source).await?;
    let () = setslot("NODE", &to_id).query_async(&mut target).await?;
    let () = setslot("NODE", &to_id).query_async(&mut source).await?;

    let () = redis::cmd("SET").arg(key).arg("landed").query_async(&mut conn).await?;
    let on_target: Option<String> = redis::cmd("GET").arg(key).query_async(&mut target).await?;
    assert_eq!(on_target.as_deref(), Some("landed"), "written on the slot's new master");
    let errors: String = redis::cmd("INFO").arg("errorstats").query_async(&mut source).await?;
    assert!(errors.contains("errorstat_MOVED"), "the first send was refused with MOVED: {errors}");
    Ok(())
}

/// A script's first use on a fresh cluster (`NOSCRIPT`, then `SCRIPT LOAD`
/// on every master) answers at once, however many start together beside
/// other commands. redis-rs 1.8 fans `SCRIPT LOAD` out without waking its
/// connection task, so such a load could sit unsent until the response
/// timeout (10 s): a worker's first ack stalled, and its entries ran twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_uses_of_scripts_on_a_cluster_never_wait_for_the_response_timeout() -> Result<()> {
    let cluster = RedisCluster::start(3).await?;
    let conn = cluster_connection(&cluster).await?;
    for round in 0..20 {
        let started = std::time::Instant::now();
        let calls: Vec<_> = (0..4)
            .map(|n| {
                let conn = conn.clone();
                tokio::spawn(async move {
                    // A script no node has seen: its first EVALSHA is refused.
                    let body = format!("return {round}{n} -- {}", streamfleet_testbed::random_suffix());
                    let script = redis::Script::new(&body);
                    let key = format!("{{k{n}}}");
                    // Beside it, other commands in flight and answered
                    // meanwhile (what hid the queued load from the client).
                    let beside: Vec<_> = (0..20)
                        .map(|_| {
                            let (mut conn, key) = (conn.clone(), key.clone());
                            tokio::spawn(
                                async move { redis::cmd("XLEN").arg(&key).query_async::<i64>(&mut conn).await },
                            )
                        })
                        .collect();
                    let ran = script.key(&key).invoke_async::<i64>(&mut conn.clone()).await?;
                    for other in beside {
                        other.await??;
                    }
                    anyhow::Ok(ran)
                })
            })
            .collect();
        let mut ran = Vec::new();
        for call in calls {
            let reply = tokio::time::timeout(Duration::from_secs(5), call)
                .await
                .with_context(|| format!("round {round}: a first use of a script still waiting after 5 s"))???;
            ran.push(reply);
        }
        ensure!(ran == (0..4).map(|n| format!("{round}{n}").parse::<i64>().unwrap()).collect::<Vec<_>>());
        ensure!(started.elapsed() < Duration::from_secs(2), "round {round} took {:?}", started.elapsed());
    }
    Ok(())
}
