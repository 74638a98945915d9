//! A host of its own for a person's commands: a network namespace joined to
//! this one by a veth pair, from which the API server alone can be reached
//! (through a forwarder on this side). No Redis, no Service address, no pod:
//! what a laptop outside the cluster's network sees.

use crate::control_plane::{PEOPLE, person_kubeconfig};
use anyhow::{Context as _, Result};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

pub struct IsolatedHost {
    /// The network namespace's name.
    pub netns: String,
    /// The address this side has on the link, where the forwarder listens.
    pub gateway: Ipv4Addr,
    /// The forwarder's port: the API server as the isolated host reaches it.
    pub api_port: u16,
    /// This side's end of the link.
    outer: String,
    dir: tempfile::TempDir,
    bed_dir: PathBuf,
    forwarder: Option<tokio::task::JoinHandle<()>>,
}

/// `ip ARGS`, which must succeed.
fn ip(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new("ip").args(args).output().context("running ip (iproute2)")?;
    anyhow::ensure!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    Ok(())
}

impl IsolatedHost {
    /// Makes the namespace and its link, and forwards the link's address on
    /// this side to `api_server` (`host:port`) from a task of the caller's runtime.
    pub(crate) async fn start(bed_dir: &Path, api_server: &str) -> Result<Self> {
        // A random /30 of 10.210.0.0/16; a name taken by another run is
        // never touched: another number is tried.
        let mut last = None;
        for _ in 0..8 {
            let dir = tempfile::tempdir()?;
            let n: u32 = rand::random_range(0..16_384);
            let netns = format!("sf-host-{n}");
            if let Err(e) = ip(&["netns", "add", &netns]) {
                last = Some(e);
                continue;
            }
            let [a, b] = [u8::try_from(n / 64).unwrap_or(0), u8::try_from((n % 64) * 4).unwrap_or(0)];
            let mut host = Self {
                netns,
                gateway: Ipv4Addr::new(10, 210, a, b + 1),
                api_port: 0,
                outer: format!("sfo{n}"),
                dir,
                bed_dir: bed_dir.to_path_buf(),
                forwarder: None,
            };
            // From here on, dropping `host` removes what was made; a link
            // name still taken (a run killed half way) means another number.
            if let Err(e) = host.wire(&format!("sfi{n}"), Ipv4Addr::new(10, 210, a, b + 2)) {
                last = Some(e);
                continue;
            }
            let listener = tokio::net::TcpListener::bind((host.gateway, 0)).await?;
            host.api_port = listener.local_addr()?.port();
            host.forwarder = Some(tokio::spawn(forward(listener, api_server.to_string())));
            return Ok(host);
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no network namespace")))
    }

    fn wire(&self, inner: &str, inside: Ipv4Addr) -> Result<()> {
        ip(&["link", "add", &self.outer, "type", "veth", "peer", "name", inner])?;
        ip(&["link", "set", inner, "netns", &self.netns])?;
        ip(&["addr", "add", &format!("{}/30", self.gateway), "dev", &self.outer])?;
        ip(&["link", "set", &self.outer, "up"])?;
        ip(&["-n", &self.netns, "addr", "add", &format!("{inside}/30"), "dev", inner])?;
        ip(&["-n", &self.netns, "link", "set", inner, "up"])?;
        ip(&["-n", &self.netns, "link", "set", "lo", "up"])
    }

    /// `person`'s kubeconfig as seen from this host: the API server at the
    /// forwarder, its certificate checked for the name `kubernetes`.
    pub fn kubeconfig(&self, person: &str) -> Result<PathBuf> {
        anyhow::ensure!(PEOPLE.contains(&person), "the test bed knows no {person:?}");
        let text = std::fs::read_to_string(person_kubeconfig(&self.bed_dir, person))?;
        let server =
            text.lines().find_map(|l| l.trim().strip_prefix("server: ")).context("no server in the kubeconfig")?;
        let here = format!("https://{}:{}\n    tls-server-name: kubernetes", self.gateway, self.api_port);
        let path = self.dir.path().join(format!("kubeconfig-{person}"));
        std::fs::write(&path, text.replacen(server, &here, 1))?;
        Ok(path)
    }

    /// `program` run on this host.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> tokio::process::Command {
        let mut command = tokio::process::Command::new("ip");
        command.args(["netns", "exec", &self.netns]).arg(program);
        command
    }

    /// This host's IPv4 routes (`ip route`), one per line.
    pub async fn routes(&self) -> Result<Vec<String>> {
        let out = self.command("ip").args(["-4", "route", "show"]).output().await?;
        anyhow::ensure!(out.status.success(), "ip route: {}", String::from_utf8_lossy(&out.stderr));
        Ok(String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect())
    }

    /// Whether a TCP connection from this host to `host:port` succeeds
    /// within 3 s.
    pub async fn reaches(&self, host: &str, port: u16) -> Result<bool> {
        let probe = format!("exec 3<>/dev/tcp/{host}/{port}");
        let out = self.command("timeout").args(["3", "bash", "-c", &probe]).output().await?;
        Ok(out.status.success())
    }
}

/// Every connection to `listener` joined to `upstream`; an accept error
/// (too many open files) waits and goes on.
async fn forward(listener: tokio::net::TcpListener, upstream: String) {
    loop {
        let Ok((mut client, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let upstream = upstream.clone();
        tokio::spawn(async move {
            if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            }
        });
    }
}

impl Drop for IsolatedHost {
    fn drop(&mut self) {
        if let Some(forwarder) = &self.forwarder {
            forwarder.abort();
        }
        // The link first (both its ends go), while the name is still ours;
        // then the namespace.
        let _ = ip(&["link", "del", &self.outer]);
        let _ = ip(&["netns", "del", &self.netns]);
    }
}
