//! The alert rules the chart ships, evaluated by a real Prometheus that
//! scrapes the Helm-installed operator and a real worker on the test bed:
//! real poison makes `StreamfleetDeadLettersGrowing` fire, a real trim under
//! pending work makes `StreamfleetPayloadLost` fire, each naming namespace,
//! resource, stream and group.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, ResourceExt as _};
use std::time::Duration;
use streamfleet_e2e::*;
use streamfleet_testbed::process::{Daemon, free_port, wait_for_port};
use streamfleet_testbed::{eventually, tools};

const T: Duration = Duration::from_secs(120);
const WORKER_METRICS_PORT: u16 = 9464;

/// GET `path` from `addr` (HTTP/1.1, connection closed after), as JSON.
async fn get_json(addr: &str, path: &str) -> Result<serde_json::Value> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b).context("no HTTP body")?;
    Ok(serde_json::from_str(body)?)
}

/// A PromQL instant query's first sample value.
async fn query(prometheus: &str, promql: &str) -> Result<Option<f64>> {
    let encoded: String = promql
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let reply = get_json(prometheus, &format!("/api/v1/query?query={encoded}")).await?;
    Ok(reply["data"]["result"][0]["value"][1].as_str().and_then(|v| v.parse().ok()))
}

/// The pod IP of the first pod in `namespace` whose name starts with `prefix`.
async fn pod_ip(pods: &Api<Pod>, prefix: &str) -> Result<Option<String>> {
    let list = pods.list(&Default::default()).await?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| p.name_any().starts_with(prefix) && p.metadata.deletion_timestamp.is_none())
        .find_map(|p| p.status.and_then(|s| s.pod_ip)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_fires_the_dead_letter_and_payload_lost_alerts_on_real_poison_and_a_real_trim() -> Result<()> {
    let mut f = Fixture::start("e2e-alerts", &[]).await?;
    let (client, ns) = (f.client.clone(), f.ns.name.clone());
    streamfleet_streams::ensure_group(&mut f.conn, "orders", "billing", "0").await?;
    let spec = "  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 1}\n  recovery: {schedule: \"0 0 1 1 *\", minIdleTimeMs: 1000}";
    // The example worker, serving its metrics on its pod IP.
    let mut pipeline = manifest("p", "orders", "billing", "streamfleet/example-worker", &[], spec);
    pipeline.push_str(&format!(
        "              - name: POD_IP\n                valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}\n\
         \x20             - {{name: STREAMFLEET_METRICS_ADDR, value: \"$(POD_IP):{WORKER_METRICS_PORT}\"}}\n"
    ));
    f.apply(&pipeline).await?;
    wait_condition(&client, &ns, "p", "Ready", "True", None, T).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let operator = eventually("the operator pod IP", T, || pod_ip(&pods, "sf-")).await?;
    let worker = eventually("the worker pod IP", T, || pod_ip(&pods, "p-worker-")).await?;

    // Prometheus with the chart's rules, scraping both every second.
    let dir = tempfile::tempdir()?;
    let rules = repo_path("charts/streamfleet/files/alerts.yaml");
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
         rule_files: [{rules:?}]\n\
         scrape_configs:\n\
         \x20 - job_name: streamfleet-metrics\n    honor_labels: true\n    static_configs: [{{targets: [\"{operator}:8080\"]}}]\n\
         \x20 - job_name: worker\n    static_configs: [{{targets: [\"{worker}:{WORKER_METRICS_PORT}\"]}}]\n"
    );
    std::fs::write(dir.path().join("prometheus.yml"), config)?;
    let port = free_port()?;
    let args = vec![
        format!("--config.file={}", dir.path().join("prometheus.yml").display()),
        format!("--storage.tsdb.path={}", dir.path().join("data").display()),
        format!("--web.listen-address=127.0.0.1:{port}"),
    ];
    let mut server = Daemon::spawn("prometheus", &tools::tool("prometheus")?, &args, dir.path())?;
    wait_for_port(port, T).await?;
    let prometheus = format!("127.0.0.1:{port}");
    eventually("both targets up", T, || async {
        let operator_up = query(&prometheus, r#"up{job="streamfleet-metrics"}"#).await?;
        let worker_up = query(&prometheus, r#"up{job="worker"}"#).await?;
        Ok((operator_up == Some(1.0) && worker_up == Some(1.0)).then_some(()))
    })
    .await
    .inspect_err(|_| println!("{}", server.log_tail(30)))?;

    // A real trim under pending work: 20 orders in the hands of a consumer
    // that is no pod of the pipeline, their payloads trimmed away (one
    // transaction, so the live worker cannot read them first).
    let mut tx = redis::pipe();
    tx.atomic();
    for i in 0..20 {
        tx.cmd("XADD")
            .arg("orders")
            .arg("*")
            .arg("order_id")
            .arg(format!("t{i}"))
            .arg("amount_cents")
            .arg(100)
            .ignore();
    }
    tx.cmd("XREADGROUP")
        .arg("GROUP")
        .arg("billing")
        .arg("ghost")
        .arg("COUNT")
        .arg(20)
        .arg("STREAMS")
        .arg("orders")
        .arg(">")
        .ignore();
    tx.cmd("XTRIM").arg("orders").arg("MAXLEN").arg(0).ignore();
    let () = tx.query_async(&mut f.conn).await?;
    // Real poison: five orders the worker's handler refuses.
    for i in 0..5 {
        let fields = [("order_id", format!("p{i}")), ("amount_cents", "100".into()), ("poison", "1".into())];
        let _: String = redis::AsyncCommands::xadd(&mut f.conn, "orders", "*", &fields).await?;
    }

    let firing = eventually("both alerts firing", T, || async {
        let alerts = get_json(&prometheus, "/api/v1/alerts").await?;
        let firing: Vec<serde_json::Value> = alerts["data"]["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|a| a["state"] == "firing")
            .collect();
        let has = |name: &str| firing.iter().any(|a| a["labels"]["alertname"] == name);
        Ok((has("StreamfleetDeadLettersGrowing") && has("StreamfleetPayloadLost")).then_some(firing))
    })
    .await
    .inspect_err(|_| println!("{}", server.log_tail(30)))?;
    for name in ["StreamfleetDeadLettersGrowing", "StreamfleetPayloadLost"] {
        let alert = firing.iter().find(|a| a["labels"]["alertname"] == name).unwrap();
        let labels = &alert["labels"];
        assert_eq!(
            (
                labels["namespace"].as_str(),
                labels["name"].as_str(),
                labels["stream"].as_str(),
                labels["group"].as_str()
            ),
            (Some(ns.as_str()), Some("p"), Some("orders"), Some("billing")),
            "{alert}"
        );
    }
    let lost = firing.iter().find(|a| a["labels"]["alertname"] == "StreamfleetPayloadLost").unwrap();
    assert!(lost["annotations"]["description"].as_str().unwrap().starts_with("20 pending entries"), "{lost}");

    // The worker's own series, scraped: what it dead-lettered and found lost.
    let permanent = query(&prometheus, r#"streamfleet_worker_dead_letters_total{reason="permanent",group="billing"}"#);
    assert_eq!(permanent.await?, Some(5.0));
    assert_eq!(query(&prometheus, r#"streamfleet_worker_payloads_lost_total{group="billing"}"#).await?, Some(20.0));
    server.stop(Duration::from_secs(5));
    Ok(())
}
