//! Stands in for `tokio-test` in fencegate's builds (`[patch.crates-io]` in the workspace
//! manifest).
//!
//! pingora-core 0.9 lists `tokio-test` as a normal dependency only to implement its stream
//! traits for `tokio_test::io::Mock`, which its own unit tests use
//! (<https://github.com/cloudflare/pingora/issues/598>). `tokio-test` turns on tokio's
//! `test-util` feature, and Cargo unifies features: every fencegate binary got tokio's
//! pausable clock, which takes a lock and reads the system clock twice for every
//! `tokio::time::Instant::now()`, and the runtime reads it around every park (issue 18's
//! profile: about 500 instructions per proxied request). This crate keeps the name and the one
//! type pingora-core refers to outside its tests, as a type with no values: nothing can create
//! or use one. Tests of ours that pause time ask for `test-util` in their own
//! `dev-dependencies`.

/// The module pingora-core names.
pub mod io {
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    /// A type with no values: pingora-core implements its stream traits for it, and nothing
    /// ever makes one.
    #[derive(Debug)]
    pub enum Mock {}

    impl AsyncRead for Mock {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            match *self {}
        }
    }

    impl AsyncWrite for Mock {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &[u8],
        ) -> Poll<io::Result<usize>> {
            match *self {}
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            match *self {}
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            match *self {}
        }
    }
}
