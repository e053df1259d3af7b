//! Upstream connections that several sessions share while each is in the plain state (see
//! [`crate::sharing`]), as twemproxy does: the requests of many clients reach Redis in one write
//! and their replies come back in one read, which costs Redis and the gateway a fraction of the
//! system calls of a connection per client (issue 18's profile: redis-server spent 7.5 µs per
//! `GET` behind a connection per client, 2.3 µs behind twemproxy).
//!
//! Sessions queue their requests' bytes with a *route*: who gets the next `count` replies.
//! Routes and bytes are appended under one lock, so the routes are in the order Redis receives
//! the requests and replies. One task writes whatever is queued in one write; another reads
//! replies and hands each to the session its route names. Each session's requests stay in its
//! own order; two sessions' requests are ordered as they were queued, as on two connections.
//!
//! Anything unexpected closes the connection for every session on it, which then ends as it
//! would on a lost connection of its own: a reply nobody asked for, or a frame that RESP2
//! without subscriptions never sends (a push, an attribute), which would mean a request
//! changed the connection's state after all.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use fencegate_core::{PollOnWake, RunQueueYield, Signal};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::RedisConfig;
use crate::error::RedisError;
use crate::frame::{self, Frame, Limits};
use crate::inbox::Outbox;
use crate::sharing;
use crate::stream::{self, Connection, ReadHalf, WriteHalf};
use crate::upstream::{self, Upstream};

/// How much room a read of replies has at least.
const READ_ROOM: usize = 16 * 1024;

/// The sessions' side of one shared upstream connection.
pub(crate) struct SharedConnection {
    queue: std::sync::Mutex<Queue>,
    /// Wakes the writing task when bytes were queued (its only waiter).
    queued: Signal,
    /// Wakes the sessions waiting for room ([`SharedConnection::room`]) when the queue was
    /// taken to be written, or the connection failed.
    written: Notify,
}

struct Queue {
    /// Requests not yet written, in the order of `routes`.
    out: BytesMut,
    /// Who gets the replies still to come, in order.
    routes: VecDeque<Route>,
    /// Why the connection is gone; once set, nothing more is accepted.
    closed: Option<Arc<str>>,
}

/// The next `count` replies go to `to`.
struct Route {
    to: Outbox,
    count: u64,
}

impl SharedConnection {
    /// Starts the tasks of a shared connection over `connection` (authenticated, RESP2).
    fn start(connection: Connection, stop: CancellationToken) -> Arc<Self> {
        let shared = Arc::new(Self {
            queue: std::sync::Mutex::new(Queue {
                out: BytesMut::new(),
                routes: VecDeque::new(),
                closed: None,
            }),
            queued: Signal::new(),
            written: Notify::new(),
        });
        let (read_half, write_half) = stream::split(connection);
        tokio::spawn(write_loop(shared.clone(), write_half, stop.clone()));
        tokio::spawn(read_loop(shared.clone(), read_half, stop));
        shared
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `requests` requests encoded in `bytes`; their replies go to `to`, in order.
    pub(crate) fn submit(
        &self,
        to: &Outbox,
        bytes: &[u8],
        requests: u64,
    ) -> Result<(), RedisError> {
        {
            let mut queue = self.lock();
            if let Some(why) = &queue.closed {
                return Err(RedisError::Upstream(format!(
                    "the shared connection is gone: {why}"
                )));
            }
            if to.is_over() {
                return Err(RedisError::Upstream(
                    "the client left too many replies unread on a shared connection".into(),
                ));
            }
            queue.out.extend_from_slice(bytes);
            match queue.routes.back_mut() {
                Some(last) if last.to.same_inbox(to) => last.count += requests,
                _ => queue.routes.push_back(Route {
                    to: to.clone(),
                    count: requests,
                }),
            }
        }
        self.queued.notify();
        Ok(())
    }

    /// Waits until the requests not yet written are under [`sharing::LARGEST_SHARED_QUEUE`]
    /// (or the connection failed: [`SharedConnection::submit`] then says so).
    pub(crate) async fn room(&self) {
        // Nearly always there is room: a waiter is registered only when there was none (a
        // waiter registered and removed per batch took the `Notify`'s lock twice, issue 18).
        while !self.has_room() {
            let written = self.written.notified();
            tokio::pin!(written);
            written.as_mut().enable();
            // Checked again once registered: the writer may have taken the queue in between.
            if self.has_room() {
                return;
            }
            written.await;
        }
    }

    fn has_room(&self) -> bool {
        let queue = self.lock();
        queue.closed.is_some() || queue.out.len() < sharing::LARGEST_SHARED_QUEUE
    }

    /// Whether the connection failed (or the gateway stopped): it takes no more requests.
    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed.is_some()
    }

    /// Closes the connection for everybody: each session waiting for a reply gets `why`.
    fn fail(&self, why: &str) {
        let routes = {
            let mut queue = self.lock();
            if queue.closed.is_some() {
                return;
            }
            let why: Arc<str> = why.into();
            queue.closed = Some(why.clone());
            queue.out = BytesMut::new();
            std::mem::take(&mut queue.routes)
                .into_iter()
                .map(|r| (r.to, why.clone()))
                .collect::<Vec<_>>()
        };
        if !routes.is_empty() {
            tracing::warn!(
                sessions = routes.len(),
                error = why,
                "a shared upstream connection failed; the sessions waiting on it end"
            );
        }
        for (to, why) in routes {
            to.fail(why);
        }
        self.queued.notify();
        self.written.notify_waiters();
    }

