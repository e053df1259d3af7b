//! TLS for the node's own ports: the client API (server certificate) and the peer port (mutual
//! TLS: a peer must present a certificate from the cluster CA), and the HTTP clients that talk
//! to them. The node's certificate is a [`ServerCert`]: SIGHUP replaces it for new handshakes
//! on both ports and for the certificate the node presents to its peers. The CA is read once.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fencegate_core::ServerCert;
use rustls::pki_types::CertificateDer;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use thiserror::Error;
use tokio_rustls::TlsAcceptor;

use crate::config::SecurityConfig;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds no PEM {what}")]
    Empty { path: PathBuf, what: &'static str },
    #[error("TLS setup with {path} failed: {message}")]
    Setup { path: PathBuf, message: String },
}

/// The node's certificates: the CA loaded once at start, its own certificate replaceable.
#[derive(Clone)]
pub struct NodeTls {
    ca_pem: Vec<u8>,
    ca_path: PathBuf,
    roots: Arc<RootCertStore>,
    cert: Arc<ServerCert>,
    cert_path: PathBuf,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = rustls_pemfile::certs(&mut &pem[..])
        .collect::<Result<_, _>>()
        .map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.to_owned(),
            what: "certificate",
        });
    }
    Ok(certs)
}

impl NodeTls {
    /// Loads the CA, certificate and key named by `security`; `None` when TLS is not configured.
    pub fn load(security: &SecurityConfig) -> Result<Option<Self>, TlsError> {
        let (Some(ca), Some(cert), Some(key)) =
            (&security.ca_file, &security.cert_file, &security.key_file)
        else {
            return Ok(None);
        };
        // The S3 gateway's pingora pulls in a second rustls backend; pick one for the process.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ca_pem = read(ca)?;
        let mut roots = RootCertStore::empty();
        for cert in certs(ca, &ca_pem)? {
            roots.add(cert).map_err(|e| TlsError::Setup {
                path: ca.clone(),
                message: e.to_string(),
            })?;
        }
        let cert_path = cert.clone();
        let cert = ServerCert::load_named(["security.cert_file", "security.key_file"], cert, key)
            .map_err(|e| TlsError::Setup {
            path: cert_path.clone(),
            message: e.to_string(),
        })?;
        let tls = Self {
            ca_pem,
            ca_path: ca.clone(),
            roots: Arc::new(roots),
            cert,
            cert_path,
        };
        // Build both server configs once now, so a bad file fails `check-config` and start.
        tls.api_acceptor()?;
        tls.peer_acceptor()?;
        Ok(Some(tls))
    }

    fn setup_err(&self, e: impl std::fmt::Display) -> TlsError {
        TlsError::Setup {
            path: self.cert_path.clone(),
            message: e.to_string(),
        }
    }

    /// The node's certificate (both ports, and what it presents to peers): SIGHUP reloads it.
    pub fn server_cert(&self) -> Arc<ServerCert> {
        self.cert.clone()
    }

    /// Whether `ca_file` on disk differs from the CA the node runs with (read at start only: the
    /// peer clients and the peer port's verifier both trust it, and must change together).
    pub fn ca_changed(&self) -> bool {
        std::fs::read(&self.ca_path).map_or(true, |pem| pem != self.ca_pem)
    }

    /// The CA file (for logs).
    pub fn ca_path(&self) -> &Path {
        &self.ca_path
    }

    /// The API port: server authentication only (clients authenticate with bearer credentials).
    pub fn api_acceptor(&self) -> Result<TlsAcceptor, TlsError> {
        let config = ServerConfig::builder()
            .with_no_client_auth()
            .with_cert_resolver(self.cert.clone());
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// The peer port: a client certificate chaining to the cluster CA is required.
    pub fn peer_acceptor(&self) -> Result<TlsAcceptor, TlsError> {
        let verifier = WebPkiClientVerifier::builder(self.roots.clone())
            .build()
            .map_err(|e| self.setup_err(e))?;
        let config = ServerConfig::builder()
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(self.cert.clone());
        Ok(TlsAcceptor::from(Arc::new(config)))
    }

    /// A client for peers: trusts only the cluster CA and presents this node's certificate (the
    /// one in force at each handshake, so a reloaded certificate reaches the peers too).
    pub fn peer_client(&self, source: Option<IpAddr>) -> Result<reqwest::Client, TlsError> {
        let config = rustls::ClientConfig::builder()
            .with_root_certificates(self.roots.clone())
            .with_client_cert_resolver(self.cert.clone());
        reqwest::Client::builder()
            .use_preconfigured_tls(config)
            .local_address(source)
            .build()
            .map_err(|e| self.setup_err(e))
    }

    /// A client for other nodes' APIs (forwarding to the leader): trusts the cluster CA.
    pub fn api_client(&self) -> Result<reqwest::Client, TlsError> {
        self.client_builder()?
            .build()
            .map_err(|e| self.setup_err(e))
    }

    fn client_builder(&self) -> Result<reqwest::ClientBuilder, TlsError> {
        let ca = reqwest::Certificate::from_pem(&self.ca_pem).map_err(|e| self.setup_err(e))?;
        Ok(reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(ca))
    }
}
