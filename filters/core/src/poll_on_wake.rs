//! A future that polls the one it wraps only after that one asked to be woken.
//!
//! A session's loop selects on its next request and on a rare event (the node draining) once
//! per request, and `tokio::select!` polls every branch each time: the drain's future, a
//! `CancellationToken` wait or a `Notify`, then takes a lock and re-registers its waker on every
//! request although nothing happened (issue 18's profile of the PostgreSQL hop). Wrapped in a
//! [`PollOnWake`], the rare future is polled once, and again only when its own waker fired; in
//! between a poll costs an atomic swap and the outer waker's registration, as in
//! `futures::future::Shared`'s notifier.
//!
//! The same holds for a busy future that shares its task with another: the Redis session's
//! reader and writer are two futures of one task, and every wake-up for the writer (a reply
//! came) polled the reader's socket, timers and drain wait for nothing, once per request.
//!
//! The registration is made on every poll, on purpose: a wake sets the flag and then takes the
//! registered waker, two steps another thread can be between, so a poll that skipped the
//! registration because its waker "was still registered" could find the gate empty after a
//! late take, and every later wake would be lost (found in review, issue 18).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use atomic_waker::AtomicWaker;

/// Wraps a future so that it is polled only when it was woken (and on the first poll). Once it
/// completed, it stays pending: in a `select!` loop its branch is not taken twice.
pub struct PollOnWake<F> {
    /// `None` once it completed.
    inner: Option<Pin<Box<F>>>,
    gate: Arc<Gate>,
    /// The waker the inner future is polled with: it opens the gate.
    waker: Waker,
}

