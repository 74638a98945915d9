//! Per-run PKI for the control plane: a CA, the kube-apiserver serving
//! certificate, and the service-account signing key. Generated fresh for every
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
}

impl Pki {
    pub fn generate(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "streamfleet-testbed-ca");
        ca_params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);

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
        })
    }
}