    /// Hands parsed replies to their sessions, in order: each session's run of them at once.
    fn route(&self, replies: &mut Vec<(Frame, Bytes)>) -> Result<(), &'static str> {
        let mut queue = self.lock();
        let mut replies = replies.drain(..);
        while replies.len() > 0 {
            let Some(route) = queue.routes.front_mut() else {
                return Err("Redis sent a reply no request asked for");
            };
            let run = route.count.min(replies.len() as u64);
            route.to.send(replies.by_ref().take(run as usize));
            route.count -= run;
            if route.count == 0 {
                queue.routes.pop_front();
            }
        }
        Ok(())
    }
}

/// Writes what the sessions queued, all of it in one write per wake-up.
async fn write_loop(shared: Arc<SharedConnection>, mut half: WriteHalf, stop: CancellationToken) {
    let _closes = CloseOnEnd(shared.clone());
    let mut spare = BytesMut::new();
    // One wait for the stop, polled only when the token woke it: a `cancelled()` made per
    // wake-up registered a waiter under the token's lock per request (issue 18).
    let mut stopped = PollOnWake::new(stop.cancelled_owned());
    loop {
        // `biased`: an unbiased select draws a random number per poll (issue 18); the stop is
        // polled only once woken, so checking it first costs nothing.
        tokio::select! {
            biased;
            () = &mut stopped => return shared.fail("the gateway stopped"),
            () = shared.queued.wait() => {}
        }
        // Let the other sessions the same wake-up made ready queue theirs first: one write
        // then carries them all (twemproxy's batching, by the same means: one turn of the
        // event loop per write). Not `yield_now`: it costs a zero-timeout poll of the I/O
        // driver, an `epoll_wait` per write.
        RunQueueYield::new().await;
        loop {
            let (mut bytes, full) = {
                let mut queue = shared.lock();
                if queue.closed.is_some() {
                    return;
                }
                if queue.out.is_empty() {
                    break;
                }
                let full = queue.out.len() >= sharing::LARGEST_SHARED_QUEUE;
                (
                    std::mem::replace(&mut queue.out, std::mem::take(&mut spare)),
                    full,
                )
            };
            // A session waits for room only after seeing the queue full, and only this loop
            // empties it: when it was not full, nobody waits (and `notify_waiters` takes a
            // lock per write).
            if full {
                shared.written.notify_waiters();
            }
            if let Err(e) = half.write_all(&bytes).await {
                return shared.fail(&format!("writing to upstream: {e}"));
            }
            bytes.clear();
            spare = bytes;
        }
    }
}

/// Closes the connection for every session when a task of it ends however it ends (a panic
/// included), so no session waits for a reply that can no longer come.
struct CloseOnEnd(Arc<SharedConnection>);

impl Drop for CloseOnEnd {
    fn drop(&mut self) {
        self.0.fail("the shared connection's task ended");
    }
}

/// Reads replies and routes them.
async fn read_loop(shared: Arc<SharedConnection>, mut half: ReadHalf, stop: CancellationToken) {
    let _closes = CloseOnEnd(shared.clone());
    let mut buf = BytesMut::new();
    let mut replies = Vec::new();
    let mut stopped = PollOnWake::new(stop.cancelled_owned());
    loop {
        if buf.capacity() - buf.len() < READ_ROOM / 4 {
            buf.reserve(READ_ROOM);
        }
        let read = tokio::select! {
            biased;
            () = &mut stopped => return shared.fail("the gateway stopped"),
            read = half.read_buf(&mut buf) => read,
        };
        match read {
            Ok(0) => return shared.fail("Redis closed the shared connection"),
            Err(e) => return shared.fail(&format!("reading from upstream: {e}")),
            Ok(_) => {}
        }
        loop {
            match frame::split_frame(&mut buf, &Limits::UPSTREAM) {
                Ok(Some((frame, raw))) => {
                    if !matches!(raw[0], b'+' | b'-' | b':' | b'$' | b'*') {
                        return shared.fail(
                            "Redis sent a frame that is not RESP2 on a shared connection (a request changed the connection's protocol)",
                        );
                    }
                    replies.push((frame, raw));
                }
                Ok(None) => break,
                Err(e) => return shared.fail(&format!("unreadable reply: {e}")),
            }
        }
        if let Err(why) = shared.route(&mut replies) {
            return shared.fail(why);
        }
    }
}

/// The shared upstream connections of one gateway (`shared_upstream_connections`); sessions
/// take them in turn. A connection that failed is replaced for the next session that asks.
pub(crate) struct SharedPool {
    places: Vec<tokio::sync::Mutex<Option<Arc<SharedConnection>>>>,
    next: AtomicUsize,
    /// Cancelled when the gateway is dropped: the connections' tasks end.
    stop: CancellationToken,
}

impl SharedPool {
    /// A pool of `size` connections, opened on first use (0: sessions never share).
    pub(crate) fn new(size: usize) -> Self {
        Self {
            places: (0..size).map(|_| tokio::sync::Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
            stop: CancellationToken::new(),
        }
    }

    /// Whether sessions start on a shared connection.
    pub(crate) fn enabled(&self) -> bool {
        !self.places.is_empty()
    }

    /// The next shared connection in turn, opened (and authenticated) if its place is empty or
    /// its connection failed.
    pub(crate) async fn get(
        &self,
        upstream: &Upstream,
        config: &RedisConfig,
    ) -> Result<Arc<SharedConnection>, RedisError> {
        let place = self.next.fetch_add(1, Ordering::Relaxed) % self.places.len();
        let mut place = self.places[place].lock().await;
        if let Some(shared) = place.as_ref().filter(|s| !s.is_closed()) {
            return Ok(shared.clone());
        }
        let connection = upstream::connect(upstream, config).await?;
        let shared = SharedConnection::start(connection, self.stop.child_token());
        *place = Some(shared.clone());
        Ok(shared)
    }
}

impl Drop for SharedPool {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
