//! Group lifecycle against a real redis-server and a real Redis Cluster.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use redis::AsyncCommands as _;
use streamfleet_streams::{
    ClientTls, Connections, Endpoint, ErrorClass, GroupCreation, Mode, destroy_group, ensure_group,
};
use streamfleet_testbed::{RedisCluster, RedisServer};

async fn last_delivered(conn: &mut streamfleet_streams::StreamConnection, stream: &str) -> Result<String> {
    let info: redis::streams::StreamInfoGroupsReply = conn.xinfo_groups(stream).await?;
    Ok(info.groups[0].last_delivered_id.clone())
}

#[tokio::test]
async fn ensure_group_creates_once_at_the_start_id_and_keeps_position() -> Result<()> {
    let server = RedisServer::start().await?;
    let pool = Connections::default();
    let endpoint = Endpoint::new(server.url(), Mode::Standalone);
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
    let endpoint = Endpoint::new(format!("redis://127.0.0.1:{port}/"), Mode::Standalone);
    let err = Connections::default().get(&endpoint).await.err().expect("nothing listens there");
    assert_eq!(err.class, ErrorClass::Unreachable, "{err}");

    let dir = tempfile_dir()?;
    let server = RedisServer::start_in(dir.path(), &["--requirepass", "right"]).await?;
    let endpoint = Endpoint::new(format!("redis://:wrong@127.0.0.1:{}/", server.port), Mode::Standalone);
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
    let endpoint = Endpoint::new(cluster.urls()[1].clone(), Mode::Cluster);
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
    let endpoint =
        Endpoint { ca_pem: Some(pki.ca_pem.clone().into_bytes()), ..Endpoint::new(url.clone(), Mode::Standalone) };
    let mut conn = Connections::default().get(&endpoint).await?;
    assert_eq!(ensure_group(&mut conn, "orders", "g", "$").await?, GroupCreation::Created);
    // Without it, the private CA is not trusted: a clear failure, not a hang.
    let untrusted = Endpoint::new(url, Mode::Standalone);
    let err = Connections::default().get(&untrusted).await.err().expect("untrusted certificate");
    assert_eq!(err.class, ErrorClass::Unreachable, "{err}");
    Ok(())
}

/// A server that requires client certificates: with the certificate and
/// key from `tls.clientCertSecretRef`, the connection works; without them,
/// it is refused, promptly.
#[tokio::test]
async fn tls_with_a_client_certificate() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = streamfleet_testbed::certs::Pki::generate(&dir.path().join("pki"))?;
    let server =
        RedisServer::start_tls_with(dir.path(), &pki.serving_cert, &pki.serving_key, &pki.ca_cert, true).await?;
    let url = format!("rediss://127.0.0.1:{}/", server.port);
    let ca = Endpoint { ca_pem: Some(pki.ca_pem.clone().into_bytes()), ..Endpoint::new(url, Mode::Standalone) };
    let with_cert = Endpoint {
        client_tls: Some(ClientTls {
            cert_pem: pki.client_cert_pem.clone().into_bytes(),
            key_pem: pki.client_key_pem.clone().into_bytes(),
        }),
        ..ca.clone()
    };
    let mut conn = Connections::default().get(&with_cert).await?;
    assert_eq!(ensure_group(&mut conn, "orders", "g", "$").await?, GroupCreation::Created);
    let started = std::time::Instant::now();
    assert!(Connections::default().get(&ca).await.is_err(), "no client certificate, yet connected");
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "refused promptly");
    Ok(())
}

/// Credentials kept apart from the URL, as `spec.redis.username` and
/// `passwordSecretRef` give them: a password a URL would need
/// percent-encoded works as it is; a password both in the URL and apart is
/// refused naming the conflict, and none is echoed.
#[tokio::test]
async fn a_username_and_password_apart_from_the_url() -> Result<()> {
    let server = RedisServer::start().await?;
    let password = "p@ss/w:rd%2F?#";
    let mut admin = server.connection().await?;
    let () = redis::cmd("ACL")
        .arg(&["SETUSER", "streamfleet", "on", &format!(">{password}"), "~*", "&*", "+@all"])
        .query_async(&mut admin)
        .await?;
    let () = redis::cmd("ACL").arg(&["SETUSER", "default", "off"]).query_async(&mut admin).await?;
    let apart = Endpoint {
        username: Some("streamfleet".into()),
        password: Some(password.into()),
        ..Endpoint::new(server.url(), Mode::Standalone)
    };
    let mut conn = Connections::default().get(&apart).await?;
    assert_eq!(ensure_group(&mut conn, "orders", "g", "$").await?, GroupCreation::Created);
    let whoami: String = redis::cmd("ACL").arg("WHOAMI").query_async(&mut conn).await?;
    assert_eq!(whoami, "streamfleet");

    let wrong = Endpoint { password: Some("not-it".into()), ..apart.clone() };
    let err = Connections::default().get(&wrong).await.err().expect("wrong password");
    assert_eq!(err.class, ErrorClass::AuthFailed, "{err}");

    let twice = Endpoint { url: format!("redis://streamfleet:other@127.0.0.1:{}/", server.port), ..apart.clone() };
    let err = Connections::default().get(&twice).await.err().expect("two passwords");
    let said = err.to_string();
    assert!(said.contains("the URL carries a password and a password is given apart"), "{said}");
    assert!(!said.contains(password) && !said.contains("other"), "a password echoed: {said}");
    Ok(())
}
