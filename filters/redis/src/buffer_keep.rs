//! When a session keeps an empty buffer through a wait instead of giving it back.
//!
//! A busy connection's next request follows within microseconds: taking a 16 KiB buffer and
//! freeing it again per request cost the fenced path about a fifth of its instructions (issue
//! 18; glibc consolidates its heap on every allocation of a kilobyte or more). A connection
//! that sends a request and then idles, as most idle connections do, must not hold one: a
//! burst of a thousand such connections holding their buffers for the keep period doubled the
//! gateway's memory per idle connection. So a buffer is kept only once it was used twice since
//! the connection was last quiet, and only for [`IdleTimer::KEEP_BUFFER`] of waiting.

use fencegate_core::IdleTimer;

/// The keep rule of one buffer (or of buffers used together).
#[derive(Debug)]
pub(crate) struct BufferKeep {
    timer: IdleTimer,
    /// Uses since the connection was last quiet (a keep that ran out).
    uses: u32,
}

impl BufferKeep {
    pub(crate) fn new() -> Self {
        Self {
            timer: IdleTimer::lax(IdleTimer::KEEP_BUFFER),
            uses: 0,
        }
    }

    /// The buffer was used: bytes were read into it or written from it.
    pub(crate) fn used(&mut self) {
        self.uses = self.uses.saturating_add(1);
    }

    /// Whether the wait that begins now keeps the buffer (then await [`BufferKeep::expired`]
    /// beside the wait): only once it was used twice since the connection was last quiet.
    pub(crate) fn begin(&mut self) -> bool {
        let keep = self.uses >= 2;
        if keep {
            self.timer.start();
        }
        keep
    }

    /// Completes once the wait begun has lasted [`IdleTimer::KEEP_BUFFER`] (lax: at most twice
    /// that): the connection is quiet, the buffer goes back. Cancel safe.
    pub(crate) async fn expired(&mut self) {
        self.timer.expired().await;
        self.uses = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn kept_from_the_second_use_until_quiet() {
        let mut keep = BufferKeep::new();
        assert!(!keep.begin(), "never used");
        keep.used();
        assert!(!keep.begin(), "one request, then idle: given back at once");
        keep.used();
        assert!(keep.begin(), "busy: kept");
        let quiet = tokio::time::Instant::now();
        keep.expired().await;
        let waited = quiet.elapsed();
        assert!(waited >= IdleTimer::KEEP_BUFFER && waited <= 2 * IdleTimer::KEEP_BUFFER);
        assert!(!keep.begin(), "quiet: the count starts again");
        keep.used();
        keep.used();
        assert!(keep.begin());
        // A wait cut short (the request came) leaves the connection busy.
        let _ = tokio::time::timeout(Duration::from_millis(1), keep.expired()).await;
        assert!(keep.begin());
    }
}
