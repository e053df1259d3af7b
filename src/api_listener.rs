//! The API's and the Raft peer port's listener, plain or TLS, and its bounds (DESIGN rule 10).
//!
//! Without them a client could hold connections before any credential is checked: by opening
//! them in a loop (the node runs out of file descriptors, and the lock service with it), or by
//! opening them and sending nothing, or a header a byte at a time (each connection is held
//! forever: hyper has no timer unless given one, and its header timeout does not cover an idle
//! keep-alive connection). So:
//! - at most `[node] max_api_connections` are open at once; one more gets `503` with the API's
//!   error body and `Retry-After` over plain HTTP, and is closed over TLS (an answer would
//!   need a handshake);
//! - a new connection must send its first request within [`FIRST_REQUEST`]; after that, one
//!   with no request in flight is closed once the last request's answer is [`IDLE`] old,
//!   however many bytes of a next request came meanwhile;
//! - a request's header must arrive within [`HEADER_READ_TIMEOUT`] once begun, its body
//!   within [`BODY_TIMEOUT`]; a connection told to close that does not, with no request in
//!   flight (an HTTP/2 client not answering the PING, an HTTP/1 one not reading), is dropped
//!   after [`CLOSE_GRACE`];
//! - a TLS handshake has [`HANDSHAKE_TIMEOUT`];
//! - TCP keepalive finds clients whose host vanished while the connection was quiet;
//! - on the Raft peer port, the last slots are kept for the members ([`PeerReserve`]).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::Router;
use fencegate_core::{Admission, ConnectionCap};
use http_body::{Body, Frame, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::task::TaskTracker;

use crate::peer_reserve::PeerReserve;

/// How long a connection may go without a request in flight: longer than the idle time after
/// which common clients drop a pooled connection themselves (reqwest's and Go's 90 s), so they
/// do not send on a connection the node is closing.
pub const IDLE: Duration = Duration::from_secs(120);

/// How long a new connection may go without its first request (its TLS handshake included):
/// clients send a request as soon as they connect, and an attacker holding slots with empty
/// connections must open one every `FIRST_REQUEST / max` instead of every `IDLE / max`.
const FIRST_REQUEST: Duration = Duration::from_secs(20);

/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long hyper waits for a request's whole header once it began reading it.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a request's body may take to arrive whole: a request in flight keeps its
/// connection from idling, so a body trickled a byte a minute must not keep it forever. Far
/// above what any real body takes: the largest, a Raft snapshot chunk, has 10 s to be sent
/// and installed (`authority::SNAPSHOT_CHUNK_TIMEOUT`).
const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a connection told to close, with no request in flight, may take to do so (an HTTP/2
/// client must answer a PING first, an HTTP/1 one read its last answer) before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(10);

/// HTTP/2 connections are PINGed this often, and dropped when a PING goes unanswered this long.
const H2_PING: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// What a plain-HTTP client over the bound gets.
fn too_many(max: usize) -> Arc<[u8]> {
    let body = serde_json::json!({
        "error": "too_many_connections",
        "message": format!(
            "this node holds its [node] max_api_connections ({max}); retry later or try another endpoint"
        ),
    })
    .to_string();
    ConnectionCap::http_503("application/json", &body)
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// Serves `app` on `listener` (over TLS with `tls`) until `stop` turns true, with at most `max`
/// connections open, the last of them only for the members' addresses `reserve` knows (the
/// peer port); then closes the listener, lets each connection finish
/// its request in flight, and returns once they are all closed (the caller bounds that wait).
/// Accept errors (EMFILE, say) are logged and retried, never fatal.
pub async fn serve(
    port: &'static str,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    reserve: Option<Arc<PeerReserve>>,
    app: Router,
    max: usize,
    mut stop: watch::Receiver<bool>,
) {
    let cap = ConnectionCap::new(max);
    let answer = too_many(max);
    // One task per open connection: its count is what the cap bounds.
    let open = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stopped(&mut stop) => break,
        };
        let (tcp, from) = match accepted {
            Ok(pair) => pair,
            Err(e) if ConnectionCap::client_gave_up(&e) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let counted = reserve
            .as_ref()
            .map_or(open.len(), |r| r.counted(from.ip(), open.len()));
        match cap.admit(counted) {
            Admission::Admitted => {}
            Admission::Reopened { refused } => {
                tracing::info!(port, refused, "the node admits connections again");
            }
            Admission::Refused { first } => {
                if first {
                    tracing::warn!(
                        port,
                        max_api_connections = max,
                        reserved_for_members = reserve.as_ref().map_or(0, |r| r.slots()),
                        "the node holds [node] max_api_connections on this port; new connections are refused until one closes"
                    );
                }
                if tls.is_none() {
                    cap.refuse(tcp, answer.clone());
                }
                continue;
            }
        }
        if let Err(e) = ConnectionCap::keep_alive(&tcp) {
            tracing::debug!(error = %e, "TCP keepalive not set on an API connection");
        }
        let member = reserve.clone().map(|r| (r, from.ip()));
        open.spawn(connection(
            tcp,
            tls.clone(),
            member,
            app.clone(),
            stop.clone(),
        ));
    }
    drop(listener);
    open.close();
    open.wait().await;
}

/// One connection's life: the handshake, then requests until the client closes, it idles for
/// [`IDLE`], or the node stops (then the request in flight finishes first). `member`: the peer
/// port's reserve, told the client's address once its handshake proved membership.
async fn connection(
    tcp: TcpStream,
    tls: Option<TlsAcceptor>,
    member: Option<(Arc<PeerReserve>, std::net::IpAddr)>,
    app: Router,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let service = TowerToHyperService::new(Tracked {
        app,
        activity: activity.clone(),
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_PING)
        .keep_alive_timeout(H2_PING_TIMEOUT);
    match tls {
        None => {
            run(
                builder.serve_connection(TokioIo::new(tcp), service),
                &activity,
                &mut stop,
            )
            .await
        }
        Some(acceptor) => {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => {
                    if let Some((reserve, ip)) = member {
                        reserve.remember(ip);
                    }
                    tls
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "TLS handshake refused");
                    return;
                }
                Err(_) => {
                    tracing::debug!("TLS handshake timed out");
                    return;
                }
            };
            run(
                builder.serve_connection(TokioIo::new(tls), service),
                &activity,
                &mut stop,
            )
            .await;
        }
    }
}

/// Drives `connection` until it ends, it idles too long, or the node stops.
async fn run<C: GracefulConnection>(
    connection: C,
    activity: &Activity,
    stop: &mut watch::Receiver<bool>,
) {
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        () = activity.idle() => {}
        () = stopped(stop) => {}
    }
    connection.as_mut().graceful_shutdown();
    // A request in flight finishes (an HTTP/2 client may still begin one it sent before it read
    // the GOAWAY; on a stop the node's drain bounds the wait). With none in flight, a client
    // that does not let the connection close (no answer to HTTP/2's PING, its last answer left
    // unread) is dropped.
    loop {
        match tokio::time::timeout(CLOSE_GRACE, connection.as_mut()).await {
            Ok(_) => return,
            Err(_) if activity.in_flight.load(Ordering::Acquire) == 0 => return,
            Err(_) => {}
        }
    }
}

