//! The S3 listener's bound on client connections (`max_client_connections`, DESIGN rule 10).
//!
//! pingora accepts without a bound and gives each TLS handshake 60 s, so a client opening
//! connections in a loop would hold the node's descriptors, its authority's among them. The
//! listener is therefore plain TCP, and [`BoundedApp`], which pingora hands every accepted
//! connection on a task of its own, admits it under the cap first, runs the TLS handshake
//! itself within [`HANDSHAKE_TIME`], then serves the connection's requests in its own loop, so
//! that the slot is held until the connection closes, across keep-alive requests.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fencegate_core::{Admission, AuditSink, ConnectionCap, Store};
use pingora_core::apps::ServerApp;
use pingora_core::listeners::tls::Acceptor;
use pingora_core::protocols::l4::stream::Stream as TcpStream;
use pingora_core::protocols::{GetSocketDigest, Stream};
use pingora_core::server::ShutdownWatch;

use crate::error_xml::S3ErrorBody;

/// The longest an admitted client may take over its TLS handshake: a slot is not held by a
/// client that never finishes one (pingora's own limit is 60 s).
pub const HANDSHAKE_TIME: Duration = Duration::from_secs(10);

/// A pingora app (the S3 proxy) behind a connection cap.
pub struct BoundedApp<A> {
    app: Arc<A>,
    cap: ConnectionCap,
    /// Connections admitted and not yet closed (refused ones pass through it briefly).
    open: AtomicUsize,
    /// Set for an HTTPS listener: the handshake runs here, after admission.
    tls: Option<Acceptor>,
    audit: Arc<dyn AuditSink>,
    /// What a plain-HTTP client over the bound reads: S3's own `503 SlowDown`.
    slow_down: Arc<[u8]>,
}

impl<A> BoundedApp<A> {
    /// `app` behind a cap of `max` connections; `tls`: the HTTPS listener's acceptor.
    pub fn new(app: A, max: usize, tls: Option<Acceptor>, audit: Arc<dyn AuditSink>) -> Self {
        Self {
            app: Arc::new(app),
            cap: ConnectionCap::new(max),
            open: AtomicUsize::new(0),
            tls,
            audit,
            slow_down: slow_down(max),
        }
    }
}

/// The answer over the bound: an S3 error that every SDK retries with backoff (as it does
/// S3's own throttling), and a close.
fn slow_down(max: usize) -> Arc<[u8]> {
    let body = S3ErrorBody::new(
        503,
        "SlowDown",
        format!("the gateway holds max_client_connections ({max}) client connections; retry later"),
        "",
        "",
    )
    .to_xml();
    ConnectionCap::http_503("application/xml", &body)
}

/// A connection counted in `open` until it is dropped.
struct Slot<'a> {
    open: &'a AtomicUsize,
    /// Connections counted before this one.
    before: usize,
}

impl<'a> Slot<'a> {
    fn take(open: &'a AtomicUsize) -> Self {
        // Counted first, judged after: concurrent connections each see a distinct count, so
        // no more than the bound are admitted at once (a refused one may briefly make a
        // client within the bound see it full, never the reverse).
        let before = open.fetch_add(1, Ordering::AcqRel);
        Self { open, before }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<A: ServerApp + Send + Sync + 'static> BoundedApp<A> {
    /// The TLS handshake, within [`HANDSHAKE_TIME`]; `None` when it failed or took too long.
    async fn handshake(acceptor: &Acceptor, stream: Stream) -> Option<Stream> {
        // The listener is plain TCP, so pingora hands over its own TCP stream.
        let tcp = stream.into_any().downcast::<TcpStream>().ok()?;
        let peer = tcp.get_socket_digest().and_then(|d| d.peer_addr().cloned());
        // Debug, not warn: anyone can fail a handshake, as often as they like.
        match tokio::time::timeout(HANDSHAKE_TIME, acceptor.tls_handshake(*tcp)).await {
            Ok(Ok(tls)) => Some(Box::new(tls)),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, ?peer, "an S3 client's TLS handshake failed");
                None
            }
            Err(_) => {
                tracing::debug!(limit = ?HANDSHAKE_TIME, ?peer, "an S3 client's TLS handshake took too long");
                None
            }
        }
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for BoundedApp<A> {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let slot = Slot::take(&self.open);
        match self.cap.admit(slot.before) {
            Admission::Admitted => {}
            Admission::Reopened { refused } => {
                tracing::info!(refused, "the S3 gateway admits clients again");
            }
            Admission::Refused { first } => {
                drop(slot);
                if first {
                    tracing::warn!(
                        max_client_connections = self.cap.max(),
                        "the S3 gateway holds max_client_connections; new clients are refused until one leaves"
                    );
                }
                self.audit.connection_refused(Store::S3);
                // An HTTPS client is closed unanswered, as the Redis gateway's are: answering
                // would cost a handshake per refused client.
                if self.tls.is_none() {
                    let answer = self.slow_down.clone();
                    self.cap
                        .refuse_here(ConnectionCap::answer_and_close(stream, answer))
                        .await;
                }
                return None;
            }
        }
        let stream = match &self.tls {
            Some(acceptor) => Self::handshake(acceptor, stream).await?,
            None => stream,
        };
        // The connection's requests, here rather than in pingora's loop, so that the slot is
        // held until the connection closes.
        let mut next = Some(stream);
        while let Some(stream) = next {
            next = self.app.process_new(stream, shutdown).await;
        }
        drop(slot);
        None
    }

    async fn cleanup(&self) {
        self.app.cleanup().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_over_the_bound_is_a_complete_http_response() {
        let answer = slow_down(7);
        let text = std::str::from_utf8(&answer).expect("ASCII");
        let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        assert!(head.contains("\r\nconnection: close"), "{head}");
        assert!(
            head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
            "{head}"
        );
        assert!(body.contains("<Code>SlowDown</Code>"), "{body}");
        assert!(body.contains("max_client_connections (7)"), "{body}");
    }

    #[test]
    fn a_slot_is_counted_while_it_lives() {
        let open = AtomicUsize::new(0);
        let a = Slot::take(&open);
        let b = Slot::take(&open);
        assert_eq!((a.before, b.before), (0, 1));
        drop(a);
        assert_eq!(Slot::take(&open).before, 1);
        drop(b);
        assert_eq!(open.load(Ordering::Acquire), 0);
    }
}
