//! Where a session on a shared upstream connection receives its replies.
//!
//! One queue under one lock, with the receiver's waker kept beside it: the shared connection's
//! reader hands a session all the replies of one read that are its own under one lock and wakes
//! it once (tokio's unbounded channel took a lock-free push, a semaphore permit and a wake per
//! reply, and its receiver a block walk per reply: about 500 instructions per `GET`, issue 18).
//! Every side runs on the session threads, so the lock is not contended in the common case.
//!
//! The queue is bounded in bytes ([`sharing::LARGEST_SHARED_BACKLOG`]): a client that does not
//! read its replies is told why once and gets no more, as Redis drops a client over its output
//! buffer limit; its session then ends.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};

use bytes::Bytes;

use crate::frame::Frame;
use crate::sharing;

/// The most replies' room an empty inbox keeps.
const KEPT_ROOM: usize = 64;

/// One reply for a session, or why the shared connection is gone.
pub(crate) type Reply = Result<(Frame, Bytes), Arc<str>>;

/// The receiving side: one per session.
pub(crate) struct Inbox {
    shared: Arc<Shared>,
}

/// The sending side: the session keeps one, and each route of the shared connection that
/// names the session holds a clone. When the last is dropped, the inbox ends once emptied.
pub(crate) struct Outbox {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Outboxes alive.
    senders: AtomicUsize,
}

#[derive(Default)]
struct State {
    replies: VecDeque<Reply>,
    /// Reply bytes queued and not yet taken.
    bytes: usize,
    /// Went over the bound: the session's replies are dropped from then on.
    over: bool,
    /// The inbox was dropped: nothing is kept for it.
    gone: bool,
    /// The receiver waiting for a reply.
    waker: Option<Waker>,
}

/// Why [`Inbox::try_recv`] has nothing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Empty {
    /// Nothing yet.
    Now,
    /// Nothing, and every outbox is gone: nothing more can come.
    Forever,
}

