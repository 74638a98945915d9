//! The console API (`console.streamfleet.io`), an aggregated API reached
//! through the test bed's kube-apiserver (its Service served by the kubelet
//! stand-in's service proxy), used by people with their own identity: the
//! `kubectl streamfleet dlq` plugin and `kubectl get --raw`.

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use redis::AsyncCommands as _;
use std::path::Path;
use std::time::Duration;
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_e2e::console::*;
use streamfleet_e2e::*;
use streamfleet_streams::deadletter::{Letter, Reason, dead_letter};
use streamfleet_testbed::{eventually, tools};

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_counted_replayed_and_purged_through_the_api_server_with_the_users_rbac() -> Result<()>
{
    let mut f = Fixture::start("e2e-dlq", &["--set", "console.enabled=true"]).await?;
    let (bed, client, ns) = (f.bed, f.client.clone(), f.ns.name.clone());
    let records = tempfile::tempdir()?;
    let spec = "  scaling: {minReplicas: 0, maxReplicas: 1, pollIntervalSeconds: 1}";
    f.apply(&recording_manifest("p", "orders", "billing", &records.path().display().to_string(), spec)).await?;
    wait_condition(&client, &ns, "p", "GroupReady", "True", None, T).await?;
    // Six orders delivered to a consumer and dead-lettered as a worker would.
    let reasons = [
        Reason::Permanent,
        Reason::Permanent,
        Reason::Permanent,
        Reason::Malformed,
        Reason::Malformed,
        Reason::MaxDeliveries,
    ];
    for i in 0..reasons.len() {
        let _: String = f.conn.xadd("orders", "*", &[("order_id", format!("o-{i}"))]).await?;
    }
    let opts = redis::streams::StreamReadOptions::default().group("billing", "c1").count(10);
    let read: redis::streams::StreamReadReply = f.conn.xread_options(&["orders"], &[">"], &opts).await?;
    for (i, (e, reason)) in read.keys[0].ids.iter().zip(reasons).enumerate() {
        let entry = streamfleet_streams::Entry {
            stream: "orders".into(),
            id: e.id.clone(),
            fields: streamfleet_streams::entry::fields_from_map(e.map.clone()),
            deliveries: 1,
            crashes: 0,
        };
        let key = format!("o-{i}");
        let letter = Letter {
            group: "billing",
            consumer: "c1",
            reason,
            error: "card declined",
            business_key: Some(&key),
            while_pending: false,
        };
        dead_letter(&mut f.conn, "{orders}:dead:billing", &entry, &letter).await?;
    }
    let plugin = tempfile::tempdir()?;
    std::os::unix::fs::symlink(
        streamfleet_testbed::tools::cargo_bin("streamfleet")?,
        plugin.path().join("kubectl-streamfleet"),
    )?;
    let pipeline = format!("{ns}/p");

    // alice may edit pipelines in this namespace (the chart's ready-made
    // role); bob has no rights at all. Neither may read the Redis Secret.
    let alice = bed.person_kubeconfig("alice")?;
    let bob = bed.person_kubeconfig("bob")?;
    let edit_role = format!("{}-streamfleet-edit", f.release);
    run_ok(
        bed,
        "kubectl",
        &["create", "rolebinding", "alice-edit", "-n", &ns, "--clusterrole", &edit_role, "--user", "alice"],
        None,
    )
    .await?;
    let as_person = async |kubeconfig: &Path, args: &[&str]| kubectl_as(kubeconfig, plugin.path(), args).await;
    let (can_read_secret, _, err) = as_person(&alice, &["get", "secret", "redis", "-n", &ns]).await?;
    assert!(!can_read_secret && err.contains("forbidden"), "alice cannot read the Redis URL: {err}");

    // The console answers through the API server once its APIService is available.
    let stats_path = format!("/apis/console.streamfleet.io/v1alpha1/namespaces/{ns}/pipelines/p/deadletterstats");
    let raw = eventually("the console through the API server", T, || async {
        let (ok, out, _) = as_person(&alice, &["get", "--raw", &stats_path]).await?;
        Ok(ok.then_some(out))
    })
    .await?;
    let stats: serde_json::Value = serde_json::from_str(&raw)?;
    assert_eq!(stats["total"], 6, "kubectl get --raw as alice: {raw}");

    // bob: refused, by the API server, and nothing of the letters shown.
    let (ok, out, err) = as_person(&bob, &["get", "--raw", &stats_path]).await?;
    assert!(!ok && err.contains("forbidden") && out.is_empty(), "bob: {out} {err}");
    let (ok, out, err) = kubectl_dlq(&bob, plugin.path(), &["--pipeline", &pipeline, "list"]).await?;
    let leaked = |text: &str| text.contains("card declined") || text.contains("key=o-") || text.contains("businessKey");
    assert!(!ok && err.contains("forbidden") && !leaked(&out) && !leaked(&err), "bob's CLI: {out} {err}");

    // The console decides too, with the user's own RBAC: bob, allowed the
    // console's paths by the API server but not to get the pipeline, is
    // refused by the console itself (its SubjectAccessReview).
    let console_only = serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "console-paths-only"},
        "rules": [{"apiGroups": ["console.streamfleet.io"], "resources": ["pipelines/deadletterstats"], "verbs": ["get"]}],
    });
    f.apply(&console_only.to_string()).await?;
    run_ok(
        bed,
        "kubectl",
        &["create", "rolebinding", "bob-console-paths", "-n", &ns, "--role", "console-paths-only", "--user", "bob"],
        None,
    )
    .await?;
    let refused = eventually("bob refused by the console, not the API server", T, || async {
        let (ok, out, err) = as_person(&bob, &["get", "--raw", &stats_path]).await?;
        assert!(!ok && out.is_empty(), "bob read the stats: {out}");
        Ok(err.contains("streamconsumergroups").then_some(err))
    })
    .await?;
    assert!(refused.contains("\"bob\"") && refused.contains("cannot get"), "{refused}");

    // The overview, from the pipelines' status: what alice sees; bob, allowed
    // the console's list by the API server but not to list the pipelines'
    // resources, is refused by the console.
    let overview = format!("/apis/console.streamfleet.io/v1alpha1/namespaces/{ns}/pipelines");
    let listed = eventually("the overview listing the pipeline", T, || async {
        let (ok, out, _) = as_person(&alice, &["get", "--raw", &overview]).await?;
        let list: serde_json::Value = if ok { serde_json::from_str(&out)? } else { serde_json::Value::Null };
        Ok((list["items"][0]["deadLetters"] == 6).then_some(list))
    })
    .await?;
    assert_eq!(listed["kind"], "PipelineList");
    let item = &listed["items"][0];
    assert_eq!((item["name"].as_str(), item["group"].as_str()), (Some("p"), Some("billing")), "{item}");
    assert!(item["health"].as_str().is_some_and(|h| h != "Unknown"), "{item}");
    assert!(item["delaySeconds"].as_i64().is_some() && item["history"].is_array(), "{item}");
    let list_role = serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "console-paths-only"},
        "rules": [{"apiGroups": ["console.streamfleet.io"], "resources": ["pipelines/deadletterstats"], "verbs": ["get"]},
                  {"apiGroups": ["console.streamfleet.io"], "resources": ["pipelines"], "verbs": ["list"]}],
    });
    f.apply(&list_role.to_string()).await?;
    let refused = eventually("bob's overview refused by the console", T, || async {
        let (ok, out, err) = as_person(&bob, &["get", "--raw", &overview]).await?;
        assert!(!ok && !out.contains("billing"), "bob listed the pipelines: {out}");
        Ok(err.contains("cannot list resource \"streamconsumergroups\"").then_some(err))
    })
    .await?;
    assert!(refused.contains("\"bob\""), "{refused}");

    // Identity headers on a connection that is not the API server's count
    // for nothing: straight to the console's Service, claiming to be alice.
    let answer = straight_to_console(&client, &ns, &f.release, &stats_path).await?;
    assert!(answer.starts_with("HTTP/1.1 401"), "a caller without the front-proxy certificate: {answer}");
    assert!(!answer.contains("total"), "{answer}");

    let dlq = async |args: &[&str]| {
        let mut all = vec!["--pipeline", pipeline.as_str(), "-o", "json"];
        all.extend_from_slice(args);
        kubectl_dlq(&alice, plugin.path(), &all).await
    };

    // The documented form, and the pipeline after the subcommand too.
    let (ok, out, err) = kubectl_dlq(&alice, plugin.path(), &["--pipeline", &pipeline, "stats"]).await?;
    assert!(ok && out.contains("total\t6") && out.contains("reason\tpermanent\t3"), "{out} {err}");
    let (ok, out, err) = kubectl_dlq(&alice, plugin.path(), &["stats", "--pipeline", &pipeline]).await?;
    assert!(ok && out.contains("total\t6"), "{out} {err}");

    // Paged: 4, then the rest from the cursor the first page printed.
    let (ok, out, err) = dlq(&["list", "--limit", "4"]).await?;
    assert!(ok, "{err}");
    let first = json_lines(&out);
    assert_eq!(first.len(), 4, "{out}");
    let cursor = err.trim().strip_prefix("more: --after ").expect(&err).to_string();
    let (_, out, err) = dlq(&["list", "--limit", "4", "--after", &cursor]).await?;
    let second = json_lines(&out);
    assert_eq!(second.len(), 2, "{out}");
    assert!(!err.contains("more:"), "the last page: {err}");
    assert_eq!(second[0]["deadLetterStream"], "{orders}:dead:billing", "found through the resource");

    // Filters: reason and business key.
    let (_, out, _) = dlq(&["list", "--reason", "malformed"]).await?;
    let keys: Vec<String> = json_lines(&out).iter().map(|l| l["businessKey"].as_str().unwrap().to_string()).collect();
    assert_eq!(keys, vec!["o-3", "o-4"]);
    let (_, out, _) = dlq(&["list", "--key", "o-5"]).await?;
    let only = json_lines(&out);
    assert_eq!((only.len(), only[0]["reason"].as_str()), (1, Some("max-deliveries")));
    let (_, out, _) = dlq(&["list", "--since", "2999-01-01T00:00:00Z"]).await?;
    assert!(json_lines(&out).is_empty(), "nothing in the future: {out}");

    // Show: the original payload with its metadata.
    let id = first[0]["id"].as_str().unwrap().to_string();
    let (_, out, _) = dlq(&["show", &id]).await?;
    let shown: serde_json::Value = serde_json::from_str(out.trim())?;
    assert_eq!(shown["payload"]["order_id"], "o-0");
    assert_eq!((shown["group"].as_str(), shown["error"].as_str()), (Some("billing"), Some("card declined")));

    // Stats by reason and by hour.
    let (_, out, _) = dlq(&["stats"]).await?;
    let stats: serde_json::Value = serde_json::from_str(out.trim())?;
    assert_eq!(stats["total"], 6);
    assert_eq!(stats["byReason"], serde_json::json!({"malformed": 2, "max-deliveries": 1, "permanent": 3}));
    let hours: u64 = stats["byHour"].as_object().unwrap().values().filter_map(serde_json::Value::as_u64).sum();
    assert_eq!(hours, 6);
    assert_eq!(stats["byError"], serde_json::json!({"card declined": 6}), "grouped by error signature");
    assert_eq!(stats["complete"], true);

    // Error text filters, case-insensitive.
    let (_, out, _) = dlq(&["list", "--error", "DECLINED", "--reason", "max-deliveries"]).await?;
    assert_eq!(json_lines(&out).len(), 1, "{out}");

    // The console's request log: a line per request naming the user, never
    // a body nor a filter's values (the payload read above, the error text
    // just asked for).
    let consoles = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels("app.kubernetes.io/name=streamfleet-console"))
        .await?;
    let log = consoles
        .items
        .iter()
        .map(|p| std::fs::read_to_string(bed.pod_dir(&ns, &p.name_any()).join("console.log")).unwrap_or_default())
        .collect::<String>();
    let shown = log.lines().find(|l| l.contains("request") && l.contains("/payloads/") && l.contains("alice"));
    assert!(shown.is_some_and(|l| l.contains("status=200")), "the payload read, logged: {log}");
    let filtered = log.lines().find(|l| l.contains("request") && l.contains("/deadletters") && l.contains("error"));
    assert!(filtered.is_some_and(|l| l.contains("reason")), "a filter's parameter names: {log}");
    assert!(!log.contains("DECLINED") && !log.contains("card declined") && !log.contains("order_id"), "{log}");

    // In flight: an entry held by a consumer (named after a live pod, so no
    // reaper takes it back), with its last error: who, how long, how often.
    let pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels("app.kubernetes.io/name=streamfleet-operator"))
        .await?;
    let holder = pods.items.first().map(|p| p.name_any()).unwrap_or_default();
    let held: String = f.conn.xadd("orders", "*", &[("order_id", "in-flight")]).await?;
    let opts_held = redis::streams::StreamReadOptions::default().group("billing", &holder).count(100);
    let _: redis::streams::StreamReadReply = f.conn.xread_options(&["orders"], &[">"], &opts_held).await?;
    let _: () =
        f.conn.hset(streamfleet_streams::keys::last_error_key("orders", "billing"), &held, "ledger timeout").await?;
    let pending = async |person: &Path, extra: &[&str]| {
        let mut args = vec!["streamfleet", "pending", "--pipeline", pipeline.as_str(), "-o", "json"];
        args.extend_from_slice(extra);
        kubectl_as(person, plugin.path(), &args).await
    };
    let (ok, out, err) = pending(&alice, &["--consumer", &holder]).await?;
    assert!(ok, "{err}");
    let entries = json_lines(&out);
    let entry = entries.iter().find(|e| e["id"] == held.as_str()).unwrap_or_else(|| panic!("{held} not listed: {out}"));
    assert_eq!((entry["consumer"].as_str(), entry["deliveries"].as_u64()), (Some(holder.as_str()), Some(1)), "{entry}");
    assert_eq!(entry["lastError"], "ledger timeout");
    let (_, out, _) = pending(&alice, &["--min-idle", "1h"]).await?;
    assert!(json_lines(&out).is_empty(), "nothing idle an hour: {out}");
    let (ok, _, err) = pending(&bob, &[]).await?;
    assert!(!ok && err.contains("forbidden"), "bob may not see what is in flight: {err}");

    // The web console, opened in headless Chromium through `kubectl proxy`
    // as each person: alice sees the pipeline, its letters grouped by error
    // and what is in flight; bob sees a refusal and none of it.
    let figures = tools::workspace_root().join("target/figures");
    std::fs::create_dir_all(&figures)?;
    let as_alice = Browser::through_proxy(&alice).await?;
    let page = eventually("the web console showing the pipeline", T, || async {
        let dom = as_alice.dom(&format!("{overview}?pipeline=p")).await?;
        Ok((dom.contains("card declined") && dom.contains(&held) && dom.contains("6 dead letters match"))
            .then_some(dom))
    })
    .await?;
    assert!(page.contains("namespace ") && page.contains(&ns), "{page}");
    as_alice.screenshot(&format!("{overview}?pipeline=p"), (1280, 800), &figures.join("console-pipeline.png")).await?;
    as_alice.screenshot(&format!("{overview}?pipeline=p"), (390, 844), &figures.join("console-phone.png")).await?;
    let as_bob = Browser::through_proxy(&bob).await?;
    let refused = as_bob.dom(&overview).await?;
    // Allowed the console's list by the API server (a Role above), bob gets
    // the page, whose data the console refuses him.
    assert!(refused.contains("cannot list resource") && refused.contains("bob"), "bob's browser: {refused}");
    assert!(!refused.contains("card declined") && !refused.contains("billing"), "bob's browser: {refused}");

    // Replay by filter: a dry run counts, changes nothing; a cap below the
    // count refuses; then the malformed ones go back to `orders` for `billing`.
    let length_before: usize = f.conn.xlen("orders").await?;
    let (ok, out, err) = dlq(&["replay", "--reason", "malformed", "--dry-run"]).await?;
    assert!(ok, "{err}");
    assert_eq!(json_lines(&out)[0]["matched"], 2, "{out}");
    let length: usize = f.conn.xlen("orders").await?;
    assert_eq!(length, length_before, "a dry run requeues nothing");
    let (ok, _, err) = dlq(&["replay", "--reason", "malformed", "--max", "1"]).await?;
    assert!(!ok && err.contains("cap of 1"), "{err}");
    let (ok, _, err) = dlq(&["replay", "--reason", "malformed", "--ids", "1-0"]).await?;
    assert!(!ok && err.contains("one way"), "IDs and a filter together are refused: {err}");
    let (ok, _, err) = kubectl_dlq(&bob, plugin.path(), &["--pipeline", &pipeline, "replay", "--all"]).await?;
    assert!(!ok && err.contains("forbidden"), "bob cannot replay: {err}");
    let (ok, out, err) = dlq(&["replay", "--reason", "malformed"]).await?;
    assert!(ok, "{err}");
    let replayed = &json_lines(&out)[0];
    assert_eq!((replayed["done"].as_u64(), replayed["requeued"].as_array().map(Vec::len)), (Some(2), Some(2)), "{out}");
    let event = wait_event(&client, &ns, "p", "DeadLettersReplayed", T).await?;
    let note = event.note.unwrap_or_default();
    assert!(note.contains("alice") && note.contains("replayed 2 of 2"), "{note}");
    let length_after: usize = f.conn.xlen("orders").await?;
    assert_eq!(length_after, length_before + 2);
    let dead: usize = f.conn.xlen("{orders}:dead:billing").await?;
    assert_eq!(dead, 4);

    // In the web console, as alice with the keyboard's focus: filter, ask to
    // replay, read the dry-run count in the confirmation, confirm; the letter
    // goes back to its stream, and the Event names her.
    let mut page = as_alice.open(&format!("{overview}?pipeline=p")).await?;
    page.wait_until("the letters table", "document.querySelectorAll('#letters tbody tr').length === 4").await?;
    page.eval("document.querySelector('#filter [name=reason]').value = 'max-deliveries'; document.getElementById('replay').click(); true").await?;
    let asked = page
        .wait_until(
            "the dry-run count in the confirmation",
            "(() => { const c = document.getElementById('confirm'); return !c.hidden && c.textContent.includes('1 dead letters would be replayed') ? c.textContent : false })()",
        )
        .await?;
    assert!(asked.as_str().is_some_and(|t| t.contains("max-deliveries")), "the confirmation names the filter: {asked}");
    let focused = page.eval("document.activeElement.id").await?;
    assert_eq!(focused, "confirm-yes", "the confirmation takes the keyboard focus");
    let length_before: usize = f.conn.xlen("orders").await?;
    page.eval("document.getElementById('confirm-yes').click(); true").await?;
    page.wait_until(
        "the replay's result",
        "document.getElementById('message').textContent.includes('1 of 1 replayed')",
    )
    .await?;
    let length_after: usize = f.conn.xlen("orders").await?;
    assert_eq!(length_after, length_before + 1, "the letter is back in its stream");
    let back: redis::streams::StreamRangeReply = f.conn.xrevrange_count("orders", "+", "-", 1).await?;
    let fields = streamfleet_streams::entry::fields_from_map(back.ids[0].map.clone());
    assert!(fields.contains(&("order_id".to_string(), b"o-5".to_vec())), "{fields:?}");
    let (_, out, _) = dlq(&["list"]).await?;
    let left: Vec<String> =
        json_lines(&out).iter().map(|l| l["reason"].as_str().unwrap_or_default().to_string()).collect();
    assert_eq!(left, vec!["permanent"; 3], "only the letters the filter chose were replayed");
    eventually("the web console's replay recorded as an Event", T, || async {
        let events = events_about(&client, &ns, "p").await?;
        Ok(events.into_iter().find(|e| e.note.as_deref().is_some_and(|n| n.contains("alice replayed 1 of 1"))))
    })
    .await?;
    drop(page);

    // Purge asks for --yes; a dry run deletes nothing; then the permanent ones go.
    let (ok, _, err) = dlq(&["purge", "--reason", "permanent"]).await?;
    assert!(!ok && err.contains("--yes"), "{err}");
    let (_, out, _) = dlq(&["purge", "--reason", "permanent", "--dry-run"]).await?;
    assert_eq!(json_lines(&out)[0]["done"], 3);
    let dead: usize = f.conn.xlen("{orders}:dead:billing").await?;
    assert_eq!(dead, 3, "a dry run deletes nothing");
    let (ok, out, err) = dlq(&["purge", "--reason", "permanent", "--yes"]).await?;
    assert!(ok, "{err}");
    assert_eq!(json_lines(&out)[0]["done"], 3);
    let (_, out, _) = dlq(&["list"]).await?;
    assert!(json_lines(&out).is_empty(), "all purged: {out}");

    // A pipeline that does not exist is a clear error.
    let (ok, _, err) = kubectl_dlq(&alice, plugin.path(), &["--pipeline", &format!("{ns}/nope"), "list"]).await?;
    assert!(!ok && err.contains("nope"), "{err}");

    // A cap: two more letters make three; capped at one, the oldest two go,
    // with the condition and a Warning saying so.
    let _: String = f.conn.xadd("orders", "*", &[("order_id", "late-1")]).await?;
    let _: String = f.conn.xadd("orders", "*", &[("order_id", "late-2")]).await?;
    let read: redis::streams::StreamReadReply = f.conn.xread_options(&["orders"], &[">"], &opts).await?;
    let mut newest = String::new();
    for e in read.keys.iter().flat_map(|k| &k.ids) {
        let fields = streamfleet_streams::entry::fields_from_map(e.map.clone());
        let entry =
            streamfleet_streams::Entry { stream: "orders".into(), id: e.id.clone(), fields, deliveries: 1, crashes: 0 };
        // The two replayed orders are read here too: they are not letters again.
        if !entry.field_str("order_id").is_some_and(|o| o.starts_with("late")) {
            continue;
        }
        let letter = Letter {
            group: "billing",
            consumer: "c1",
            reason: Reason::Permanent,
            error: "x",
            business_key: None,
            while_pending: false,
        };
        newest = dead_letter(&mut f.conn, "{orders}:dead:billing", &entry, &letter).await?.unwrap_or_default();
    }
    let scgs: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), &ns);
    let cap = serde_json::json!({"spec": {"recovery": {"deadLetterMaxLength": 1}}});
    scgs.patch("p", &PatchParams::default(), &Patch::Merge(cap)).await?;
    let scg = wait_condition(&client, &ns, "p", "DeadLetterCapReached", "True", None, T).await?;
    let condition = scg.status.unwrap().conditions.into_iter().find(|c| c.type_ == "DeadLetterCapReached").unwrap();
    assert_eq!(condition.reason, "AtCap");
    let kept: redis::streams::StreamRangeReply = f.conn.xrange_all("{orders}:dead:billing").await?;
    let kept: Vec<String> = kept.ids.into_iter().map(|e| e.id).collect();
    assert_eq!(kept, vec![newest.clone()], "the newest letter stays");
    let warning = wait_event(&client, &ns, "p", "DeadLetterCapReached", T).await?;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    let note = warning.note.unwrap_or_default();
    assert!(note.contains("holds 2") && note.contains("oldest 1"), "{note}");

    // The documents' examples, as written, with this pipeline and a real
    // letter ID in place of theirs, in order, as alice on her laptop: a
    // host of its own that reaches the API server and nothing else.
    let laptop = bed.isolated_host().await?;
    let gateway = laptop.gateway.to_string();
    // Its one route is its link (no default route): this machine's loopback,
    // where Redis, the pods and the Services listen, is not its own.
    let routes = laptop.routes().await?;
    assert!(routes.len() == 1 && routes[0].contains("/30") && !routes[0].starts_with("default"), "{routes:?}");
    assert!(laptop.reaches(&gateway, laptop.api_port).await?, "the laptop reaches the API server");
    let console_ip = Api::<k8s_openapi::api::core::v1::Service>::namespaced(client.clone(), &ns)
        .get(&format!("{}-streamfleet-console", f.release))
        .await?
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the console's Service has a cluster IP")?;
    let here = tokio::net::TcpStream::connect((console_ip.as_str(), 443)).await;
    assert!(here.is_ok(), "the console's Service answers on this machine");
    for (host, port, what) in
        [(gateway.as_str(), f.redis.port, "Redis across the link"), (console_ip.as_str(), 443, "the console's Service")]
    {
        assert!(!laptop.reaches(host, port).await?, "{what} ({host}:{port}) is out of the laptop's reach");
    }
    let alice_laptop = laptop.kubeconfig("alice")?;
    let commands = doc_commands(&["docs/dead-letters.md", "docs/quick-start.md", "docs/console.md"]);
    assert!(commands.len() >= 15, "the documents' kubectl examples: {commands:?}");
    for command in &commands {
        let line = command
            .replace("shop/orders", &pipeline)
            .replace("namespaces/shop/pipelines/orders", &format!("namespaces/{ns}/pipelines/p"))
            .replace("1700000000000-0", &newest);
        let words: Vec<&str> = line.split_whitespace().collect();
        let (ok, out, err) = kubectl_on(Some(&laptop), &alice_laptop, plugin.path(), &words[1..]).await?;
        assert!(ok, "{command}\n(run as: {line}, on the laptop)\n{out}{err}");
    }

    // Pause and resume (the documents' last two lines, as alice): each set
    // spec.suspend and left an Event naming her; bob may do neither.
    for (reason, word) in [("PipelinePaused", "paused"), ("PipelineResumed", "resumed")] {
        let event = wait_event(&client, &ns, "p", reason, T).await?;
        let note = event.note.unwrap_or_default();
        assert!(note.contains(&format!("alice {word} the pipeline")), "{note}");
    }
    let scg = Api::<StreamConsumerGroup>::namespaced(client.clone(), &ns).get("p").await?;
    assert!(!scg.spec.suspend, "resumed at the end");
    let (ok, out, err) =
        kubectl_as(&alice, plugin.path(), &["streamfleet", "pause", "--pipeline", &pipeline, "-o", "json"]).await?;
    assert!(ok && out.contains("\"suspended\":true"), "{out}{err}");
    let scg = Api::<StreamConsumerGroup>::namespaced(client.clone(), &ns).get("p").await?;
    assert!(scg.spec.suspend, "paused by alice through the console");
    let (ok, _, err) = kubectl_as(&bob, plugin.path(), &["streamfleet", "resume", "--pipeline", &pipeline]).await?;
    assert!(!ok && (err.contains("forbidden") || err.contains("cannot")), "bob may not resume: {err}");
    let scg = Api::<StreamConsumerGroup>::namespaced(client.clone(), &ns).get("p").await?;
    assert!(scg.spec.suspend, "still paused after bob's try");
    Ok(())
}