/// Whether a connection has a request in flight, and since when it has had none.
struct Activity {
    in_flight: AtomicUsize,
    /// When the connection, with no request in flight, is idle: [`FIRST_REQUEST`] after it
    /// began, then [`IDLE`] after each answer.
    idle_at: Mutex<Instant>,
}

impl Activity {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            idle_at: Mutex::new(Instant::now() + FIRST_REQUEST),
        }
    }

    fn idle_at(&self) -> Instant {
        *self.idle_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves once the connection has had no request in flight since its `idle_at`.
    async fn idle(&self) {
        loop {
            tokio::time::sleep_until(self.idle_at()).await;
            if self.in_flight.load(Ordering::Acquire) == 0 && self.idle_at() <= Instant::now() {
                return;
            }
            if self.in_flight.load(Ordering::Acquire) > 0 {
                // Busy: look again a period later (or once it is answered, as `idle_at` moves).
                tokio::time::sleep(IDLE).await;
            }
        }
    }
}

/// A request in flight on a connection: counted until its answer is ready.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.idle_at.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now() + IDLE;
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The API's router, with each request counted in flight on its connection.
#[derive(Clone)]
struct Tracked {
    app: Router,
    activity: Arc<Activity>,
}

impl<B> tower_service::Service<axum::http::Request<B>> for Tracked
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // A Router is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: axum::http::Request<B>) -> Self::Future {
        self.activity.in_flight.fetch_add(1, Ordering::AcqRel);
        let in_flight = InFlight(self.activity.clone());
        let request = request.map(Deadline::new);
        let answer = tower_service::Service::call(&mut self.app, request);
        Box::pin(async move {
            let answer = answer.await;
            drop(in_flight);
            answer
        })
    }
}

