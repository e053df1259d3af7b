//! A per-connection idle timeout that costs a clock read per wait, not a timer.
//!
//! `tokio::time::timeout(period, read)` around every read of a busy connection adds a timer
//! entry to the runtime's wheel and removes it again for every request: issue 18's profile of
//! the PostgreSQL gateway under `pgbench -S` put the timer at 2.4 % of the gateway's CPU (entry,
//! wheel insert and remove, the driver's lock). An [`IdleTimer`] keeps one timer per connection
//! and moves it only when it fires early, as the kernel's TCP keepalive and Netty's
//! `IdleStateHandler` do: [`IdleTimer::start`] only notes the time, and the timer, once due,
//! sleeps again for what is left of the period if the connection was active meanwhile. So a busy
//! connection touches the wheel once a period, not once a request.

use std::pin::Pin;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// Fires once a wait that began at the last [`IdleTimer::start`] has lasted `period`.
#[derive(Debug)]
pub struct IdleTimer {
    period: Duration,
    started: Instant,
    /// Armed on the first wait; its deadline is never later than the wait's end.
    sleep: Option<Pin<Box<Sleep>>>,
}

impl IdleTimer {
    /// A timer for waits of at most `period`.
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            started: Instant::now(),
            sleep: None,
        }
    }

    /// A wait begins now (for a reader: the buffer is empty and it waits for the next request).
    pub fn start(&mut self) {
        self.started = Instant::now();
    }

    /// Completes once `period` has passed since the last [`IdleTimer::start`]. Cancel safe: drop
    /// it when the awaited event comes first, and call `start` before the next wait.
    ///
    /// Needs a tokio runtime with its time driver.
    pub async fn expired(&mut self) {
        loop {
            let due = self.started + self.period;
            if Instant::now() >= due {
                return;
            }
            match &mut self.sleep {
                // Pending with a deadline no later than `due`: it fires, and the loop sleeps
                // again for what is left. Anything else is moved to `due`.
                Some(sleep) if !sleep.is_elapsed() && sleep.deadline() <= due => {}
                Some(sleep) => sleep.as_mut().reset(due),
                None => self.sleep = Some(Box::pin(tokio::time::sleep_until(due))),
            }
            if let Some(sleep) = &mut self.sleep {
                sleep.as_mut().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn fires_a_period_after_the_last_start_and_never_before() {
        let period = Duration::from_millis(100);
        let mut timer = IdleTimer::new(period);
        let begin = Instant::now();
        timer.expired().await;
        assert_eq!(begin.elapsed(), period);

        // Busy: waits that end before the period do not fire, and a wait that began late
        // lasts its whole period, although the timer was armed for an earlier start.
        for _ in 0..5 {
            timer.start();
            let waited = tokio::time::timeout(Duration::from_millis(60), timer.expired()).await;
            assert!(waited.is_err(), "fired within a busy connection's wait");
        }
        timer.start();
        let begin = Instant::now();
        timer.expired().await;
        assert_eq!(begin.elapsed(), period);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_wait_stays_expired_until_the_next_start() {
        let mut timer = IdleTimer::new(Duration::from_millis(10));
        timer.expired().await;
        let begin = Instant::now();
        timer.expired().await;
        assert_eq!(begin.elapsed(), Duration::ZERO);
    }
}
