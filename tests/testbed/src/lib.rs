//! streamfleet's test bed: real components on one machine, no containers.
//!
//! * [`ControlPlane`]: etcd + kube-apiserver + kube-controller-manager.
//! * [`kubelet`]: a stand-in that runs pods as local processes.
//! * [`RedisServer`] / [`RedisCluster`]: real redis-server processes.
//!
//! Tests share one control plane per test binary ([`TestBed::shared`]) and
//! isolate themselves by namespace ([`TestBed::namespace`]); each test that
//! needs Redis starts its own server.

pub mod audit;
pub mod certs;
pub mod control_plane;
pub mod isolated;
pub mod kubelet;
pub mod process;
pub mod redis_server;
pub mod tools;

pub use control_plane::ControlPlane;
pub use redis_server::{RedisCluster, RedisServer};

use anyhow::{Context as _, Result, anyhow};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

/// A running control plane with the kubelet stand-in.
pub struct TestBed {
    pub dir: PathBuf,
    pub kubeconfig: PathBuf,
    pub server: String,
    /// The API server's audit log of service-account requests.
    pub audit_log: PathBuf,
    runtime: tokio::runtime::Handle,
    plane: std::sync::Arc<tokio::sync::Mutex<ControlPlane>>,
}

static SHARED: OnceLock<std::result::Result<TestBed, String>> = OnceLock::new();

impl TestBed {
    /// The test binary's control plane, started on first use on a thread of
    /// its own that lives as long as the process; its servers and pods die
    /// with the process.
    pub fn shared() -> Result<&'static TestBed> {
        SHARED
            .get_or_init(|| {
                let dir = runs_dir().join(format!("run-{}", std::process::id()));
                Self::start_detached(dir).map_err(|e| format!("{e:#}"))
            })
            .as_ref()
            .map_err(|e| anyhow!("test bed failed to start: {e}"))
    }

    /// Starts a control plane and kubelet stand-in under `dir` on a dedicated
    /// thread and runtime, and returns once the API answers.
    pub fn start_detached(dir: PathBuf) -> Result<TestBed> {
        clean_stale_runs();
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        let (tx, rx) = std::sync::mpsc::channel::<Result<TestBed>>();
        let thread_dir = dir.clone();
        std::thread::Builder::new().name("testbed".into()).spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(e.into()));
                    return;
                }
            };
            let handle = runtime.handle().clone();
            runtime.block_on(async move {
                let started = async {
                    // Beds running at once take addresses of their own;
                    // addresses are the machine's, so the slots are too (two
                    // clones' beds on one machine must not share them).
                    let slot = kubelet::Slot::claim(Path::new(kubelet::SLOTS_DIR))?;
                    let plane = ControlPlane::start(&thread_dir, slot).await?;
                    let kubelet = kubelet_for(&plane, &thread_dir, slot).await?;
                    anyhow::Ok((plane, kubelet))
                };
                let (plane, kubelet) = match started.await {
                    Ok(started) => started,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let (kubeconfig, server, audit_log) =
                    (plane.kubeconfig.clone(), plane.server.clone(), plane.audit_log.clone());
                // Kept alive here with the process.
                let plane = std::sync::Arc::new(tokio::sync::Mutex::new(plane));
                let _ = tx.send(Ok(TestBed {
                    dir: thread_dir.clone(),
                    kubeconfig,
                    server,
                    audit_log,
                    runtime: handle,
                    plane: plane.clone(),
                }));
                if let Err(e) = kubelet.run().await {
                    tracing::error!("kubelet stand-in stopped: {e:#}");
                }
                futures::future::pending::<()>().await;
            });
        })?;
        rx.recv_timeout(Duration::from_secs(300)).context("test bed did not start within 300s")?
    }

    /// Restarts the kube-apiserver (see [`ControlPlane::restart_apiserver`]):
    /// (old pid, new pid). It runs on the test bed's own runtime, whose
    /// threads live with the process: the new server dies with its spawning
    /// thread (`PR_SET_PDEATHSIG`), and a test's threads end with the test.
    pub async fn restart_apiserver(&self) -> Result<(u32, u32)> {
        let plane = self.plane.clone();
        self.runtime.spawn(async move { plane.lock().await.restart_apiserver().await }).await?
    }

    /// A new admin client for the calling runtime.
    pub async fn client(&self) -> Result<Client> {
        control_plane::client_from(&self.kubeconfig).await
    }

    /// The kubeconfig of a person (one of [`control_plane::PEOPLE`]): a
    /// user of their own, with no rights until a test binds some.
    pub fn person_kubeconfig(&self, person: &str) -> Result<PathBuf> {
        anyhow::ensure!(control_plane::PEOPLE.contains(&person), "the test bed knows no {person:?}");
        Ok(control_plane::person_kubeconfig(&self.dir, person))
    }

    /// A host of its own that reaches this bed's API server and nothing
    /// else ([`isolated::IsolatedHost`]): where a person's laptop stands.
    pub async fn isolated_host(&self) -> Result<isolated::IsolatedHost> {
        isolated::IsolatedHost::start(&self.dir, self.server.trim_start_matches("https://")).await
    }

    /// Creates a namespace named `prefix-<random>`; it is deleted when the
    /// returned guard drops, even if the test fails.
    pub async fn namespace(&self, client: &Client, prefix: &str) -> Result<TestNamespace> {
        let name = format!("{prefix}-{}", random_suffix());
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await?;
        Ok(TestNamespace { name, kubeconfig: self.kubeconfig.clone(), runtime: self.runtime.clone() })
    }

    /// Where the kubelet stand-in keeps a pod's files (logs, kubeconfig).
    pub fn pod_dir(&self, namespace: &str, pod: &str) -> PathBuf {
        self.dir.join("pods").join(namespace).join(pod)
    }
}

