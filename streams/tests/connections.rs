//! The shared connections against an endpoint that accepts and never
//! answers (a host gone dark behind a live load balancer): one connect at a
//! time, and the failure is every caller's answer for a while, so resources
//! on a dead endpoint do not each wait out a connect timeout.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use streamfleet_streams::connection::CONNECT_FAILURE_REMEMBERED;
use streamfleet_streams::{Connections, Endpoint, ErrorClass, Mode};

/// Accepts connections, reads what is sent, answers nothing; counts them.
async fn silent_server() -> Result<(Endpoint, Arc<AtomicUsize>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&accepted);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            held.push(socket);
        }
    });
    Ok((Endpoint::new(format!("redis://127.0.0.1:{port}"), Mode::Standalone), accepted))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_of_a_silent_endpoint_share_one_connect_and_then_its_failure() -> Result<()> {
    let (endpoint, accepted) = silent_server().await?;
    let connections = Connections::default();

    // Twenty callers at once (twenty resources on one endpoint): one connect.
    let began = Instant::now();
    let callers: Vec<_> = (0..20)
        .map(|_| {
            let (connections, endpoint) = (connections.clone(), endpoint.clone());
            tokio::spawn(async move { connections.get_checked(&endpoint).await.map(|_| ()) })
        })
        .collect();
    let mut said = std::collections::BTreeSet::new();
    for caller in callers {
        let e = caller.await?.expect_err("nothing answers");
        assert_eq!(e.class, ErrorClass::Unreachable, "{e}");
        said.insert(e.to_string());
    }
    // The same words for every caller: a message that changed would be a
    // new status write and a new Event per resource per poll.
    assert_eq!(said.len(), 1, "{said:?}");
    let first = began.elapsed();
    let connects = accepted.load(Ordering::SeqCst);
    println!("20 callers failed together after {first:?}; {connects} TCP connections accepted");
    // One caller's connect (with its client's own retries), not twenty.
    assert!((1..=3).contains(&connects), "{connects} connections for one endpoint");
    assert!(first < Duration::from_secs(20), "the callers waited in turn: {first:?}");

    // Within the window: the same failure at once, and no new connection.
    let asked = Instant::now();
    let e = connections.get_checked(&endpoint).await.map(|_| ()).expect_err("remembered");
    assert!(asked.elapsed() < Duration::from_secs(1), "{:?}", asked.elapsed());
    assert_eq!(e.class, ErrorClass::Unreachable);
    assert!(said.contains(&e.to_string()), "{e} is not what the first callers were told: {said:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), connects);

    // After it: one caller tries again, and meanwhile another gets the
    // last failure at once rather than queue behind the attempt.
    tokio::time::sleep(CONNECT_FAILURE_REMEMBERED).await;
    let retry = {
        let (connections, endpoint) = (connections.clone(), endpoint.clone());
        tokio::spawn(async move { connections.get_checked(&endpoint).await.map(|_| ()) })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while accepted.load(Ordering::SeqCst) == connects {
        assert!(Instant::now() < deadline, "no caller tried again after the window");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked = Instant::now();
    let e = connections.get_checked(&endpoint).await.map(|_| ()).expect_err("being tried again");
    assert!(asked.elapsed() < Duration::from_secs(1), "queued behind the attempt: {:?}", asked.elapsed());
    assert_eq!(e.class, ErrorClass::Unreachable);
    retry.abort();
    Ok(())
}

/// A refusal by a server that answers is not remembered: the next caller
/// asks again (a fixed password works on the next poll, not seconds later).
#[tokio::test]
async fn a_refusal_by_a_live_server_is_asked_again() -> Result<()> {
    let server = streamfleet_testbed::RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let _: () = redis::cmd("CONFIG").arg("SET").arg("requirepass").arg("s3cret").query_async(&mut conn).await?;
    let connections = Connections::default();
    let wrong = Endpoint::new(server.url().replace("redis://", "redis://:wrong@"), Mode::Standalone);
    let e = connections.get_checked(&wrong).await.map(|_| ()).expect_err("wrong password");
    assert_eq!(e.class, ErrorClass::AuthFailed, "{e}");
    let _: () = redis::cmd("CONFIG").arg("SET").arg("requirepass").arg("wrong").query_async(&mut conn).await?;
    connections.get_checked(&wrong).await?;
    Ok(())
}
