//! The key of the Secrets digest stamped on worker pod templates
//! (`redis_endpoint::secrets_digest`). Keyed, the digest tells nothing
//! about a password to whoever reads a Deployment: without the key, a
//! guess cannot be checked against it. The key is random, kept in a Secret
//! of the operator's own namespace, created by the first operator that
//! finds none, and never logged.

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use std::collections::BTreeMap;

/// The Secret's key holding the random bytes.
const DATA_KEY: &str = "key";
const KEY_LEN: usize = 32;
/// The label that says the Secret is the operator's own.
const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
const MANAGER: &str = "streamfleet-operator";

/// An HMAC-SHA256 key. Its `Debug` shows nothing of it.
#[derive(Clone)]
pub struct DigestKey(ring::hmac::Key);

impl DigestKey {
    pub fn new(bytes: &[u8]) -> Self {
        Self(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes))
    }

    pub(crate) fn key(&self) -> &ring::hmac::Key {
        &self.0
    }

    fn random_bytes() -> Result<[u8; KEY_LEN], DigestKeyError> {
        let mut bytes = [0u8; KEY_LEN];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
            .map_err(|_| DigestKeyError::Random)?;
        Ok(bytes)
    }
}

/// A random key of this process alone (builders in tests): never a known
/// one. Should the system have no random bytes, the time and process.
impl Default for DigestKey {
    fn default() -> Self {
        let bytes = Self::random_bytes().map(|b| b.to_vec()).unwrap_or_else(|_| {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            format!("{}-{}", nanos.as_nanos(), std::process::id()).into_bytes()
        });
        Self::new(&bytes)
    }
}

impl std::fmt::Debug for DigestKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DigestKey(..)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DigestKeyError {
    #[error(
        "reading or creating the Secret {namespace}/{name} (the key of the pod templates' Secrets digest): \
         the operator's service account needs get on it and create on secrets in {namespace} (the chart's Role)"
    )]
    Api { namespace: String, name: String, source: kube::Error },
    #[error(
        "the Secret {namespace}/{name} is not the operator's digest key (no label {MANAGED_BY}={MANAGER}, or no \
         key {DATA_KEY:?} of at least {KEY_LEN} bytes): name another with STREAMFLEET_DIGEST_KEY_SECRET, or, if \
         it is the operator's, delete it"
    )]
    Malformed { namespace: String, name: String },
    #[error("no random bytes for the digest key")]
    Random,
}

/// The key in `namespace/name`, made (random) when the Secret does not
/// exist. Two operators starting at once both end with the one created first.
pub async fn load_or_create(client: Client, namespace: &str, name: &str) -> Result<DigestKey, DigestKeyError> {
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let api_error = |source| DigestKeyError::Api { namespace: namespace.to_string(), name: name.to_string(), source };
    // Only the operator's own: a user's Secret of that name is never used.
    let from = |secret: Secret| {
        let ours = secret.metadata.labels.as_ref().and_then(|l| l.get(MANAGED_BY)).is_some_and(|m| m == MANAGER);
        secret
            .data
            .filter(|_| ours)
            .and_then(|mut d| d.remove(DATA_KEY))
            .filter(|b| b.0.len() >= KEY_LEN)
            .map(|b| DigestKey::new(&b.0))
            .ok_or_else(|| DigestKeyError::Malformed { namespace: namespace.to_string(), name: name.to_string() })
    };
    if let Some(secret) = api.get_opt(name).await.map_err(api_error)? {
        return from(secret);
    }
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(BTreeMap::from([(MANAGED_BY.to_string(), MANAGER.to_string())])),
            ..ObjectMeta::default()
        },
        // Never rewritten: a new key only by deleting it.
        immutable: Some(true),
        data: Some(BTreeMap::from([(DATA_KEY.to_string(), ByteString(DigestKey::random_bytes()?.to_vec()))])),
        type_: Some("Opaque".into()),
        ..Secret::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(created) => from(created),
        // Another operator made it first: theirs is the key.
        Err(kube::Error::Api(e)) if e.code == 409 => from(api.get(name).await.map_err(api_error)?),
        Err(e) => Err(api_error(e)),
    }
}
