//! A pipeline's Redis: the endpoint its spec and Secrets name, and its
//! validated spec (streams, group, dead-letter streams).

use crate::controller::validate::{ValidSpec, validate};
use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, ResourceExt as _};
use streamfleet_crd::{SecretKeyRef, StreamConsumerGroup};
use streamfleet_streams::Endpoint;

pub struct Target {
    pub endpoint: Endpoint,
    pub spec: ValidSpec,
}

impl Target {
    /// Every shard's dead-letter stream, shard 0 first.
    pub fn dead_letter_streams(&self) -> Vec<String> {
        self.spec.streams.iter().map(|s| self.spec.dead_letter_stream_of(s)).collect()
    }
}

pub async fn redis_of(client: &Client, scg: &StreamConsumerGroup) -> Result<Target> {
    // Validated first: a spec the operator refuses names no Secret to read.
    let spec = validate(scg).map_err(|e| anyhow::anyhow!("{e}"))?;
    let namespace = scg.namespace().unwrap_or_default();
    let secrets = Api::<Secret>::namespaced(client.clone(), &namespace);
    let read = async |r: &SecretKeyRef| -> Result<Vec<u8>> {
        let secret = secrets.get(&r.name).await.with_context(|| format!("Secret {namespace}/{}", r.name))?;
        let value = secret.data.and_then(|mut d| d.remove(&r.key));
        Ok(value.with_context(|| format!("Secret {namespace}/{} has no key {:?}", r.name, r.key))?.0)
    };
    let mut values = Vec::new();
    for r in crate::redis_endpoint::secret_keys(&spec.redis) {
        let value = read(&r).await?;
        values.push((r, value));
    }
    let endpoint = crate::redis_endpoint::endpoint(&spec.redis, &values)?;
    Ok(Target { endpoint, spec })
}
