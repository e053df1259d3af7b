//! A connection that is plain TCP or TLS over it, for every gateway and both hops. One type with
//! one set of I/O impls, so no filter writes its own delegation.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// Plain bytes (`P`: a TCP stream or one of its halves) or TLS over them (`T`). The filter
/// picks the TLS type: a boxed `tokio_rustls` stream of its side, or a half of one.
pub enum MaybeTls<P, T> {
    /// Plain TCP.
    Plain(P),
    /// TLS, terminated (client side) or originated (upstream side) by the gateway.
    Tls(T),
}

// The delegations are `#[inline]`: each is a match and a call, and without the hint LLVM stops
// inlining them once they have several callers (issue 18: a new caller in the PostgreSQL hop
// left three of them out of line, about 150 instructions per `pgbench -S` transaction).
impl<P: AsyncRead + Unpin, T: AsyncRead + Unpin> AsyncRead for MaybeTls<P, T> {
    #[inline]
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl<P: AsyncWrite + Unpin, T: AsyncWrite + Unpin> AsyncWrite for MaybeTls<P, T> {
    #[inline]
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    #[inline]
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
        }
    }

    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    #[inline]
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// The reading half of a [`MaybeTls`] connection over TCP (see [`split`]).
pub type ReadHalf<T> = MaybeTls<OwnedReadHalf, tokio::io::ReadHalf<T>>;

/// The writing half of a [`MaybeTls`] connection over TCP (see [`split`]).
pub type WriteHalf<T> = MaybeTls<OwnedWriteHalf, tokio::io::WriteHalf<T>>;

/// Splits a connection into halves that a reader and a writer (tasks, or futures of one task)
/// can own. Plain TCP keeps tokio's owned halves: a read or write on one is the socket's own,
/// where `tokio::io::split`'s halves take a lock per call (issue 18's profile of the
/// PostgreSQL hop: 354 instructions per `pgbench -S -M prepared` transaction), and a reader
/// can wait for readability without a buffer. TLS, one stream for both directions, is split
/// with `tokio::io::split`. As tokio's, a plain write half shuts down the socket's writing
/// side when it is dropped.
pub fn split<T: AsyncRead + AsyncWrite>(
    connection: MaybeTls<TcpStream, T>,
) -> (ReadHalf<T>, WriteHalf<T>) {
    match connection {
        MaybeTls::Plain(s) => {
            let (r, w) = s.into_split();
            (MaybeTls::Plain(r), MaybeTls::Plain(w))
        }
        MaybeTls::Tls(s) => {
            let (r, w) = tokio::io::split(s);
            (MaybeTls::Tls(r), MaybeTls::Tls(w))
        }
    }
}
