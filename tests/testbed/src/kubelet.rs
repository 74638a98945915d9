//! A kubelet stand-in for a machine without a container runtime.
//!
//! It registers one Node, binds every unscheduled pod to it (there is no
//! kube-scheduler), and runs each container as a local process:
//!
//! * **Image mapping.** An image `streamfleet/NAME[:tag]` runs the binary
//!   `NAME` from the cargo target folder; [`ImageMap::insert`] adds explicit
//!   entries (matched on the image without its tag), which win.
//! * **Command.** `command[0]` names the image's entrypoint, which is the
//!   mapped binary; the process gets `command[1..]` followed by `args`.
//! * **Env.** `value`, `fieldRef` (`metadata.name`, `metadata.namespace`,
//!   `metadata.uid`, `metadata.labels['k']`, `metadata.annotations['k']`,
//!   `spec.nodeName`, `spec.serviceAccountName`, `status.podIP`,
//!   `status.hostIP`), `secretKeyRef`, `configMapKeyRef` and `envFrom`
//!   are resolved; a missing required Secret or key leaves the container
//!   waiting with `CreateContainerConfigError`, retried.
//! * **Identity.** The pod's ServiceAccount gets a token from the TokenRequest
//!   API, bound to the pod, handed over as a per-pod kubeconfig in
//!   `KUBECONFIG`, so RBAC applies to the process exactly as in a cluster.
//! * **Network.** Pods share the host's network, but each gets its own pod IP
//!   in 127.0.0.0/8 (reported in status and `status.podIP`), so servers that
//!   bind their pod IP do not collide.
//! * **Readiness.** `httpGet` and `tcpSocket` readiness probes run against the
//!   pod IP; a container without one is ready while running.
//! * **Lifecycle.** Exits follow
//!   `restartPolicy` (with back-off) and end the pod `Succeeded`/`Failed`.
//!   On deletion: SIGTERM, the grace period, SIGKILL, then the pod object is
//!   removed.
//!
//! Liveness and startup probes, volumes, init containers, security contexts
//! and resource limits are not emulated.

use crate::control_plane::kubeconfig_yaml;
use crate::process::signal;
use anyhow::{Context as _, Result, anyhow};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Container, EnvVar, Node, Pod, Secret, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt as _};
use nix::sys::signal::Signal;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::sync::watch;

pub const NODE_NAME: &str = "testbed-node";
/// The node's address. Each pod gets an address of its own in 127.0.0.0/8, so
/// pods that bind their pod IP (as the chart's operator does) never collide.
const HOST_IP: &str = "127.0.0.1";
const MAX_BACKOFF: Duration = Duration::from_secs(20);

/// Image (without tag) → local binary.
#[derive(Clone, Debug, Default)]
pub struct ImageMap {
    explicit: HashMap<String, PathBuf>,
    bin_dir: Option<PathBuf>,
}

impl ImageMap {
    /// Maps `streamfleet/NAME` to `bin_dir/NAME`.
    pub fn with_bin_dir(bin_dir: PathBuf) -> Self {
        Self { explicit: HashMap::new(), bin_dir: Some(bin_dir) }
    }

    pub fn insert(&mut self, image: &str, binary: PathBuf) {
        self.explicit.insert(image_repository(image).to_string(), binary);
    }

    pub fn resolve(&self, image: &str) -> Option<PathBuf> {
        let repo = image_repository(image);
        if let Some(path) = self.explicit.get(repo) {
            return Some(path.clone());
        }
        let name = repo.strip_prefix("streamfleet/")?;
        let path = self.bin_dir.as_ref()?.join(name);
        path.is_file().then_some(path)
    }
}

/// The `n`th pod's address: 127.A.B.C with C in 1..=254, never 127.0.0.1.
pub fn pod_ip(n: u32) -> String {
    let c = 1 + n % 254;
    let b = (n / 254) % 256;
    let a = 1 + (n / 254 / 256) % 254;
    format!("127.{a}.{b}.{c}")
}

