//! Sharding by business key, across languages: the Python producer
//! (`examples/python`, redis-py) and the Rust helper agree with the
//! published vectors and put every entry on the same shard of a real
//! redis-server.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::{Context as _, Result};
use std::path::PathBuf;
use streamfleet_streams::shard::{send, shard_key, shard_of};
use streamfleet_testbed::RedisServer;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The venv `scripts/install-deps.sh` makes, with redis-py.
fn python() -> Result<PathBuf> {
    let home = std::env::var("HOME").context("HOME")?;
    let python = PathBuf::from(home).join(".cache/streamfleet/venv/bin/python3");
    anyhow::ensure!(python.exists(), "{} missing: run scripts/install-deps.sh", python.display());
    Ok(python)
}

fn producer(args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(python()?)
        .arg(root().join("examples/python/streamfleet_producer.py"))
        .args(args)
        .output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn the_python_producer_agrees_with_the_published_vectors() -> Result<()> {
    let vectors = root().join("docs/shard-vectors.json");
    let said = producer(&["--check-vectors", vectors.to_str().unwrap()])?;
    assert!(said.starts_with("77/77"), "{said}");
    Ok(())
}

#[tokio::test]
async fn python_and_rust_producers_put_each_key_on_its_shard() -> Result<()> {
    let server = RedisServer::start().await?;
    let mut conn = server.connection().await?;
    let keys: Vec<String> = (0..20).map(|i| format!("order-{i}")).collect();
    let url = server.url();
    for key in &keys[..10] {
        let field = format!("order_id={key}");
        producer(&["--url", &url, "--stream", "orders", "--shards", "3", "--key", key, &field])?;
    }
    for key in &keys[10..] {
        send(&mut conn, "orders", 3, key, &[("order_id", key.as_bytes())]).await?;
    }
    let mut placed = 0;
    for key in &keys {
        let shard = shard_key("orders", shard_of(key, 3));
        let entries: redis::streams::StreamRangeReply =
            redis::cmd("XRANGE").arg(&shard).arg("-").arg("+").query_async(&mut conn).await?;
        let here = entries
            .ids
            .iter()
            .filter(|e| matches!(e.map.get("order_id"), Some(redis::Value::BulkString(v)) if v == key.as_bytes()))
            .count();
        assert_eq!(here, 1, "{key} on {shard}");
        placed += 1;
    }
    let mut total = 0;
    for shard in 0..3 {
        let len: usize = redis::cmd("XLEN").arg(shard_key("orders", shard)).query_async(&mut conn).await?;
        assert!(len > 0, "shard {shard} empty: keys spread");
        total += len;
    }
    assert_eq!((placed, total), (20, 20));
    Ok(())
}
