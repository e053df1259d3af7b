//! The bound on the connections the API and Raft ports hold open (DESIGN rule 10): without it a
//! client opening connections in a loop, before any credential is checked, would run the node
//! out of file descriptors, and with them the lock service. Over the bound a plain-HTTP client
//! gets `503` with the API's error body and `Retry-After`, as from a server at its
//! `max_connections`; a TLS client has its connection closed (an answer needs a handshake).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use fencegate_core::ConnectionCap;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// One listener's open connections, counted against its bound.
#[derive(Debug, Clone)]
pub struct ApiConnections {
    open: Arc<AtomicUsize>,
    max: usize,
}

/// One admitted connection: counted until dropped.
#[derive(Debug)]
pub struct ApiSlot(Arc<AtomicUsize>);

impl Drop for ApiSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ApiConnections {
    /// A bound of `max` open connections.
    pub fn new(max: usize) -> Self {
        Self {
            open: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }

    /// A slot for one more connection, if the bound allows it.
    pub fn admit(&self) -> Option<ApiSlot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.max).then_some(open + 1)
            })
            .ok()
            .map(|_| ApiSlot(self.open.clone()))
    }

    /// The connections open now.
    #[cfg(test)]
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// What a plain-HTTP client over the bound gets.
fn too_many(max: usize) -> Arc<[u8]> {
    let body = serde_json::json!({
        "error": "too_many_connections",
        "message": format!(
            "this node holds its [node] max_api_connections ({max}); retry later or try another endpoint"
        ),
    })
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    Arc::from((head + &body).into_bytes())
}

/// A TCP listener for `axum::serve` that admits at most `max_api_connections` at once.
pub struct CappedListener {
    listener: TcpListener,
    connections: ApiConnections,
    /// The refusals' bounded tasks.
    refusals: ConnectionCap,
    answer: Arc<[u8]>,
}

impl CappedListener {
    /// Serves `listener` with at most `max` connections open.
    pub fn new(listener: TcpListener, max: usize) -> Self {
        Self {
            listener,
            connections: ApiConnections::new(max),
            refusals: ConnectionCap::new(max),
            answer: too_many(max),
        }
    }
}

impl axum::serve::Listener for CappedListener {
    type Io = Capped;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (tcp, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                // EMFILE and the like: retried, as axum's own listener does.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            match self.connections.admit() {
                Some(slot) => return (Capped { tcp, _slot: slot }, peer),
                None => self.refusals.refuse(tcp, self.answer.clone()),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}

/// An admitted connection; its slot is given back when it closes.
pub struct Capped {
    tcp: TcpStream,
    _slot: ApiSlot,
}

impl AsyncRead for Capped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Capped {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_given_back() {
        let connections = ApiConnections::new(2);
        let a = connections.admit().expect("a first slot");
        let b = connections.admit().expect("a second slot");
        assert!(connections.admit().is_none());
        drop(a);
        assert_eq!(connections.open(), 1);
        let _c = connections.admit().expect("a freed slot");
        assert!(connections.admit().is_none());
        drop(b);
        assert_eq!(connections.open(), 1);
    }

    #[test]
    fn the_answer_is_one_whole_http_response() {
        let answer = too_many(7);
        let text = std::str::from_utf8(&answer).expect("UTF-8");
        let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        assert!(head.starts_with("HTTP/1.1 503 "));
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let body: serde_json::Value = serde_json::from_str(body).expect("JSON");
        assert_eq!(body["error"], "too_many_connections");
        assert!(body["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_api_connections (7)")));
    }
}
