//! Errors from Redis, classified so callers can report a precise reason.

use std::fmt;

/// Why a Redis operation failed, in the terms an operator's user acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// No connection could be made (refused, timed out, DNS, TLS handshake).
    Unreachable,
    /// The server refused the credentials (`WRONGPASS`, `NOAUTH`, `NOPERM`).
    AuthFailed,
    /// The URL or settings are malformed.
    InvalidConfig,
    /// The server answered with an error to a well-formed request.
    Server,
    /// The server is older than streamfleet supports (`Version::is_supported`).
    Unsupported,
}

impl ErrorClass {
    /// A stable CamelCase reason for conditions, Events and metric labels.
    pub fn reason(self) -> &'static str {
        match self {
            ErrorClass::Unreachable => "RedisUnreachable",
            ErrorClass::AuthFailed => "RedisAuthFailed",
            ErrorClass::InvalidConfig => "RedisInvalidConfig",
            ErrorClass::Server => "RedisError",
            ErrorClass::Unsupported => "RedisUnsupported",
        }
    }
}

/// A failed Redis operation: its class, what was being done, and the
/// server's or client's message (never the URL, which may carry a password).
#[derive(Debug, thiserror::Error)]
pub struct StreamError {
    pub class: ErrorClass,
    pub action: &'static str,
    #[source]
    pub source: redis::RedisError,
}

impl fmt::Display for StreamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.action, redact(&self.source.to_string()))
    }
}

impl StreamError {
    pub fn new(action: &'static str, source: redis::RedisError) -> Self {
        Self { class: classify(&source), action, source }
    }

    /// A failure another caller met, remembered: its class, and its
    /// message word for word (a message that changed every poll would be a
    /// new status and a new Event every poll).
    pub fn remembered(class: ErrorClass, action: &'static str, message: &str) -> Self {
        let source = redis::RedisError::from(std::io::Error::other(message.to_string()));
        Self { class, action, source }
    }

    /// A server too old to run on (`version`, what it reported).
    pub fn unsupported(version: crate::version::Version) -> Self {
        let oldest = crate::version::Version::OLDEST_SUPPORTED;
        let detail = format!(
            "the server reports version {}.{}.{}; streamfleet needs Redis {}.{} or later (or Valkey)",
            version.major, version.minor, version.patch, oldest.major, oldest.minor
        );
        let source = redis::RedisError::from((redis::ErrorKind::Client, "unsupported server", detail));
        Self { class: ErrorClass::Unsupported, action: "checking the server version", source }
    }
}

/// Classifies a redis-rs error.
pub fn classify(e: &redis::RedisError) -> ErrorClass {
    if let Some("WRONGPASS" | "NOAUTH" | "NOPERM") = e.code() {
        return ErrorClass::AuthFailed;
    }
    if matches!(e.kind(), redis::ErrorKind::AuthenticationFailed) {
        return ErrorClass::AuthFailed;
    }
    if matches!(e.kind(), redis::ErrorKind::InvalidClientConfig) {
        return ErrorClass::InvalidConfig;
    }
    if e.is_io_error() || e.is_connection_refusal() || e.is_timeout() || e.is_connection_dropped() {
        return ErrorClass::Unreachable;
    }
    let text = e.to_string();
    if text.contains("WRONGPASS") || text.contains("NOAUTH") || text.contains("invalid username-password") {
        return ErrorClass::AuthFailed;
    }
    ErrorClass::Server
}

/// Removes `user:password@` from any URL in a message.
pub fn redact(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for word in message.split_inclusive(char::is_whitespace) {
        match (word.find("://"), word.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                out.push_str(&word[..scheme + 3]);
                out.push_str("***@");
                out.push_str(&word[at + 1..]);
            }
            _ => out.push_str(word),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_hides_credentials_in_urls() {
        assert_eq!(
            redact("cannot reach redis://u:secret@10.0.0.1:6379/0 now"),
            "cannot reach redis://***@10.0.0.1:6379/0 now"
        );
        assert_eq!(redact("plain message"), "plain message");
    }

    #[test]
    fn a_server_older_than_7_0_is_unsupported_and_says_so() {
        let e = StreamError::unsupported(crate::version::Version { major: 6, minor: 2, patch: 14 });
        assert_eq!(e.class.reason(), "RedisUnsupported");
        assert!(e.to_string().contains("version 6.2.14; streamfleet needs Redis 7.0 or later"), "{e}");
    }

    #[test]
    fn server_auth_errors_are_auth_failures() {
        let e = redis::RedisError::from((
            redis::ErrorKind::AuthenticationFailed,
            "WRONGPASS invalid username-password pair",
        ));
        assert_eq!(classify(&e), ErrorClass::AuthFailed);
    }
}
