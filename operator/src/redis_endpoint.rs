//! The Redis endpoint a validated `spec.redis` names, from the values of
//! the Secret keys it references: one resolver for the controller and the
//! console, so both connect the way the workers do.

use crate::controller::validate::{UrlSource, UsernameSource, ValidRedis};
use crate::digest_key::DigestKey;
use crate::error::Error;
use streamfleet_crd::{SecretKeyRef, TLS_CERT_KEY, TLS_PRIVATE_KEY_KEY};
use streamfleet_streams::{ClientTls, Endpoint};

/// The Secret keys `redis` reads: the URL's, the username's, the password's,
/// the CA's, the client certificate's and key's.
pub fn secret_keys(redis: &ValidRedis) -> Vec<SecretKeyRef> {
    let url = match &redis.url {
        UrlSource::Secret(r) => Some(r.clone()),
        UrlSource::Spec(_) => None,
    };
    let client = redis.client_cert.iter().flat_map(|name| {
        [TLS_CERT_KEY, TLS_PRIVATE_KEY_KEY].map(|key| SecretKeyRef { name: name.clone(), key: key.into() })
    });
    let username = match &redis.username {
        Some(UsernameSource::Secret(r)) => Some(r.clone()),
        _ => None,
    };
    url.into_iter().chain(username).chain(redis.password.clone()).chain(redis.ca.clone()).chain(client).collect()
}

/// `redis`'s endpoint from `values`, the value of each of its
/// [`secret_keys`]. The password is taken as it is, byte for byte (an empty
/// one is none), as the workers take it from their environment.
pub fn endpoint(redis: &ValidRedis, values: &[(SecretKeyRef, Vec<u8>)]) -> Result<Endpoint, Error> {
    let value = |r: &SecretKeyRef| {
        values
            .iter()
            .find(|(k, _)| k == r)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| Error::SecretKeyNotFound { name: r.name.clone(), key: r.key.clone() })
    };
    let text = |r: &SecretKeyRef, field: &str| {
        String::from_utf8(value(r)?)
            .map_err(|_| Error::InvalidSpec(format!("{field}: the Secret's value is not UTF-8")))
    };
    let url = match &redis.url {
        UrlSource::Spec(url) => url.clone(),
        UrlSource::Secret(r) => text(r, "spec.redis.urlSecretRef")?.trim().to_string(),
    };
    // Whitespace around a name from a Secret is not part of it (nor to the
    // workers); an empty one is none.
    let username = match &redis.username {
        Some(UsernameSource::Spec(name)) => Some(name.clone()),
        Some(UsernameSource::Secret(r)) => {
            Some(text(r, "spec.redis.usernameSecretRef")?.trim().to_string()).filter(|u| !u.is_empty())
        }
        None => None,
    };
    // An empty value is no password, as the workers read it.
    let password =
        redis.password.as_ref().map(|r| text(r, "spec.redis.passwordSecretRef")).transpose()?.filter(|p| !p.is_empty());
    let ca_pem = redis.ca.as_ref().map(value).transpose()?;
    let client_tls = match &redis.client_cert {
        Some(name) => {
            let key = |key: &str| SecretKeyRef { name: name.clone(), key: key.into() };
            Some(ClientTls { cert_pem: value(&key(TLS_CERT_KEY))?, key_pem: value(&key(TLS_PRIVATE_KEY_KEY))? })
        }
        None => None,
    };
    Ok(Endpoint { ca_pem, username, password, client_tls, ..Endpoint::new(url, redis.mode) })
}

