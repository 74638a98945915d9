//! The commands people run, as `streamfleet …` or as the kubectl plugin
//! (`kubectl streamfleet …`): dead letters and pending entries, through
//! the console API with the caller's kubeconfig.

pub mod dead_letters;
pub mod pending;
pub mod shards;
pub mod suspend;

use crate::console::wire;
use anyhow::{Context as _, Result};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Run as the kubectl plugin (`kubectl-streamfleet`, found on the PATH):
/// `kubectl streamfleet dlq …` is `streamfleet dead-letters …`.
pub fn plugin_args(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let plugin = args
        .first()
        .and_then(|program| std::path::Path::new(program).file_name())
        .is_some_and(|name| name == "kubectl-streamfleet");
    if plugin && args.get(1).is_some_and(|a| a == "dlq") {
        args[1] = "dead-letters".into();
    }
    args
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// Any wire type as one JSON line.
pub trait ToJson {
    fn to_json(&self) -> String;
}

impl<T: Serialize> ToJson for T {
    fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// `value` as JSON, or `text`.
pub fn print(output: Output, value: &dyn ToJson, text: String) {
    match output {
        Output::Json => println!("{}", value.to_json()),
        Output::Text => println!("{text}"),
    }
}

/// A pipeline's console API, through the API server with the caller's kubeconfig.
pub struct ConsoleClient {
    client: kube::Client,
    /// The pipeline's path (`/apis/console.streamfleet.io/v1alpha1/namespaces/…/pipelines/…`).
    path: String,
}

impl ConsoleClient {
    /// `pipeline` is `namespace/name`.
    pub async fn open(pipeline: &str) -> Result<Self> {
        let (namespace, name) = pipeline.split_once('/').context("--pipeline: NAMESPACE/NAME")?;
        let client = kube::Client::try_default().await.context("reading your kubeconfig")?;
        Ok(Self { client, path: wire::pipeline_path(namespace, name) })
    }

    /// GET the pipeline's `sub` (a subresource, with its query).
    pub async fn get<T: DeserializeOwned>(&self, sub: &str) -> Result<T> {
        let uri = format!("{}/{sub}", self.path);
        let request = http::Request::get(&uri).body(Vec::new())?;
        self.client.request(request).await.map_err(|e| console_error(e, &uri))
    }

    /// [`Self::get`], `None` when the console says 404 with `missing` in its message.
    pub async fn get_opt<T: DeserializeOwned>(&self, sub: &str, missing: &str) -> Result<Option<T>> {
        let uri = format!("{}/{sub}", self.path);
        let request = http::Request::get(&uri).body(Vec::new())?;
        match self.client.request::<T>(request).await {
            Ok(found) => Ok(Some(found)),
            Err(kube::Error::Api(e)) if e.code == 404 && e.message.contains(missing) => Ok(None),
            Err(e) => Err(console_error(e, &uri)),
        }
    }

    /// POST `body` as JSON to the pipeline's `sub`.
    pub async fn post<B: Serialize, T: DeserializeOwned>(&self, sub: &str, body: &B) -> Result<T> {
        let uri = format!("{}/{sub}", self.path);
        let request = http::Request::post(&uri)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(serde_json::to_vec(body)?)?;
        self.client.request(request).await.map_err(|e| console_error(e, &uri))
    }
}

/// The API server's or the console's refusal, said plainly; a console
/// that is not installed is named as such.
fn console_error(e: kube::Error, uri: &str) -> anyhow::Error {
    match e {
        kube::Error::Api(status) if status.code == 404 && status.message.contains("the server could not find") => {
            anyhow::anyhow!(
                "{uri}: the API server does not serve the streamfleet console (is the chart's console enabled?). \
                 Break-glass for dead letters: --redis-url"
            )
        }
        kube::Error::Api(status) => anyhow::anyhow!("{} ({})", status.message, status.reason),
        other => anyhow::Error::new(other).context(format!("calling {uri}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<std::ffi::OsString> {
        args.iter().map(Into::into).collect()
    }

    #[test]
    fn as_a_kubectl_plugin_dlq_means_dead_letters() {
        assert_eq!(plugin_args(os(&["/usr/local/bin/kubectl-streamfleet", "dlq", "list"]))[1], "dead-letters");
        assert_eq!(plugin_args(os(&["streamfleet", "dlq"]))[1], "dlq", "only under the plugin's name");
    }
}
