//! Who is asking, and may they. The API server authenticates the user (any
//! method its kubeconfig uses) and, for an aggregated API, passes the
//! identity on in request headers; those headers are believed only on a
//! connection that proved the API server's front-proxy client certificate.
//! Every request is then authorized with a SubjectAccessReview, so the
//! user's RBAC in the namespace decides, not the console's own rights.

use super::tls::Peer;
use anyhow::{Context as _, Result};
use axum::http::HeaderMap;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec, SubjectAccessReviewStatus,
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::PostParams;
use kube::{Api, Client};
use std::collections::BTreeMap;

/// Where the API server publishes how it proxies identities.
const AUTH_CONFIGMAP_NAMESPACE: &str = "kube-system";
const AUTH_CONFIGMAP: &str = "extension-apiserver-authentication";

/// How the API server passes identities on (its `--requestheader-*` flags).
#[derive(Clone, Debug, Default)]
pub struct FrontProxy {
    /// PEM bundle that signs the API server's front-proxy client certificate.
    pub client_ca_pem: Vec<u8>,
    /// Accepted certificate CNs; empty: any certificate that CA signed.
    pub allowed_names: Vec<String>,
    pub user_headers: Vec<String>,
    pub group_headers: Vec<String>,
    pub extra_prefixes: Vec<String>,
    pub uid_headers: Vec<String>,
}

impl FrontProxy {
    /// Read from `kube-system/extension-apiserver-authentication`.
    pub async fn load(client: &Client) -> Result<Self> {
        let cm = Api::<ConfigMap>::namespaced(client.clone(), AUTH_CONFIGMAP_NAMESPACE)
            .get(AUTH_CONFIGMAP)
            .await
            .with_context(|| format!("reading ConfigMap {AUTH_CONFIGMAP_NAMESPACE}/{AUTH_CONFIGMAP}"))?;
        Self::from_data(&cm.data.unwrap_or_default())
    }

    pub fn from_data(data: &BTreeMap<String, String>) -> Result<Self> {
        let ca = data.get("requestheader-client-ca-file").with_context(
            || "the API server has no --requestheader-client-ca-file: it cannot proxy identities to aggregated APIs",
        )?;
        let list = |key: &str| -> Result<Vec<String>> {
            match data.get(key) {
                Some(json) if !json.trim().is_empty() => {
                    serde_json::from_str(json).with_context(|| format!("{AUTH_CONFIGMAP} {key}: not a JSON list"))
                }
                _ => Ok(Vec::new()),
            }
        };
        Ok(Self {
            client_ca_pem: ca.as_bytes().to_vec(),
            allowed_names: list("requestheader-allowed-names")?,
            user_headers: list("requestheader-username-headers")?,
            group_headers: list("requestheader-group-headers")?,
            extra_prefixes: list("requestheader-extra-headers-prefix")?,
            uid_headers: list("requestheader-uid-headers")?,
        })
    }

    /// The user the API server vouches for, or `None` when the connection
    /// is not the API server's (no front-proxy certificate, or one whose CN
    /// is not allowed) or names no user.
    pub fn caller(&self, peer: &Peer, headers: &HeaderMap) -> Option<Caller> {
        let cn = peer.client_cn.as_ref()?;
        if !self.allowed_names.is_empty() && !self.allowed_names.contains(cn) {
            return None;
        }
        let values = |name: &str| -> Vec<String> {
            headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).map(String::from).collect()
        };
        let user = self.user_headers.iter().flat_map(|h| values(h)).find(|u| !u.is_empty())?;
        let groups = self.group_headers.iter().flat_map(|h| values(h)).collect();
        let uid = self.uid_headers.iter().flat_map(|h| values(h)).find(|u| !u.is_empty());
        let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, value) in headers {
            let name = name.as_str();
            let Some(key) = self.extra_prefixes.iter().find_map(|p| {
                name.get(..p.len()).filter(|head| head.eq_ignore_ascii_case(p)).map(|_| &name[p.len()..])
            }) else {
                continue;
            };
            if let Ok(value) = value.to_str() {
                // Header names arrive lower-cased; a malformed escape keeps
                // the key as sent, as the API server's own reader does.
                let key = percent_decode(key).unwrap_or_else(|| key.to_string());
                extra.entry(key).or_default().push(value.to_string());
            }
        }
        Some(Caller { user, uid, groups, extra })
    }
}

