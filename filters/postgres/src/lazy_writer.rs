//! A write buffer that exists only while there is something to write.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncWrite, BufWriter};

/// The capacity of the buffer while in use (that of `BufWriter::new`).
const CAPACITY: usize = 8 * 1024;

/// A `BufWriter` that takes its buffer on the first write and gives it back once flushed, so an
/// idle connection holds none. From a first write to the next flush it is a `BufWriter` of
/// `CAPACITY` bytes and buffers exactly as one.
pub(crate) struct LazyWriter<W> {
    /// `None` only in the middle of `resize`.
    inner: Option<BufWriter<W>>,
    /// Whether `inner` has its buffer (a zero-capacity `BufWriter` allocates none).
    sized: bool,
}

impl<W: AsyncWrite + Unpin> LazyWriter<W> {
    pub(crate) fn new(stream: W) -> Self {
        Self {
            inner: Some(BufWriter::with_capacity(0, stream)),
            sized: false,
        }
    }

    /// Swaps the buffer for one of `capacity` bytes; only called while nothing is buffered.
    fn resize(&mut self, capacity: usize) {
        let writer = self.inner.take().expect("a writer outside resize");
        debug_assert!(
            writer.buffer().is_empty(),
            "resizing would drop buffered bytes"
        );
        self.inner = Some(BufWriter::with_capacity(capacity, writer.into_inner()));
        self.sized = capacity > 0;
    }

    fn writer(&mut self) -> Pin<&mut BufWriter<W>> {
        Pin::new(self.inner.as_mut().expect("a writer outside resize"))
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for LazyWriter<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if !this.sized {
            this.resize(CAPACITY);
        }
        this.writer().poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if !this.sized {
            this.resize(CAPACITY);
        }
        this.writer().poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.as_ref().is_some_and(|w| w.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.writer().poll_flush(cx))?;
        if this.sized {
            this.resize(0);
        }
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().writer().poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn buffers_until_flushed_then_holds_no_buffer() {
        let mut writer = LazyWriter::new(Vec::new());
        assert!(!writer.sized);
        writer.write_all(b"hello ").await.unwrap();
        writer.write_all(b"world").await.unwrap();
        assert!(writer.sized);
        assert!(
            writer.inner.as_ref().unwrap().get_ref().is_empty(),
            "still buffered"
        );
        writer.flush().await.unwrap();
        assert!(!writer.sized);
        assert_eq!(writer.inner.as_ref().unwrap().get_ref(), b"hello world");
        writer.write_all(&[7; 3 * CAPACITY]).await.unwrap();
        writer.shutdown().await.unwrap();
        assert_eq!(
            writer.inner.as_ref().unwrap().get_ref().len(),
            11 + 3 * CAPACITY
        );
    }
}
