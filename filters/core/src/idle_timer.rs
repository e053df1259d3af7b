//! A per-connection idle timeout that costs neither a timer nor a clock read per wait.
//!
//! `tokio::time::timeout(period, read)` around every read of a busy connection adds a timer
//! entry to the runtime's wheel and removes it again for every request: issue 18's profile of
//! the PostgreSQL gateway under `pgbench -S` put the timer at 2.4 % of the gateway's CPU (entry,
//! wheel insert and remove, the driver's lock). Noting the time at each wait and polling a
//! sleep in each wait instead still cost two clock reads and a timer poll per wait (tokio's
//! clock then looked up the runtime's handle on every read: pingora turned on tokio's
//! `test-util`, until `patch/tokio-test` kept it out).
//!
//! An [`IdleTimer`] ticks a few times a period, as PgBouncer's janitor and the kernel's TCP
//! keepalive check idleness on a clock of their own: [`IdleTimer::start`] only flags activity,
//! each tick takes the flag, and the timer fires after a period's worth of ticks in a row
//! without activity while a wait is under way. A wait thus lasts at least `period` and at most
//! `period` and one tick before it fires, a busy connection touches the wheel once a tick, and a
//! wait polls the sleep only when it ticked (or when the task's waker changed).

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// Ticks per period of [`IdleTimer::new`]: a wait outlasts its period by at most an eighth.
const TICKS: u32 = 8;

/// Fires once a wait has lasted a whole `period` since the last [`IdleTimer::start`] (and at
/// most one tick more).
#[derive(Debug)]
pub struct IdleTimer {
    tick: Duration,
    /// Ticks in a period.
    ticks: u32,
    /// A wait started since the last tick.
    active: bool,
    /// Ticks in a row without activity.
    quiet: u32,
    /// Armed on the first wait, at the next tick.
    sleep: Option<Pin<Box<Sleep>>>,
    /// The waker the armed sleep holds: a poll with the same waker need not poll the sleep.
    registered: Option<Waker>,
}

impl IdleTimer {
    /// How long a connection waiting for bytes keeps its empty buffer before giving it back
    /// (with [`IdleTimer::lax`]: at most twice that). A busy connection's next message follows
    /// within microseconds, so its buffer is reused instead of taken and freed per message (an
    /// allocation of a buffer's size costs glibc a heap consolidation each time); a connection
    /// quiet for longer holds none.
    pub const KEEP_BUFFER: Duration = Duration::from_millis(100);

    /// A timer for waits of at least `period` and at most an eighth more: for timeouts a user
    /// sets.
    pub fn new(period: Duration) -> Self {
        Self::ticking(period, TICKS)
    }

    /// A timer for waits of at least `period` and at most twice that, ticking once a period:
    /// for housekeeping where the exact moment does not matter, on connections busy enough that
    /// a wake-up per tick would show.
    pub fn lax(period: Duration) -> Self {
        Self::ticking(period, 1)
    }

    fn ticking(period: Duration, ticks: u32) -> Self {
        Self {
            tick: period / ticks,
            ticks,
            active: false,
            quiet: 0,
            sleep: None,
            registered: None,
        }
    }

    /// A wait begins now (for a reader: the buffer is empty and it waits for the next request).
    pub fn start(&mut self) {
        self.active = true;
    }

    /// Completes once the wait that began at the last [`IdleTimer::start`] has lasted the
    /// period. Cancel safe: drop it when the awaited event comes first, and call `start` before
    /// the next wait.
    ///
    /// Needs a tokio runtime with its time driver.
    pub async fn expired(&mut self) {
        poll_fn(|cx| self.poll_expired(cx)).await;
    }

    fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            if self.quiet >= self.ticks && !self.active {
                return Poll::Ready(());
            }
            let Some(sleep) = self.sleep.as_mut() else {
                self.sleep = Some(Box::pin(tokio::time::sleep(self.tick)));
                self.registered = None;
                continue;
            };
            if sleep.is_elapsed() {
                if std::mem::take(&mut self.active) {
                    self.quiet = 0;
                } else {
                    self.quiet += 1;
                }
                if self.quiet >= self.ticks {
                    // Not re-armed: the next wait's first poll counts as a tick.
                    return Poll::Ready(());
                }
                sleep.as_mut().reset(Instant::now() + self.tick);
                self.registered = None;
            }
            if self
                .registered
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                return Poll::Pending;
            }
            // Unconstrained: with the task's budget spent, a sleep returns Pending without
            // registering the waker, and this timer would then never be polled again.
            match Pin::new(&mut tokio::task::unconstrained(sleep.as_mut())).poll(cx) {
                Poll::Ready(()) => continue,
                Poll::Pending => {
                    self.registered = Some(cx.waker().clone());
                    return Poll::Pending;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How long `timer.expired()` takes (paused time: exact).
    async fn wait(timer: &mut IdleTimer) -> Duration {
        let begin = Instant::now();
        timer.expired().await;
        begin.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn fires_a_period_after_the_last_start_and_never_before() {
        let period = Duration::from_millis(800);
        let most = period + period / TICKS;
        let mut timer = IdleTimer::new(period);
        let waited = wait(&mut timer).await;
        assert!(waited >= period && waited <= most, "{waited:?}");

        // Busy: waits that end before the period do not fire, however long the connection
        // stays busy, and a wait that began late lasts its whole period.
        for _ in 0..20 {
            timer.start();
            let waited = tokio::time::timeout(Duration::from_millis(450), timer.expired()).await;
            assert!(waited.is_err(), "fired within a busy connection's wait");
        }
        timer.start();
        let waited = wait(&mut timer).await;
        assert!(waited >= period && waited <= most, "{waited:?}");

        // Started in the middle of a tick.
        tokio::time::sleep(Duration::from_millis(37)).await;
        timer.start();
        let waited = wait(&mut timer).await;
        assert!(waited >= period && waited <= most, "{waited:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_wait_stays_expired_until_the_next_start() {
        let mut timer = IdleTimer::new(Duration::from_millis(80));
        timer.expired().await;
        assert_eq!(wait(&mut timer).await, Duration::ZERO);
        timer.start();
        assert!(wait(&mut timer).await >= Duration::from_millis(80));
    }

    /// A wait polled with a new waker (the reader moved to another task) registers it: the
    /// timer still fires.
    #[tokio::test(start_paused = true)]
    async fn a_new_waker_is_registered() {
        let mut timer = IdleTimer::new(Duration::from_millis(80));
        timer.start();
        let first = tokio::time::timeout(Duration::from_millis(10), timer.expired()).await;
        assert!(first.is_err());
        let moved = tokio::spawn(async move {
            timer.start();
            wait(&mut timer).await
        });
        let waited = tokio::time::timeout(Duration::from_secs(10), moved)
            .await
            .expect("the timer fires in its new task")
            .expect("the task ends");
        assert!(waited >= Duration::from_millis(80), "{waited:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lax_timer_fires_within_two_periods() {
        let period = Duration::from_millis(100);
        let mut timer = IdleTimer::lax(period);
        for offset in [0, 1, 50, 99] {
            tokio::time::sleep(Duration::from_millis(offset)).await;
            timer.start();
            let waited = wait(&mut timer).await;
            assert!(
                waited >= period && waited <= 2 * period,
                "{offset}: {waited:?}"
            );
        }
        // Busy for many periods: never fires.
        for _ in 0..10 {
            timer.start();
            let waited = tokio::time::timeout(Duration::from_millis(99), timer.expired()).await;
            assert!(waited.is_err(), "fired within a busy connection's wait");
        }
    }
}