/// `registry/name:tag@digest` → `registry/name` (a `:` after the last `/` is a tag).
pub fn image_repository(image: &str) -> &str {
    let no_digest = image.split('@').next().unwrap_or(image);
    match no_digest.rfind(':') {
        Some(colon) if !no_digest[colon..].contains('/') => &no_digest[..colon],
        _ => no_digest,
    }
}

/// Shared settings of the stand-in.
pub struct Kubelet {
    next_pod: std::sync::atomic::AtomicU32,
    client: Client,
    images: ImageMap,
    root: PathBuf,
    server: String,
    ca_pem: String,
}

impl Kubelet {
    pub fn new(client: Client, images: ImageMap, root: PathBuf, server: String, ca_pem: String) -> Self {
        Self { next_pod: std::sync::atomic::AtomicU32::new(0), client, images, root, server, ca_pem }
    }

    /// Registers the node and runs pods until the future is dropped (which
    /// kills every process it started).
    pub async fn run(self) -> Result<()> {
        self.register_node().await?;
        let this = Arc::new(self);
        let pods: Api<Pod> = Api::all(this.client.clone());
        let mut supervisors: HashMap<String, watch::Sender<Option<Pod>>> = HashMap::new();
        let mut tasks = tokio::task::JoinSet::new();
        let mut events = watcher(pods, watcher::Config::default()).boxed();
        loop {
            let event = match events.try_next().await {
                Ok(Some(e)) => e,
                Ok(None) => return Ok(()),
                Err(e) => {
                    tracing::warn!("pod watch: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            let (pod, gone) = match event {
                watcher::Event::Apply(p) | watcher::Event::InitApply(p) => (p, false),
                watcher::Event::Delete(p) => (p, true),
                watcher::Event::Init | watcher::Event::InitDone => continue,
            };
            let Some(uid) = pod.metadata.uid.clone() else {
                continue;
            };
            if gone {
                if let Some(tx) = supervisors.remove(&uid) {
                    let _ = tx.send(None);
                }
                continue;
            }
            supervisors.retain(|_, tx| !tx.is_closed());
            match supervisors.get(&uid) {
                Some(tx) => {
                    let _ = tx.send(Some(pod));
                }
                None => {
                    if pod_is_finished(&pod) && pod.metadata.deletion_timestamp.is_none() {
                        continue;
                    }
                    let (tx, rx) = watch::channel(Some(pod));
                    supervisors.insert(uid, tx);
                    let this = this.clone();
                    tasks.spawn(async move { this.supervise(rx).await });
                }
            }
            while let Some(done) = tasks.try_join_next() {
                if let Ok(Err(e)) = done {
                    tracing::warn!("pod supervisor: {e:#}");
                }
            }
        }
    }

    async fn register_node(&self) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux"}},
        }))?;
        let pp = PatchParams::apply("testbed-kubelet").force();
        nodes.patch(NODE_NAME, &pp, &Patch::Apply(&node)).await?;
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let status = json!({"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "testbed kubelet stand-in", "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": NODE_NAME}],
            "capacity": {"cpu": "64", "memory": "256Gi", "pods": "1000"},
            "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "1000"},
            "nodeInfo": {"kubeletVersion": "testbed", "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "local-process://", "kernelVersion": "", "osImage": "",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""}
        }});
        nodes.patch_status(NODE_NAME, &PatchParams::default(), &Patch::Merge(&status)).await?;
        Ok(())
    }

    /// Drives one pod from binding to removal.
    async fn supervise(self: Arc<Self>, mut rx: watch::Receiver<Option<Pod>>) -> Result<()> {
        let Some(first) = rx.borrow().clone() else {
            return Ok(());
        };
        let (ns, name) = (first.namespace().unwrap_or_default(), first.name_any());
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let mut runtime: Option<PodRuntime> = None;
        let mut backoff = Duration::from_secs(1);
        loop {
            let Some(pod) = rx.borrow_and_update().clone() else {
                // Gone from the API (force-deleted): stop at once.
                if let Some(rt) = runtime.as_mut() {
                    rt.kill_all().await;
                }
                return Ok(());
            };
            if pod.metadata.deletion_timestamp.is_some() {
                if let Some(rt) = runtime.as_mut() {
                    rt.terminate(grace_period(&pod)).await;
                }
                let dp = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions { uid: pod.metadata.uid.clone(), resource_version: None }),
                    ..DeleteParams::default()
                };
                let _ = api.delete(&name, &dp).await;
                return Ok(());
            }
            match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
                None => {
                    if let Err(e) = bind(&api, &name).await {
                        tracing::warn!("binding {ns}/{name}: {e}");
                    }
                }
                Some(NODE_NAME) if runtime.is_none() && !pod_is_finished(&pod) => {
                    match self.start(&pod).await {
                        Ok(rt) => {
                            patch_status(&api, &name, rt.status(None)).await;
                            runtime = Some(rt);
                        }
                        Err(StartError::Config(reason, message)) => {
                            patch_status(&api, &name, waiting_status(&pod, &reason, &message)).await;
                            // Retry: the Secret or image may appear later.
                            tokio::select! {
                                _ = tokio::time::sleep(backoff) => {}
                                r = rx.changed() => if r.is_err() { return Ok(()) },
                            }
                            backoff = (backoff * 2).min(MAX_BACKOFF);
                            continue;
                        }
                        Err(StartError::Other(e)) => return Err(e),
                    }
                }
                _ => {}
            }
            let Some(rt) = runtime.as_mut() else {
                if rx.changed().await.is_err() {
                    return Ok(());
                }
                continue;
            };
            let next_restart = rt.next_restart();
            let next_probe = rt.next_probe();
            tokio::select! {
                () = sleep_until_opt(next_probe) => {
                    if rt.run_due_probes().await {
                        patch_status(&api, &name, rt.status(None)).await;
                    }
                }
                changed = rx.changed() => {
                    if changed.is_err() {
                        rt.kill_all().await;
                        return Ok(());
                    }
                }
                (index, code) = rt.wait_any() => {
                    match rt.on_exit(index, code) {
                        ExitAction::Restart(delay) => {
                            rt.schedule_restart(index, delay);
                            patch_status(&api, &name, rt.status(None)).await;
                        }
                        ExitAction::Wait => patch_status(&api, &name, rt.status(None)).await,
                        ExitAction::Finish(phase) => {
                            patch_status(&api, &name, rt.status(Some(phase))).await;
                            return Ok(());
                        }
                    }
                }
                index = sleep_until_restart(next_restart) => {
                    if let Err(e) = rt.restart(index).await {
                        tracing::warn!("restarting {ns}/{name}: {e:#}");
                        rt.schedule_restart(index, MAX_BACKOFF);
                    }
                    patch_status(&api, &name, rt.status(None)).await;
                }
            }
        }
    }

    async fn start(&self, pod: &Pod) -> Result<PodRuntime, StartError> {
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let spec = pod.spec.as_ref().ok_or_else(|| StartError::Other(anyhow!("pod has no spec")))?;
        let dir = self.root.join(&ns).join(&name);
        std::fs::create_dir_all(&dir).map_err(|e| StartError::Other(e.into()))?;
        let kubeconfig = self.identity(pod, &dir).await?;
        let ip = pod_ip(self.next_pod.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let mut containers = Vec::new();
        for c in &spec.containers {
            let binary = c.image.as_deref().and_then(|image| self.images.resolve(image)).ok_or_else(|| {
                StartError::Config(
                    "ErrImagePull".into(),
                    format!("image {:?} is not mapped to a local binary", c.image),
                )
            })?;
            let env = self.resolve_env(pod, &ip, c).await?;
            containers.push(ContainerRuntime {
                spec: c.clone(),
                binary,
                env,
                kubeconfig: kubeconfig.clone(),
                log: dir.join(format!("{}.log", c.name)),
                home: dir.clone(),
                child: None,
                restarts: 0,
                last_exit: None,
                started_at: None,
                restart_at: None,
                probe_ok: false,
                next_probe: None,
            });
        }
        let mut rt = PodRuntime {
            containers,
            restart_policy: spec.restart_policy.clone().unwrap_or_else(|| "Always".into()),
            started: Time(k8s_openapi::jiff::Timestamp::now()),
            pod_ip: ip,
        };
        for i in 0..rt.containers.len() {
            rt.restart(i).await.map_err(StartError::Other)?;
        }
        Ok(rt)
    }

    /// A per-pod kubeconfig carrying a token for the pod's ServiceAccount.
    async fn identity(&self, pod: &Pod, dir: &Path) -> Result<Option<PathBuf>, StartError> {
        let spec = pod.spec.as_ref();
        if spec.and_then(|s| s.automount_service_account_token) == Some(false) {
            return Ok(None);
        }
        let ns = pod.namespace().unwrap_or_default();
        let sa = spec.and_then(|s| s.service_account_name.clone()).unwrap_or_else(|| "default".into());
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &ns);
        let request = TokenRequest {
            metadata: ObjectMeta::default(),
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(24 * 3600),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(pod.name_any()),
                    uid: pod.metadata.uid.clone(),
                }),
            },
            status: None,
        };
        let issued: TokenRequest = match api.create_subresource("token", &sa, &PostParams::default(), &request).await {
            Ok(t) => t,
            Err(e) => {
                return Err(StartError::Config(
                    "CreateContainerConfigError".into(),
                    format!("token for serviceaccount {sa}: {e}"),
                ));
            }
        };
        let token = issued.status.map(|s| s.token).unwrap_or_default();
        let path = dir.join("kubeconfig");
        std::fs::write(&path, kubeconfig_yaml(&self.server, &self.ca_pem, &token, &ns))
            .map_err(|e| StartError::Other(e.into()))?;
        Ok(Some(path))
    }

    async fn resolve_env(&self, pod: &Pod, pod_ip: &str, c: &Container) -> Result<Vec<(String, String)>, StartError> {
        let ns = pod.namespace().unwrap_or_default();
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &ns);
        let maps: Api<ConfigMap> = Api::namespaced(self.client.clone(), &ns);
        let config_err = |m: String| StartError::Config("CreateContainerConfigError".into(), m);
        let mut out: Vec<(String, String)> = Vec::new();
        for from in c.env_from.iter().flatten() {
            let prefix = from.prefix.clone().unwrap_or_default();
            if let Some(r) = &from.secret_ref {
                match secrets.get_opt(&r.name).await.map_err(|e| StartError::Other(e.into()))? {
                    Some(s) => out.extend(secret_data(&s).into_iter().map(|(k, v)| (format!("{prefix}{k}"), v))),
                    None if r.optional == Some(true) => {}
                    None => return Err(config_err(format!("secret {:?} not found", r.name))),
                }
            }
            if let Some(r) = &from.config_map_ref {
                match maps.get_opt(&r.name).await.map_err(|e| StartError::Other(e.into()))? {
                    Some(m) => {
                        out.extend(m.data.unwrap_or_default().into_iter().map(|(k, v)| (format!("{prefix}{k}"), v)))
                    }
                    None if r.optional == Some(true) => {}
                    None => return Err(config_err(format!("configmap {:?} not found", r.name))),
                }
            }
        }
        for EnvVar { name, value, value_from } in c.env.iter().flatten() {
            let resolved = match (value, value_from) {
                (Some(v), _) => Some(expand_vars(v, &out)),
                (None, None) => Some(String::new()),
                (None, Some(from)) => {
                    if let Some(f) = &from.field_ref {
                        Some(
                            field_value(pod, pod_ip, &f.field_path)
                                .ok_or_else(|| config_err(format!("unsupported fieldRef {:?}", f.field_path)))?,
                        )
                    } else if let Some(r) = &from.secret_key_ref {
                        let secret = secrets.get_opt(&r.name).await.map_err(|e| StartError::Other(e.into()))?;
                        match secret.and_then(|s| secret_data(&s).remove(&r.key)) {
                            Some(v) => Some(v),
                            None if r.optional == Some(true) => None,
                            None => {
                                return Err(config_err(format!("secret {:?} key {:?} not found", r.name, r.key)));
                            }
                        }
                    } else if let Some(r) = &from.config_map_key_ref {
                        let map = maps.get_opt(&r.name).await.map_err(|e| StartError::Other(e.into()))?;
                        match map.and_then(|m| m.data.unwrap_or_default().remove(&r.key)) {
                            Some(v) => Some(v),
                            None if r.optional == Some(true) => None,
                            None => {
                                return Err(config_err(format!("configmap {:?} key {:?} not found", r.name, r.key)));
                            }
                        }
                    } else {
                        return Err(config_err(format!("env {name}: unsupported valueFrom")));
                    }
                }
            };
            if let Some(v) = resolved {
                out.retain(|(k, _)| k != name);
                out.push((name.clone(), v));
            }
        }
        Ok(out)
    }
}