/// Whether the inner future was woken since its last poll, and the task to wake then.
struct Gate {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Gate {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<F: Future> PollOnWake<F> {
    /// Wraps `inner`; it is polled on the first poll.
    pub fn new(inner: F) -> Self {
        let gate = Arc::new(Gate {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        Self {
            inner: Some(Box::pin(inner)),
            waker: Waker::from(gate.clone()),
            gate,
        }
    }
}

impl<F: Future> Future for PollOnWake<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Pending;
        };
        // Register before reading the flag: a wake in between then wakes this task again.
        this.gate.task.register(cx.waker());
        if !this.gate.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        // A wake during this poll sets the flag and wakes the task registered above.
        match inner.as_mut().poll(&mut Context::from_waker(&this.waker)) {
            Poll::Ready(output) => {
                this.inner = None;
                Poll::Ready(output)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    use tokio_util::sync::CancellationToken;

    use super::*;

    /// Counts its polls and wakes; ready once `done` is set.
    #[derive(Default)]
    struct Probe {
        polls: AtomicUsize,
        done: AtomicBool,
        waker: Mutex<Option<Waker>>,
    }

    impl Probe {
        fn wake(&self) {
            if let Some(w) = self.waker.lock().unwrap().take() {
                w.wake();
            }
        }

        async fn wait(self: Arc<Self>) {
            std::future::poll_fn(|cx| {
                self.polls.fetch_add(1, Ordering::SeqCst);
                if self.done.load(Ordering::SeqCst) {
                    return Poll::Ready(());
                }
                *self.waker.lock().unwrap() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await
        }
    }

    /// Counts the wakes of the outer task.
    #[derive(Default)]
    struct Task(AtomicUsize);

    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A gated probe, and the outer task that polls it (its waker counts the wakes).
    fn gated() -> (
        Arc<Probe>,
        Arc<Task>,
        Waker,
        PollOnWake<impl Future<Output = ()>>,
    ) {
        let probe = Arc::new(Probe::default());
        let task = Arc::new(Task::default());
        let waker = Waker::from(task.clone());
        let gated = PollOnWake::new(probe.clone().wait());
        (probe, task, waker, gated)
    }

    #[test]
    fn the_inner_future_is_polled_only_after_it_was_woken() {
        let (probe, task, waker, mut gated) = gated();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..5 {
            assert_eq!(Pin::new(&mut gated).poll(&mut cx), Poll::Pending);
        }
        assert_eq!(probe.polls.load(Ordering::SeqCst), 1, "only the first poll");

        // A wake that does not complete it: polled once more, and the outer task was woken.
        probe.wake();
        assert_eq!(task.0.load(Ordering::SeqCst), 1);
        assert_eq!(Pin::new(&mut gated).poll(&mut cx), Poll::Pending);
        assert_eq!(Pin::new(&mut gated).poll(&mut cx), Poll::Pending);
        assert_eq!(probe.polls.load(Ordering::SeqCst), 2);

        probe.done.store(true, Ordering::SeqCst);
        probe.wake();
        assert_eq!(
            task.0.load(Ordering::SeqCst),
            2,
            "the waker a wake took was registered again"
        );
        assert_eq!(Pin::new(&mut gated).poll(&mut cx), Poll::Ready(()));
        assert_eq!(probe.polls.load(Ordering::SeqCst), 3);
        // Terminated: pending from then on, without polling the finished future.
        assert_eq!(Pin::new(&mut gated).poll(&mut cx), Poll::Pending);
        assert_eq!(probe.polls.load(Ordering::SeqCst), 3);
    }

    /// Polled by another task than before (a new waker): a wake reaches that one.
    #[test]
    fn a_new_outer_waker_is_registered() {
        let probe = Arc::new(Probe::default());
        let (first, second) = (Arc::new(Task::default()), Arc::new(Task::default()));
        let mut gated = PollOnWake::new(probe.clone().wait());
        for task in [&first, &second] {
            let waker = Waker::from(Arc::clone(task));
            assert_eq!(
                Pin::new(&mut gated).poll(&mut Context::from_waker(&waker)),
                Poll::Pending
            );
        }
        probe.wake();
        assert_eq!(first.0.load(Ordering::SeqCst), 0);
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
    }

    /// A wake is two steps (set the flag, take and wake the registered waker) that another
    /// thread can be between while this task polls: here played in that order by hand. After
    /// the late take, the next poll must register again, or the gate stays empty and every
    /// later wake is lost.
    #[test]
    fn a_wake_split_by_a_poll_loses_no_later_wake() {
        let (probe, task, waker, mut gated) = gated();
        let mut cx = Context::from_waker(&waker);
        assert_eq!(Pin::new(&mut gated).poll(&mut cx), Poll::Pending);

        gated.gate.woken.store(true, Ordering::Release);
        assert_eq!(Pin::new(&mut gated).poll(&mut cx), Poll::Pending);
        gated.gate.task.wake();
        assert_eq!(task.0.load(Ordering::SeqCst), 1);
        assert_eq!(Pin::new(&mut gated).poll(&mut cx), Poll::Pending);

        probe.wake();
        assert_eq!(task.0.load(Ordering::SeqCst), 2, "a later wake was lost");
    }

    /// As the sessions use it: a branch of a `select!` loop that ends once the token is
    /// cancelled by another task.
    #[tokio::test]
    async fn a_select_loop_sees_a_cancellation() {
        let shutdown = CancellationToken::new();
        let mut drained = PollOnWake::new(shutdown.clone().cancelled_owned());
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(1);
        let cancel = shutdown.clone();
        let sender = tokio::spawn(async move {
            for i in 0..3 {
                tx.send(i).await.unwrap();
            }
            cancel.cancel();
            // Keep the channel open: the loop must end on the cancellation, not on a close.
            std::future::pending::<()>().await;
        });
        let mut received = Vec::new();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            loop {
                tokio::select! {
                    biased;
                    () = &mut drained => break,
                    Some(i) = rx.recv() => received.push(i),
                }
            }
        })
        .await;
        sender.abort();
        assert!(ended.is_ok(), "the loop never saw the cancellation");
        assert!(shutdown.is_cancelled());
        assert_eq!(received, (0..received.len() as u32).collect::<Vec<_>>());
    }
}