/// The `kubectl streamfleet …` and `kubectl get --raw /apis/console…`
/// lines of the documents' `sh` blocks, without their comments.
fn doc_commands(docs: &[&str]) -> Vec<String> {
    let mut commands = Vec::new();
    for doc in docs {
        let text = std::fs::read_to_string(repo_path(doc)).unwrap_or_else(|e| panic!("{doc}: {e}"));
        let mut in_sh = false;
        for line in text.lines() {
            if line.starts_with("```") {
                in_sh = line == "```sh";
                continue;
            }
            let command = line.split(" #").next().unwrap_or_default().trim();
            if in_sh
                && (command.starts_with("kubectl streamfleet ")
                    || command.starts_with("kubectl get --raw /apis/console"))
            {
                commands.push(command.to_string());
            }
        }
    }
    commands
}

/// `GET path` sent straight to the console's Service (TLS verified with the
/// chart's CA, no client certificate) with `X-Remote-User: alice` and
/// `X-Remote-Group: system:masters`: the whole answer.
async fn straight_to_console(client: &kube::Client, ns: &str, release: &str, path: &str) -> Result<String> {
    use k8s_openapi::api::core::v1::{Secret, Service};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let name = format!("{release}-streamfleet-console");
    let svc = Api::<Service>::namespaced(client.clone(), ns).get(&name).await?;
    let ip = svc.spec.and_then(|s| s.cluster_ip).unwrap_or_default();
    let secret = Api::<Secret>::namespaced(client.clone(), ns).get(&format!("{name}-tls")).await?;
    let ca = secret.data.and_then(|mut d| d.remove("ca.crt")).map(|b| b.0).unwrap_or_default();
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(&ca) {
        roots.add(cert?)?;
    }
    let config =
        rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect((ip.as_str(), 443)).await?;
    let server_name = rustls::pki_types::ServerName::try_from(format!("{name}.{ns}.svc"))?;
    let mut tls = connector.connect(server_name, tcp).await?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {name}\r\nX-Remote-User: alice\r\nX-Remote-Group: system:masters\r\nConnection: close\r\n\r\n"
    );
    tls.write_all(request.as_bytes()).await?;
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await?;
    Ok(answer)
}
