//! A write buffer that exists only while there is something to write.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::AsyncWrite;

/// The most bytes buffered before they are written (that of `BufWriter::new`); a write at
/// least this long bypasses the buffer, as with a `BufWriter`.
const CAPACITY: usize = 8 * 1024;

/// The buffer's first allocation, kept across flushes. Issue 18's callgrind profile of
/// `pgbench -S` found an 8 KiB buffer taken and given back at every flush of both directions
/// among the gateway's costliest allocations, for about 100 bytes each; then, with 512 bytes
/// taken and given back, still two of the nine allocations of a transaction. A larger output
/// grows the buffer up to `CAPACITY`, and a grown buffer is given back at the flush.
const FIRST: usize = 512;

/// A buffered writer that holds at most `FIRST` bytes once flushed (an idle connection holds
/// no more), and none before its first write. From a first write to the next flush it buffers
/// as a `BufWriter` of `CAPACITY` bytes would.
pub(crate) struct LazyWriter<W> {
    inner: W,
    /// What is buffered (`written..` not yet written); no allocation while empty.
    buf: Vec<u8>,
    written: usize,
}

impl<W: AsyncWrite + Unpin> LazyWriter<W> {
    pub(crate) fn new(stream: W) -> Self {
        Self {
            inner: stream,
            buf: Vec::new(),
            written: 0,
        }
    }

    /// `write_all(data)`, with the common case, a message that fits in the buffer, done here as
    /// a copy instead of through a `WriteAll` future and `poll_write` (issue 18's profile of
    /// `pgbench -S -M prepared`: seven such writes per transaction). The same effect either way:
    /// buffered while it fits, as [`AsyncWrite::poll_write`] does.
    pub(crate) async fn put(&mut self, data: &[u8]) -> io::Result<()> {
        // An empty `data` as `write_all`: no write, so no buffer either.
        if data.is_empty() || self.buffer_if_fits(data) {
            return Ok(());
        }
        tokio::io::AsyncWriteExt::write_all(self, data).await
    }

    /// Buffers `data` if it fits beside what is buffered and is shorter than a whole buffer
    /// (a longer write goes past the buffer); `false`, and nothing done, otherwise.
    fn buffer_if_fits(&mut self, data: &[u8]) -> bool {
        if self.buf.len() + data.len() > CAPACITY || data.len() >= CAPACITY {
            return false;
        }
        if self.buf.capacity() == 0 {
            self.buf.reserve_exact(FIRST.max(data.len()));
        }
        self.buf.extend_from_slice(data);
        true
    }

    /// Writes out what is buffered; the buffer is kept (empty) for more.
    fn poll_write_buffered(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.buf.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.buf[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "failed to write the buffered data",
                )));
            }
            self.written += n;
        }
        self.buf.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for LazyWriter<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if !this.buffer_if_fits(data) {
            ready!(this.poll_write_buffered(cx))?;
            // The buffer is empty now: `data` fits unless it is a whole buffer or more.
            if !this.buffer_if_fits(data) {
                return Pin::new(&mut this.inner).poll_write(cx, data);
            }
        }
        Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_buffered(cx))?;
        ready!(Pin::new(&mut this.inner).poll_flush(cx))?;
        if this.buf.capacity() > FIRST {
            this.buf = Vec::new();
        }
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_write_buffered(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn buffers_until_flushed_then_holds_at_most_the_first_buffer() {
        let mut writer = LazyWriter::new(Vec::new());
        assert_eq!(writer.buf.capacity(), 0);
        writer.write_all(b"hello ").await.unwrap();
        writer.write_all(b"world").await.unwrap();
        assert_eq!(writer.buf.capacity(), FIRST);
        assert!(writer.inner.is_empty(), "still buffered");
        writer.flush().await.unwrap();
        assert_eq!(writer.buf.capacity(), FIRST, "a small buffer is kept");
        assert_eq!(writer.inner, b"hello world");
        // Small writes grow the buffer up to CAPACITY, then go out in CAPACITY-sized writes.
        for _ in 0..3 * CAPACITY / 100 {
            writer.write_all(&[1; 100]).await.unwrap();
            assert!(writer.buf.len() <= CAPACITY);
        }
        writer.write_all(&[7; 3 * CAPACITY]).await.unwrap();
        writer.write_all(b"tail").await.unwrap();
        writer.flush().await.unwrap();
        assert_eq!(writer.buf.capacity(), 0, "a grown buffer is given back");
        writer.shutdown().await.unwrap();
        let mut expected = b"hello world".to_vec();
        expected.extend(std::iter::repeat_n(1, 3 * CAPACITY / 100 * 100));
        expected.extend(std::iter::repeat_n(7, 3 * CAPACITY));
        expected.extend_from_slice(b"tail");
        assert_eq!(writer.inner, expected);
    }

    /// `put` leaves the writer as `write_all` does, whatever the sizes: the same bytes out, the
    /// same bytes buffered, the same buffer kept.
    #[tokio::test]
    async fn put_is_write_all() {
        let sizes = [
            0,
            1,
            100,
            FIRST - 1,
            FIRST,
            FIRST + 1,
            CAPACITY - 1,
            CAPACITY,
            3 * CAPACITY,
        ];
        for first in sizes {
            for second in sizes {
                let mut by_put = LazyWriter::new(Vec::new());
                let mut by_write = LazyWriter::new(Vec::new());
                for (n, fill) in [(first, 1u8), (second, 2u8)] {
                    let data = vec![fill; n];
                    by_put.put(&data).await.unwrap();
                    by_write.write_all(&data).await.unwrap();
                    assert_eq!(by_put.inner, by_write.inner, "{first} {second}");
                    assert_eq!(by_put.buf, by_write.buf, "{first} {second}");
                    assert_eq!(by_put.buf.capacity(), by_write.buf.capacity());
                }
                by_put.flush().await.unwrap();
                by_write.flush().await.unwrap();
                assert_eq!(by_put.inner, by_write.inner);
                assert_eq!(by_put.buf.capacity(), by_write.buf.capacity());
            }
        }
    }
}
