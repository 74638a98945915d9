//! Helpers for end-to-end suites: kubectl and helm against the shared test
//! bed, operator installation from the chart, and waiting on resources.

pub mod console;

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_testbed::{TestBed, tools};

/// Runs a Go-built tool (`kubectl`, `helm`) against the test bed; `stdin` is piped in.
pub async fn run_tool(bed: &TestBed, tool: &str, args: &[&str], stdin: Option<&str>) -> Result<Output> {
    use tokio::io::AsyncWriteExt as _;
    let mut cmd = tokio::process::Command::new(tools::tool(tool)?);
    cmd.args(args)
        .env("KUBECONFIG", &bed.kubeconfig)
        .env("HELM_CACHE_HOME", bed.dir.join("helm/cache"))
        .env("HELM_CONFIG_HOME", bed.dir.join("helm/config"))
        .env("HELM_DATA_HOME", bed.dir.join("helm/data"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("starting {tool}"))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes()).await?;
    }
    Ok(child.wait_with_output().await?)
}

/// Like [`run_tool`], failing with the tool's stderr unless it succeeded.
pub async fn run_ok(bed: &TestBed, tool: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
    let out = run_tool(bed, tool, args, stdin).await?;
    if !out.status.success() {
        bail!("{tool} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn repo_path(rel: &str) -> PathBuf {
    tools::workspace_root().join(rel)
}

/// Installs the CRD (server-side apply, idempotent across parallel tests).
pub async fn ensure_crd(bed: &TestBed) -> Result<()> {
    let crd = repo_path("deploy/crds/streamconsumergroups.streamfleet.io.yaml");
    let crd = crd.display().to_string();
    run_ok(bed, "kubectl", &["apply", "--server-side", "--force-conflicts", "-f", &crd], None).await?;
    // `kubectl wait` fails at once, instead of waiting, on a CRD with no
    // conditions yet ("accessor error: <nil>"): one just created, here or by
    // a parallel test that deleted and re-created it. Asked again until
    // Established.
    let wait = ["wait", "--for=condition=Established", "--timeout=20s", "crd/streamconsumergroups.streamfleet.io"];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = run_tool(bed, "kubectl", &wait, None).await?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        let not_yet = stderr.contains("accessor error") || stderr.contains("NotFound");
        if !not_yet || std::time::Instant::now() >= deadline {
            bail!("kubectl {}: {stderr}", wait.join(" "));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `helm install`s the chart into `namespace`, watching only that namespace,
/// and waits for the operator to be ready. The operator image maps to the
/// freshly built `streamfleet` binary; it runs with the chart's
/// ServiceAccount and RBAC.
pub async fn install_operator(bed: &TestBed, namespace: &str, extra: &[&str]) -> Result<String> {
    ensure_crd(bed).await?;
    let release = format!("sf-{}", streamfleet_testbed::random_suffix());
    let chart = repo_path("charts/streamfleet").display().to_string();
    let watch = format!("watchNamespace={namespace}");
    let mut args = vec![
        "install",
        &release,
        &chart,
        "--namespace",
        namespace,
        "--set",
        &watch,
        "--set",
        "log.format=text",
        "--set",
        "log.level=info\\,streamfleet_operator=debug",
        // The console's APIService is cluster-wide: only the tests of the
        // console install it (passing console.enabled=true).
        "--set",
        "console.enabled=false",
        // The CRD is the test bed's (ensure_crd), shared by every release.
        "--set",
        "crds.install=false",
        // The test bed's pods share the host's network namespace.
        "--set",
        "listenOn=podIP",
        "--wait",
        "--timeout",
        "120s",
    ];
    args.extend_from_slice(extra);
    run_ok(bed, "helm", &args, None).await?;
    Ok(release)
}

pub async fn create_redis_secret(client: &Client, namespace: &str, name: &str, url: &str) -> Result<()> {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name}, "stringData": {"url": url}
    }))?;
    Api::<Secret>::namespaced(client.clone(), namespace)
        .patch(name, &PatchParams::apply("e2e").force(), &Patch::Apply(&secret))
        .await?;
    Ok(())
}

