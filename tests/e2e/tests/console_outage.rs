//! A payment provider's outage lived in the web console, with the example
//! order worker and its ledger: its own test binary (and test bed), since
//! the console's APIService is one per cluster.

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use redis::AsyncCommands as _;
use std::time::Duration;
use streamfleet_e2e::console::*;
use streamfleet_e2e::*;
use streamfleet_testbed::{eventually, tools};

const T: Duration = Duration::from_secs(90);

/// A payment provider's outage, as on-call lives it in the web console: the
/// orders wait for their retries (seen per shard, with the worker pod that
/// holds them and the provider's error), run out of deliveries and become
/// dead letters; the provider comes back, alice replays them from the page
/// after its dry-run count, and the worker charges every one, once. The
/// orders that can never succeed she purges from the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outages_dead_letters_are_replayed_from_the_web_console_and_charged() -> Result<()> {
    let f = Fixture::start("e2e-outage", &["--set", "console.enabled=true"]).await?;
    let (bed, client, ns, mut conn) = (f.bed, f.client.clone(), f.ns.name.clone(), f.conn.clone());
    let _: () = conn.set("{ledger}:down", 1).await?;
    // Six attempts 3 s apart: the orders wait about 15 s for their retries.
    let spec = "  startId: \"0\"\n  scaling: {minReplicas: 1, maxReplicas: 1, pollIntervalSeconds: 1}\n  recovery: {minIdleTimeMs: 1000, maxDeliveries: 6, batchSize: 50, retry: {backoff: Fixed, initialDelayMs: 3000, jitterPercent: 0}}";
    f.apply(&manifest("orders", "orders", "billing", "streamfleet/example-worker", &[], spec)).await?;
    wait_condition(&client, &ns, "orders", "GroupReady", "True", None, T).await?;
    run_ok(
        bed,
        "kubectl",
        &[
            "create",
            "rolebinding",
            "alice-edit",
            "-n",
            &ns,
            "--clusterrole",
            &format!("{}-streamfleet-edit", f.release),
            "--user",
            "alice",
        ],
        None,
    )
    .await?;
    let alice = bed.person_kubeconfig("alice")?;
    let plugin = tempfile::tempdir()?;
    std::os::unix::fs::symlink(tools::cargo_bin("streamfleet")?, plugin.path().join("kubectl-streamfleet"))?;
    // The console answers before the orders come: their retries are not
    // missed while the APIService becomes available.
    let shards_path = format!("/apis/console.streamfleet.io/v1alpha1/namespaces/{ns}/pipelines/orders/shards");
    let worker_consumer = async || -> Result<Option<(serde_json::Value, String)>> {
        let (ok, out, _) = kubectl_as(&alice, plugin.path(), &["get", "--raw", &shards_path]).await?;
        let list: serde_json::Value = if ok { serde_json::from_str(&out)? } else { serde_json::Value::Null };
        let shard = list["items"][0].clone();
        let worker = shard["consumers"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|c| c["name"].as_str().filter(|n| n.starts_with("orders-worker-")).map(str::to_string));
        Ok(worker.map(|w| (shard, w)))
    };
    eventually("the console answering for the pipeline", T, || async {
        let (ok, out, _) = kubectl_as(&alice, plugin.path(), &["get", "--raw", &shards_path]).await?;
        Ok((ok && out.contains("\"groupExists\":true")).then_some(()))
    })
    .await?;
    let orders: Vec<String> = (1..=5).map(|i| format!("o-{i}")).collect();
    for order in &orders {
        let _: String = conn.xadd("orders", "*", &[("order_id", order.as_str()), ("amount_cents", "250")]).await?;
    }
    for order in ["p-1", "p-2"] {
        let _: String =
            conn.xadd("orders", "*", &[("order_id", order), ("amount_cents", "250"), ("poison", "1")]).await?;
    }

    // While the provider is down: the orders wait for their retries, and
    // the shard says who holds what and why.
    let (shard, worker) = eventually("the orders waiting for a retry, with the provider's error", T, || async {
        let Some((shard, worker)) = worker_consumer().await? else { return Ok(None) };
        let waiting = shard["retries"].as_array().into_iter().flatten().any(|r| {
            r["lastError"].as_str().is_some_and(|e| e.contains("503")) && r["entries"].as_u64().is_some_and(|n| n > 0)
        });
        Ok(waiting.then_some((shard, worker)))
    })
    .await?;
    assert_eq!((shard["stream"].as_str(), shard["groupExists"].as_bool()), (Some("orders"), Some(true)), "{shard}");
    // A worker's consumer is `<pod name>.<pod UID>`: that pod, alive.
    let (pod_name, uid) = worker.split_once('.').context("a consumer named <pod>.<uid>")?;
    let pod = Api::<Pod>::namespaced(client.clone(), &ns).get(pod_name).await.context("the consumer's pod")?;
    assert_eq!(pod.metadata.uid.as_deref(), Some(uid), "{worker}");

    // They run out of deliveries: dead letters, grouped by error.
    let stats_path = format!("/apis/console.streamfleet.io/v1alpha1/namespaces/{ns}/pipelines/orders/deadletterstats");
    let stats = eventually("every order a dead letter", T, || async {
        let (ok, out, _) = kubectl_as(&alice, plugin.path(), &["get", "--raw", &stats_path]).await?;
        let stats: serde_json::Value = if ok { serde_json::from_str(&out)? } else { serde_json::Value::Null };
        Ok((stats["total"] == 7).then_some(stats))
    })
    .await?;
    assert_eq!(stats["byReason"], serde_json::json!({"retries-exhausted": 5, "permanent": 2}), "{stats}");
    let outage = stats["byError"].as_object().into_iter().flatten().find(|(k, _)| k.contains("service unavailable"));
    assert_eq!(outage.map(|(_, n)| n.as_u64()), Some(Some(5)), "the outage's letters, one signature: {stats}");
    let charged: usize = conn.hlen("{ledger}:charges").await?;
    assert_eq!(charged, 0, "nothing charged while the provider was down");
    let (ok, out, err) =
        kubectl_as(&alice, plugin.path(), &["streamfleet", "shards", "--pipeline", &format!("{ns}/orders")]).await?;
    assert!(ok && out.contains(&format!("consumer {worker}")) && out.contains("dead letters 7"), "{out}{err}");

    // The page: the shard with its worker pod, the letters by error signature.
    let overview = format!("/apis/console.streamfleet.io/v1alpha1/namespaces/{ns}/pipelines");
    let figures = tools::workspace_root().join("target/figures");
    std::fs::create_dir_all(&figures)?;
    let browser = Browser::through_proxy(&alice).await?;
    let page_path = format!("{overview}?pipeline=orders");
    let dom = eventually("the page showing the shard and its worker", T, || async {
        let dom = browser.dom(&page_path).await?;
        Ok((dom.contains(&worker) && dom.contains("7 dead letters match")).then_some(dom))
    })
    .await?;
    assert!(dom.contains("service unavailable") && dom.contains("card declined"), "{dom}");
    browser.screenshot(&page_path, (1280, 800), &figures.join("console-outage.png")).await?;

    // The provider is back. Alice replays the orders that ran out of
    // deliveries, from the page, after its dry-run count.
    let _: () = conn.del("{ledger}:down").await?;
    let mut page = browser.open(&page_path).await?;
    page.wait_until("the letters table", "document.querySelectorAll('#letters tbody tr').length === 7").await?;
    page.eval("document.querySelector('#filter [name=reason]').value = 'retries-exhausted'; document.getElementById('replay').click(); true").await?;
    page.wait_until(
        "the dry-run count",
        "(() => { const c = document.getElementById('confirm'); return !c.hidden && c.textContent.includes('5 dead letters would be replayed') })()",
    )
    .await?;
    page.eval("document.getElementById('confirm-yes').click(); true").await?;
    page.wait_until(
        "the replay's result",
        "document.getElementById('message').textContent.includes('5 of 5 replayed')",
    )
    .await?;

    // The letters return and the worker charges each order once.
    let mut charged = eventually("the replayed orders charged", T, || async {
        let charged: Vec<String> = conn.clone().hkeys("{ledger}:charges").await?;
        Ok((charged.len() == orders.len()).then_some(charged))
    })
    .await?;
    charged.sort();
    assert_eq!(charged, orders, "the orders replayed, and only those");
    let duplicates: usize = conn.hlen("{ledger}:duplicates").await?;
    assert_eq!(duplicates, 0, "each charged once");
    eventually("nothing pending", T, || async {
        let (ok, out, _) = kubectl_as(&alice, plugin.path(), &["get", "--raw", &shards_path]).await?;
        let list: serde_json::Value = if ok { serde_json::from_str(&out)? } else { serde_json::Value::Null };
        Ok((list["items"][0]["pending"] == 0 && list["items"][0]["lag"] == 0).then_some(()))
    })
    .await?;

    // The poison orders will never succeed: purged from the page, whose
    // confirmation starts on Cancel.
    page.eval("document.querySelector('#filter [name=reason]').value = 'permanent'; document.getElementById('purge').click(); true").await?;
    page.wait_until(
        "the purge's dry-run count",
        "(() => { const c = document.getElementById('confirm'); return !c.hidden && c.textContent.includes('2 dead letters would be purged for good') })()",
    )
    .await?;
    assert_eq!(page.eval("document.activeElement.id").await?, "confirm-no", "a purge starts on Cancel");
    page.eval("document.getElementById('confirm-yes').click(); true").await?;
    page.wait_until("the purge's result", "document.getElementById('message').textContent.includes('2 of 2 purged')")
        .await?;
    let dead: usize = conn.xlen("{orders}:dead:billing").await?;
    assert_eq!(dead, 0, "every letter replayed or purged");
    for (reason, note) in
        [("DeadLettersReplayed", "alice replayed 5 of 5"), ("DeadLettersPurged", "alice purged 2 of 2")]
    {
        eventually(reason, T, || async {
            let events = events_about(&client, &ns, "orders").await?;
            Ok(events
                .into_iter()
                .find(|e| e.reason.as_deref() == Some(reason) && e.note.as_deref().is_some_and(|n| n.contains(note))))
        })
        .await?;
    }
    Ok(())
}
