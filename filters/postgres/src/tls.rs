//! TLS for clients: a rustls acceptor built from the configured certificate chain and key, and
//! a stream that is either plain TCP or TLS over it (the client's, and the upstream's: see
//! [`crate::upstream`]).

use std::path::Path;
use std::sync::Arc;

use fencegate_core::stream::MaybeTls;
use fencegate_core::ServerCert;
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::error::PostgresError;

/// Builds the acceptor from PEM files: `cert` holds the chain (leaf first), `key` the private
/// key (PKCS#8, PKCS#1 or SEC1). The settings are shared with the other gateways
/// (`fencegate_core::tls`); the certificate is returned too, for SIGHUP to replace.
pub fn acceptor(cert: &Path, key: &Path) -> Result<(TlsAcceptor, Arc<ServerCert>), PostgresError> {
    let config_err = |e: fencegate_core::tls::TlsSetupError| PostgresError::Config(e.to_string());
    let cert = ServerCert::load(cert, key).map_err(config_err)?;
    let settings = fencegate_core::tls::server_config(&cert).map_err(config_err)?;
    Ok((TlsAcceptor::from(settings), cert))
}

/// A client connection: plain TCP, or TLS terminated by the gateway after an `SSLRequest` was
/// accepted.
pub type ClientStream = MaybeTls<TcpStream, Box<TlsStream<TcpStream>>>;

/// The reading half of a [`ClientStream`] ([`fencegate_core::stream::split`]).
pub type ClientRead = fencegate_core::stream::ReadHalf<Box<TlsStream<TcpStream>>>;

/// The writing half of a [`ClientStream`].
pub type ClientWrite = fencegate_core::stream::WriteHalf<Box<TlsStream<TcpStream>>>;