/// A StreamConsumerGroup manifest: `name` consumes `stream` as `group` with
/// the Redis URL from the `redis` Secret; its workers run `image` with `env`;
/// `spec` adds lines under `spec:` (two-space indented YAML).
pub fn manifest(name: &str, stream: &str, group: &str, image: &str, env: &[(&str, &str)], spec: &str) -> String {
    manifest_with_redis(name, stream, group, image, env, spec, "    urlSecretRef: {name: redis, key: url}")
}

/// [`manifest`] with `redis` (four-space indented YAML) under `spec.redis`.
pub fn manifest_with_redis(
    name: &str,
    stream: &str,
    group: &str,
    image: &str,
    env: &[(&str, &str)],
    spec: &str,
    redis: &str,
) -> String {
    let env: String = env.iter().map(|(k, v)| format!("              - {{name: {k}, value: \"{v}\"}}\n")).collect();
    format!(
        r#"apiVersion: streamfleet.io/v1alpha1
kind: StreamConsumerGroup
metadata:
  name: {name}
spec:
  redis:
{redis}
  stream: {stream}
  group: {group}
{spec}
  worker:
    template:
      spec:
        terminationGracePeriodSeconds: 5
        containers:
          - name: worker
            image: {image}
            env:
              - {{name: RUST_LOG, value: info}}
{env}"#
    )
}

/// A manifest whose workers are the test bed's `testproc`: they record their
/// environment under `record_dir` and never consume.
pub fn recording_manifest(name: &str, stream: &str, group: &str, record_dir: &str, spec: &str) -> String {
    manifest(name, stream, group, "streamfleet/testproc", &[("TESTPROC_DIR", record_dir)], spec)
}

/// One test's world: its namespace with the Helm-installed operator, its own
/// redis-server, and the `redis` Secret pointing at it.
pub struct Fixture {
    pub bed: &'static TestBed,
    pub client: Client,
    pub ns: streamfleet_testbed::TestNamespace,
    pub redis: streamfleet_testbed::RedisServer,
    pub conn: redis::aio::MultiplexedConnection,
    /// The operator's Helm release.
    pub release: String,
}

impl Fixture {
    pub async fn start(prefix: &str, helm_args: &[&str]) -> Result<Self> {
        Self::start_with_redis(prefix, helm_args, &[]).await
    }

    /// Like [`Fixture::start`], with extra `redis-server` arguments.
    pub async fn start_with_redis(prefix: &str, helm_args: &[&str], redis_args: &[&str]) -> Result<Self> {
        let bed = TestBed::shared()?;
        let client = bed.client().await?;
        let ns = bed.namespace(&client, prefix).await?;
        let release = install_operator(bed, &ns.name, helm_args).await?;
        let redis = streamfleet_testbed::RedisServer::start_with(redis_args).await?;
        let conn = redis.connection().await?;
        create_redis_secret(&client, &ns.name, "redis", &redis.url()).await?;
        Ok(Self { bed, client, ns, redis, conn, release })
    }

    /// `kubectl apply` of a manifest into the fixture's namespace.
    pub async fn apply(&self, manifest: &str) -> Result<String> {
        run_ok(self.bed, "kubectl", &["apply", "-n", &self.ns.name, "-f", "-"], Some(manifest)).await
    }

    pub async fn wait_condition(&self, name: &str, type_: &str, status: &str) -> Result<StreamConsumerGroup> {
        wait_condition(&self.client, &self.ns.name, name, type_, status, None, Duration::from_secs(120)).await
    }
}

/// Waits until the resource's condition `type_` has `status`, returning the resource.
pub async fn wait_condition(
    client: &Client,
    namespace: &str,
    name: &str,
    type_: &str,
    status: &str,
    reason: Option<&str>,
    timeout: Duration,
) -> Result<StreamConsumerGroup> {
    let api: Api<StreamConsumerGroup> = Api::namespaced(client.clone(), namespace);
    let what = format!("{name}: {type_}={status} ({reason:?})");
    streamfleet_testbed::eventually(&what, timeout, || async {
        let scg = api.get(name).await?;
        let hit = scg.status.as_ref().is_some_and(|s| {
            s.conditions.iter().any(|c| c.type_ == type_ && c.status == status && reason.is_none_or(|r| c.reason == r))
        });
        Ok(hit.then_some(scg))
    })
    .await
}

/// Events about `name` in `namespace`.
pub async fn events_about(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Vec<k8s_openapi::api::events::v1::Event>> {
    let api: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), namespace);
    Ok(api
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect())
}

