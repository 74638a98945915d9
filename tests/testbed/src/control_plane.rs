//! A real Kubernetes control plane on loopback: etcd, kube-apiserver and
//! kube-controller-manager as child processes, on ports picked per run.

use crate::certs::Pki;
use crate::process::{Daemon, free_port, wait_for_port};
use crate::tools;
use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The controllers kube-controller-manager runs here: what Deployments,
/// ReplicaSets, Jobs, CronJobs, owner-reference garbage collection, namespace
/// teardown, service accounts and PodDisruptionBudget status need. Node
/// lifecycle is left out because the kubelet stand-in's node never goes away.
const CONTROLLERS: &str = "deployment-controller,replicaset-controller,job-controller,\
cronjob-controller,garbage-collector-controller,namespace-controller,disruption-controller,\
serviceaccount-controller,serviceaccount-token-controller,\
root-ca-certificate-publisher-controller,ttl-after-finished-controller";

/// People the API server knows besides the admin: bearer tokens of users
/// in the group `testbed:people`, with no rights until a test grants some.
pub const PEOPLE: [&str; 2] = ["alice", "bob"];

/// The kubeconfig of one of [`PEOPLE`] in the test bed at `dir`.
pub fn person_kubeconfig(dir: &Path, person: &str) -> PathBuf {
    dir.join(format!("kubeconfig-{person}"))
}

pub struct ControlPlane {
    pub server: String,
    pub kubeconfig: PathBuf,
    /// The kube-apiserver's audit log of service-account requests (see [`crate::audit`]).
    pub audit_log: PathBuf,
    pub pki: Pki,
    // Dropped in reverse order of start: controller-manager, apiserver, etcd.
    controller_manager: Daemon,
    apiserver: Daemon,
    etcd: Daemon,
    /// How the API server was started, to start it again the same way.
    apiserver_args: Vec<String>,
    logs: PathBuf,
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and kube-controller-manager under `dir` and
    /// waits until the API is ready and controllers are working.
    /// Services get addresses of `slot` (`kubelet::Slot`).
    pub async fn start(dir: &Path, slot: crate::kubelet::Slot) -> Result<Self> {
        let logs = dir.join("logs");
        let pki = Pki::generate(&dir.join("pki"))?;
        let token = crate::random_string(32);
        let tokens = dir.join("tokens.csv");
        let mut token_lines = format!("{token},admin,admin,system:masters\n");
        let mut people = Vec::new();
        for person in PEOPLE {
            let token = crate::random_string(32);
            token_lines.push_str(&format!("{token},{person},{person},testbed:people\n"));
            people.push((person, token));
        }
        std::fs::write(&tokens, token_lines)?;

        let etcd = start_etcd(dir, &logs).await?;
        let audit_log = logs.join("audit.log");
        let (mut apiserver, server, apiserver_args) =
            start_apiserver(dir, &logs, &pki, &tokens, etcd.1, &audit_log, slot).await?;
        let etcd = etcd.0;

        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_yaml(&server, &pki.ca_pem, &token, "default"))?;
        for (person, token) in &people {
            std::fs::write(person_kubeconfig(dir, person), kubeconfig_yaml(&server, &pki.ca_pem, token, "default"))?;
        }
        let client = client_from(&kubeconfig).await?;
        wait_ready(&client, &mut apiserver).await?;

        let controller_manager = start_controller_manager(&logs, &pki, &kubeconfig)?;
        let mut plane =
            Self { server, kubeconfig, audit_log, pki, controller_manager, apiserver, etcd, apiserver_args, logs };
        plane.wait_controllers(&client).await?;
        Ok(plane)
    }

    /// A new admin client (each tokio runtime needs its own).
    pub async fn client(&self) -> Result<Client> {
        client_from(&self.kubeconfig).await
    }

    /// Fails if any control-plane process has died, with its log tail.
    pub fn check_alive(&mut self) -> Result<()> {
        self.etcd.check_alive()?;
        self.apiserver.check_alive()?;
        self.controller_manager.check_alive()
    }

    /// Stops the API server (SIGTERM, then SIGKILL after 5 s) and starts it
    /// again on the same port with the same state in etcd; returns the old and
    /// new process IDs once it is ready. Its clients see connection errors
    /// meanwhile, as in an upgrade of a single control-plane node.
    pub async fn restart_apiserver(&mut self) -> Result<(u32, u32)> {
        let before = self.apiserver.pid();
        self.apiserver.stop(Duration::from_secs(5));
        let bin = tools::tool("kube-apiserver")?;
        self.apiserver = Daemon::spawn("kube-apiserver", &bin, &self.apiserver_args, &self.logs)?;
        let client = self.client().await?;
        wait_ready(&client, &mut self.apiserver).await?;
        Ok((before, self.apiserver.pid()))
    }

    pub fn log_dir(&self) -> Option<&Path> {
        self.apiserver.log_path().parent()
    }

    /// The serviceaccount controller creates `default` in every namespace; once
    /// it has done so for `default`, the controller manager is working.
    async fn wait_controllers(&mut self, client: &Client) -> Result<()> {
        let api: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
        for _ in 0..600 {
            if api.get_opt("default").await?.is_some() {
                return Ok(());
            }
            self.controller_manager.check_alive()?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("kube-controller-manager made no service account in 60s:\n{}", self.controller_manager.log_tail(30))
    }
}

