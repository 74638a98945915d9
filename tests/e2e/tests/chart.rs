//! The chart and the shipped manifests, as a cluster would take them:
//! `helm template` under the settings users set (a subchart, other names,
//! a production install, RBAC off), and the quick start's manifests under
//! the `restricted` Pod Security Standard on the real API server.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use streamfleet_e2e::*;
use streamfleet_testbed::TestBed;

/// Every document `helm template` renders, as JSON values.
async fn rendered(bed: &TestBed, sets: &[&str]) -> Result<Vec<serde_json::Value>> {
    let chart = repo_path("charts/streamfleet").display().to_string();
    // The chart requires a recent Kubernetes; `helm template` assumes an old one.
    let mut args = vec!["template", "t", &chart, "--namespace", "ops", "--kube-version", "1.35.0"];
    for set in sets {
        args.extend(["--set", set]);
    }
    let yaml = run_ok(bed, "helm", &args, None).await?;
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&yaml) {
        let value: serde_json::Value = serde::Deserialize::deserialize(doc)?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// `helm template` with `sets` fails, and its error says `names`.
async fn refused_by_template(bed: &TestBed, sets: &[&str], names: &str) -> Result<()> {
    let chart = repo_path("charts/streamfleet").display().to_string();
    let mut args = vec!["template", "t", &chart, "--kube-version", "1.35.0"];
    for set in sets {
        args.extend(["--set", set]);
    }
    let refused = run_tool(bed, "helm", &args, None).await?;
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains(names), "{sets:?}: {said}");
    Ok(())
}

/// The first rendered object of `kind` that is the operator's own, not the
/// console's (which has its own Deployment, Service, Roles).
fn operator_object<'a>(docs: &'a [serde_json::Value], kind: &str) -> &'a serde_json::Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["labels"]["app.kubernetes.io/name"] != "streamfleet-console")
        .unwrap_or_else(|| panic!("no {kind} of the operator's"))
}

fn kinds(docs: &[serde_json::Value]) -> Vec<String> {
    docs.iter().map(|d| d["kind"].as_str().unwrap_or_default().to_string()).collect()
}

/// As a subchart (a parent's `global` values) and under other names: the
/// strict schema accepts `global`, and every object, the Lease its Role
/// names included, follows `fullnameOverride` or `nameOverride`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_works_as_a_subchart_and_under_other_names() -> Result<()> {
    let bed = TestBed::shared()?;
    let docs = rendered(bed, &["global.imageRegistry=registry.example", "fullnameOverride=payments-ops"]).await?;
    let deployment = operator_object(&docs, "Deployment");
    assert_eq!(deployment["metadata"]["name"], "payments-ops");
    let lease_role = operator_object(&docs, "Role");
    let named = lease_role["rules"].as_array().unwrap().iter().find(|r| r["resourceNames"].is_array()).unwrap();
    assert_eq!(named["resourceNames"][0], "payments-ops-leader");
    // The digest key's Secret: the one the operator is told, and the only
    // one its Role lets it read.
    let key_role = docs.iter().find(|d| d["kind"] == "Role" && d["metadata"]["name"] == "payments-ops-digest-key");
    let key_role = key_role.expect("the digest key's Role");
    let readable: Vec<_> =
        key_role["rules"].as_array().unwrap().iter().filter_map(|r| r["resourceNames"].get(0)).collect();
    let told = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "STREAMFLEET_DIGEST_KEY_SECRET")
        .map(|e| e["value"].clone());
    assert_eq!(
        (readable, told),
        (vec![&serde_json::json!("payments-ops-digest-key")], Some(serde_json::json!("payments-ops-digest-key")))
    );
    let docs = rendered(bed, &["nameOverride=queues"]).await?;
    let deployment = operator_object(&docs, "Deployment");
    assert_eq!(deployment["metadata"]["name"], "t-queues");
    Ok(())
}