enum StartError {
    /// The pod cannot start yet (missing Secret, unmapped image): reported, retried.
    Config(String, String),
    Other(anyhow::Error),
}

impl From<anyhow::Error> for StartError {
    fn from(e: anyhow::Error) -> Self {
        StartError::Other(e)
    }
}

fn secret_data(s: &Secret) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = s.string_data.clone().unwrap_or_default();
    for (k, v) in s.data.clone().unwrap_or_default() {
        out.insert(k, String::from_utf8_lossy(&v.0).into_owned());
    }
    out
}

/// `$(VAR)` references to earlier variables, as the kubelet expands them.
fn expand_vars(value: &str, env: &[(String, String)]) -> String {
    let mut out = value.to_string();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// The downward-API fields the stand-in supports.
pub fn field_value(pod: &Pod, pod_ip: &str, path: &str) -> Option<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let subscript =
        |prefix: &str| -> Option<String> { path.strip_prefix(prefix)?.strip_suffix("']").map(str::to_string) };
    match path {
        "metadata.name" => meta.name.clone(),
        "metadata.namespace" => meta.namespace.clone(),
        "metadata.uid" => meta.uid.clone(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        "status.podIP" => Some(pod_ip.to_string()),
        "status.hostIP" => Some(HOST_IP.to_string()),
        _ => {
            if let Some(key) = subscript("metadata.labels['") {
                return Some(meta.labels.as_ref()?.get(&key).cloned().unwrap_or_default());
            }
            if let Some(key) = subscript("metadata.annotations['") {
                return Some(meta.annotations.as_ref()?.get(&key).cloned().unwrap_or_default());
            }
            None
        }
    }
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => futures::future::pending().await,
    }
}