async fn start_etcd(dir: &Path, logs: &Path) -> Result<(Daemon, u16)> {
    let bin = tools::tool("etcd")?;
    let (client_port, peer_port) = (free_port()?, free_port()?);
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let args = vec![
        format!("--data-dir={}", dir.join("etcd").display()),
        format!("--listen-client-urls={client_url}"),
        format!("--advertise-client-urls={client_url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=default={peer_url}"),
        // Throwaway data: skip fsync so the shared 2-core machine stays quick.
        "--unsafe-no-fsync=true".into(),
        "--log-level=warn".into(),
    ];
    let mut etcd = Daemon::spawn("etcd", &bin, &args, logs)?;
    if let Err(e) = wait_for_port(client_port, Duration::from_secs(30)).await {
        etcd.check_alive()?;
        return Err(e);
    }
    Ok((etcd, client_port))
}

async fn start_apiserver(
    dir: &Path,
    logs: &Path,
    pki: &Pki,
    tokens: &Path,
    etcd_port: u16,
    audit_log: &Path,
    slot: crate::kubelet::Slot,
) -> Result<(Daemon, String, Vec<String>)> {
    let bin = tools::tool("kube-apiserver")?;
    let port = free_port()?;
    let policy = dir.join("audit-policy.yaml");
    std::fs::write(&policy, crate::audit::POLICY)?;
    let args = vec![
        format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--secure-port={port}"),
        format!("--cert-dir={}", dir.join("apiserver-certs").display()),
        format!("--tls-cert-file={}", pki.serving_cert.display()),
        format!("--tls-private-key-file={}", pki.serving_key.display()),
        format!("--client-ca-file={}", pki.ca_cert.display()),
        format!("--token-auth-file={}", tokens.display()),
        "--authorization-mode=RBAC".into(),
        "--service-account-issuer=https://kubernetes.default.svc".into(),
        format!("--service-account-key-file={}", pki.sa_pub.display()),
        format!("--service-account-signing-key-file={}", pki.sa_key.display()),
        // Service IPs on loopback, where the kubelet stand-in's service
        // proxy listens for them (see `kubelet::services`).
        format!("--service-cluster-ip-range={}", slot.service_range()),
        // Aggregated APIs (the console): the API server authenticates the
        // user and passes the identity on in headers, proven by its client
        // certificate from the front-proxy CA.
        format!("--requestheader-client-ca-file={}", pki.front_proxy_ca.display()),
        format!("--requestheader-allowed-names={}", crate::certs::FRONT_PROXY_CLIENT),
        "--requestheader-username-headers=X-Remote-User".into(),
        "--requestheader-group-headers=X-Remote-Group".into(),
        "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
        format!("--proxy-client-cert-file={}", pki.proxy_client_cert.display()),
        format!("--proxy-client-key-file={}", pki.proxy_client_key.display()),
        // Loopback cannot be published as the `kubernetes` Service endpoint.
        "--endpoint-reconciler-type=none".into(),
        "--profiling=false".into(),
        // The API server's own count of what each service account asked for.
        format!("--audit-policy-file={}", policy.display()),
        format!("--audit-log-path={}", audit_log.display()),
        "--audit-log-format=json".into(),
        "--audit-log-mode=blocking".into(),
        "--v=1".into(),
    ];
    let daemon = Daemon::spawn("kube-apiserver", &bin, &args, logs)?;
    Ok((daemon, format!("https://127.0.0.1:{port}"), args))
}

fn start_controller_manager(logs: &Path, pki: &Pki, kubeconfig: &Path) -> Result<Daemon> {
    let bin = tools::tool("kube-controller-manager")?;
    let args = vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--controllers={CONTROLLERS}"),
        format!("--service-account-private-key-file={}", pki.sa_key.display()),
        format!("--root-ca-file={}", pki.ca_cert.display()),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
        // React quickly: tests wait on rollouts and job completions.
        "--concurrent-deployment-syncs=10".into(),
        "--concurrent-replicaset-syncs=10".into(),
        // Its client's default 20 requests/s took minutes to report 500
        // new worker Deployments available in bench-fleet, which then
        // measured the controller-manager, not the operator. A cluster's
        // own setting; tests on a few objects never reach either limit.
        "--kube-api-qps=200".into(),
        "--kube-api-burst=400".into(),
        "--v=1".into(),
    ];
    Daemon::spawn("kube-controller-manager", &bin, &args, logs)
}

async fn wait_ready(client: &Client, apiserver: &mut Daemon) -> Result<()> {
    let mut last = String::new();
    for _ in 0..1200 {
        apiserver.check_alive()?;
        let req = http_get("/readyz");
        match client.request_text(req).await {
            Ok(body) if body.trim() == "ok" => return Ok(()),
            Ok(body) => last = body,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("kube-apiserver not ready after 120s ({last}):\n{}", apiserver.log_tail(30))
}

fn http_get(path: &str) -> http::Request<Vec<u8>> {
    let mut req = http::Request::new(Vec::new());
    *req.uri_mut() = http::Uri::try_from(path).unwrap_or_default();
    req
}

/// A kube client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig).with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

/// A kubeconfig for `server` authenticating with a bearer `token`.
pub fn kubeconfig_yaml(server: &str, ca_pem: &str, token: &str, namespace: &str) -> String {
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: testbed
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: user
  user:
    token: {token}
contexts:
- name: testbed
  context:
    cluster: testbed
    user: user
    namespace: {namespace}
current-context: testbed
"
    )
}
