//! One error type for the controller. Its `reason()` names the condition
//! reason, the Event reason and the metric label alike.

use streamfleet_streams::StreamError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The spec is well-formed YAML but cannot be acted on.
    #[error("invalid spec: {0}")]
    InvalidSpec(String),

    #[error("secret {name:?} not found")]
    SecretNotFound { name: String },

    #[error("secret {name:?} has no key {key:?}")]
    SecretKeyNotFound { name: String, key: String },

    #[error("{0}")]
    Redis(#[from] StreamError),

    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),

    #[error("serializing: {0}")]
    Serialize(#[from] serde_json::Error),
}

impl Error {
    pub fn reason(&self) -> &'static str {
        match self {
            Error::InvalidSpec(_) => "InvalidSpec",
            Error::SecretNotFound { .. } => "SecretNotFound",
            Error::SecretKeyNotFound { .. } => "SecretKeyNotFound",
            Error::Redis(e) => e.class.reason(),
            Error::Kube(_) => "KubernetesApiError",
            Error::Serialize(_) => "InternalError",
        }
    }

    /// Whether the user (not the operator) can fix it: worth a Warning Event
    /// and a condition on their resource.
    pub fn is_users(&self) -> bool {
        !matches!(self, Error::Kube(_) | Error::Serialize(_))
    }
}
