//! Where a gateway's sessions run: `session_threads` single-threaded runtimes, each on a thread
//! of its own with its own epoll; a session is given one at accept (round robin) and stays on
//! it. The Redis and PostgreSQL gateways both run their sessions so, as twemproxy and PgBouncer
//! run theirs on one event loop.
//!
//! Why not the node's multi-threaded runtime: there a session woken by its socket is often
//! polled by another worker than the one waiting in epoll, and an idle worker parks on a futex
//! that the next wake-up must signal. Issue 18's profile of `pgbench -S` at 8 clients on two
//! cores (`strace -c`, voluntary context switches from `/proc/<pid>/task/*/status`): 0.3
//! `futex` calls and 0.4-0.9 voluntary context switches per transaction, against PgBouncer's
//! 0 and 0.13-0.45 on its one thread. One thread per core did not help (two threads each with
//! half the sessions sleep and wake more often: 0.6-1.0 switches per transaction); one thread
//! for all sessions did (0.23-0.31), hence the default of 1. The Redis gateway the same way
//! (`redis-benchmark GET`, 50 clients): 13-14 µs of gateway CPU per request on the node's
//! runtime, 8.7-9.4 µs on one thread, twemproxy's 8.8-9.2 µs in the same runs.
//!
//! Nothing in a session blocks its thread: the audit sink and the key ring are reached through
//! channels and locks that work across runtimes, and a session's sockets are registered with
//! the runtime that polls them (the gateway hands the accepted socket over as a std socket).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::{Builder, Handle};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// One gateway's session threads; they end when it is dropped (which is after its last
/// session: every session holds the gateway).
pub struct SessionThreads {
    handles: Vec<Handle>,
    next: AtomicUsize,
    stop: CancellationToken,
}

impl SessionThreads {
    /// Starts `count` threads (at least one), named `<name>-<i>`.
    pub fn start(name: &str, count: usize) -> std::io::Result<Self> {
        let count = count.max(1);
        let stop = CancellationToken::new();
        let mut handles = Vec::with_capacity(count);
        for i in 0..count {
            let runtime = Builder::new_current_thread().enable_all().build()?;
            handles.push(runtime.handle().clone());
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                // Runs the sessions spawned on its handle until the gateway is gone.
                .spawn(move || runtime.block_on(stop.cancelled()))?;
        }
        Ok(Self {
            handles,
            next: AtomicUsize::new(0),
            stop,
        })
    }

    /// Spawns `session` on the next thread (round robin), tracked by `tracker`. The session
    /// must register its sockets itself, in the runtime it runs on.
    pub fn spawn<F>(&self, tracker: &TaskTracker, session: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        tracker.spawn_on(session, &self.handles[i]);
    }
}

impl Drop for SessionThreads {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