/// A session's inbox and the outbox its replies are sent to.
pub(crate) fn inbox() -> (Outbox, Inbox) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::default()),
        senders: AtomicUsize::new(1),
    });
    (
        Outbox {
            shared: shared.clone(),
        },
        Inbox { shared },
    )
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next reply, or why there is none. `senders` is read under the lock: the last
    /// outbox's drop takes the lock before it wakes the receiver.
    fn next(&self, state: &mut State) -> Result<Reply, Empty> {
        if let Some(reply) = state.take() {
            return Ok(reply);
        }
        if self.senders.load(Ordering::Acquire) == 0 {
            return Err(Empty::Forever);
        }
        Err(Empty::Now)
    }

    /// Changes the state under the lock, then wakes a waiting receiver outside it.
    fn then_wake(&self, change: impl FnOnce(&mut State)) {
        let waker = {
            let mut state = self.lock();
            change(&mut state);
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl State {
    fn take(&mut self) -> Option<Reply> {
        let reply = self.replies.pop_front()?;
        if let Ok((_, raw)) = &reply {
            self.bytes -= raw.len();
        }
        // A burst's room is given back once it is read (a deque does not shrink by itself;
        // thousands of replies' worth kept per quiet session would add up).
        if self.replies.is_empty() && self.replies.capacity() > KEPT_ROOM {
            self.replies = VecDeque::new();
        }
        Some(reply)
    }
}

impl Inbox {
    /// The next reply if one is there.
    pub(crate) fn try_recv(&mut self) -> Result<Reply, Empty> {
        self.shared.next(&mut self.shared.lock())
    }

    /// The next reply; `None` when every outbox is gone and nothing is left.
    pub(crate) async fn recv(&mut self) -> Option<Reply> {
        poll_fn(|cx| {
            let mut state = self.shared.lock();
            match self.shared.next(&mut state) {
                Ok(reply) => Poll::Ready(Some(reply)),
                Err(Empty::Forever) => Poll::Ready(None),
                Err(Empty::Now) => {
                    match &mut state.waker {
                        Some(waker) if waker.will_wake(cx.waker()) => {}
                        waker => *waker = Some(cx.waker().clone()),
                    }
                    Poll::Pending
                }
            }
        })
        .await
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.gone = true;
        state.replies.clear();
        state.bytes = 0;
        state.waker = None;
    }
}

impl Outbox {
    /// Whether both send to the same inbox.
    pub(crate) fn same_inbox(&self, other: &Outbox) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Whether the session's unread replies went over the bound.
    pub(crate) fn is_over(&self) -> bool {
        self.shared.lock().over
    }

    /// Hands `replies` to the session, in order, and wakes it once. A reply that would take its
    /// unread replies over the bound (unless nothing is unread: one reply of any size always
    /// goes through) is not queued; the session is told why, once, and gets no more.
    pub(crate) fn send(&self, replies: impl IntoIterator<Item = (Frame, Bytes)>) {
        self.shared.then_wake(|state| {
            // Every reply is taken from `replies`, kept or not: the caller counts them as
            // delivered. A session that is gone no longer wants its replies.
            for reply in replies {
                if state.gone || state.over {
                    continue;
                }
                let len = reply.1.len();
                if state.bytes > 0 && state.bytes + len > sharing::LARGEST_SHARED_BACKLOG {
                    state.over = true;
                    let why = format!(
                        "the client left over {} bytes of replies unread",
                        sharing::LARGEST_SHARED_BACKLOG
                    );
                    state.replies.push_back(Err(why.into()));
                    continue;
                }
                state.bytes += len;
                state.replies.push_back(Ok(reply));
            }
        });
    }

    /// Tells the session why the shared connection is gone.
    pub(crate) fn fail(&self, why: Arc<str>) {
        self.shared.then_wake(|state| {
            if !state.gone {
                state.replies.push_back(Err(why));
            }
        });
    }
}

impl Clone for Outbox {
    fn clone(&self) -> Self {
        self.shared.senders.fetch_add(1, Ordering::Relaxed);
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for Outbox {
    fn drop(&mut self) {
        if self.shared.senders.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last one: a waiting receiver learns that nothing more comes.
            self.shared.then_wake(|_| {});
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(n: usize) -> (Frame, Bytes) {
        let raw = Bytes::from(vec![b'x'; n]);
        (Frame::Bulk(raw.clone()), raw)
    }

    fn len(reply: Reply) -> usize {
        reply.expect("a reply").1.len()
    }

    #[tokio::test]
    async fn replies_arrive_in_order_and_the_end_is_seen() {
        let (outbox, mut inbox) = inbox();
        assert_eq!(inbox.try_recv().err(), Some(Empty::Now));
        outbox.send([reply(1), reply(2)]);
        let second = outbox.clone();
        second.send([reply(3)]);
        assert_eq!(len(inbox.try_recv().expect("queued")), 1);
        assert_eq!(len(inbox.recv().await.expect("queued")), 2);
        drop(outbox);
        assert_eq!(len(inbox.recv().await.expect("queued")), 3);
        assert_eq!(inbox.try_recv().err(), Some(Empty::Now), "a clone is alive");
        drop(second);
        assert_eq!(inbox.try_recv().err(), Some(Empty::Forever));
        assert!(inbox.recv().await.is_none());
    }

    #[tokio::test]
    async fn a_waiting_receiver_is_woken_by_a_send_and_by_the_last_drop() {
        let (outbox, mut inbox) = inbox();
        let waiting = tokio::spawn(async move {
            let first = inbox.recv().await.map(len);
            let end = inbox.recv().await.is_none();
            (first, end)
        });
        tokio::task::yield_now().await;
        outbox.send([reply(5)]);
        tokio::task::yield_now().await;
        drop(outbox);
        let (first, end) = waiting.await.expect("the receiver ends");
        assert_eq!(first, Some(5));
        assert!(end);
    }

    #[tokio::test]
    async fn over_the_bound_the_session_is_told_once_and_gets_nothing_more() {
        let (outbox, mut inbox) = inbox();
        // One reply of any size goes through while nothing is unread.
        outbox.send([reply(sharing::LARGEST_SHARED_BACKLOG + 1)]);
        assert!(!outbox.is_over());
        assert_eq!(
            len(inbox.recv().await.expect("queued")),
            sharing::LARGEST_SHARED_BACKLOG + 1
        );
        outbox.send([reply(sharing::LARGEST_SHARED_BACKLOG - 1)]);
        outbox.send([reply(1), reply(1), reply(7)]);
        assert!(outbox.is_over());
        outbox.send([reply(1)]);
        assert_eq!(
            len(inbox.recv().await.expect("queued")),
            sharing::LARGEST_SHARED_BACKLOG - 1
        );
        assert_eq!(len(inbox.recv().await.expect("queued")), 1);
        let why = inbox.recv().await.expect("queued").expect_err("told why");
        assert!(why.contains("unread"), "{why}");
        assert_eq!(inbox.try_recv().err(), Some(Empty::Now));
    }

    /// The shared connection's reader counts every reply it hands over as delivered: a send
    /// must take them all from the run, kept or not, or the rest would go to the next session.
    #[test]
    fn a_send_takes_every_reply_of_its_run_kept_or_not() {
        let (outbox, mut inbox) = inbox();
        let mut run = vec![reply(sharing::LARGEST_SHARED_BACKLOG), reply(2), reply(3)].into_iter();
        outbox.send(run.by_ref().take(2));
        assert_eq!(run.len(), 1, "an over-the-bound reply was taken too");
        outbox.send(run.by_ref().take(1));
        assert_eq!(
            run.len(),
            0,
            "a reply for a session over the bound was taken too"
        );
        drop(inbox.try_recv());
        drop(inbox);
        let mut run = vec![reply(1), reply(1)].into_iter();
        outbox.send(run.by_ref());
        assert_eq!(
            run.len(),
            0,
            "replies for a session that is gone were taken too"
        );
    }

    #[tokio::test]
    async fn room_for_a_burst_is_given_back_once_read() {
        let (outbox, mut inbox) = inbox();
        outbox.send((0..1000).map(|_| reply(1)));
        for _ in 0..999 {
            len(inbox.try_recv().expect("queued"));
        }
        assert!(outbox.shared.lock().replies.capacity() >= 1000);
        len(inbox.recv().await.expect("queued"));
        assert!(outbox.shared.lock().replies.capacity() <= KEPT_ROOM);
    }

    #[test]
    fn nothing_is_kept_for_a_session_that_is_gone() {
        let (outbox, inbox) = inbox();
        drop(inbox);
        outbox.send([reply(10)]);
        outbox.fail("gone".into());
        let state = outbox.shared.lock();
        assert!(state.replies.is_empty());
        assert_eq!(state.bytes, 0);
    }
}