/// The first Event about `name` with `reason`, once there is one.
pub async fn wait_event(
    client: &Client,
    namespace: &str,
    name: &str,
    reason: &str,
    timeout: Duration,
) -> Result<k8s_openapi::api::events::v1::Event> {
    streamfleet_testbed::eventually(&format!("a {reason} Event about {name}"), timeout, || async {
        let events = events_about(client, namespace, name).await?;
        Ok(events.into_iter().find(|e| e.reason.as_deref() == Some(reason)))
    })
    .await
}

/// How many times Events about `name` with `reason` occurred (the recorder
/// folds repeats of one reason into a series on one Event).
pub async fn event_count(client: &Client, namespace: &str, name: &str, reason: &str) -> Result<i32> {
    Ok(events_about(client, namespace, name)
        .await?
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| e.series.map(|s| s.count).unwrap_or(1))
        .sum())
}

/// The reasons of Events about `name` in `namespace`.
pub async fn event_reasons(client: &Client, namespace: &str, name: &str) -> Result<Vec<String>> {
    Ok(events_about(client, namespace, name).await?.into_iter().filter_map(|e| e.reason).collect())
}

/// GET `path` from the operator pod of `namespace` (its probes/metrics port
/// on its pod IP) and return the body.
pub async fn operator_http(client: &Client, namespace: &str, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), namespace);
    let list =
        pods.list(&kube::api::ListParams::default().labels("app.kubernetes.io/name=streamfleet-operator")).await?;
    let ip = list
        .items
        .iter()
        .find_map(|p| p.status.as_ref().and_then(|s| s.pod_ip.clone()))
        .context("no operator pod IP")?;
    let mut stream = tokio::net::TcpStream::connect((ip.as_str(), 8080)).await?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: {ip}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default())
}

/// SIGKILLs the process of the first container of pod `name` (no pod delete:
/// the process dies as it would from the OOM killer or a node fault) and
/// waits until the kubelet stand-in has seen it die: the restart count moved
/// and the last state is `terminated` with exit code 137. A pod a rollout
/// deletes meanwhile is not restarted: then the kill is shown by the process
/// being gone and the pod terminating. Returns the killed pid.
/// Whether process `pid` has exited (gone, or a zombie not yet reaped).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // "<pid> (<comm>) <state> …": the state follows the last ')'.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

pub async fn sigkill_container(client: &Client, namespace: &str, name: &str) -> Result<u32> {
    use k8s_openapi::api::core::v1::Pod;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let restarts = |p: &Pod| {
        p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|s| s.first()).map(|s| s.restart_count)
    };
    // A container that has just died (of its own, e.g. an order that kills
    // its worker) may still show its old process: wait until the status
    // shows it running in a live one, or the kill would hit nothing and
    // its next restart would not be ours.
    let (before, pid) = streamfleet_testbed::eventually(
        &format!("{namespace}/{name} running in a live process"),
        Duration::from_secs(60),
        || {
            let pods = pods.clone();
            async move {
                let pod = pods.get(name).await?;
                let Some(status) = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref()?.first().cloned())
                else {
                    return Ok(None);
                };
                let running = status.state.as_ref().is_some_and(|s| s.running.is_some());
                let pid = streamfleet_testbed::kubelet::container_pid(&pod, &status.name);
                Ok(pid.filter(|pid| running && !process_gone(*pid)).map(|pid| (status.restart_count, pid)))
            }
        },
    )
    .await?;
    streamfleet_testbed::process::signal(pid, streamfleet_testbed::process::Signal::SIGKILL);
    streamfleet_testbed::eventually(
        &format!("{name} (pid {pid}) seen dead of SIGKILL"),
        Duration::from_secs(30),
        || {
            let pods = pods.clone();
            async move {
                let Some(p) = pods.get_opt(name).await? else {
                    return Ok(process_gone(pid).then_some(()));
                };
                if p.metadata.deletion_timestamp.is_some() && process_gone(pid) {
                    return Ok(Some(()));
                }
                let last = p
                    .status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref())
                    .and_then(|s| s.first())
                    .and_then(|s| s.last_state.as_ref())
                    .and_then(|s| s.terminated.as_ref())
                    .map(|t| t.exit_code);
                Ok((restarts(&p).unwrap_or(0) > before && last == Some(137)).then_some(()))
            }
        },
    )
    .await?;
    Ok(pid)
}
