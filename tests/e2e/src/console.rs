//! What people use, for end-to-end suites of the console: `kubectl` (and
//! the `kubectl streamfleet` plugin) as one person, on this machine or on a
//! host that reaches only the API server, and headless Chromium through
//! `kubectl proxy` with that person's kubeconfig, driven over DevTools.

use anyhow::{Context as _, Result};
use std::path::Path;
use std::time::Duration;
use streamfleet_testbed::isolated::IsolatedHost;
use streamfleet_testbed::{eventually, tools};

const T: Duration = Duration::from_secs(90);

/// `kubectl ARGS` as the user of `kubeconfig`, with the `streamfleet`
/// plugin in `plugin_dir` on the PATH: (succeeded, stdout, stderr). The
/// process gets no Redis URL: what it learns of a pipeline it learns
/// through the API server.
pub async fn kubectl_as(kubeconfig: &Path, plugin_dir: &Path, args: &[&str]) -> Result<(bool, String, String)> {
    kubectl_on(None, kubeconfig, plugin_dir, args).await
}

/// [`kubectl_as`] on `host` if given (a laptop outside the cluster's
/// network), else on this one.
pub async fn kubectl_on(
    host: Option<&IsolatedHost>,
    kubeconfig: &Path,
    plugin_dir: &Path,
    args: &[&str],
) -> Result<(bool, String, String)> {
    let path = format!("{}:{}", plugin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let kubectl = tools::tool("kubectl")?;
    let mut command = match host {
        Some(host) => host.command(kubectl),
        None => tokio::process::Command::new(kubectl),
    };
    let out = command
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env("PATH", path)
        .env_remove("STREAMFLEET_REDIS_URL")
        .env_remove("STREAMFLEET_REDIS_USERNAME")
        .env_remove("STREAMFLEET_REDIS_PASSWORD")
        // As a person runs it: errors without a backtrace (the test
        // command sets one for its own binaries).
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .await?;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok((out.status.success(), text(&out.stdout), text(&out.stderr)))
}

/// `kubectl streamfleet dlq ARGS` as the user of `kubeconfig`.
pub async fn kubectl_dlq(kubeconfig: &Path, plugin_dir: &Path, args: &[&str]) -> Result<(bool, String, String)> {
    let mut all = vec!["streamfleet", "dlq"];
    all.extend_from_slice(args);
    kubectl_as(kubeconfig, plugin_dir, &all).await
}

pub fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Headless Chromium (Debian's `chromium`) reaching the API server through
/// `kubectl proxy` run with one person's kubeconfig: what that person's
/// browser would show.
pub struct Browser {
    proxy: tokio::process::Child,
    port: u16,
    profile: tempfile::TempDir,
    /// Profiles of the driven pages, apart from the one-shot runs'.
    driven: tempfile::TempDir,
}

impl Browser {
    pub async fn through_proxy(kubeconfig: &Path) -> Result<Self> {
        let port = streamfleet_testbed::process::free_port()?;
        let proxy = tokio::process::Command::new(tools::tool("kubectl")?)
            // As docs/console.md says to run it: the console's paths only, so
            // no other page shares its origin.
            .args([
                "proxy",
                &format!("--port={port}"),
                "--address=127.0.0.1",
                r"--accept-paths=^/apis/console\.streamfleet\.io/",
            ])
            .env("KUBECONFIG", kubeconfig)
            .kill_on_drop(true)
            .stdout(std::process::Stdio::null())
            .spawn()?;
        streamfleet_testbed::process::wait_for_port(port, Duration::from_secs(20)).await?;
        Ok(Self { proxy, port, profile: tempfile::tempdir()?, driven: tempfile::tempdir()? })
    }

    async fn chromium(&self, path: &str, size: (u32, u32), output: &[&str]) -> Result<std::process::Output> {
        let url = format!("http://127.0.0.1:{}{path}", self.port);
        let out = tokio::process::Command::new("chromium")
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"])
            .arg("--disable-crash-reporter")
            .arg(format!("--user-data-dir={}", self.profile.path().display()))
            .arg(format!("--window-size={},{}", size.0, size.1))
            .arg("--virtual-time-budget=10000")
            .args(output)
            .arg(url)
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(T, out).await.context("chromium did not finish")??;
        anyhow::ensure!(out.status.success(), "chromium: {}", String::from_utf8_lossy(&out.stderr));
        Ok(out)
    }

    /// The page's DOM once its scripts have run.
    pub async fn dom(&self, path: &str) -> Result<String> {
        let out = self.chromium(path, (1280, 800), &["--dump-dom"]).await?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub async fn screenshot(&self, path: &str, size: (u32, u32), file: &Path) -> Result<()> {
        self.chromium(path, size, &[&format!("--screenshot={}", file.display())]).await?;
        anyhow::ensure!(std::fs::metadata(file)?.len() > 10_000, "{} is nearly empty", file.display());
        Ok(())
    }
}

/// A page open in headless Chromium, driven over the DevTools protocol.
pub struct Page {
    socket: tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    next_id: u64,
    _chromium: tokio::process::Child,
}

impl Page {
    /// The value of a JavaScript expression (awaited if a promise).
    pub async fn eval(&mut self, expression: &str) -> Result<serde_json::Value> {
        use futures::{SinkExt as _, StreamExt as _};
        self.next_id += 1;
        let id = self.next_id;
        let call = serde_json::json!({"id": id, "method": "Runtime.evaluate",
            "params": {"expression": expression, "returnByValue": true, "awaitPromise": true}});
        self.socket.send(tokio_tungstenite::tungstenite::Message::text(call.to_string())).await?;
        while let Some(message) =
            tokio::time::timeout(T, self.socket.next()).await.context("no answer from the page")?
        {
            let text = message?.into_text()?;
            let reply: serde_json::Value = serde_json::from_str(&text)?;
            if reply["id"] == id {
                anyhow::ensure!(reply["result"]["exceptionDetails"].is_null(), "{expression}: {reply}");
                return Ok(reply["result"]["result"]["value"].clone());
            }
        }
        anyhow::bail!("the browser went away")
    }

    /// Polls `expression` until it is truthy; returns its value.
    pub async fn wait_until(&mut self, what: &str, expression: &str) -> Result<serde_json::Value> {
        let deadline = tokio::time::Instant::now() + T;
        loop {
            let value = self.eval(expression).await?;
            if !matches!(value, serde_json::Value::Null | serde_json::Value::Bool(false)) {
                return Ok(value);
            }
            if tokio::time::Instant::now() > deadline {
                let said = self.eval("document.getElementById('message').textContent").await?;
                anyhow::bail!("timed out waiting for {what} (the page says {said})");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Browser {
    /// Opens `path` in a Chromium of its own, to be driven.
    pub async fn open(&self, path: &str) -> Result<Page> {
        let port = streamfleet_testbed::process::free_port()?;
        let profile = self.driven.path().join(port.to_string());
        let chromium = tokio::process::Command::new("chromium")
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800"])
            .arg("--disable-crash-reporter")
            .arg(format!("--remote-debugging-port={port}"))
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!("http://127.0.0.1:{}{path}", self.port))
            .kill_on_drop(true)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        streamfleet_testbed::process::wait_for_port(port, Duration::from_secs(30))
            .await
            .context("Chromium's DevTools port")?;
        let targets = eventually("the page's DevTools target", T, || async {
            let text = http_get(port, "/json/list").await.context("GET /json/list")?;
            let targets: serde_json::Value = serde_json::from_str(&text)?;
            let page = targets.as_array().into_iter().flatten().find(|t| t["type"] == "page").cloned();
            Ok(page.and_then(|t| t["webSocketDebuggerUrl"].as_str().map(String::from)))
        })
        .await?;
        let (socket, _) = tokio_tungstenite::connect_async(targets.as_str())
            .await
            .with_context(|| format!("connecting to {targets}"))?;
        Ok(Page { socket, next_id: 0, _chromium: chromium })
    }
}

/// The body of `GET path` on 127.0.0.1:port (read to its Content-Length:
/// the DevTools server keeps the connection open).
async fn http_get(port: u16, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk)).await??;
        answer.extend_from_slice(&chunk[..n]);
        let Some(split) = answer.windows(4).position(|w| w == b"\r\n\r\n") else {
            anyhow::ensure!(n > 0, "no answer from {path}");
            continue;
        };
        let head = String::from_utf8_lossy(&answer[..split]).to_ascii_lowercase();
        let length =
            head.lines().find_map(|l| l.strip_prefix("content-length:").and_then(|v| v.trim().parse::<usize>().ok()));
        let body = &answer[split + 4..];
        if n == 0 || length.is_some_and(|len| body.len() >= len) {
            return Ok(String::from_utf8_lossy(body).into_owned());
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.proxy.start_kill();
    }
}
