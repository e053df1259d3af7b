//! A wake-up for one waiting task, with a permit.
//!
//! A connection's writing task waits for "bytes were queued" once per request. tokio's `Notify`
//! serves any number of waiters: each wait that finds no permit takes its waiter list's lock to
//! enqueue, and its drop takes it again (issue 18's profile of the shared Redis connection: about
//! 450 instructions per request). With a single waiter, an atomic flag and an
//! [`AtomicWaker`] are all it takes, as in `futures`' and tokio's own single-consumer channels.

use std::future::poll_fn;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;

use atomic_waker::AtomicWaker;

/// [`Signal::notify`] wakes the one task in [`Signal::wait`]; a notify with nobody waiting is
/// kept (one permit) and ends the next wait at once. Several notifies before a wait count once.
#[derive(Debug, Default)]
pub struct Signal {
    set: AtomicBool,
    waiter: AtomicWaker,
}

impl Signal {
    /// A signal with no permit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the permit and wakes the waiting task, if any.
    pub fn notify(&self) {
        self.set.store(true, Ordering::Release);
        self.waiter.wake();
    }

    /// Completes once the permit is set, and takes it. Only one task may wait at a time (a
    /// second one would take the first one's place as the task woken). Cancel safe: a permit
    /// is taken only by the poll that completes.
    pub async fn wait(&self) {
        poll_fn(|cx| {
            if self.set.swap(false, Ordering::AcqRel) {
                return Poll::Ready(());
            }
            // Register before reading the flag again: a notify in between then wakes us.
            self.waiter.register(cx.waker());
            if self.set.swap(false, Ordering::AcqRel) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_notify_before_the_wait_is_kept_once() {
        let signal = Signal::new();
        signal.notify();
        signal.notify();
        tokio::time::timeout(Duration::from_secs(10), signal.wait())
            .await
            .expect("the permit ends the wait");
        let second = tokio::time::timeout(Duration::from_millis(20), signal.wait()).await;
        assert!(second.is_err(), "two notifies before a wait are one permit");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_notify_after_a_wait_began_wakes_it() {
        let signal = Arc::new(Signal::new());
        for _ in 0..1_000 {
            let waiter = tokio::spawn({
                let signal = signal.clone();
                async move { signal.wait().await }
            });
            tokio::task::yield_now().await;
            signal.notify();
            tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .expect("the waiter was woken")
                .unwrap();
        }
    }
}