/// A test's own namespace, deleted (in the background) when dropped.
pub struct TestNamespace {
    pub name: String,
    kubeconfig: PathBuf,
    runtime: tokio::runtime::Handle,
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::env::var_os("STREAMFLEET_KEEP_NAMESPACES").is_some() {
            return;
        }
        let (name, kubeconfig) = (self.name.clone(), self.kubeconfig.clone());
        self.runtime.spawn(async move {
            if let Ok(client) = control_plane::client_from(&kubeconfig).await {
                let _ = Api::<Namespace>::all(client).delete(&name, &DeleteParams::default()).await;
            }
        });
    }
}

/// The `streamfleet/python-worker` image: the repository's Python example
/// under the redis-py venv `scripts/install-deps.sh` makes.
fn python_worker_entrypoint(dir: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    let python = home.join(".cache/streamfleet/venv/bin/python3");
    let script = tools::workspace_root().join("examples/python/streamfleet_worker.py");
    let entry = dir.join("images/python-worker");
    std::fs::create_dir_all(dir.join("images"))?;
    std::fs::write(&entry, format!("#!/bin/sh\nexec {python:?} -u {script:?} \"$@\"\n"))?;
    std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o755))?;
    Ok(entry)
}

async fn kubelet_for(plane: &ControlPlane, dir: &Path, slot: kubelet::Slot) -> Result<kubelet::Kubelet> {
    let mut images = kubelet::ImageMap::with_bin_dir(tools::cargo_bin_dir()?)
        .with_store(tools::workspace_root().join("target/images"));
    images.insert("streamfleet/python-worker", python_worker_entrypoint(dir)?);
    Ok(kubelet::Kubelet::new(
        plane.client().await?,
        images,
        dir.join("pods"),
        plane.server.clone(),
        plane.pki.ca_pem.clone(),
        slot,
    ))
}

/// `target/testbed`: every run's files (logs, etcd data, pod folders).
pub fn runs_dir() -> PathBuf {
    tools::workspace_root().join("target/testbed")
}

