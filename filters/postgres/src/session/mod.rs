//! One client connection relayed to one upstream connection (session mode). The only module of
//! the crate that does I/O.
//!
//! Two loops per session, each a task on the session's thread (the session's own task only
//! joins them): `client -> upstream` reads the client's messages, decides (through the pure
//! [`crate::rewrite`]) and forwards them, pushing what replies each message will get onto a
//! shared queue; `upstream -> client` reads the server's replies and uses that queue to swallow
//! the guard's own replies, audit stale refusals reported by the guard, and emit the gateway's
//! local answers in order.
//!
//! - [`startup`]: the startup packet, TLS, cancels and the relayed authentication.
//! - [`pending`]: PURE: the queue of replies each forwarded message will get, the statement
//!   map, and what each upstream message means ([`pending::on_reply`]).
//! - [`requests`]: the `client -> upstream` loop; [`replies`]: the `upstream -> client` loop.
//! - [`copy`]: which Syncs the server ignores, as it reads a `COPY ... FROM STDIN`'s data.

mod copy;
mod pending;
mod replies;
mod requests;
mod startup;

pub(crate) use startup::refuse_over_cap;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use atomic_waker::AtomicWaker;
use fencegate_core::{
    Attempt, OpenConnection, OperationSummary, RejectReason, Rejection, Store, Token,
};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::error::PostgresError;
use crate::gateway::Gateway;
use crate::lazy_writer::LazyWriter;
use crate::message::FrameReader;

use pending::State;

/// The largest message the server may send us (PostgreSQL's own limit is 1 GiB).
const MAX_BACKEND_MESSAGE: usize = 1 << 30;

/// How long a client may take from connecting to the server's first ReadyForQuery (the
/// server's own `authentication_timeout` defaults to the same minute).
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs one session to its end; errors are logged, never propagated. Once `shutdown` is
/// cancelled the session ends at its next ReadyForQuery outside a transaction.
pub(crate) async fn run(
    gateway: Arc<Gateway>,
    client: TcpStream,
    peer: SocketAddr,
    shutdown: CancellationToken,
) {
    let id = gateway.next_connection_id();
    let _open = OpenConnection::new(gateway.sink.clone(), Store::Postgres);
    let _ = client.set_nodelay(true);
    match session(gateway, client, peer, id, shutdown).await {
        Ok(()) => tracing::debug!(conn = id, %peer, "postgres session ended"),
        Err(e) => tracing::info!(conn = id, %peer, error = %e, "postgres session closed"),
    }
}

