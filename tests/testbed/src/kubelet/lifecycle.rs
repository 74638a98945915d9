//! A pod's processes: starting and restarting containers (with the kubelet's
//! crash-loop back-off, 10 s doubling to 5 minutes), their exits under
//! `restartPolicy`, deletion (SIGTERM, the grace period but at least the
//! kubelet's minimum of 2 s, SIGKILL), `activeDeadlineSeconds`, and the pod
//! status reported for them.

use super::Kubelet;
use super::network::HOST_IP;
use crate::process::signal;
use anyhow::{Context as _, Result, anyhow};
use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use nix::sys::signal::Signal;
use serde_json::json;
use std::path::PathBuf;
use std::time::Duration;
use tokio::process::{Child, Command};

/// The longest wait between attempts to start a pod whose config is missing.
pub(super) const MAX_CONFIG_RETRY: Duration = Duration::from_secs(20);

/// The kubelet's crash-loop back-off: 10 s, doubling, capped at 5 minutes.
const CRASH_BACKOFF_FIRST: Duration = Duration::from_secs(10);
const CRASH_BACKOFF_MAX: Duration = Duration::from_secs(300);
/// A container that ran this long before exiting restarts with the first back-off again.
const CRASH_BACKOFF_RESET: Duration = Duration::from_secs(600);

/// The kubelet never gives a container less than this between SIGTERM and
/// SIGKILL, even when the pod is deleted with a grace period of 0 (force).
pub(super) const MIN_GRACE: Duration = Duration::from_secs(2);

impl Kubelet {
    pub(super) async fn start(&self, pod: &Pod) -> Result<PodRuntime, StartError> {
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let spec = pod.spec.as_ref().ok_or_else(|| StartError::Other(anyhow!("pod has no spec")))?;
        let dir = self.root.join(&ns).join(&name);
        std::fs::create_dir_all(&dir).map_err(|e| StartError::Other(e.into()))?;
        let mut resolved = Vec::new();
        for c in &spec.containers {
            resolved.push(c.image.as_deref().and_then(|image| self.images.resolve(image)).ok_or_else(|| {
                StartError::Config(
                    "ErrImagePull".into(),
                    format!("image {:?} is not mapped to a local binary", c.image),
                )
            })?);
        }
        // A pod that runs as an image's user gets a home that user can reach
        // (the checkout holding `dir` may be closed to others); its logs stay in `dir`.
        let user = resolved.iter().find_map(|r| r.user);
        let home = match user {
            Some(_) => user_home(&ns, &name).map_err(StartError::Other)?,
            None => dir.clone(),
        };
        let kubeconfig = self.identity(pod, &home).await?;
        if let Some((uid, gid)) = user {
            chown_tree(&home, uid, gid).map_err(StartError::Other)?;
        }
        let ip = self.slot.pod_ip(self.next_pod.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let mut containers = Vec::new();
        for (c, resolved) in spec.containers.iter().zip(resolved) {
            let env = self.resolve_env(pod, &ip, c).await?;
            containers.push(ContainerRuntime {
                spec: c.clone(),
                binary: resolved.binary,
                user: resolved.user,
                env,
                kubeconfig: kubeconfig.clone(),
                log: dir.join(format!("{}.log", c.name)),
                home: home.clone(),
                child: None,
                restarts: 0,
                crashes: 0,
                last_exit: None,
                started_at: None,
                ran_since: None,
                restart_at: None,
                probes: super::probes::ContainerProbes::default(),
            });
        }
        let mut rt = PodRuntime {
            containers,
            restart_policy: spec.restart_policy.clone().unwrap_or_else(|| "Always".into()),
            started: Time(k8s_openapi::jiff::Timestamp::now()),
            pod_ip: ip,
            start_latency: self.start_latency,
            deadline: spec
                .active_deadline_seconds
                .map(|s| tokio::time::Instant::now() + Duration::from_secs(u64::try_from(s).unwrap_or(0))),
            failure: None,
        };
        for i in 0..rt.containers.len() {
            rt.restart(i).await.map_err(StartError::Other)?;
        }
        Ok(rt)
    }
}

pub(super) enum StartError {
    /// The pod cannot start yet (missing Secret, unmapped image): reported, retried.
    Config(String, String),
    Other(anyhow::Error),
}

impl StartError {
    /// `CreateContainerConfigError`: a Secret, ConfigMap, key or token the
    /// container needs is missing.
    pub(super) fn config(message: String) -> Self {
        StartError::Config("CreateContainerConfigError".into(), message)
    }
}

impl From<anyhow::Error> for StartError {
    fn from(e: anyhow::Error) -> Self {
        StartError::Other(e)
    }
}

/// Sleeps until a scheduled restart is due and returns its container; never
/// returns when none is scheduled.
pub(super) async fn sleep_until_restart(next: Option<(tokio::time::Instant, usize)>) -> usize {
    match next {
        Some((at, i)) => {
            tokio::time::sleep_until(at).await;
            i
        }
        None => futures::future::pending().await,
    }
}

/// A terminated container's reason, as the kubelet reports it.
fn exit_reason(code: i32) -> &'static str {
    if code == 0 { "Completed" } else { "Error" }
}