/// One readiness probe: `httpGet` (HTTP only; 200-399 passes) and `tcpSocket`
/// are run against the pod IP; `exec` and `grpc` are not emulated and pass.
async fn probe_once(probe: &k8s_openapi::api::core::v1::Probe, c: &Container, pod_ip: &str) -> bool {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let port_of = |p: &IntOrString| match p {
        IntOrString::Int(n) => u16::try_from(*n).ok(),
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|cp| cp.name.as_deref() == Some(name.as_str()))
            .and_then(|cp| u16::try_from(cp.container_port).ok()),
    };
    let timeout = Duration::from_secs(u64::try_from(probe.timeout_seconds.unwrap_or(1).max(1)).unwrap_or(1));
    let attempt = async {
        if let Some(http) = &probe.http_get {
            let host = http.host.clone().unwrap_or_else(|| pod_ip.to_string());
            let port = port_of(&http.port)?;
            let mut stream = tokio::net::TcpStream::connect((host.as_str(), port)).await.ok()?;
            let path = http.path.clone().unwrap_or_else(|| "/".into());
            let request = format!("GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut head = [0u8; 64];
            let n = stream.read(&mut head).await.ok()?;
            let code: u16 = String::from_utf8_lossy(&head[..n]).split_whitespace().nth(1)?.parse().ok()?;
            return Some((200..400).contains(&code));
        }
        if let Some(tcp) = &probe.tcp_socket {
            let host = tcp.host.clone().unwrap_or_else(|| pod_ip.to_string());
            let port = port_of(&tcp.port)?;
            return Some(tokio::net::TcpStream::connect((host.as_str(), port)).await.is_ok());
        }
        Some(true)
    };
    matches!(tokio::time::timeout(timeout, attempt).await, Ok(Some(true)))
}

