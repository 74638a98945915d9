//! The kube-apiserver's audit log, read back: every request a service
//! account made (the operator runs as one), counted by the API server
//! itself. Admin requests (tests, kube-controller-manager) are not logged.

use anyhow::{Context as _, Result};
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::Path;

/// Metadata of service-account requests, once each (when the response is
/// complete); everything else is not logged.
pub const POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"#;

/// One request as the API server recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub user: String,
    pub verb: String,
    pub resource: String,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
}

impl Request {
    /// `verb resource[/subresource]`, e.g. `patch streamconsumergroups/status`.
    pub fn kind(&self) -> String {
        match &self.subresource {
            Some(sub) => format!("{} {}/{sub}", self.verb, self.resource),
            None => format!("{} {}", self.verb, self.resource),
        }
    }
}

/// The log's current end: requests from here on are "since now".
pub fn offset(log: &Path) -> Result<u64> {
    Ok(std::fs::metadata(log).map(|m| m.len()).unwrap_or(0))
}

/// The requests logged after `from` (an [`offset`]) by users starting with
/// `user_prefix` (e.g. `system:serviceaccount:<namespace>:`).
pub fn since(log: &Path, from: u64, user_prefix: &str) -> Result<Vec<Request>> {
    let mut file = std::fs::File::open(log).with_context(|| format!("opening {}", log.display()))?;
    file.seek(SeekFrom::Start(from))?;
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    let mut requests = Vec::new();
    // A line still being written at the end is left for the next read.
    for line in text.lines().filter(|l| l.ends_with('}')) {
        let Ok(line) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let text = |v: &serde_json::Value| v.as_str().map(str::to_string);
        let user = text(&line["user"]["username"]).unwrap_or_default();
        if !user.starts_with(user_prefix) {
            continue;
        }
        let object = &line["objectRef"];
        requests.push(Request {
            user,
            verb: text(&line["verb"]).unwrap_or_default(),
            resource: text(&object["resource"]).unwrap_or_default(),
            subresource: text(&object["subresource"]),
            namespace: text(&object["namespace"]),
        });
    }
    Ok(requests)
}

/// Requests counted by [`Request::kind`], sorted.
pub fn count_by_kind(requests: &[Request]) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for r in requests {
        *counts.entry(r.kind()).or_insert(0) += 1;
    }
    counts
}
