//! Yielding to the tasks already made ready, without a turn of the I/O driver.
//!
//! `tokio::task::yield_now` defers the task's wake-up until the runtime has polled its I/O
//! driver, and a runtime with ready tasks polls it with a zero timeout: one `epoll_wait` (and
//! the time driver's bookkeeping) per yield. The Redis hop's shared write loop yields once per
//! wake-up so that every session the same turn made ready queues its request first, and with
//! `yield_now` that was a third `epoll_wait` per request at one client (issue 18, `strace -c`).
//! [`RunQueueYield`] wakes the task at once instead: the scheduler puts it behind the tasks
//! already queued, which is the point of the yield, and polls the driver on its own schedule.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Pending once, with the task woken at once: it runs again after the tasks already ready.
#[derive(Debug, Default)]
pub struct RunQueueYield {
    yielded: bool,
}

impl RunQueueYield {
    /// A yield not yet taken.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Future for RunQueueYield {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// On a single-threaded runtime, a task that yields runs again only after the tasks that
    /// were ready before it yielded.
    #[test]
    fn a_yielding_task_runs_after_the_tasks_already_ready() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        runtime.block_on({
            let order = order.clone();
            async move {
                let push = move |what: &'static str| order.lock().unwrap().push(what);
                let yielder = tokio::spawn({
                    let push = push.clone();
                    async move {
                        push("yielder before");
                        RunQueueYield::new().await;
                        push("yielder after");
                    }
                });
                let others: Vec<_> = ["a", "b", "c"]
                    .into_iter()
                    .map(|name| {
                        let push = push.clone();
                        tokio::spawn(async move { push(name) })
                    })
                    .collect();
                yielder.await.unwrap();
                for other in others {
                    other.await.unwrap();
                }
            }
        });
        assert_eq!(
            *order.lock().unwrap(),
            ["yielder before", "a", "b", "c", "yielder after"]
        );
    }
}
