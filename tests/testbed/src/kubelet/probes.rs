//! Probes as the kubelet runs them: a startup probe first (liveness and
//! readiness wait for it), then liveness and readiness, each with its initial
//! delay, period and thresholds; `httpGet` and `tcpSocket` against the pod
//! IP, `exec` as a process with the container's environment and user.
//! A container whose startup or liveness probe fails `failureThreshold`
//! times in a row is killed and restarted under `restartPolicy`.

use super::lifecycle::{ExecContext, PodRuntime};
use k8s_openapi::api::core::v1::{Container, Probe};
use std::time::Duration;
use tokio::time::Instant;

/// One probe of one container and its run of results.
struct ProbeRun {
    probe: Probe,
    next: Instant,
    failures: i32,
    successes: i32,
}

impl ProbeRun {
    fn new(probe: Option<&Probe>, now: Instant) -> Option<Self> {
        let probe = probe?.clone();
        let delay = secs(probe.initial_delay_seconds, 0);
        Some(Self { probe, next: now + delay, failures: 0, successes: 0 })
    }

    /// Records one result; schedules the next run one period later.
    fn record(&mut self, ok: bool, now: Instant) {
        if ok {
            self.successes += 1;
            self.failures = 0;
        } else {
            self.failures += 1;
            self.successes = 0;
        }
        self.next = now + secs(self.probe.period_seconds, 10).max(Duration::from_secs(1));
    }

    fn failed(&self) -> bool {
        self.failures >= self.probe.failure_threshold.unwrap_or(3).max(1)
    }

    fn succeeded(&self) -> bool {
        self.successes >= self.probe.success_threshold.unwrap_or(1).max(1)
    }
}

fn secs(value: Option<i32>, default: u64) -> Duration {
    Duration::from_secs(value.and_then(|v| u64::try_from(v).ok()).unwrap_or(default))
}

/// A running container's probes.
#[derive(Default)]
pub(super) struct ContainerProbes {
    /// The startup probe has passed (or there is none).
    pub(super) started: bool,
    /// Ready: without a readiness probe, once started; else per its thresholds.
    pub(super) ready: bool,
    startup: Option<ProbeRun>,
    liveness: Option<ProbeRun>,
    readiness: Option<ProbeRun>,
}

impl ContainerProbes {
    /// The probes of a container that has just started.
    pub(super) fn new(spec: &Container) -> Self {
        let now = Instant::now();
        let startup = ProbeRun::new(spec.startup_probe.as_ref(), now);
        let readiness = ProbeRun::new(spec.readiness_probe.as_ref(), now);
        Self {
            started: startup.is_none(),
            ready: startup.is_none() && readiness.is_none(),
            startup,
            liveness: ProbeRun::new(spec.liveness_probe.as_ref(), now),
            readiness,
        }
    }

    /// When the next probe of this container is due.
    fn next(&self) -> Option<Instant> {
        if !self.started {
            return self.startup.as_ref().map(|p| p.next);
        }
        [&self.liveness, &self.readiness].into_iter().flatten().map(|p| p.next).min()
    }
}

/// What a round of probes found.
#[derive(Default)]
pub(super) struct ProbeOutcome {
    /// Some container's readiness or started state changed.
    pub(super) changed: bool,
    /// Containers to kill: their startup or liveness probe failed.
    pub(super) kill: Vec<usize>,
}

impl PodRuntime {
    /// The earliest due probe of a running container.
    pub(super) fn next_probe(&self) -> Option<Instant> {
        self.containers.iter().filter(|c| c.child.is_some()).filter_map(|c| c.probes.next()).min()
    }

    /// Runs the probes that are due.
    pub(super) async fn run_due_probes(&mut self) -> ProbeOutcome {
        let now = Instant::now();
        let mut outcome = ProbeOutcome::default();
        for (index, c) in self.containers.iter_mut().enumerate() {
            if c.child.is_none() {
                continue;
            }
            let exec = c.exec_context();
            let (spec, pod_ip, p) = (&c.spec, self.pod_ip.as_str(), &mut c.probes);
            if !p.started {
                if let Some(run) = p.startup.as_mut().filter(|r| r.next <= now) {
                    run.record(probe_once(&run.probe, spec, &exec, pod_ip).await, now);
                    if run.succeeded() {
                        p.started = true;
                        p.ready = p.readiness.is_none();
                        p.startup = None;
                        outcome.changed = true;
                    } else if run.failed() {
                        outcome.kill.push(index);
                    }
                }
                continue;
            }
            if let Some(run) = p.liveness.as_mut().filter(|r| r.next <= now) {
                run.record(probe_once(&run.probe, spec, &exec, pod_ip).await, now);
                if run.failed() {
                    outcome.kill.push(index);
                    continue;
                }
            }
            if let Some(run) = p.readiness.as_mut().filter(|r| r.next <= now) {
                run.record(probe_once(&run.probe, spec, &exec, pod_ip).await, now);
                let ready = if run.succeeded() {
                    true
                } else if run.failed() {
                    false
                } else {
                    p.ready
                };
                outcome.changed |= ready != p.ready;
                p.ready = ready;
            }
        }
        outcome
    }
}

pub(super) async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => futures::future::pending().await,
    }
}

/// One probe: `httpGet` (HTTP only; 200-399 passes) and `tcpSocket` are run
/// against the pod IP; `exec` runs its command with the container's
/// environment, working directory and user (on this machine: a pod's image
/// is not a filesystem of its own here) and passes on exit code 0; `grpc` is
/// not emulated and passes.
async fn probe_once(probe: &Probe, c: &Container, exec: &ExecContext, pod_ip: &str) -> bool {
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
        if let Some(command) = probe.exec.as_ref().and_then(|e| e.command.as_ref()) {
            let (program, args) = command.split_first()?;
            let mut cmd = exec.command(program.as_ref());
            cmd.args(args).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
            return Some(cmd.status().await.is_ok_and(|s| s.success()));
        }
        Some(true)
    };
    matches!(tokio::time::timeout(timeout, attempt).await, Ok(Some(true)))
}
