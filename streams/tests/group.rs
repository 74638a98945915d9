//! Group lifecycle against a real redis-server and a real Redis Cluster.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use streamfleet_streams::{Connections, Endpoint, ErrorClass, GroupCreation, Mode, destroy_group, ensure_group};
use streamfleet_testbed::{RedisCluster, RedisServer};

async fn last_delivered(conn: &mut streamfleet_streams::StreamConnection, stream: &str) -> Result<String> {
    let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups(stream).await?;
    Ok(info.groups[0].last_delivered_id.clone())
}

#[tokio::test]
async fn ensure_group_creates_once_at_the_start_id_and_keeps_position() -> Result<()> {
    let server = RedisServer::start().await?;
    let pool = Connections::default();
    let endpoint = Endpoint { url: server.url(), mode: Mode::Standalone, ca_pem: None };
    let mut conn = pool.get(&endpoint).await?;
    let _: String = conn.xadd("orders", "5-1", &[("k", "v")]).await?;

    assert_eq!(ensure_group(&mut conn, "orders", "billing", "0").await?, GroupCreation::Created);
    assert_eq!(last_delivered(&mut conn, "orders").await?, "0-0");
    // A second call with another start ID is success and moves nothing.
    assert_eq!(ensure_group(&mut conn, "orders", "billing", "$").await?, GroupCreation::AlreadyExisted);
    assert_eq!(last_delivered(&mut conn, "orders").await?, "0-0");
    // `$` starts after the last entry.
    ensure_group(&mut conn, "orders", "audit", "$").await?;
    let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups("orders").await?;
    let audit = info.groups.iter().find(|g| g.name == "audit").map(|g| g.last_delivered_id.clone());
    assert_eq!(audit.as_deref(), Some("5-1"));
    // MKSTREAM: a group on a missing stream creates the stream.
    ensure_group(&mut conn, "fresh", "g", "$").await?;
    assert!(conn.exists::<_, bool>("fresh").await?);

    assert!(destroy_group(&mut conn, "orders", "billing").await?);
    assert!(!destroy_group(&mut conn, "orders", "billing").await?);
    assert!(!destroy_group(&mut conn, "missing-stream", "g").await?);
    // The pool hands out one shared connection per endpoint.
    let _again = pool.get(&endpoint).await?;
    assert_eq!(pool.endpoints().await, 1);
    Ok(())
}

#[tokio::test]
async fn unreachable_and_unauthorised_redis_are_classified() -> Result<()> {
    let port = streamfleet_testbed::process::free_port()?;
    let endpoint = Endpoint { url: format!("redis://127.0.0.1:{port}/"), mode: Mode::Standalone, ca_pem: None };
    let err = Connections::default().get(&endpoint).await.err().expect("nothing listens there");
    assert_eq!(err.class, ErrorClass::Unreachable, "{err}");

    let dir = tempfile_dir()?;
    let server = RedisServer::start_in(dir.path(), &["--requirepass", "right"]).await?;
    let endpoint =
        Endpoint { url: format!("redis://:wrong@127.0.0.1:{}/", server.port), mode: Mode::Standalone, ca_pem: None };
    let err = Connections::default().get(&endpoint).await.err().expect("wrong password");
    assert_eq!(err.class, ErrorClass::AuthFailed, "{err}");
    assert!(!err.to_string().contains("wrong"), "password leaked: {err}");
    Ok(())
}

fn tempfile_dir() -> Result<tempfile::TempDir> {
    Ok(tempfile::tempdir()?)
}

#[tokio::test]
async fn ensure_group_works_on_a_cluster() -> Result<()> {
    let cluster = RedisCluster::start(3).await?;
    let endpoint = Endpoint { url: cluster.urls()[1].clone(), mode: Mode::Cluster, ca_pem: None };
    let mut conn = Connections::default().get(&endpoint).await?;
    for key in ["{a}orders", "{b}orders", "{c}orders"] {
        assert_eq!(ensure_group(&mut conn, key, "g", "0").await?, GroupCreation::Created);
        assert_eq!(ensure_group(&mut conn, key, "g", "0").await?, GroupCreation::AlreadyExisted);
    }
    Ok(())
}

#[tokio::test]
async fn tls_with_a_private_ca() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = streamfleet_testbed::certs::Pki::generate(&dir.path().join("pki"))?;
    let server = RedisServer::start_tls(dir.path(), &pki.serving_cert, &pki.serving_key, &pki.ca_cert).await?;
    let url = format!("rediss://127.0.0.1:{}/", server.port);
    // With the CA from the Secret: connects and works.
    let endpoint = Endpoint { url: url.clone(), mode: Mode::Standalone, ca_pem: Some(pki.ca_pem.clone().into_bytes()) };
    let mut conn = Connections::default().get(&endpoint).await?;
    assert_eq!(ensure_group(&mut conn, "orders", "g", "$").await?, GroupCreation::Created);
    // Without it, the private CA is not trusted: a clear failure, not a hang.
    let untrusted = Endpoint { url, mode: Mode::Standalone, ca_pem: None };
    let err = Connections::default().get(&untrusted).await.err().expect("untrusted certificate");
    assert_eq!(err.class, ErrorClass::Unreachable, "{err}");
    Ok(())
}