/// The `n`th consecutive crash's back-off: 10 s, 20 s, 40 s, ... capped at 5 minutes.
fn restart_backoff(crashes: u32) -> Duration {
    let exp = crashes.clamp(1, 16) - 1;
    (CRASH_BACKOFF_FIRST * 2u32.pow(exp)).min(CRASH_BACKOFF_MAX)
}

/// The pod's termination grace period (the deletion's, else the spec's,
/// else 30 s), never below the kubelet's minimum.
pub(super) fn grace_period(pod: &Pod) -> Duration {
    let secs = pod
        .metadata
        .deletion_grace_period_seconds
        .or_else(|| pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds))
        .unwrap_or(30);
    Duration::from_secs(u64::try_from(secs).unwrap_or(0)).max(MIN_GRACE)
}

pub(super) async fn patch_status(api: &Api<Pod>, name: &str, status: serde_json::Value) {
    let patch = json!({ "status": status });
    if let Err(e) = api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        tracing::debug!("pod status {name}: {e}");
    }
}

pub(super) fn waiting_status(pod: &Pod, reason: &str, message: &str) -> serde_json::Value {
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

pub(super) struct ContainerRuntime {
    pub(super) spec: Container,
    binary: PathBuf,
    /// Runs as this (uid, gid): the user of an image from the OCI store.
    user: Option<(u32, u32)>,
    env: Vec<(String, String)>,
    kubeconfig: Option<PathBuf>,
    log: PathBuf,
    home: PathBuf,
    pub(super) child: Option<Child>,
    restarts: i32,
    /// Crashes since the container last ran for [`CRASH_BACKOFF_RESET`].
    crashes: u32,
    last_exit: Option<i32>,
    started_at: Option<Time>,
    ran_since: Option<tokio::time::Instant>,
    restart_at: Option<tokio::time::Instant>,
    pub(super) probes: super::probes::ContainerProbes,
}

impl ContainerRuntime {
    fn command(&self) -> Result<Command> {
        let mut cmd = self.exec_context().command(self.binary.as_os_str());
        cmd.args(self.spec.command.iter().flatten().skip(1));
        cmd.args(self.spec.args.iter().flatten());
        let log = std::fs::File::options().create(true).append(true).open(&self.log)?;
        cmd.stdout(log.try_clone()?).stderr(log);
        Ok(cmd)
    }

    /// How a process runs in this container: its environment, working
    /// directory and user (the container's own command, an exec probe).
    pub(super) fn exec_context(&self) -> ExecContext {
        ExecContext {
            env: self.env.clone(),
            home: self.home.clone(),
            working_dir: self.spec.working_dir.as_deref().map(PathBuf::from),
            kubeconfig: self.kubeconfig.clone(),
            user: self.user,
        }
    }
}

/// What a process in a container runs with ([`ContainerRuntime::exec_context`]).
pub(super) struct ExecContext {
    env: Vec<(String, String)>,
    home: PathBuf,
    working_dir: Option<PathBuf>,
    kubeconfig: Option<PathBuf>,
    user: Option<(u32, u32)>,
}

impl ExecContext {
    /// `program` with the container's environment, working directory and
    /// user; no stdin, and killed if dropped.
    pub(super) fn command(&self, program: &std::ffi::OsStr) -> Command {
        let mut cmd = Command::new(program);
        cmd.env_clear();
        cmd.env("PATH", std::env::var_os("PATH").unwrap_or_default());
        cmd.env("HOME", &self.home);
        cmd.env("HOSTNAME", self.home.file_name().unwrap_or_default());
        if let Some(k) = &self.kubeconfig {
            cmd.env("KUBECONFIG", k);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.current_dir(self.working_dir.as_deref().unwrap_or(&self.home));
        cmd.stdin(std::process::Stdio::null());
        if let Some((uid, gid)) = self.user {
            cmd.uid(uid).gid(gid);
        }
        cmd.kill_on_drop(true);
        cmd
    }
}

pub(super) struct PodRuntime {
    pub(super) containers: Vec<ContainerRuntime>,
    restart_policy: String,
    started: Time,
    pub(super) pod_ip: String,
    /// How long creating a container takes (a warm image start).
    start_latency: Duration,
    /// `activeDeadlineSeconds`, from the pod's start.
    pub(super) deadline: Option<tokio::time::Instant>,
    /// Why the pod failed as a whole (`DeadlineExceeded`), with a message.
    failure: Option<(&'static str, String)>,
}

pub(super) enum ExitAction {
    Restart(Duration),
    Wait,
    Finish(&'static str),
}

/// A pod's home under the system's temporary folder, which every user can
/// traverse: `<tmp>/streamfleet-pods-<pid>/<namespace>/<pod>`.
fn user_home(ns: &str, name: &str) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let base = std::env::temp_dir().join(format!("streamfleet-pods-{}", std::process::id()));
    let home = base.join(ns).join(name);
    std::fs::create_dir_all(&home)?;
    for dir in [&base, &base.join(ns)] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(home)
}

/// Hands `dir` and everything in it to `uid:gid`.
fn chown_tree(dir: &std::path::Path, uid: u32, gid: u32) -> Result<()> {
    let owner = (Some(nix::unistd::Uid::from_raw(uid)), Some(nix::unistd::Gid::from_raw(gid)));
    nix::unistd::chown(dir, owner.0, owner.1).with_context(|| format!("chown {}", dir.display()))?;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            chown_tree(&path, uid, gid)?;
        } else {
            nix::unistd::chown(&path, owner.0, owner.1).with_context(|| format!("chown {}", path.display()))?;
        }
    }
    Ok(())
}

/// An exit status as the kubelet reports it: the code, or 128+n for signal n.
fn exit_code(status: std::io::Result<std::process::ExitStatus>) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    match status {
        Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
        Err(_) => 255,
    }
}

