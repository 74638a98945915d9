//! Container environment: `value` (with `$(VAR)` expansion), `fieldRef`,
//! `secretKeyRef`, `configMapKeyRef` and `envFrom`.

use super::Kubelet;
use super::lifecycle::StartError;
use super::network::HOST_IP;
use k8s_openapi::api::core::v1::{ConfigMap, Container, EnvVar, EnvVarSource, Pod, Secret};
use kube::{Api, ResourceExt as _};
use std::collections::BTreeMap;

/// A container's environment, in order: later entries may refer to earlier ones.
pub(super) type EnvVars = Vec<(String, String)>;

/// What a container's env reads from, besides the pod itself.
#[derive(Clone, Copy)]
enum Source {
    Secret,
    ConfigMap,
}

impl Source {
    /// The kind as error messages name it.
    fn noun(self) -> &'static str {
        match self {
            Source::Secret => "secret",
            Source::ConfigMap => "configmap",
        }
    }
}

impl Kubelet {
    pub(super) async fn resolve_env(&self, pod: &Pod, pod_ip: &str, c: &Container) -> Result<EnvVars, StartError> {
        let ns = pod.namespace().unwrap_or_default();
        let mut out: EnvVars = Vec::new();
        for from in c.env_from.iter().flatten() {
            let prefix = from.prefix.clone().unwrap_or_default();
            let refs = [
                from.secret_ref.as_ref().map(|r| (Source::Secret, &r.name, r.optional)),
                from.config_map_ref.as_ref().map(|r| (Source::ConfigMap, &r.name, r.optional)),
            ];
            for (source, name, optional) in refs.into_iter().flatten() {
                match self.data(&ns, source, name).await? {
                    Some(data) => out.extend(data.into_iter().map(|(k, v)| (format!("{prefix}{k}"), v))),
                    None if optional == Some(true) => {}
                    None => return Err(StartError::config(format!("{} {name:?} not found", source.noun()))),
                }
            }
        }
        for EnvVar { name, value, value_from } in c.env.iter().flatten() {
            let resolved = match (value, value_from) {
                (Some(v), _) => Some(expand_vars(v, &out)),
                (None, None) => Some(String::new()),
                (None, Some(from)) => self.value_from(pod, pod_ip, name, from).await?,
            };
            if let Some(v) = resolved {
                out.retain(|(k, _)| k != name);
                out.push((name.clone(), v));
            }
        }
        Ok(out)
    }

    /// One `valueFrom`; `None` when it names a missing optional key.
    async fn value_from(
        &self,
        pod: &Pod,
        pod_ip: &str,
        env: &str,
        from: &EnvVarSource,
    ) -> Result<Option<String>, StartError> {
        if let Some(f) = &from.field_ref {
            let unsupported = || StartError::config(format!("unsupported fieldRef {:?}", f.field_path));
            return field_value(pod, pod_ip, &f.field_path).map(Some).ok_or_else(unsupported);
        }
        let (source, name, key, optional) = match (&from.secret_key_ref, &from.config_map_key_ref) {
            (Some(r), _) => (Source::Secret, &r.name, &r.key, r.optional),
            (None, Some(r)) => (Source::ConfigMap, &r.name, &r.key, r.optional),
            (None, None) => return Err(StartError::config(format!("env {env}: unsupported valueFrom"))),
        };
        let ns = pod.namespace().unwrap_or_default();
        match self.data(&ns, source, name).await?.and_then(|mut data| data.remove(key)) {
            Some(v) => Ok(Some(v)),
            None if optional == Some(true) => Ok(None),
            None => Err(StartError::config(format!("{} {name:?} key {key:?} not found", source.noun()))),
        }
    }

    /// The string data of a Secret or ConfigMap; `None` when it does not exist.
    async fn data(&self, ns: &str, source: Source, name: &str) -> Result<Option<BTreeMap<String, String>>, StartError> {
        let found = match source {
            Source::Secret => {
                let secret = Api::<Secret>::namespaced(self.client.clone(), ns).get_opt(name).await;
                secret.map(|s| s.as_ref().map(secret_data))
            }
            Source::ConfigMap => {
                let map = Api::<ConfigMap>::namespaced(self.client.clone(), ns).get_opt(name).await;
                map.map(|m| m.map(|m| m.data.unwrap_or_default()))
            }
        };
        found.map_err(|e| StartError::Other(e.into()))
    }
}

fn secret_data(s: &Secret) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = s.string_data.clone().unwrap_or_default();
    for (k, v) in s.data.clone().unwrap_or_default() {
        out.insert(k, String::from_utf8_lossy(&v.0).into_owned());
    }
    out
}

/// `$(VAR)` references to earlier variables, as the kubelet expands them.
fn expand_vars(value: &str, env: &[(String, String)]) -> String {
    let mut out = value.to_string();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// The downward-API fields the stand-in supports.
pub fn field_value(pod: &Pod, pod_ip: &str, path: &str) -> Option<String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let subscript =
        |prefix: &str| -> Option<String> { path.strip_prefix(prefix)?.strip_suffix("']").map(str::to_string) };
    match path {
        "metadata.name" => meta.name.clone(),
        "metadata.namespace" => meta.namespace.clone(),
        "metadata.uid" => meta.uid.clone(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        "status.podIP" => Some(pod_ip.to_string()),
        "status.hostIP" => Some(HOST_IP.to_string()),
        _ => {
            if let Some(key) = subscript("metadata.labels['") {
                return Some(meta.labels.as_ref()?.get(&key).cloned().unwrap_or_default());
            }
            if let Some(key) = subscript("metadata.annotations['") {
                return Some(meta.annotations.as_ref()?.get(&key).cloned().unwrap_or_default());
            }
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubelet::NODE_NAME;
    use serde_json::json;

    #[test]
    fn field_refs_resolve_from_pod() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "n", "labels": {"app": "x"}},
            "spec": {"containers": [], "nodeName": NODE_NAME}
        }))
        .unwrap();
        let ip = "127.1.0.7";
        assert_eq!(field_value(&pod, ip, "metadata.name").as_deref(), Some("p"));
        assert_eq!(field_value(&pod, ip, "metadata.namespace").as_deref(), Some("n"));
        assert_eq!(field_value(&pod, ip, "metadata.labels['app']").as_deref(), Some("x"));
        assert_eq!(field_value(&pod, ip, "spec.nodeName").as_deref(), Some(NODE_NAME));
        assert_eq!(field_value(&pod, ip, "status.podIP").as_deref(), Some(ip));
        assert_eq!(field_value(&pod, ip, "status.hostIP").as_deref(), Some(HOST_IP));
        assert_eq!(field_value(&pod, ip, "spec.bogus"), None);
    }

    #[test]
    fn env_values_expand_earlier_variables() {
        let env = vec![("A".to_string(), "1".to_string())];
        assert_eq!(expand_vars("x-$(A)-$(B)", &env), "x-1-$(B)");
    }
}