/// A digest of the Secret values read (`values` as [`endpoint`] takes
/// them): the first 16 hex digits of an HMAC-SHA256, under the operator's
/// [`DigestKey`], over each key and value in key order. Changes when a
/// value does, and with nothing else about the Secrets (a label, an
/// unrelated key). `None` when no Secret is named. Readable by whoever
/// reads the Deployment, it tells them nothing: without the key, a guess
/// at a password cannot be checked against it.
pub fn secrets_digest(key: &DigestKey, values: &[(SecretKeyRef, Vec<u8>)]) -> Option<String> {
    if values.is_empty() {
        return None;
    }
    let mut sorted: Vec<&(SecretKeyRef, Vec<u8>)> = values.iter().collect();
    sorted.sort_by(|a, b| (&a.0.name, &a.0.key).cmp(&(&b.0.name, &b.0.key)));
    let mut mac = ring::hmac::Context::with_key(key.key());
    mac.update(b"streamfleet.io/redis-secrets-digest/v2");
    for (r, value) in sorted {
        for part in [r.name.as_bytes(), r.key.as_bytes(), value.as_slice()] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
    }
    Some(mac.sign().as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::validate::validate_redis;
    use streamfleet_crd::RedisConnection;

    fn redis(spec: serde_json::Value) -> ValidRedis {
        validate_redis(&serde_json::from_value::<RedisConnection>(spec).unwrap()).unwrap()
    }

    fn r(name: &str, key: &str) -> SecretKeyRef {
        SecretKeyRef { name: name.into(), key: key.into() }
    }

    /// The user's name from a Secret key, as the workers read it from their
    /// env: whitespace around it (a file's trailing newline) is not part of it.
    #[test]
    fn a_username_from_a_secret_is_read_trimmed() {
        let v = redis(serde_json::json!({
            "url": "redis://redis-master.db:6379",
            "usernameSecretRef": {"name": "vault", "key": "user"},
            "passwordSecretRef": {"name": "vault", "key": "password"}
        }));
        let keys = secret_keys(&v);
        assert_eq!(keys, vec![r("vault", "user"), r("vault", "password")]);
        let values: Vec<_> = keys.into_iter().zip([b"streamfleet\n".to_vec(), b"pw".to_vec()]).collect();
        let e = endpoint(&v, &values).unwrap();
        assert_eq!((e.username.as_deref(), e.password.as_deref()), (Some("streamfleet"), Some("pw")));
    }

    #[test]
    fn a_url_in_the_spec_and_a_password_apart_are_read_as_they_are() {
        let v = redis(serde_json::json!({
            "url": "redis://redis-master.db:6379", "username": "streamfleet",
            "passwordSecretRef": {"name": "redis", "key": "redis-password"},
            "tls": {"clientCertSecretRef": {"name": "client"}}
        }));
        let keys = secret_keys(&v);
        assert_eq!(keys, vec![r("redis", "redis-password"), r("client", "tls.crt"), r("client", "tls.key")]);
        // A password a URL would need percent-encoded, and a trailing
        // newline, kept: the workers get the same bytes from their env.
        let values: Vec<_> = keys.into_iter().zip([b"p@ss/w:rd%\n".to_vec(), b"CERT".into(), b"KEY".into()]).collect();
        let e = endpoint(&v, &values).unwrap();
        assert_eq!(e.url, "redis://redis-master.db:6379");
        assert_eq!((e.username.as_deref(), e.password.as_deref()), (Some("streamfleet"), Some("p@ss/w:rd%\n")));
        assert_eq!(e.client_tls, Some(ClientTls { cert_pem: b"CERT".to_vec(), key_pem: b"KEY".to_vec() }));
        // A key not read is an error naming it, not an endpoint without it.
        let missing = endpoint(&v, &values[..1]).unwrap_err();
        assert_eq!(missing.to_string(), "secret \"client\" has no key \"tls.crt\"");
    }

    #[test]
    fn the_digest_follows_the_values_in_any_order_and_nothing_else() {
        let key = DigestKey::new(b"0123456789abcdef0123456789abcdef");
        let secrets_digest = |values: &[(SecretKeyRef, Vec<u8>)]| super::secrets_digest(&key, values);
        let values = vec![(r("redis", "redis-password"), b"s3cret".to_vec()), (r("ca", "ca.crt"), b"CA".to_vec())];
        let digest = secrets_digest(&values).unwrap();
        assert_eq!(digest.len(), 16);
        let reversed: Vec<_> = values.iter().rev().cloned().collect();
        assert_eq!(secrets_digest(&reversed).unwrap(), digest, "the order read does not matter");
        let rotated = vec![(r("redis", "redis-password"), b"s3cret2".to_vec()), (r("ca", "ca.crt"), b"CA".to_vec())];
        assert_ne!(secrets_digest(&rotated).unwrap(), digest);
        // Bytes moved from one value to the next are another set of values.
        let moved = vec![(r("redis", "redis-password"), b"s3cretC".to_vec()), (r("ca", "ca.crt"), b"A".to_vec())];
        assert_ne!(secrets_digest(&moved).unwrap(), digest);
        assert_eq!(secrets_digest(&[]), None);
        // Under another key, the same values give another digest: without
        // the key, a guess at the password cannot be checked against it.
        let other = DigestKey::new(b"another key, another digest.....");
        assert_ne!(super::secrets_digest(&other, &values).unwrap(), digest);
        let mut unkeyed = ring::digest::Context::new(&ring::digest::SHA256);
        unkeyed.update(b"s3cret");
        let unkeyed: String = unkeyed.finish().as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
        assert_ne!(digest, unkeyed);
    }

    #[test]
    fn a_url_from_a_secret_is_trimmed_and_keeps_its_credentials() {
        let v = redis(serde_json::json!({"urlSecretRef": {"name": "redis", "key": "url"},
            "tls": {"caSecretRef": {"name": "ca", "key": "ca.crt"}}}));
        let values = vec![(r("redis", "url"), b"redis://u:p@h:6379/\n".to_vec()), (r("ca", "ca.crt"), b"CA".to_vec())];
        let e = endpoint(&v, &values).unwrap();
        assert_eq!((e.url.as_str(), e.password, e.ca_pem), ("redis://u:p@h:6379/", None, Some(b"CA".to_vec())));
        let not_text = vec![(r("redis", "url"), vec![0xff]), (r("ca", "ca.crt"), vec![])];
        assert!(endpoint(&v, &not_text).unwrap_err().to_string().contains("spec.redis.urlSecretRef"));
    }
}