/// Removes the folders of earlier runs whose process is gone.
fn clean_stale_runs() {
    let Ok(entries) = std::fs::read_dir(runs_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("run-").and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Writes a figure a test measured as `target/figures/<name>.json`;
/// `scripts/docs-figures.sh` copies it to `docs/figures/` and generates its
/// section of `docs/benchmarks.md`. Shape: `what`, `settings`, `columns`,
/// `rows`, `summary`, and `environment` (added here: where and from which
/// commit it was measured).
pub fn write_figure(name: &str, figure: &serde_json::Value) -> Result<()> {
    write_figure_in(&tools::workspace_root().join("target/figures"), name, figure)
}

/// Shows the libraries' logs (info and up; `RUST_LOG` overrides) in a test's
/// captured output, so a failing test prints what the worker saw and did.
pub fn test_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_test_writer().try_init();
}

/// Writes a figure a benchmark program measured straight to
/// `docs/figures/<name>.json` (see [`write_figure`]). Refused on an
/// uncommitted tree (the figure would name no commit that has its code)
/// unless `STREAMFLEET_FIGURES_DIRTY=1`.
pub fn publish_figure(name: &str, figure: &serde_json::Value) -> Result<()> {
    let commit = environment()["commit"].as_str().unwrap_or_default().to_string();
    if commit.ends_with("-dirty") && std::env::var("STREAMFLEET_FIGURES_DIRTY").as_deref() != Ok("1") {
        anyhow::bail!(
            "not writing docs/figures/{name}.json: the tree has uncommitted changes ({commit}); commit, then \
             measure (or STREAMFLEET_FIGURES_DIRTY=1 to write it marked -dirty)"
        );
    }
    write_figure_in(&tools::workspace_root().join("docs/figures"), name, figure)
}

fn write_figure_in(dir: &Path, name: &str, figure: &serde_json::Value) -> Result<()> {
    let mut figure = figure.clone();
    if let Some(fields) = figure.as_object_mut() {
        let mut environment = environment();
        if let (Some(given), Some(all)) =
            (fields.get("environment").and_then(|e| e.as_object()), environment.as_object_mut())
        {
            all.extend(given.clone());
        }
        fields.insert("environment".into(), environment);
    }
    // A server-matrix run (another server than the one figures are
    // measured on) keeps its figures apart: the docs never show them.
    let matrix = std::env::var_os("STREAMFLEET_REDIS_SERVER").is_some_and(|s| !s.is_empty());
    let dir = if matrix { dir.join("server-matrix") } else { dir.to_path_buf() };
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&figure)? + "\n")?;
    eprintln!("figure written to {}", path.display());
    Ok(())
}

/// Where a figure was measured: the commit (marked `-dirty` with local
/// changes), the date, the machine.
fn environment() -> serde_json::Value {
    let output = |cmd: &str, args: &[&str]| {
        std::process::Command::new(cmd)
            .args(args)
            .current_dir(tools::workspace_root())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    // Figure files other programs of the same session rewrote do not count.
    let dirty =
        !output("git", &["status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/figures"]).is_empty();
    let commit = output("git", &["rev-parse", "--short=12", "HEAD"]) + if dirty { "-dirty" } else { "" };
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu =
        cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|v| v.trim_start_matches([' ', '\t', ':']));
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    serde_json::json!({
        "commit": commit,
        "date": output("date", &["-u", "+%Y-%m-%d"]),
        "machine": format!("{cores} cores ({}), {} GiB", cpu.unwrap_or("unknown CPU"), mem_kib / 1024 / 1024),
    })
}

pub fn random_suffix() -> String {
    random_string(6)
}

/// `len` random lowercase letters and digits.
pub(crate) fn random_string(len: usize) -> String {
    use rand::Rng as _;
    let mut rng = rand::rng();
    (0..len).map(|_| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[rng.random_range(0..36)])).collect()
}

/// Polls `f` every 100ms until it returns `Some`, or fails after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_err = None;
    loop {
        match f().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if tokio::time::Instant::now() > deadline {
            return Err(match last_err {
                Some(e) => e.context(format!("timed out after {timeout:?} waiting for {what}")),
                None => anyhow!("timed out after {timeout:?} waiting for {what}"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
