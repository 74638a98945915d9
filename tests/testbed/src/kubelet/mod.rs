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
//!   bind their pod IP do not collide. Services with a selector get a
//!   userspace proxy on their cluster IP (also on loopback) to ready pods.
//! * **Start.** Creating a container takes a while, as a warm image start
//!   does: 1 s by default (`TESTBED_POD_START_MS`); the pod shows
//!   `ContainerCreating` meanwhile.
//! * **Probes.** Startup, liveness and readiness probes (`httpGet`,
//!   `tcpSocket` against the pod IP; `exec` as a process with the
//!   container's environment, working directory and user, on this machine's
//!   filesystem) run with their delays, periods and thresholds; a failed
//!   startup or liveness probe kills the container, which restarts under
//!   `restartPolicy`; a container without a readiness probe is ready once
//!   started.
//! * **Lifecycle.** Exits follow `restartPolicy` with the kubelet's
//!   CrashLoopBackOff (10 s doubling to 5 minutes) and end the pod
//!   `Succeeded`/`Failed`. On deletion: SIGTERM, the grace period (never less
//!   than the kubelet's minimum of 2 s, also for a force delete, when the
//!   object is gone at once), SIGKILL, then the pod object is removed.
//!   `activeDeadlineSeconds` ends the pod `Failed` with `DeadlineExceeded`.
//!
//! gRPC probes, volumes, init containers, security contexts and resource
//! limits are not emulated.

mod env;
mod identity;
mod images;
mod lifecycle;
mod network;
mod probes;
mod services;

pub use env::field_value;
pub use images::{ImageMap, Resolved, image_repository};
pub use network::{SLOTS_DIR, Slot};

use anyhow::{Context as _, Result};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt as _};
use lifecycle::{
    ExitAction, MAX_CONFIG_RETRY, MIN_GRACE, PodRuntime, StartError, grace_period, patch_status, sleep_until_restart,
    waiting_status,
};
use network::HOST_IP;
use probes::sleep_until_opt;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

pub const NODE_NAME: &str = "testbed-node";

/// Shared settings of the stand-in.
pub struct Kubelet {
    next_pod: std::sync::atomic::AtomicU32,
    /// This bed's addresses.
    slot: Slot,
    /// How long creating a container takes.
    start_latency: Duration,
    client: Client,
    images: ImageMap,
    root: PathBuf,
    server: String,
    ca_pem: String,
}

impl Kubelet {
    pub fn new(client: Client, images: ImageMap, root: PathBuf, server: String, ca_pem: String, slot: Slot) -> Self {
        let start_ms = std::env::var("TESTBED_POD_START_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
        Self {
            next_pod: std::sync::atomic::AtomicU32::new(0),
            slot,
            start_latency: Duration::from_millis(start_ms),
            client,
            images,
            root,
            server,
            ca_pem,
        }
    }

    /// Registers the node and runs pods until the future is dropped (which
    /// kills every process it started).
    pub async fn run(self) -> Result<()> {
        self.register_node().await?;
        let _services = services::AbortOnDrop(tokio::spawn(services::proxy(self.client.clone())));
        let this = Arc::new(self);
        let pods: Api<Pod> = Api::all(this.client.clone());
        let mut supervisors: HashMap<String, watch::Sender<Option<Pod>>> = HashMap::new();
        let mut tasks = tokio::task::JoinSet::new();
        let mut events = watcher(pods, watcher::Config::default()).boxed();
        // Pods seen by a (re)list in progress: a pod deleted while the watch
        // was down has no Delete event, only its absence from the relist.
        let mut relisted: Option<HashSet<String>> = None;
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
                watcher::Event::Apply(p) => (p, false),
                watcher::Event::InitApply(p) => {
                    if let (Some(seen), Some(uid)) = (relisted.as_mut(), p.metadata.uid.as_ref()) {
                        seen.insert(uid.clone());
                    }
                    (p, false)
                }
                watcher::Event::Delete(p) => (p, true),
                watcher::Event::Init => {
                    relisted = Some(HashSet::new());
                    continue;
                }
                watcher::Event::InitDone => {
                    // Gone while the watch was down (force-deleted, say).
                    if let Some(seen) = relisted.take() {
                        supervisors.retain(|uid, tx| {
                            let kept = seen.contains(uid);
                            if !kept {
                                let _ = tx.send(None);
                            }
                            kept
                        });
                    }
                    continue;
                }
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
                // Gone from the API (force-deleted): the kubelet still gives
                // the containers its minimum grace.
                if let Some(rt) = runtime.as_mut() {
                    rt.terminate(MIN_GRACE).await;
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
                    patch_status(&api, &name, waiting_status(&pod, "ContainerCreating", "")).await;
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
                            backoff = (backoff * 2).min(MAX_CONFIG_RETRY);
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
            let deadline = rt.deadline;
            tokio::select! {
                () = sleep_until_opt(next_probe) => {
                    let outcome = rt.run_due_probes().await;
                    for index in outcome.kill {
                        let code = rt.kill_container(index, grace_period(&pod)).await;
                        if after_exit(rt, &api, &name, index, code).await {
                            return Ok(());
                        }
                    }
                    if outcome.changed {
                        patch_status(&api, &name, rt.status(None)).await;
                    }
                }
                () = sleep_until_opt(deadline) => {
                    rt.exceed_deadline(grace_period(&pod)).await;
                    patch_status(&api, &name, rt.status(Some("Failed"))).await;
                    return Ok(());
                }
                changed = rx.changed() => {
                    if changed.is_err() {
                        rt.terminate(MIN_GRACE).await;
                        return Ok(());
                    }
                }
                (index, code) = rt.wait_any() => {
                    if after_exit(rt, &api, &name, index, code).await {
                        return Ok(());
                    }
                }
                index = sleep_until_restart(next_restart) => {
                    if let Err(e) = rt.restart(index).await {
                        tracing::warn!("restarting {ns}/{name}: {e:#}");
                        rt.schedule_restart(index, MAX_CONFIG_RETRY);
                    }
                    patch_status(&api, &name, rt.status(None)).await;
                }
            }
        }
    }
}

/// Applies `restartPolicy` to a container that exited with `code` and reports
/// it; true when the pod has finished.
async fn after_exit(rt: &mut PodRuntime, api: &Api<Pod>, name: &str, index: usize, code: i32) -> bool {
    match rt.on_exit(index, code) {
        ExitAction::Restart(delay) => {
            rt.schedule_restart(index, delay);
            patch_status(api, name, rt.status(None)).await;
            false
        }
        ExitAction::Wait => {
            patch_status(api, name, rt.status(None)).await;
            false
        }
        ExitAction::Finish(phase) => {
            patch_status(api, name, rt.status(Some(phase))).await;
            true
        }
    }
}

fn pod_is_finished(pod: &Pod) -> bool {
    matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded") | Some("Failed"))
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

/// The process ID behind a container, from the `local://<pid>` container ID
/// the stand-in reports; `None` while it is not running.
pub fn container_pid(pod: &Pod, container: &str) -> Option<u32> {
    let status = pod.status.as_ref()?.container_statuses.as_ref()?.iter().find(|s| s.name == container)?;
    status.container_id.as_deref()?.strip_prefix("local://")?.parse().ok().filter(|pid| *pid != 0)
}