impl PodRuntime {
    pub(super) async fn restart(&mut self, index: usize) -> Result<()> {
        tokio::time::sleep(self.start_latency).await;
        let c = self.containers.get_mut(index).context("no such container")?;
        let mut cmd = c.command()?;
        let std_cmd = cmd.as_std_mut();
        crate::process::die_with_parent(std_cmd);
        c.child = Some(cmd.spawn().with_context(|| format!("starting {}", c.binary.display()))?);
        c.started_at = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        c.ran_since = Some(tokio::time::Instant::now());
        c.restart_at = None;
        c.probes = super::probes::ContainerProbes::new(&c.spec);
        Ok(())
    }

    /// Waits until some running container exits: (index, exit code; signal → 128+n).
    pub(super) async fn wait_any(&mut self) -> (usize, i32) {
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
        (i, exit_code(status))
    }

    pub(super) fn on_exit(&mut self, index: usize, code: i32) -> ExitAction {
        if let Some(c) = self.containers.get_mut(index) {
            c.child = None;
            c.last_exit = Some(code);
        }
        let restart = match self.restart_policy.as_str() {
            "Always" => true,
            "OnFailure" => code != 0,
            _ => false,
        };
        if restart && let Some(c) = self.containers.get_mut(index) {
            c.restarts += 1;
            let ran = c.ran_since.take().map(|t| t.elapsed()).unwrap_or_default();
            c.crashes = if ran >= CRASH_BACKOFF_RESET { 1 } else { c.crashes + 1 };
            return ExitAction::Restart(restart_backoff(c.crashes));
        }
        if self.containers.iter().any(|c| c.child.is_some()) {
            return ExitAction::Wait;
        }
        let failed = self.containers.iter().any(|c| c.last_exit.unwrap_or(0) != 0);
        ExitAction::Finish(if failed { "Failed" } else { "Succeeded" })
    }

