//! The console's TLS listener. Handshakes run concurrently off the accept
//! loop (a slow client never holds up the others); each connection carries
//! the common name of the client certificate it proved, if any: the API
//! server's front-proxy certificate is what makes its `X-Remote-User`
//! headers believable.

use anyhow::{Context as _, Result};
use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Who is on the other end of a connection.
#[derive(Clone, Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The CN of the client certificate, verified against the front-proxy
    /// CA; `None` without one.
    pub client_cn: Option<String>,
}

/// Serving certificate and key (PEM), and the CA bundle client
/// certificates are verified against. A client without one still connects
/// (and is then refused by the API for want of an identity).
pub fn server_config(cert_pem: &[u8], key_pem: &[u8], client_ca_pem: &[u8]) -> Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(cert_pem).collect::<Result<_, _>>().context("the serving certificate")?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).context("the serving key")?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(client_ca_pem) {
        roots.add(ca.context("the front-proxy CA")?).context("the front-proxy CA")?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()
        .context("the client certificate verifier")?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .context("the serving certificate and key")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

pub struct TlsListener {
    connections: mpsc::Receiver<(TlsStream<TcpStream>, Peer)>,
    local: SocketAddr,
    _accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub async fn bind(addr: &str, config: rustls::ServerConfig) -> Result<Self> {
        let tcp = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        let local = tcp.local_addr()?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let (tx, connections) = mpsc::channel(64);
        let accepting = tokio::spawn(async move {
            loop {
                let (stream, addr) = match tcp.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: wait, go on.
                        tracing::warn!(error = %e, "accepting a connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let client_cn = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(cn);
                            let _ = tx.send((tls, Peer { addr, client_cn })).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%addr, error = %e, "TLS handshake"),
                        Err(_) => tracing::debug!(%addr, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self { connections, local, _accepting: accepting })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self._accepting.abort();
    }
}

fn cn(der: &CertificateDer<'_>) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    cert.subject().iter_common_name().next()?.as_str().ok().map(String::from)
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = Peer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.connections.recv().await {
            Some(connection) => connection,
            // The accept loop is gone only when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(Peer { addr: self.local, client_cn: None })
    }
}

impl Connected<IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        stream.remote_addr().clone()
    }
}
