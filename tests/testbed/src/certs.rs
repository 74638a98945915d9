//! Per-run PKI for the control plane: a CA, the kube-apiserver serving
//! certificate, the service-account signing key, and the front-proxy CA and
//! client certificate the API server presents to aggregated APIs. Generated fresh for every
//! test bed, so nothing secret is committed and runs cannot cross-talk.

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use std::path::{Path, PathBuf};

pub struct Pki {
    pub ca_cert: PathBuf,
    pub ca_pem: String,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    /// ECDSA P-256 key the API server signs service-account tokens with.
    pub sa_key: PathBuf,
    /// Its public half, which verifies them.
    pub sa_pub: PathBuf,
    /// The CA aggregated API servers trust for the `X-Remote-User` headers.
    pub front_proxy_ca: PathBuf,
    /// The API server's client certificate toward aggregated APIs
    /// (CN [`FRONT_PROXY_CLIENT`]).
    pub proxy_client_cert: PathBuf,
    pub proxy_client_key: PathBuf,
    /// A client certificate and key (PEM) signed by the CA, for servers
    /// that require one (`tls-auth-clients yes`).
    pub client_cert_pem: String,
    pub client_key_pem: String,
}

/// The CN aggregated API servers accept the user headers from.
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";

fn ca(name: &str) -> Result<(rcgen::Certificate, Issuer<'static, KeyPair>)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let cert = params.self_signed(&key)?;
    Ok((cert, Issuer::new(params, key)))
}

impl Pki {
    pub fn generate(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let (ca_cert, issuer) = ca("streamfleet-testbed-ca")?;

        let serving_key = KeyPair::generate()?;
        let mut serving = CertificateParams::new(vec![
            "localhost".to_string(),
            "127.0.0.1".to_string(),
            "kubernetes".to_string(),
            "kubernetes.default".to_string(),
            "kubernetes.default.svc".to_string(),
        ])?;
        serving.distinguished_name.push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert = serving.signed_by(&serving_key, &issuer)?;

        let sa_key = KeyPair::generate()?;

        let (front_proxy_ca, front_proxy_issuer) = ca("streamfleet-testbed-front-proxy-ca")?;
        let proxy_client_key = KeyPair::generate()?;
        let mut proxy_client = CertificateParams::new(Vec::<String>::new())?;
        proxy_client.distinguished_name.push(DnType::CommonName, FRONT_PROXY_CLIENT);
        proxy_client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let proxy_client_cert = proxy_client.signed_by(&proxy_client_key, &front_proxy_issuer)?;

        let client_key = KeyPair::generate()?;
        let mut client = CertificateParams::new(Vec::<String>::new())?;
        client.distinguished_name.push(DnType::CommonName, "streamfleet-client");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_cert = client.signed_by(&client_key, &issuer)?;

        let write = |name: &str, body: &str| -> Result<PathBuf> {
            let path = dir.join(name);
            std::fs::write(&path, body)?;
            Ok(path)
        };
        Ok(Self {
            ca_cert: write("ca.crt", &ca_cert.pem())?,
            ca_pem: ca_cert.pem(),
            serving_cert: write("apiserver.crt", &serving_cert.pem())?,
            serving_key: write("apiserver.key", &serving_key.serialize_pem())?,
            sa_key: write("sa.key", &sa_key.serialize_pem())?,
            sa_pub: write("sa.pub", &sa_key.public_key_pem())?,
            front_proxy_ca: write("front-proxy-ca.crt", &front_proxy_ca.pem())?,
            proxy_client_cert: write("front-proxy-client.crt", &proxy_client_cert.pem())?,
            proxy_client_key: write("front-proxy-client.key", &proxy_client_key.serialize_pem())?,
            client_cert_pem: client_cert.pem(),
            client_key_pem: client_key.serialize_pem(),
        })
    }
}