/// Sleeps until a scheduled restart is due and returns its container; never
/// returns when none is scheduled.
async fn sleep_until_restart(next: Option<(tokio::time::Instant, usize)>) -> usize {
    match next {
        Some((at, i)) => {
            tokio::time::sleep_until(at).await;
            i
        }
        None => futures::future::pending().await,
    }
}

/// 1s, 2s, 4s, ... capped at [`MAX_BACKOFF`], like the kubelet's crash-loop back-off.
fn restart_backoff(restarts: i32) -> Duration {
    let exp = u32::try_from(restarts.clamp(1, 16) - 1).unwrap_or(0);
    (Duration::from_secs(1) * 2u32.pow(exp)).min(MAX_BACKOFF)
}

fn pod_is_finished(pod: &Pod) -> bool {
    matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded") | Some("Failed"))
}

fn grace_period(pod: &Pod) -> Duration {
    let secs = pod
        .metadata
        .deletion_grace_period_seconds
        .or_else(|| pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds))
        .unwrap_or(30);
    Duration::from_secs(u64::try_from(secs).unwrap_or(0))
}

async fn bind(api: &Api<Pod>, name: &str) -> Result<()> {
    let binding = json!({
        "apiVersion": "v1", "kind": "Binding",
        "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME},
    });
    api.create_subresource::<_, serde_json::Value>("binding", name, &PostParams::default(), &binding)
        .await
        .context("binding pod")?;
    Ok(())
}

