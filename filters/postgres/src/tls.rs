//! TLS for clients: a rustls acceptor built from the configured certificate chain and key, and
//! a stream that is either plain TCP or TLS over it (the client's, and the upstream's: see
//! [`crate::upstream`]).

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls::{self, pki_types::CertificateDer, RootCertStore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::error::PostgresError;

/// Builds the acceptor from PEM files: `cert` holds the chain (leaf first), `key` the private
/// key (PKCS#8, PKCS#1 or SEC1).
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, PostgresError> {
    let bad = |what: &str, path: &Path, e: &dyn std::fmt::Display| {
        PostgresError::Config(format!("{what} {}: {e}", path.display()))
    };
    let certs: Vec<CertificateDer<'static>> = {
        let file = std::fs::File::open(cert).map_err(|e| bad("tls_cert", cert, &e))?;
        rustls_pemfile::certs(&mut io::BufReader::new(file))
            .collect::<Result<_, _>>()
            .map_err(|e| bad("tls_cert", cert, &e))?
    };
    if certs.is_empty() {
        return Err(bad("tls_cert", cert, &"no PEM certificate in the file"));
    }
    let file = std::fs::File::open(key).map_err(|e| bad("tls_key", key, &e))?;
    let key_der = rustls_pemfile::private_key(&mut io::BufReader::new(file))
        .map_err(|e| bad("tls_key", key, &e))?
        .ok_or_else(|| bad("tls_key", key, &"no PEM private key in the file"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PostgresError::Config(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)
        .map_err(|e| PostgresError::Config(format!("TLS certificate and key: {e}")))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A connection that is plain TCP, or TLS over it after an `SSLRequest` was accepted.
pub enum MaybeTls<T> {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over the TCP connection.
    Tls(Box<T>),
}

/// A client connection: TLS, if any, terminated by the gateway.
pub type ClientStream = MaybeTls<TlsStream<TcpStream>>;

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for MaybeTls<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for MaybeTls<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A rustls client config that verifies the server's chain against the PEM certificates in
/// `ca_file`, or the system's roots without one (`no_file` says which setting was absent and
/// `setting` names the file's, for errors). The host name is checked by the caller's
/// `ServerName`.
pub fn verifying_client(
    ca_file: Option<&Path>,
    no_file: &str,
    setting: &str,
) -> Result<Arc<rustls::ClientConfig>, PostgresError> {
    let roots = match ca_file {
        Some(path) => roots_from_file(path, setting)?,
        None => system_roots(no_file, setting)?,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PostgresError::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

fn roots_from_file(path: &Path, setting: &str) -> Result<RootCertStore, PostgresError> {
    let bad = |e: &dyn std::fmt::Display| {
        PostgresError::Config(format!("{setting} {}: {e}", path.display()))
    };
    let file = std::fs::File::open(path).map_err(|e| bad(&e))?;
    let certs: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut io::BufReader::new(file))
        .collect::<Result<_, _>>()
        .map_err(|e| bad(&e))?;
    if certs.is_empty() {
        return Err(bad(&"no PEM certificate in the file"));
    }
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| bad(&e))?;
    }
    Ok(roots)
}

fn system_roots(no_file: &str, setting: &str) -> Result<RootCertStore, PostgresError> {
    let mut roots = RootCertStore::empty();
    let certs = rustls_native_certs::load_native_certs().map_err(|e| {
        PostgresError::Config(format!(
            "{no_file}: the system's root certificates cannot be read ({e}); set {setting}"
        ))
    })?;
    // Unparsable entries are skipped, as every TLS client does with the system store.
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(PostgresError::Config(format!(
            "{no_file}: the system has no root certificates; set {setting}"
        )));
    }
    Ok(roots)
}