/// Header names cannot carry every character of an extra's key: the API
/// server percent-encodes them. `None` for a malformed escape or bytes
/// that are not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = |b: u8| (b as char).to_digit(16);
            let h = bytes.get(i + 1).copied().and_then(hex)?;
            let l = bytes.get(i + 2).copied().and_then(hex)?;
            out.push(u8::try_from(h * 16 + l).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A user as the API server authenticated them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub user: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What a request does, in RBAC terms.
#[derive(Clone, Debug)]
pub struct Access {
    pub verb: &'static str,
    pub group: &'static str,
    pub resource: &'static str,
    pub subresource: Option<&'static str>,
}

/// Whether `caller` may do `access` on the object `namespace/name` (on
/// every one, without a name); with
/// the reason the authorizer gave when not.
pub async fn allowed(
    client: &Client,
    caller: &Caller,
    access: &Access,
    namespace: &str,
    name: Option<&str>,
) -> Result<(bool, String)> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(caller.user.clone()),
            uid: caller.uid.clone(),
            groups: Some(caller.groups.clone()),
            extra: Some(caller.extra.clone()),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(namespace.to_string()),
                verb: Some(access.verb.to_string()),
                group: Some(access.group.to_string()),
                resource: Some(access.resource.to_string()),
                subresource: access.subresource.map(String::from),
                name: name.map(String::from),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let reviewed = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .context("asking the API server whether the user may (SubjectAccessReview)")?;
    let SubjectAccessReviewStatus { allowed, reason, .. } = reviewed.status.unwrap_or_default();
    Ok((allowed, reason.unwrap_or_default()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn proxy() -> FrontProxy {
        let data: BTreeMap<String, String> = [
            ("requestheader-client-ca-file", "PEM"),
            ("requestheader-allowed-names", r#"["front-proxy-client"]"#),
            ("requestheader-username-headers", r#"["X-Remote-User"]"#),
            ("requestheader-group-headers", r#"["X-Remote-Group"]"#),
            ("requestheader-extra-headers-prefix", r#"["X-Remote-Extra-"]"#),
            ("requestheader-uid-headers", r#"["X-Remote-Uid"]"#),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        FrontProxy::from_data(&data).unwrap_or_else(|e| panic!("{e:#}"))
    }

    fn peer(cn: Option<&str>) -> Peer {
        Peer { addr: ([127, 0, 0, 1], 1).into(), client_cn: cn.map(String::from) }
    }

    #[test]
    fn identity_headers_count_only_from_the_front_proxy() {
        let mut headers = HeaderMap::new();
        headers.insert("x-remote-user", HeaderValue::from_static("alice"));
        headers.append("x-remote-group", HeaderValue::from_static("devs"));
        headers.append("x-remote-group", HeaderValue::from_static("system:authenticated"));
        headers.insert("x-remote-extra-authentication.kubernetes.io%2fcredential-id", HeaderValue::from_static("X1"));
        headers.insert("x-remote-extra-bad%zzkey", HeaderValue::from_static("Y"));
        headers.insert("x-remote-uid", HeaderValue::from_static("u-1"));
        let p = proxy();
        let caller = p.caller(&peer(Some("front-proxy-client")), &headers).unwrap_or_else(|| panic!("no caller"));
        assert_eq!(caller.user, "alice");
        assert_eq!(caller.groups, vec!["devs", "system:authenticated"]);
        assert_eq!(caller.extra.get("authentication.kubernetes.io/credential-id"), Some(&vec!["X1".to_string()]));
        assert_eq!(caller.extra.get("bad%zzkey"), Some(&vec!["Y".to_string()]), "a malformed escape: the key as sent");
        assert_eq!(caller.uid.as_deref(), Some("u-1"));
        assert_eq!(p.caller(&peer(None), &headers), None, "no client certificate: the headers are anyone's");
        assert_eq!(p.caller(&peer(Some("mallory")), &headers), None, "a CN not allowed");
        assert_eq!(p.caller(&peer(Some("front-proxy-client")), &HeaderMap::new()), None, "no user");
    }

    #[test]
    fn an_api_server_that_cannot_proxy_identities_is_named() {
        let err = FrontProxy::from_data(&BTreeMap::new()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("--requestheader-client-ca-file"), "{err}");
    }
}