async fn patch_status(api: &Api<Pod>, name: &str, status: serde_json::Value) {
    let patch = json!({ "status": status });
    if let Err(e) = api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        tracing::debug!("pod status {name}: {e}");
    }
}

fn waiting_status(pod: &Pod, reason: &str, message: &str) -> serde_json::Value {
    let statuses: Vec<_> = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .map(|c| {
            json!({"name": c.name, "image": c.image, "imageID": "", "ready": false, "restartCount": 0,
                        "state": {"waiting": {"reason": reason, "message": message}}})
        })
        .collect();
    json!({"phase": "Pending", "hostIP": HOST_IP, "containerStatuses": statuses,
           "conditions": [{"type": "PodScheduled", "status": "True"},
                          {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}]})
}

struct ContainerRuntime {
    spec: Container,
    binary: PathBuf,
    env: Vec<(String, String)>,
    kubeconfig: Option<PathBuf>,
    log: PathBuf,
    home: PathBuf,
    child: Option<Child>,
    restarts: i32,
    last_exit: Option<i32>,
    started_at: Option<Time>,
    restart_at: Option<tokio::time::Instant>,
    /// Readiness: true without a readiness probe, else the last probe's result.
    probe_ok: bool,
    next_probe: Option<tokio::time::Instant>,
}

impl ContainerRuntime {
    fn command(&self) -> Result<Command> {
        let mut cmd = Command::new(&self.binary);
        cmd.args(self.spec.command.iter().flatten().skip(1));
        cmd.args(self.spec.args.iter().flatten());
        cmd.env_clear();
        cmd.env("PATH", std::env::var_os("PATH").unwrap_or_default());
        cmd.env("HOME", &self.home);
        cmd.env("HOSTNAME", self.home.file_name().unwrap_or_default());
        if let Some(k) = &self.kubeconfig {
            cmd.env("KUBECONFIG", k);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(dir) = self.spec.working_dir.as_deref() {
            cmd.current_dir(dir);
        } else {
            cmd.current_dir(&self.home);
        }
        let log = std::fs::File::options().create(true).append(true).open(&self.log)?;
        cmd.stdout(log.try_clone()?).stderr(log).stdin(std::process::Stdio::null());
        cmd.kill_on_drop(true);
        Ok(cmd)
    }
}

struct PodRuntime {
    containers: Vec<ContainerRuntime>,
    restart_policy: String,
    started: Time,
    pod_ip: String,
}

enum ExitAction {
    Restart(Duration),
    Wait,
    Finish(&'static str),
}

impl PodRuntime {
    async fn restart(&mut self, index: usize) -> Result<()> {
        let c = self.containers.get_mut(index).context("no such container")?;
        let mut cmd = c.command()?;
        let std_cmd = cmd.as_std_mut();
        crate::process::die_with_parent(std_cmd);
        c.child = Some(cmd.spawn().with_context(|| format!("starting {}", c.binary.display()))?);
        c.started_at = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        c.restart_at = None;
        let probe = c.spec.readiness_probe.as_ref();
        c.probe_ok = probe.is_none();
        c.next_probe = probe.map(|p| {
            let delay = u64::try_from(p.initial_delay_seconds.unwrap_or(0)).unwrap_or(0);
            tokio::time::Instant::now() + Duration::from_secs(delay)
        });
        Ok(())
    }

