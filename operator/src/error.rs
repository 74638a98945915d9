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

    /// The API server refused an owned object (a spec it rejects, a quota,
    /// an admission webhook): its own message, for the user to act on.
    #[error("the API server refused the {kind}: {message}")]
    Refused { kind: &'static str, message: String },

    /// A defect in the operator, not in the resource.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    pub fn reason(&self) -> &'static str {
        match self {
            Error::InvalidSpec(_) => "InvalidSpec",
            Error::SecretNotFound { .. } => "SecretNotFound",
            Error::SecretKeyNotFound { .. } => "SecretKeyNotFound",
            Error::Redis(e) => e.class.reason(),
            Error::Kube(_) => "KubernetesApiError",
            Error::Serialize(_) | Error::Internal(_) => "InternalError",
            Error::Refused { kind: "Deployment", .. } => "DeploymentRefused",
            Error::Refused { kind: "CronJob", .. } => "CronJobRefused",
            Error::Refused { .. } => "ObjectRefused",
        }
    }

    /// Whether the user (not the operator) can fix it: worth a Warning Event
    /// and a condition on their resource.
    pub fn is_users(&self) -> bool {
        !matches!(self, Error::Kube(_) | Error::Serialize(_) | Error::Internal(_))
    }

    /// An API error on applying a `kind` becomes `Refused` with the API
    /// server's message; other errors stay as they are.
    pub fn refused(self, kind: &'static str) -> Self {
        match self {
            Error::Kube(kube::Error::Api(response)) => Error::Refused { kind, message: response.message.clone() },
            other => other,
        }
    }
}