    /// SIGTERM to one container, SIGKILL if it still runs after `grace`; its
    /// exit code (a signal n as 128+n), as the kubelet kills a container whose
    /// liveness or startup probe failed.
    pub(super) async fn kill_container(&mut self, index: usize, grace: Duration) -> i32 {
        let Some(child) = self.containers.get_mut(index).and_then(|c| c.child.as_mut()) else {
            return 0;
        };
        if let Some(pid) = child.id() {
            signal(pid, Signal::SIGTERM);
        }
        let status = match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => status,
            Err(_) => {
                let _ = child.start_kill();
                child.wait().await
            }
        };
        exit_code(status)
    }

    /// Ends a pod past its `activeDeadlineSeconds`: its containers are
    /// stopped and the pod fails with reason `DeadlineExceeded`.
    pub(super) async fn exceed_deadline(&mut self, grace: Duration) {
        self.terminate(grace).await;
        self.failure =
            Some(("DeadlineExceeded", "Pod was active on the node longer than the specified deadline".into()));
    }

    /// SIGTERM to every container, SIGKILL to those still running after `grace`.
    pub(super) async fn terminate(&mut self, grace: Duration) {
        for c in &self.containers {
            if let Some(pid) = c.child.as_ref().and_then(Child::id) {
                signal(pid, Signal::SIGTERM);
            }
        }
        let deadline = tokio::time::Instant::now() + grace;
        for c in &mut self.containers {
            if let Some(child) = c.child.as_mut() {
                let status = match tokio::time::timeout_at(deadline, child.wait()).await {
                    Ok(status) => status,
                    Err(_) => {
                        let _ = child.start_kill();
                        child.wait().await
                    }
                };
                c.last_exit = Some(exit_code(status));
            }
            c.child = None;
        }
    }

    pub(super) fn schedule_restart(&mut self, index: usize, delay: Duration) {
        if let Some(c) = self.containers.get_mut(index) {
            c.restart_at = Some(tokio::time::Instant::now() + delay);
        }
    }

    /// The earliest scheduled restart: (when, container index).
    pub(super) fn next_restart(&self) -> Option<(tokio::time::Instant, usize)> {
        self.containers.iter().enumerate().filter_map(|(i, c)| c.restart_at.map(|t| (t, i))).min()
    }

    pub(super) fn status(&self, finished: Option<&str>) -> serde_json::Value {
        let statuses: Vec<_> = self
            .containers
            .iter()
            .map(|c| {
                let running = c.child.is_some();
                let ready = running && c.probes.ready;
                let state = match (running, c.last_exit) {
                    (true, _) => json!({"running": {"startedAt": c.started_at}}),
                    (false, Some(code)) if finished.is_some() => json!({"terminated": {"exitCode": code, "reason": exit_reason(code), "startedAt": c.started_at, "finishedAt": Time(k8s_openapi::jiff::Timestamp::now())}}),
                    (false, _) => json!({"waiting": {"reason": "CrashLoopBackOff"}}),
                };
                let mut s = json!({"name": c.spec.name, "image": c.spec.image, "imageID": format!("local://{}", c.binary.display()),
                                   "containerID": format!("local://{}", c.child.as_ref().and_then(Child::id).unwrap_or(0)),
                                   "ready": ready, "started": running && c.probes.started, "restartCount": c.restarts, "state": state});
                if let Some(code) = c.last_exit.filter(|_| finished.is_none()) {
                    s["lastState"] = json!({"terminated": {"exitCode": code, "reason": exit_reason(code)}});
                }
                s
            })
            .collect();
        let all_ready = finished.is_none() && self.containers.iter().all(|c| c.child.is_some() && c.probes.ready);
        let ready = if all_ready { "True" } else { "False" };
        let phase = finished.unwrap_or("Running");
        let mut status = json!({
            "phase": phase, "hostIP": HOST_IP, "podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}],
            "startTime": self.started,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready},
                {"type": "Ready", "status": ready},
            ],
            "containerStatuses": statuses,
        });
        if let Some((reason, message)) = &self.failure {
            status["reason"] = json!(reason);
            status["message"] = json!(message);
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_backoff_is_the_kubelets_10s_doubling_to_5_minutes() {
        let secs: Vec<u64> = (1..=8).map(|n| restart_backoff(n).as_secs()).collect();
        assert_eq!(secs, [10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(restart_backoff(1000), CRASH_BACKOFF_MAX);
    }
}