    /// Waits until some running container exits: (index, exit code; signal → 128+n).
    async fn wait_any(&mut self) -> (usize, i32) {
        let waits: Vec<_> = self
            .containers
            .iter_mut()
            .enumerate()
            .filter_map(|(i, c)| c.child.as_mut().map(|ch| Box::pin(async move { (i, ch.wait().await) })))
            .collect();
        if waits.is_empty() {
            return futures::future::pending().await;
        }
        let ((i, status), _, _) = futures::future::select_all(waits).await;
        let code = match status {
            Ok(s) => {
                use std::os::unix::process::ExitStatusExt as _;
                s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
            }
            Err(_) => 255,
        };
        (i, code)
    }

    fn on_exit(&mut self, index: usize, code: i32) -> ExitAction {
        if let Some(c) = self.containers.get_mut(index) {
            c.child = None;
            c.last_exit = Some(code);
        }
        let restart = match self.restart_policy.as_str() {
            "Always" => true,
            "OnFailure" => code != 0,
            _ => false,
        };
        if restart {
            let restarts = match self.containers.get_mut(index) {
                Some(c) => {
                    c.restarts += 1;
                    c.restarts
                }
                None => 1,
            };
            return ExitAction::Restart(restart_backoff(restarts));
        }
        if self.containers.iter().any(|c| c.child.is_some()) {
            return ExitAction::Wait;
        }
        let failed = self.containers.iter().any(|c| c.last_exit.unwrap_or(0) != 0);
        ExitAction::Finish(if failed { "Failed" } else { "Succeeded" })
    }

    /// SIGTERM to every container, SIGKILL to those still running after `grace`.
    async fn terminate(&mut self, grace: Duration) {
        for c in &self.containers {
            if let Some(pid) = c.child.as_ref().and_then(Child::id) {
                signal(pid, Signal::SIGTERM);
            }
        }
        let deadline = tokio::time::Instant::now() + grace;
        for c in &mut self.containers {
            if let Some(child) = c.child.as_mut()
                && tokio::time::timeout_at(deadline, child.wait()).await.is_err()
            {
                let _ = child.kill().await;
            }
            c.child = None;
        }
    }

    async fn kill_all(&mut self) {
        for c in &mut self.containers {
            if let Some(child) = c.child.as_mut() {
                let _ = child.kill().await;
            }
            c.child = None;
        }
    }

    fn schedule_restart(&mut self, index: usize, delay: Duration) {
        if let Some(c) = self.containers.get_mut(index) {
            c.restart_at = Some(tokio::time::Instant::now() + delay);
        }
    }

    /// The earliest due readiness probe.
    fn next_probe(&self) -> Option<tokio::time::Instant> {
        self.containers.iter().filter(|c| c.child.is_some()).filter_map(|c| c.next_probe).min()
    }

    /// Runs the readiness probes that are due; true when readiness changed.
    async fn run_due_probes(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        let mut changed = false;
        for c in &mut self.containers {
            let (Some(due), Some(probe)) = (c.next_probe, c.spec.readiness_probe.clone()) else {
                continue;
            };
            if due > now || c.child.is_none() {
                continue;
            }
            let ok = probe_once(&probe, &c.spec, &self.pod_ip).await;
            changed |= ok != c.probe_ok;
            c.probe_ok = ok;
            let period = u64::try_from(probe.period_seconds.unwrap_or(10).max(1)).unwrap_or(10);
            c.next_probe = Some(now + Duration::from_secs(period));
        }
        changed
    }

    /// The earliest scheduled restart: (when, container index).
    fn next_restart(&self) -> Option<(tokio::time::Instant, usize)> {
        self.containers.iter().enumerate().filter_map(|(i, c)| c.restart_at.map(|t| (t, i))).min()
    }

