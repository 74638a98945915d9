//! Readiness probes: `httpGet` and `tcpSocket` against the pod IP.

use super::lifecycle::PodRuntime;
use k8s_openapi::api::core::v1::Container;
use std::time::Duration;

impl PodRuntime {
    /// The earliest due readiness probe.
    pub(super) fn next_probe(&self) -> Option<tokio::time::Instant> {
        self.containers.iter().filter(|c| c.child.is_some()).filter_map(|c| c.next_probe).min()
    }

    /// Runs the readiness probes that are due; true when readiness changed.
    pub(super) async fn run_due_probes(&mut self) -> bool {
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
}

pub(super) async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
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
