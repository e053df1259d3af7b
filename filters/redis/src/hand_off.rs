//! A bounded queue between two futures of one task that a `biased` select polls producer
//! first, consumer second: the session's reader and writer.
//!
//! Why not a tokio channel: its receiver registers the task's waker, and every send then wakes
//! the very task that is running. Tokio reschedules a task woken while it runs as a yield,
//! which notifies a parked worker thread: a futex wake and a thread woken for nothing on every
//! request of an otherwise idle connection (issue 18, one client). Here the consumer registers
//! no waker: whatever the producer queued during a poll, the consumer sees later in the same
//! poll, because it is polled after the producer. The producer does register one, but only
//! when the queue is full (the consumer must free room first: rare, and then a self-wake is
//! the right thing).
//!
//! The contract is the caller's: both ends must be polled by one select, `biased`, producer
//! first (or the consumer alone once the producer is done). Anything else can strand an item.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};

struct State<T> {
    items: VecDeque<T>,
    capacity: usize,
    /// One end is gone: the producer finished (the consumer drains what is left, then sees the
    /// end), or the consumer finished (the producer's sends fail).
    closed: bool,
    /// The producer, waiting for room.
    producer: Option<Waker>,
}

type Shared<T> = Arc<Mutex<State<T>>>;

fn lock<T>(shared: &Shared<T>) -> MutexGuard<'_, State<T>> {
    // The lock is never held across user code that could panic: a poisoned state is whole.
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// A queue of at most `capacity` items, as its producing and consuming ends.
pub(crate) fn hand_off<T>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    let shared = Arc::new(Mutex::new(State {
        items: VecDeque::new(),
        capacity: capacity.max(1),
        closed: false,
        producer: None,
    }));
    (
        Producer {
            shared: shared.clone(),
        },
        Consumer { shared },
    )
}

/// The producing end.
pub(crate) struct Producer<T> {
    shared: Shared<T>,
}

impl<T> Producer<T> {
    /// Queues `item`, waiting for room while the queue is full; gives it back when the
    /// consumer is gone.
    pub(crate) async fn send(&self, item: T) -> Result<(), T> {
        let mut item = Some(item);
        poll_fn(|cx| {
            let mut state = lock(&self.shared);
            if state.closed {
                state.producer = None;
                return Poll::Ready(Err(item.take().expect("polled after completion")));
            }
            if state.items.len() < state.capacity {
                state.producer = None;
                state
                    .items
                    .push_back(item.take().expect("polled after completion"));
                return Poll::Ready(Ok(()));
            }
            state.producer = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        lock(&self.shared).closed = true;
    }
}

/// The consuming end.
pub(crate) struct Consumer<T> {
    shared: Shared<T>,
}

impl<T> Consumer<T> {
    /// The next item (`Ready(Some)`), the end (`Ready(None)`: the producer is gone and the
    /// queue drained), or `Pending` when the queue is empty for now.
    pub(crate) fn try_recv(&mut self) -> Poll<Option<T>> {
        let mut state = lock(&self.shared);
        match state.items.pop_front() {
            Some(item) => {
                if let Some(producer) = state.producer.take() {
                    producer.wake();
                }
                Poll::Ready(Some(item))
            }
            None if state.closed => Poll::Ready(None),
            None => Poll::Pending,
        }
    }

    /// Waits for the next item, or the end. Registers no waker (see the module's contract):
    /// an item can only come from the producer, which is polled before this in every poll.
    pub(crate) async fn recv(&mut self) -> Option<T> {
        poll_fn(|_| self.try_recv()).await
    }
}

impl<T> Drop for Consumer<T> {
    fn drop(&mut self) {
        let mut state = lock(&self.shared);
        state.closed = true;
        if let Some(producer) = state.producer.take() {
            producer.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::Context;

    #[test]
    fn items_come_out_in_order_then_the_end() {
        let (tx, mut rx) = hand_off(4);
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        for i in 0..3 {
            assert!(pin!(tx.send(i)).poll(&mut cx).is_ready());
        }
        assert_eq!(rx.try_recv(), Poll::Ready(Some(0)));
        drop(tx);
        assert_eq!(rx.try_recv(), Poll::Ready(Some(1)));
        assert_eq!(rx.try_recv(), Poll::Ready(Some(2)));
        assert_eq!(rx.try_recv(), Poll::Ready(None));
    }

    #[test]
    fn a_full_queue_holds_the_producer_until_the_consumer_frees_room() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::task::Wake;
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let (tx, mut rx) = hand_off(1);
        assert!(pin!(tx.send(1)).poll(&mut cx).is_ready());
        let mut second = pin!(tx.send(2));
        assert!(second.as_mut().poll(&mut cx).is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        assert_eq!(rx.try_recv(), Poll::Ready(Some(1)));
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "freeing room wakes the producer"
        );
        assert_eq!(second.as_mut().poll(&mut cx), Poll::Ready(Ok(())));
        assert_eq!(rx.try_recv(), Poll::Ready(Some(2)));
        assert_eq!(rx.try_recv(), Poll::Pending);
    }

    #[test]
    fn sends_fail_once_the_consumer_is_gone() {
        let (tx, rx) = hand_off(1);
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        drop(rx);
        assert_eq!(pin!(tx.send(7)).poll(&mut cx), Poll::Ready(Err(7)));
    }
}