    fn status(&self, finished: Option<&str>) -> serde_json::Value {
        let statuses: Vec<_> = self
            .containers
            .iter()
            .map(|c| {
                let running = c.child.is_some();
                let ready = running && c.probe_ok;
                let state = match (running, c.last_exit) {
                    (true, _) => json!({"running": {"startedAt": c.started_at}}),
                    (false, Some(code)) if finished.is_some() => json!({"terminated": {"exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" }, "startedAt": c.started_at, "finishedAt": Time(k8s_openapi::jiff::Timestamp::now())}}),
                    (false, _) => json!({"waiting": {"reason": "CrashLoopBackOff"}}),
                };
                let mut s = json!({"name": c.spec.name, "image": c.spec.image, "imageID": format!("local://{}", c.binary.display()),
                                   "containerID": format!("local://{}", c.child.as_ref().and_then(Child::id).unwrap_or(0)),
                                   "ready": ready, "started": running, "restartCount": c.restarts, "state": state});
                if let Some(code) = c.last_exit.filter(|_| finished.is_none()) {
                    s["lastState"] = json!({"terminated": {"exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" }}});
                }
                s
            })
            .collect();
        let all_ready = finished.is_none() && self.containers.iter().all(|c| c.child.is_some() && c.probe_ok);
        let ready = if all_ready { "True" } else { "False" };
        let phase = finished.unwrap_or("Running");
        json!({
            "phase": phase, "hostIP": HOST_IP, "podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.started,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
            ],
            "containerStatuses": statuses,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_repository_strips_tag_and_digest_but_not_registry_port() {
        assert_eq!(image_repository("streamfleet/testproc:0.1"), "streamfleet/testproc");
        assert_eq!(image_repository("streamfleet/testproc"), "streamfleet/testproc");
        assert_eq!(image_repository("reg:5000/a/b"), "reg:5000/a/b");
        assert_eq!(image_repository("reg:5000/a/b:v1@sha256:abc"), "reg:5000/a/b");
    }

    #[test]
    fn field_refs_resolve_from_pod() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "n", "labels": {"app": "x"}},
            "spec": {"containers": [], "nodeName": NODE_NAME}
        }))
        .unwrap();
        let ip = "127.1.0.7";
        assert_eq!(field_value(&pod, ip, "metadata.name").as_deref(), Some("p"));
        assert_eq!(field_value(&pod, ip, "metadata.namespace").as_deref(), Some("n"));
        assert_eq!(field_value(&pod, ip, "metadata.labels['app']").as_deref(), Some("x"));
        assert_eq!(field_value(&pod, ip, "spec.nodeName").as_deref(), Some(NODE_NAME));
        assert_eq!(field_value(&pod, ip, "status.podIP").as_deref(), Some(ip));
        assert_eq!(field_value(&pod, ip, "status.hostIP").as_deref(), Some(HOST_IP));
        assert_eq!(field_value(&pod, ip, "spec.bogus"), None);
    }

    #[test]
    fn pod_ips_are_distinct_loopback_addresses() {
        let ips: std::collections::BTreeSet<String> = (0..70_000).map(pod_ip).collect();
        assert_eq!(ips.len(), 70_000);
        for ip in &ips {
            let addr: std::net::Ipv4Addr = ip.parse().unwrap();
            assert!(addr.is_loopback() && addr != std::net::Ipv4Addr::LOCALHOST, "{ip}");
            assert!(!ip.ends_with(".0") && !ip.ends_with(".255"), "{ip}");
        }
    }

    #[test]
    fn restart_backoff_doubles_and_caps() {
        assert_eq!(restart_backoff(1), Duration::from_secs(1));
        assert_eq!(restart_backoff(3), Duration::from_secs(4));
        assert_eq!(restart_backoff(100), MAX_BACKOFF);
    }

    #[test]
    fn env_values_expand_earlier_variables() {
        let env = vec![("A".to_string(), "1".to_string())];
        assert_eq!(expand_vars("x-$(A)-$(B)", &env), "x-1-$(B)");
    }
}
