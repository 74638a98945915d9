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

    /// A dependency out of reach (Redis, the API server): no fault of the
    /// resource, so it is retried at the resource's own poll pace, and its
    /// status is back within one poll of the dependency returning.
    pub fn is_outage(&self) -> bool {
        match self {
            // Or up but not serving yet: loading its data, its cluster re-forming.
            Error::Redis(e) => {
                e.class == streamfleet_streams::ErrorClass::Unreachable
                    || matches!(e.source.code(), Some("LOADING" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN"))
            }
            Error::Kube(e) => !matches!(e, kube::Error::Api(_)),
            _ => false,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_dependency_out_of_reach_is_an_outage() {
        let refused = redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused"));
        assert!(Error::Redis(StreamError::new("inspecting the group", refused)).is_outage());
        let server =
            |kind| Error::Redis(StreamError::new("inspecting the group", (redis::ErrorKind::Server(kind), "x").into()));
        assert!(server(redis::ServerErrorKind::BusyLoading).is_outage(), "up, loading its data");
        assert!(server(redis::ServerErrorKind::ClusterDown).is_outage());
        assert!(!server(redis::ServerErrorKind::ResponseError).is_outage());
        assert!(!Error::SecretNotFound { name: "r".into() }.is_outage());
        assert!(!Error::InvalidSpec("x".into()).is_outage());
    }
}
