//! The Secrets a spec references, read from the API server only when they
//! change. A metadata-only watch (names and resource versions, never data)
//! says which Secrets exist and at which version; a referenced key is fetched
//! once per version and kept. At rest a poll makes no Secret read, and a
//! rotated Secret is re-read (and reconciled) as soon as the watch sees it.

use crate::error::Error;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt as _};
use std::collections::HashMap;
use std::sync::Mutex;
use streamfleet_crd::{SecretKeyRef, StreamConsumerGroup};

/// Secret metadata from the watch; annotations and managed fields are
/// dropped before they are stored (`kubectl apply` copies the whole Secret,
/// data included, into an annotation).
pub type SecretMeta = PartialObjectMeta<Secret>;

/// (namespace, Secret name, key) → (resource version read, the key's value).
type Values = HashMap<(String, String, String), (String, Vec<u8>)>;

pub struct SecretCache {
    metadata: Store<SecretMeta>,
    values: Mutex<Values>,
}

impl SecretCache {
    pub fn new(metadata: Store<SecretMeta>) -> Self {
        Self { metadata, values: Mutex::new(HashMap::new()) }
    }

    pub async fn wait_until_ready(&self) -> bool {
        self.metadata.wait_until_ready().await.is_ok()
    }

    /// The value of `r` in `namespace`: from memory while the Secret's
    /// resource version is the one read, else one GET. A Secret the synced
    /// watch does not know does not exist (no GET to find that out).
    pub async fn read(&self, client: &Client, namespace: &str, r: &SecretKeyRef) -> Result<Vec<u8>, Error> {
        let not_found = || Error::SecretNotFound { name: r.name.clone() };
        let meta = self.metadata.get(&ObjectRef::new(&r.name).within(namespace)).ok_or_else(not_found)?;
        let version = meta.resource_version().unwrap_or_default();
        let key = (namespace.to_string(), r.name.clone(), r.key.clone());
        if let Some((read, value)) = self.values.lock().ok().and_then(|v| v.get(&key).cloned())
            && read == version
        {
            return Ok(value);
        }
        let secret =
            Api::<Secret>::namespaced(client.clone(), namespace).get_opt(&r.name).await?.ok_or_else(not_found)?;
        // The version actually read, which may be newer than the watch's.
        let read = secret.resource_version().unwrap_or_default();
        let value = secret
            .data
            .and_then(|mut d| d.remove(&r.key))
            .map(|v| v.0)
            .ok_or_else(|| Error::SecretKeyNotFound { name: r.name.clone(), key: r.key.clone() })?;
        if let Ok(mut values) = self.values.lock() {
            values.insert(key, (read, value.clone()));
        }
        Ok(value)
    }

    /// Forgets values whose Secret is gone, so a deleted Secret's data does
    /// not stay in memory.
    pub fn prune(&self) {
        let Ok(mut values) = self.values.lock() else { return };
        values.retain(|(ns, name, _), _| self.metadata.get(&ObjectRef::new(name).within(ns)).is_some());
    }
}

/// Whether `scg` references the Secret `name` (its URL, password, CA or
/// client certificate: the keys the resolver reads). A spec that does not
/// validate reads none.
pub fn references(scg: &StreamConsumerGroup, name: &str) -> bool {
    super::validate::validate_redis(&scg.spec.redis)
        .is_ok_and(|redis| crate::redis_endpoint::secret_keys(&redis).iter().any(|r| r.name == name))
}

/// Drops what the cache must not hold: annotations (see [`SecretMeta`]) and
/// managed fields (memory).
pub fn strip(meta: &mut SecretMeta) {
    meta.metadata.annotations = None;
    meta.metadata.managed_fields = None;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strip_drops_the_annotation_that_can_carry_the_data() {
        let mut meta: SecretMeta = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {
                "name": "redis", "resourceVersion": "7",
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{\"data\":{\"url\":\"c2VjcmV0\"}}"},
                "managedFields": [{"manager": "kubectl"}]
            }
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        strip(&mut meta);
        assert_eq!(meta.metadata.annotations, None);
        assert_eq!(meta.metadata.managed_fields, None);
        assert_eq!(meta.resource_version().as_deref(), Some("7"));
    }
}