/// A request body that must arrive whole within [`BODY_TIMEOUT`]: past it, the next read fails
/// (the handler's extractor answers 400) and the request ends.
struct Deadline<B> {
    body: B,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// The deadline passed: the body ended with its error, and stays ended.
    expired: bool,
}

impl<B> Deadline<B> {
    fn new(body: B) -> Self {
        Self {
            body,
            deadline: Box::pin(tokio::time::sleep(BODY_TIMEOUT)),
            expired: false,
        }
    }
}

impl<B> Body for Deadline<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = self.get_mut();
        if this.expired {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(Into::into))),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.expired = true;
                    Poll::Ready(Some(Err(format!(
                        "the request's body did not arrive within {} s",
                        BODY_TIMEOUT.as_secs()
                    )
                    .into())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.expired || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Idle means no first request within `FIRST_REQUEST`, then no request in flight for
    /// `IDLE` since the last answer, however long a request was in flight before.
    #[tokio::test(start_paused = true)]
    async fn idle_counts_from_the_last_answer_and_never_while_busy() {
        let activity = Arc::new(Activity::new());
        let began = Instant::now();
        activity.idle().await;
        assert_eq!(
            began.elapsed(),
            FIRST_REQUEST,
            "a connection with no request"
        );

        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        let in_flight = InFlight(activity.clone());
        let busy = tokio::time::timeout(5 * IDLE, activity.idle()).await;
        assert!(busy.is_err(), "idle while a request was in flight");
        drop(in_flight);
        let answered = Instant::now();
        activity.idle().await;
        assert!(answered.elapsed() >= IDLE && answered.elapsed() < 2 * IDLE);
    }

    /// A body that never comes.
    struct Never;

    impl Body for Never {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Pending
        }
    }

    /// A body of one frame.
    struct Once(Option<Bytes>);

    impl Body for Once {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.take().map(|b| Ok(Frame::data(b))))
        }
    }

    async fn next<B: Body<Data = Bytes> + Unpin>(
        body: &mut Deadline<B>,
    ) -> Option<Result<Bytes, String>>
    where
        B::Error: Into<axum::BoxError>,
    {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx))
            .await
            .map(|f| {
                f.map(|f| f.into_data().unwrap_or_default())
                    .map_err(|e| e.to_string())
            })
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_must_arrive_within_its_time() {
        let began = Instant::now();
        let mut never = Deadline::new(Never);
        let e = next(&mut never)
            .await
            .expect("a frame")
            .expect_err("timed out");
        assert_eq!(began.elapsed(), BODY_TIMEOUT);
        assert!(e.contains("did not arrive within 60 s"), "{e}");
        assert!(never.is_end_stream(), "ended by its deadline");
        assert_eq!(next(&mut never).await, None, "and stays ended");

        let mut once = Deadline::new(Once(Some(Bytes::from_static(b"{}"))));
        assert_eq!(next(&mut once).await, Some(Ok(Bytes::from_static(b"{}"))));
        assert_eq!(next(&mut once).await, None);
    }
}
