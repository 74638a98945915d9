//! The pod's identity: a TokenRequest token for its ServiceAccount, bound to
//! the pod and handed over as a per-pod kubeconfig.

use super::Kubelet;
use super::lifecycle::StartError;
use crate::control_plane::kubeconfig_yaml;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, ResourceExt as _};
use std::path::{Path, PathBuf};

impl Kubelet {
    /// A per-pod kubeconfig carrying a token for the pod's ServiceAccount.
    pub(super) async fn identity(&self, pod: &Pod, dir: &Path) -> Result<Option<PathBuf>, StartError> {
        let spec = pod.spec.as_ref();
        if spec.and_then(|s| s.automount_service_account_token) == Some(false) {
            return Ok(None);
        }
        let ns = pod.namespace().unwrap_or_default();
        let sa = spec.and_then(|s| s.service_account_name.clone()).unwrap_or_else(|| "default".into());
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &ns);
        let request = TokenRequest {
            metadata: ObjectMeta::default(),
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(24 * 3600),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(pod.name_any()),
                    uid: pod.metadata.uid.clone(),
                }),
            },
            status: None,
        };
        let issued: TokenRequest = match api.create_subresource("token", &sa, &PostParams::default(), &request).await {
            Ok(t) => t,
            Err(e) => return Err(StartError::config(format!("token for serviceaccount {sa}: {e}"))),
        };
        let token = issued.status.map(|s| s.token).unwrap_or_default();
        let path = dir.join("kubeconfig");
        std::fs::write(&path, kubeconfig_yaml(&self.server, &self.ca_pem, &token, &ns))
            .map_err(|e| StartError::Other(e.into()))?;
        Ok(Some(path))
    }
}