/// By default each alert's runbook is the one of the chart's own release
/// (`docs/runbook.md` at the tag `v<appVersion>`), and it has a section
/// for the alert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_alert_links_its_section_of_the_runbook_of_the_charts_release() -> Result<()> {
    let bed = TestBed::shared()?;
    let docs = rendered(bed, &["prometheusRule.enabled=true"]).await?;
    let chart = std::fs::read_to_string(repo_path("charts/streamfleet/Chart.yaml"))?;
    let app_version = chart
        .lines()
        .find_map(|l| l.strip_prefix("appVersion:"))
        .map(|v| v.trim().trim_matches('"').to_string())
        .expect("appVersion in Chart.yaml");
    let runbook = std::fs::read_to_string(repo_path("docs/runbook.md"))?;
    let sections: Vec<String> =
        runbook.lines().filter_map(|l| l.strip_prefix("## ")).map(|h| h.trim().to_lowercase()).collect();
    let rules = operator_object(&docs, "PrometheusRule");
    for alert in rules["spec"]["groups"].as_array().unwrap().iter().flat_map(|g| g["rules"].as_array().unwrap()) {
        let url = alert["annotations"]["runbook_url"].as_str().unwrap();
        let base = format!("https://github.com/streamfleet/streamfleet/blob/v{app_version}/docs/runbook.md#");
        let anchor = url.strip_prefix(&base).unwrap_or_else(|| panic!("{url}"));
        let name = alert["alert"].as_str().unwrap().to_lowercase();
        assert_eq!(anchor, name, "{url}");
        assert!(sections.contains(&name), "docs/runbook.md has no section for {name}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_renders_what_a_production_install_sets() -> Result<()> {
    let bed = TestBed::shared()?;
    let defaults = rendered(bed, &[]).await?;
    let default_kinds = kinds(&defaults);
    for kind in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment", "Service"]
    {
        assert!(default_kinds.contains(&kind.to_string()), "{kind} by default: {default_kinds:?}");
    }
    assert!(!default_kinds.iter().any(|k| k == "PodDisruptionBudget" || k == "ServiceMonitor"), "{default_kinds:?}");
    let lease_role = operator_object(&defaults, "Role");
    let named = lease_role["rules"].as_array().unwrap().iter().find(|r| r["resourceNames"].is_array()).unwrap();
    assert_eq!(named["resourceNames"][0], "t-streamfleet-leader", "renews only its own Lease");
    // The CRD comes with the release (upgraded with it) and stays after it.
    let crd = operator_object(&defaults, "CustomResourceDefinition");
    let committed: serde_json::Value = serde_norway::from_str(&std::fs::read_to_string(repo_path(
        "deploy/crds/streamconsumergroups.streamfleet.io.yaml",
    ))?)?;
    assert_eq!(crd["spec"], committed["spec"], "the chart's CRD is the generated one");
    assert_eq!(crd["metadata"]["name"], "streamconsumergroups.streamfleet.io");
    assert_eq!(crd["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");
    // The real API server takes it as rendered (a server-side dry run over
    // the test bed's own copy).
    ensure_crd(bed).await?;
    run_ok(
        bed,
        "kubectl",
        &["apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-"],
        Some(&serde_json::to_string(crd)?),
    )
    .await?;
    let kept_off = rendered(bed, &["crds.keep=false"]).await?;
    assert!(operator_object(&kept_off, "CustomResourceDefinition")["metadata"]["annotations"].is_null());
    let without = rendered(bed, &["crds.install=false"]).await?;
    assert!(!kinds(&without).iter().any(|k| k == "CustomResourceDefinition"), "crds.install=false");

    let docs = rendered(
        bed,
        &[
            "podDisruptionBudget.enabled=true",
            "metrics.serviceMonitor.enabled=true",
            "metrics.serviceMonitor.labels.release=prom",
            "rbac.create=false",
            "serviceAccount.create=false",
            "serviceAccount.name=bring-your-own",
            "leaderElection.leaseName=ops-leader",
            "imagePullSecrets[0].name=regcred",
            "priorityClassName=system-cluster-critical",
            "nodeSelector.pool=ops",
            "tolerations[0].key=dedicated",
            "tolerations[0].operator=Exists",
            "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=pool",
            "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
            "topologySpreadConstraints[0].maxSkew=1",
            "topologySpreadConstraints[0].topologyKey=kubernetes.io/hostname",
            "topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
            "podAnnotations.team=payments",
            "podLabels.tier=ops",
            "podSecurityContext.runAsUser=1000",
            "podSecurityContext.runAsNonRoot=true",
            "securityContext.readOnlyRootFilesystem=true",
            "livenessProbe.periodSeconds=30",
            "readinessProbe.failureThreshold=6",
            "extraEnv[0].name=HTTPS_PROXY",
            "extraEnv[0].value=http://proxy:3128",
            "extraArgs[0]=--log-format=json",
            "extraVolumes[0].name=ca",
            "extraVolumes[0].configMap.name=corp-ca",
            "extraVolumeMounts[0].name=ca",
            "extraVolumeMounts[0].mountPath=/etc/corp-ca",
            "sweep.activeDeadlineSeconds=300",
            "terminationGracePeriodSeconds=45",
            "prometheusRule.enabled=true",
            "prometheusRule.runbookUrl=https://runbooks.example/streamfleet",
            "prometheusRule.delayObjectiveFor=2m",
            "prometheusRule.alerts.StreamfleetLagUnknown.enabled=false",
            "prometheusRule.alerts.StreamfleetPendingRising.for=30m",
            "prometheusRule.alerts.StreamfleetPendingRising.labels.team=payments",
            "prometheusRule.alerts.StreamfleetPendingRising.severity=page",
            "prometheusRule.alerts.StreamfleetDeadLettersGrowing.expr=streamfleet_dead_letter_length > 10",
            "dashboard.enabled=true",
            "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "networkPolicy.enabled=true",
            "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
            "metrics.workerPodMonitor.enabled=true",
            "metrics.workerPodMonitor.labels.release=prom",
            "watchNamespace=shop",
            "maxConcurrentReconciles=8",
        ],
    )
    .await?;
    // By digest, for the operator and its sweep Jobs alike.
    let pinned = "streamfleet/streamfleet@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let operator = operator_object(&docs, "Deployment");
    let container = &operator["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["image"], pinned);
    let env = container["env"].as_array().unwrap();
    let sweep_image = env.iter().find(|e| e["name"] == "STREAMFLEET_OPERATOR_IMAGE").unwrap();
    assert_eq!(sweep_image["value"], pinned);
    // Listening on every address by default, so `kubectl port-forward` reaches /metrics.
    let health = env.iter().find(|e| e["name"] == "STREAMFLEET_HEALTH_ADDR").unwrap();
    assert_eq!(health["value"], "0.0.0.0:8080");
    let bound = env.iter().find(|e| e["name"] == "STREAMFLEET_MAX_CONCURRENT_RECONCILES").unwrap();
    assert_eq!(bound["value"], "8");
    // The NetworkPolicy: the operator's pods take /metrics and probes from
    // the namespaces named, and nothing else.
    let policy = operator_object(&docs, "NetworkPolicy");
    assert_eq!(policy["spec"]["podSelector"]["matchLabels"], operator["spec"]["selector"]["matchLabels"]);
    assert_eq!(policy["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let ingress = &policy["spec"]["ingress"][0];
    assert_eq!(ingress["ports"], serde_json::json!([{"port": 8080, "protocol": "TCP"}]));
    assert_eq!(ingress["from"][0]["namespaceSelector"]["matchLabels"]["name"], "monitoring");
    let found = kinds(&docs);
    for kind in ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"] {
        assert!(!found.contains(&kind.to_string()), "{kind} with rbac.create/serviceAccount.create off: {found:?}");
    }
    let pdb = operator_object(&docs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    let monitor = operator_object(&docs, "ServiceMonitor");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prom");
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(monitor["spec"]["endpoints"][0]["honorLabels"], true, "the pipeline's namespace label stays");
    // The workers' PodMonitor selects what the operator labels its worker
    // pods with (objects.rs checks the template against them), in the
    // namespace it watches.
    let workers = operator_object(&docs, "PodMonitor");
    assert_eq!(workers["metadata"]["labels"]["release"], "prom");
    assert_eq!(workers["spec"]["namespaceSelector"]["matchNames"], serde_json::json!(["shop"]));
    assert_eq!(
        workers["spec"]["selector"]["matchLabels"],
        serde_json::json!({"app.kubernetes.io/managed-by": "streamfleet", "app.kubernetes.io/component": "worker"})
    );
    assert_eq!(workers["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    let rules = operator_object(&docs, "PrometheusRule");
    let alerts = rules["spec"]["groups"][0]["rules"].as_array().unwrap();
    assert!(alerts.len() >= 9, "{alerts:?}");
    for alert in alerts {
        let url = alert["annotations"]["runbook_url"].as_str().unwrap();
        assert!(url.starts_with("https://runbooks.example/streamfleet#streamfleet"), "{url}");
    }
    let objective = alerts.iter().find(|a| a["alert"] == "StreamfleetDelayObjectiveBreached").unwrap();
    assert_eq!(objective["for"], "2m", "prometheusRule.delayObjectiveFor");
    // Tuned per alert: one left out, one delayed and re-labelled, one with
    // its own threshold; the others as shipped.
    let named = |name: &str| alerts.iter().find(|a| a["alert"] == name);
    assert!(named("StreamfleetLagUnknown").is_none(), "enabled=false leaves the alert out");
    let rising = named("StreamfleetPendingRising").unwrap();
    assert_eq!((rising["for"].as_str(), rising["labels"]["team"].as_str()), (Some("30m"), Some("payments")));
    assert_eq!(rising["labels"]["severity"], "page");
    assert_eq!(named("StreamfleetDeadLettersGrowing").unwrap()["expr"], "streamfleet_dead_letter_length > 10");
    assert_eq!(named("StreamfleetPayloadLost").unwrap()["labels"]["severity"], "critical", "untouched");
    assert_eq!(alerts.len(), shipped_alerts() - 1);
    // What Prometheus would load: the tuned rules pass promtool's check.
    let tuned = tempfile::NamedTempFile::new()?;
    std::fs::write(tuned.path(), serde_json::json!({"groups": rules["spec"]["groups"]}).to_string())?;
    run_ok(bed, "promtool", &["check", "rules", &tuned.path().display().to_string()], None).await?;
    let dashboard = operator_object(&docs, "ConfigMap");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: serde_json::Value =
        serde_json::from_str(dashboard["data"]["streamfleet-pipelines.json"].as_str().unwrap())?;
    assert_eq!(json["uid"], "streamfleet-pipelines");
    let service = operator_object(&docs, "Service");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "health");

    let deployment = operator_object(&docs, "Deployment");
    let pod = &deployment["spec"]["template"];
    assert_eq!(pod["metadata"]["annotations"]["team"], "payments");
    assert_eq!(pod["metadata"]["labels"]["tier"], "ops");
    let spec = &pod["spec"];
    assert_eq!(spec["serviceAccountName"], "bring-your-own");
    assert_eq!(spec["priorityClassName"], "system-cluster-critical");
    assert_eq!(spec["nodeSelector"]["pool"], "ops");
    assert_eq!(spec["tolerations"][0]["key"], "dedicated");
    assert!(spec["affinity"]["nodeAffinity"].is_object());
    assert_eq!(spec["topologySpreadConstraints"][0]["topologyKey"], "kubernetes.io/hostname");
    assert_eq!(spec["securityContext"]["runAsUser"], 1000);
    assert_eq!(spec["terminationGracePeriodSeconds"], 45);
    assert_eq!(spec["volumes"][0]["configMap"]["name"], "corp-ca");
    let container = &spec["containers"][0];
    assert_eq!(container["args"], serde_json::json!(["run", "--log-format=json"]));
    assert_eq!(container["volumeMounts"][0]["mountPath"], "/etc/corp-ca");
    assert_eq!(container["livenessProbe"]["periodSeconds"], 30);
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["failureThreshold"], 6);
    assert_eq!(container["securityContext"]["capabilities"]["drop"][0], "ALL", "restricted unless overridden");
    let env: std::collections::BTreeMap<String, String> = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?.to_string(), e["value"].as_str()?.to_string())))
        .collect();
    assert_eq!(env["STREAMFLEET_LEASE_NAME"], "ops-leader");
    assert_eq!(env["STREAMFLEET_IMAGE_PULL_SECRETS"], "regcred");
    assert_eq!(env["STREAMFLEET_SWEEP_DEADLINE_SECONDS"], "300");
    let resources: serde_json::Value = serde_json::from_str(&env["STREAMFLEET_SWEEP_RESOURCES"])?;
    assert_eq!(resources["limits"]["memory"], "256Mi");
    assert_eq!(env["HTTPS_PROXY"], "http://proxy:3128");

    // A ServiceMonitor without the Service it scrapes is refused with a reason.
    refused_by_template(
        bed,
        &["metrics.serviceMonitor.enabled=true", "metrics.service.enabled=false"],
        "needs metrics.service.enabled",
    )
    .await?;
    // No reconcile at all is refused by the schema, named.
    refused_by_template(bed, &["maxConcurrentReconciles=0"], "maxConcurrentReconciles").await?;
    // A misspelt alert name is refused, named, instead of tuning nothing.
    refused_by_template(bed, &["prometheusRule.alerts.StreamfleetLagUnknwn.enabled=false"], "StreamfleetLagUnknwn")
        .await?;
    Ok(())
}

/// How many alerts `files/alerts.yaml` ships.
fn shipped_alerts() -> usize {
    yaml_docs("charts/streamfleet/files/alerts.yaml")[0]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["rules"].as_array().unwrap().len())
        .sum()
}

/// The documents of a YAML file of the repository.
fn yaml_docs(rel: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(repo_path(rel)).unwrap();
    serde_norway::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect()
}

/// `kubectl create --dry-run=server` of a pod with `spec` in `ns`: (accepted, stderr).
async fn pod_admitted(bed: &TestBed, ns: &str, name: &str, spec: &serde_json::Value) -> Result<(bool, String)> {
    let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec});
    let out =
        run_tool(bed, "kubectl", &["create", "--dry-run=server", "-n", ns, "-f", "-"], Some(&pod.to_string())).await?;
    Ok((out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_start_manifests_are_accepted_under_restricted_pod_security() -> Result<()> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    ensure_crd(bed).await?;
    let ns = bed.namespace(&client, "e2e-quickstart").await?;
    run_ok(bed, "kubectl", &["label", "namespace", &ns.name, "pod-security.kubernetes.io/enforce=restricted"], None)
        .await?;
    for file in
        ["deploy/examples/redis.yaml", "deploy/examples/redis-secret.yaml", "deploy/examples/order-pipeline.yaml"]
    {
        let path = repo_path(file).display().to_string();
        run_ok(bed, "kubectl", &["apply", "--dry-run=server", "-n", &ns.name, "-f", &path], None).await?;
    }
    // Pod Security is enforced on pods: the Redis pod, and a worker pod of
    // the example pipeline's template, are admitted as they are.
    let redis = yaml_docs("deploy/examples/redis.yaml");
    let sts = operator_object(&redis, "StatefulSet");
    let mut redis_pod = sts["spec"]["template"]["spec"].clone();
    // The claim the StatefulSet controller would make for the template's volume.
    redis_pod["volumes"].as_array_mut().unwrap().push(serde_json::json!({"name": "data", "emptyDir": {}}));
    let (ok, err) = pod_admitted(bed, &ns.name, "redis-0", &redis_pod).await?;
    assert!(ok, "the Redis pod is refused: {err}");
    let pipeline = yaml_docs("deploy/examples/order-pipeline.yaml");
    let worker_pod = pipeline[0]["spec"]["worker"]["template"]["spec"].clone();
    let (ok, err) = pod_admitted(bed, &ns.name, "orders-worker", &worker_pod).await?;
    assert!(ok, "the example worker pod is refused: {err}");
    // The check bites: the same Redis pod without its security context is refused.
    let mut lax = redis_pod.clone();
    lax["securityContext"] = serde_json::json!({});
    lax["containers"][0]["securityContext"] = serde_json::json!({});
    let (ok, err) = pod_admitted(bed, &ns.name, "lax", &lax).await?;
    assert!(!ok && err.contains("PodSecurity"), "a pod breaking the restricted standard was admitted: {err}");
    // The Secret the pipeline reads names the Redis of the quick start, as its user.
    let secret = yaml_docs("deploy/examples/redis-secret.yaml");
    let url = secret[0]["stringData"]["url"].as_str().unwrap();
    assert!(url.starts_with("redis://streamfleet:") && url.contains("@redis.shop.svc:6379"), "{url}");
    let users = operator_object(&redis, "Secret")["stringData"]["users.acl"].as_str().unwrap();
    assert!(users.contains("user default off") && users.contains("user streamfleet on >"), "{users}");
    Ok(())
}
