//! A connection of either hop (client or upstream): plain TCP, or TLS over it
//! ([`fencegate_core::stream::MaybeTls`]). Plain TCP keeps tokio's owned halves, so the session
//! can wait for readability without holding a buffer.

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use fencegate_core::stream::MaybeTls;

/// A TLS stream of either side (`tokio_rustls` server or client).
pub trait TlsIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> TlsIo for T {}

/// One connection.
pub type Connection = MaybeTls<TcpStream, Box<dyn TlsIo>>;

/// The reading half of a [`Connection`].
pub type ReadHalf = fencegate_core::stream::ReadHalf<Box<dyn TlsIo>>;

/// The writing half of a [`Connection`].
pub type WriteHalf = fencegate_core::stream::WriteHalf<Box<dyn TlsIo>>;

/// Splits a connection into halves a reader and a writer task can own.
pub fn split(connection: Connection) -> (ReadHalf, WriteHalf) {
    fencegate_core::stream::split(connection)
}
