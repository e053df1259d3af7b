//! TLS for clients: a rustls acceptor built from the configured certificate chain and key, and
//! the client stream that is either plain TCP or TLS over it.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::error::PostgresError;

/// Builds the acceptor from PEM files: `cert` holds the chain (leaf first), `key` the private
/// key (PKCS#8, PKCS#1 or SEC1). The settings are shared with the other gateways
/// (`fencegate_core::tls`).
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, PostgresError> {
    fencegate_core::tls::server_config(cert, key)
        .map(TlsAcceptor::from)
        .map_err(|e| PostgresError::Config(e.to_string()))
}

/// A client connection: plain TCP, or TLS after an accepted `SSLRequest`.
pub enum ClientStream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS terminated by the gateway.
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for ClientStream {
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

impl AsyncWrite for ClientStream {
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
