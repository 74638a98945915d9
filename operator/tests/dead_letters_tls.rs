//! `streamfleet dead-letters` against a `rediss://` server whose certificate
//! a private CA signs: with `--ca-file` it reads the letters; without it the
//! server is not trusted and the tool says so instead of hanging. And
//! against one that asks for a client certificate (`tls-auth-clients yes`):
//! with `--client-cert-file` and `--client-key-file` it reads them; without,
//! it is refused.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use std::process::Command;
use streamfleet_streams::deadletter as dl;
use streamfleet_testbed::RedisServer;

#[tokio::test]
async fn dead_letters_are_read_over_tls_with_the_ca_file_and_refused_without_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = streamfleet_testbed::certs::Pki::generate(&dir.path().join("pki"))?;
    let server = RedisServer::start_tls(dir.path(), &pki.serving_cert, &pki.serving_key, &pki.ca_cert).await?;
    let url = format!("rediss://127.0.0.1:{}/", server.port);

    // One dead letter, written over TLS with the CA.
    let endpoint = streamfleet_streams::Endpoint {
        ca_pem: Some(pki.ca_pem.clone().into_bytes()),
        ..streamfleet_streams::Endpoint::new(url.clone(), streamfleet_streams::Mode::Standalone)
    };
    let mut conn = streamfleet_streams::StreamConnection::connect(&endpoint).await?;
    let letter = [
        (dl::F_SOURCE_STREAM, "orders"),
        (dl::F_SOURCE_ID, "1-0"),
        (dl::F_GROUP, "billing"),
        (dl::F_CONSUMER, "w-1"),
        (dl::F_DELIVERIES, "4"),
        (dl::F_REASON, "permanent"),
        (dl::F_ERROR, "card declined"),
        (dl::F_BUSINESS_KEY, "order-7"),
        (dl::F_AT, "1764547200000"),
        ("order_id", "order-7"),
    ];
    let _: String = redis::cmd("XADD").arg("{orders}:dead").arg("*").arg(&letter[..]).query_async(&mut conn).await?;

    let tool = |ca: Option<&std::path::Path>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_streamfleet"));
        cmd.args(["dead-letters", "--redis-url", &url, "--dead-letter-stream", "{orders}:dead", "-o", "json"]);
        if let Some(ca) = ca {
            cmd.arg("--ca-file").arg(ca);
        }
        cmd.arg("list").output().unwrap()
    };
    let out = tool(Some(&pki.ca_cert));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let letters: Vec<serde_json::Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &serde_json::Value| v.get("id").is_some())
        .collect();
    assert_eq!(letters.len(), 1, "{stdout}");
    assert!(stdout.contains("order-7") && stdout.contains("card declined"), "{stdout}");

    let out = tool(None);
    let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(!out.status.success(), "read a private-CA server without its CA");
    assert!(stderr.contains("certificate") || stderr.contains("tls"), "unclear refusal: {stderr}");
    // The URL is shown without the password it could carry; here there is none to leak.
    Ok(())
}

#[tokio::test]
async fn dead_letters_are_read_with_a_client_certificate_where_the_server_asks_for_one() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = streamfleet_testbed::certs::Pki::generate(&dir.path().join("pki"))?;
    let server =
        RedisServer::start_tls_with(dir.path(), &pki.serving_cert, &pki.serving_key, &pki.ca_cert, true).await?;
    let url = format!("rediss://127.0.0.1:{}/", server.port);
    let (cert, key) = (dir.path().join("client.crt"), dir.path().join("client.key"));
    std::fs::write(&cert, &pki.client_cert_pem)?;
    std::fs::write(&key, &pki.client_key_pem)?;
    let endpoint = streamfleet_streams::Endpoint {
        ca_pem: Some(pki.ca_pem.clone().into_bytes()),
        client_tls: Some(streamfleet_streams::ClientTls {
            cert_pem: pki.client_cert_pem.clone().into_bytes(),
            key_pem: pki.client_key_pem.clone().into_bytes(),
        }),
        ..streamfleet_streams::Endpoint::new(url.clone(), streamfleet_streams::Mode::Standalone)
    };
    let mut conn = streamfleet_streams::StreamConnection::connect(&endpoint).await?;
    let letter = [(dl::F_SOURCE_STREAM, "orders"), (dl::F_REASON, "permanent"), (dl::F_ERROR, "card declined")];
    let _: String = redis::cmd("XADD").arg("{orders}:dead").arg("*").arg(&letter[..]).query_async(&mut conn).await?;

    let tool = |client: &[&std::path::Path]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_streamfleet"));
        cmd.args(["dead-letters", "--redis-url", &url, "--dead-letter-stream", "{orders}:dead", "-o", "json"]);
        cmd.arg("--ca-file").arg(&pki.ca_cert);
        if let [cert, key] = client {
            cmd.arg("--client-cert-file").arg(cert).arg("--client-key-file").arg(key);
        }
        cmd.arg("list").output().unwrap()
    };
    let out = tool(&[&cert, &key]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("card declined"), "{stdout}");
    let out = tool(&[]);
    assert!(!out.status.success(), "read a server that asks for a client certificate without one");
    // One file without the other is refused before connecting.
    let mut half = Command::new(env!("CARGO_BIN_EXE_streamfleet"));
    half.args(["dead-letters", "--redis-url", &url, "--dead-letter-stream", "{orders}:dead", "--client-cert-file"]);
    let out = half.arg(&cert).arg("list").output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--client-key-file"), "{stderr}");
    Ok(())
}