struct Shared {
    pub(super) gateway: Arc<Gateway>,
    pub(super) state: Mutex<State>,
    /// A local answer was queued since the reply loop last looked (see [`Shared::local_queued`]).
    pub(super) local: AtomicBool,
    /// The reply loop, while it waits for `local`.
    pub(super) local_waker: AtomicWaker,
    pub(super) peer: SocketAddr,
    pub(super) user: String,
    pub(super) protected: bool,
    pub(super) conn: u64,
    pub(super) requests: std::sync::atomic::AtomicU64,
    /// The node is draining: end the session at its next idle ReadyForQuery.
    pub(super) shutdown: CancellationToken,
    /// Woken by the reply loop after each ReadyForQuery it relayed or local answer it sent, once
    /// [`Shared::draining`] ([`Shared::maybe_settled`]).
    pub(super) settled: Notify,
    /// The request loop waits for `settled` (the node drains): set before it first checks
    /// [`Shared::idle`], so no ReadyForQuery after that check goes unnoticed. Until then the
    /// reply loop skips the notification (a lock per ReadyForQuery).
    pub(super) draining: AtomicBool,
    /// Woken by the reply loop when it learnt something of a message watched for a COPY FROM
    /// STDIN ([`copy`]), and when it ends.
    pub(super) copy_changed: Notify,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells the reply loop that a local answer was queued, and wakes it (a flag and an
    /// `AtomicWaker`: a `Notify` cost a lock per poll of the waiting reply loop).
    fn local_queued(&self) {
        self.local.store(true, Ordering::Release);
        self.local_waker.wake();
    }

    /// Ready once a local answer was queued since the last time it was ready.
    async fn local_ready(&self) {
        std::future::poll_fn(|cx| {
            // Registered before the flag is read: a local answer queued in between wakes it.
            self.local_waker.register(cx.waker());
            if self.local.swap(false, Ordering::AcqRel) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }

    /// Reports the latency of the oldest open requests (their read times in `state`), for
    /// each of `ready` ReadyForQuery messages just judged for relaying (the reply loop counts
    /// them as it judges them: scanning the relayed bytes again cost about 90 instructions per
    /// `pgbench -S` transaction). Under the lock the caller already holds, with one clock read.
    fn answered(&self, state: &mut State, ready: u32) {
        if ready == 0 {
            return;
        }
        let now = std::time::Instant::now();
        for _ in 0..ready {
            if let Some(read_at) = state.read_at.pop_front() {
                self.gateway
                    .sink
                    .request_done(Store::Postgres, now.saturating_duration_since(read_at));
            }
        }
    }

    /// Whether the session can end without cutting anything: no transaction open and every
    /// reply delivered (the client has its ReadyForQuery).
    fn idle(&self) -> bool {
        let state = self.lock();
        state.status == b'I' && state.pending.is_empty()
    }

    /// Tells a draining request loop that the session may have become [`Shared::idle`]: its
    /// wait is polled only when notified. Nothing to do before the node drains.
    fn maybe_settled(&self) {
        if self.draining.load(Ordering::Acquire) {
            self.settled.notify_waiters();
        }
    }

    /// Returns once the node drains and the session is [`Shared::idle`].
    async fn drained(&self) {
        self.shutdown.cancelled().await;
        self.draining.store(true, Ordering::Release);
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if self.idle() {
                return;
            }
            settled.await;
        }
    }

    fn request_id(&self) -> String {
        let n = self
            .requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("pg-{}-{}", self.conn, n + 1)
    }

    async fn audit(&self, rejection: &Rejection, token: Option<&Token>, summary: OperationSummary) {
        let fence = match rejection.reason {
            RejectReason::Stale { fence } => Some(fence),
            _ => None,
        };
        let request_id = self.request_id();
        tracing::info!(
            conn = self.conn,
            request_id = %request_id,
            reason = rejection.reason.label(),
            resource = rejection.resource.as_ref().map(|r| r.as_str()),
            revision = rejection.revision.map(|r| r.get()),
            fence,
            command = %summary.command,
            "postgres write refused"
        );
        let attempt = Attempt {
            store: Store::Postgres,
            client_addr: self.peer.to_string(),
            client_identity: Some(self.user.clone()),
            token: token.cloned(),
            operation: summary,
            request_id,
        };
        let event = attempt.refused(rejection);
        if let Err(e) = self.gateway.sink.refused(event).await {
            tracing::error!(conn = self.conn, error = %e, "could not write the audit record of a refusal");
        }
    }
}

#[cfg(test)]
impl Shared {
    /// A session's shared state for tests of one loop: a gateway of the default config
    /// (resource `job`), an in-memory audit sink, no transaction open.
    fn for_test() -> Arc<Self> {
        let config = crate::config::PostgresConfig {
            resource: Some("job".to_owned()),
            ..crate::config::PostgresConfig::default()
        };
        let sink = Arc::new(fencegate_core::MemoryAuditSink::default());
        let gateway = Gateway::new(config, fencegate_core::TokenPolicy::unsigned(), sink)
            .expect("a gateway's config");
        Arc::new(Self {
            gateway,
            state: Mutex::new(State::new(b'I', None, crate::lexing::Lexing::default())),
            local: AtomicBool::new(false),
            local_waker: AtomicWaker::new(),
            peer: "127.0.0.1:1".parse().expect("an address"),
            user: "app".to_owned(),
            protected: true,
            conn: 1,
            requests: std::sync::atomic::AtomicU64::new(0),
            shutdown: CancellationToken::new(),
            settled: Notify::new(),
            draining: AtomicBool::new(false),
            copy_changed: Notify::new(),
        })
    }
}

async fn session(
    gateway: Arc<Gateway>,
    client: TcpStream,
    peer: SocketAddr,
    conn: u64,
    shutdown: CancellationToken,
) -> Result<(), PostgresError> {
    let max = gateway.config.max_message_bytes;
    let established = tokio::time::timeout(
        STARTUP_TIMEOUT,
        startup::establish(&gateway, client, peer, conn),
    )
    .await
    .map_err(|_| {
        PostgresError::Protocol(format!(
            "the client did not finish its startup within {} s",
            STARTUP_TIMEOUT.as_secs()
        ))
    })??;
    let Some(established) = established else {
        return Ok(());
    };
    let startup::Established {
        client_read,
        upstream_read,
        upstream_write,
        status,
        session_token,
        lexing,
        user,
        protected,
    } = established;
    let shared = Arc::new(Shared {
        gateway,
        state: Mutex::new(State::new(status, session_token, lexing)),
        local: AtomicBool::new(false),
        local_waker: AtomicWaker::new(),
        peer,
        user,
        protected,
        conn,
        requests: std::sync::atomic::AtomicU64::new(0),
        shutdown,
        settled: Notify::new(),
        draining: AtomicBool::new(false),
        copy_changed: Notify::new(),
    });

    let (stream, buffered) = client_read.into_parts();
    let (client_read, client_write) = fencegate_core::stream::split(stream);
    let client_read = FrameReader::with_buffer(client_read, buffered, max);
    // Each direction is a task of its own on this session's thread (a current-thread runtime:
    // no wake-up crosses threads). As two futures of one task, every wake-up polled both, and
    // the one still waiting on its socket polled its read, its idle timer and its select again
    // for nothing (issue 18's profile of `pgbench -S`: 8 readiness checks and 4 idle-timer
    // polls per transaction where 6 and 2 do). Each still runs until it ends, and neither waits
    // for the other except through the sockets and the shared queue. This task only joins
    // them: it is woken when one ends, not per message (the request loop selecting on the reply
    // task's handle polled it once per transaction, about 130 instructions). Both are aborted
    // if this one is dropped, and a panic in either ends the session at once.
    let mut replies = AbortOnDropHandle::new(tokio::spawn(replies::relay_replies(
        shared.clone(),
        upstream_read,
        LazyWriter::new(client_write),
    )));
    let mut requests = AbortOnDropHandle::new(tokio::spawn(requests::relay_requests(
        shared.clone(),
        client_read,
        LazyWriter::new(upstream_write),
    )));
    let (result, replies) = tokio::select! {
        biased;
        result = &mut requests => {
            let result = joined(result);
            if result.is_err() {
                // Let the reply loop deliver what is queued (a protocol error, say), then stop.
                shared.local_queued();
            }
            (result, joined(replies.await))
        }
        replies = &mut replies => {
            let replies = joined(replies);
            // A request loop waiting for the server's word on a COPY learns no more.
            shared.lock().copy.closed = true;
            shared.copy_changed.notify_one();
            // The reply loop failed (the server's connection, the client's, or replies it can
            // no longer match to requests): nothing the client sends may go on to the server.
            if replies.is_err() {
                requests.abort();
            }
            let requests = match requests.await {
                Err(e) if e.is_cancelled() => Ok(()),
                other => joined(other),
            };
            (requests, replies)
        }
    };
    result.and(replies)
}

/// A direction task's result; its panic goes on in this task.
fn joined(
    joined: Result<Result<(), PostgresError>, tokio::task::JoinError>,
) -> Result<(), PostgresError> {
    match joined {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(PostgresError::Protocol(format!("a relay loop ended: {e}"))),
    }
}
