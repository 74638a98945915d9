//! The chart's default, cluster-wide mode (a ClusterRole, all namespaces),
//! in a test binary of its own so no other operator shares its control plane.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use std::time::Duration;
use streamfleet_e2e::*;
use streamfleet_testbed::{RedisServer, TestBed};

const T: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_cluster_wide_operator_serves_every_namespace_with_its_cluster_role() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    ensure_crd(bed).await?;
    let chart = repo_path("charts/streamfleet").display().to_string();
    let system = bed.namespace(&client, "streamfleet-system").await?;
    run_ok(
        bed,
        "helm",
        &[
            "install",
            "streamfleet",
            &chart,
            "--namespace",
            &system.name,
            "--set",
            "log.format=text",
            "--set",
            "console.enabled=false",
            // The CRD is the test bed's (ensure_crd), shared by every test.
            "--set",
            "crds.install=false",
            // The test bed's pods share the host's network namespace.
            "--set",
            "listenOn=podIP",
            "--wait",
            "--timeout",
            "120s",
        ],
        None,
    )
    .await?;
    let redis = RedisServer::start().await?;
    let records = tempfile::tempdir()?;
    let dir = records.path().display().to_string();
    let mut teams = Vec::new();
    for team in ["team-a", "team-b"] {
        let ns = bed.namespace(&client, team).await?;
        create_redis_secret(&client, &ns.name, "redis", &redis.url()).await?;
        run_ok(
            bed,
            "kubectl",
            &["apply", "-n", &ns.name, "-f", "-"],
            Some(&recording_manifest("p", team, "g", &dir, "")),
        )
        .await?;
        teams.push(ns);
    }
    for ns in &teams {
        wait_condition(&client, &ns.name, "p", "Ready", "True", None, T).await?;
    }

    // A Secret without the referenced key: a precise reason, then healed.
    let ns = &teams[0];
    let wrong: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "other"}, "stringData": {"uri": redis.url()}
    }))?;
    Api::<Secret>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &wrong).await?;
    let manifest =
        recording_manifest("q", "team-a-2", "g", &dir, "").replace("name: redis, key: url", "name: other, key: url");
    run_ok(bed, "kubectl", &["apply", "-n", &ns.name, "-f", "-"], Some(&manifest)).await?;
    wait_condition(&client, &ns.name, "q", "GroupReady", "False", Some("SecretKeyNotFound"), T).await?;
    let fixed = serde_json::json!({"stringData": {"url": redis.url()}});
    Api::<Secret>::namespaced(client.clone(), &ns.name)
        .patch("other", &PatchParams::default(), &Patch::Merge(&fixed))
        .await?;
    wait_condition(&client, &ns.name, "q", "Ready", "True", None, T).await?;
    Ok(())
}
