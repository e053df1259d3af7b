//! PostgreSQL v3 wire messages: check-then-parse framing (as in mini-redis' `connection.rs`),
//! the few frontend bodies the gateway must read, and the few backend messages it synthesizes.
//!
//! Frames are kept as their raw bytes so that everything the gateway does not rewrite is relayed
//! byte-for-byte. Message *encoding* of frontend messages the gateway sends on its own (the
//! guard's Parse/Bind/Execute/Close) uses `postgres_protocol::message::frontend`; backend
//! messages are decoded with `postgres_protocol::message::backend` where their fields matter.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use fallible_iterator::FallibleIterator;
use fencegate_core::IdleTimer;
use postgres_protocol::message::backend;
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::error::PostgresError;

/// The startup packet's protocol version 3.0.
pub const PROTOCOL_V3: u32 = 196_608;
/// `SSLRequest`'s code.
pub const SSL_REQUEST: u32 = 80_877_103;
/// `GSSENCRequest`'s code.
pub const GSSENC_REQUEST: u32 = 80_877_104;
/// `CancelRequest`'s code.
pub const CANCEL_REQUEST: u32 = 80_877_102;
/// The largest startup packet accepted (PostgreSQL's own limit is 10,000 bytes).
pub const MAX_STARTUP_BYTES: usize = 10_000;

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length field is below 4 or above the limit.
    #[error("message length {len} is outside 4..={max}")]
    BadLength {
        /// The declared length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A startup packet with an unknown protocol version or request code.
    #[error("unsupported startup code {0}")]
    BadStartup(u32),
    /// A body that does not hold the fields its type needs.
    #[error("malformed {0} message")]
    BadBody(&'static str),
}

/// One typed message: tag byte, then a length that counts itself and the body. `B` holds its
/// bytes: `Bytes` for a frame split off to be kept or handed on ([`parse_frame`]), `&[u8]` for
/// one looked at and relayed where it was read ([`FrameReader::next`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<B = Bytes> {
    /// The type byte (`Q`, `P`, `B`, ...).
    pub tag: u8,
    /// The whole frame as received: tag, length, body.
    pub raw: B,
}

impl<B: AsRef<[u8]>> Frame<B> {
    /// The body (after tag and length).
    pub fn body(&self) -> &[u8] {
        &self.raw.as_ref()[5..]
    }
}

/// The first packet of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Startup {
    /// `SSLRequest`.
    Ssl,
    /// `GSSENCRequest`.
    Gss,
    /// `CancelRequest`, relayed as is.
    Cancel(Bytes),
    /// A v3 `StartupMessage`: its parameters in order.
    Message(Vec<(String, String)>),
}

/// Checks whether `buf` starts with a whole typed frame; splits it off if so.
/// `Ok(None)`: more bytes are needed. Never panics on any input.
pub fn parse_frame(buf: &mut BytesMut, max: usize) -> Result<Option<Frame>, FrameError> {
    let Some(size) = frame_size(buf, max)? else {
        return Ok(None);
    };
    let raw = buf.split_to(size).freeze();
    Ok(Some(Frame { tag: raw[0], raw }))
}

/// The size of the whole typed frame at the front of `buf` (tag, length and body), once all of
/// it is there; until then `Ok(None)`, with room reserved for the rest. An error for a length
/// outside `4..=max`. Never panics on any input.
fn frame_size(buf: &mut BytesMut, max: usize) -> Result<Option<usize>, FrameError> {
    let Some(size) = announced_size(buf, max)? else {
        return Ok(None);
    };
    if buf.len() < size {
        buf.reserve(size - buf.len());
        return Ok(None);
    }
    Ok(Some(size))
}

/// The size the typed frame at the front of `bytes` announces (tag, length and body), once its
/// header is there, whether or not the rest is; an error for a length outside `4..=max`. The
/// one place that bound is checked, for [`frame_size`] and [`FrameReader::frame_at`].
fn announced_size(bytes: &[u8], max: usize) -> Result<Option<usize>, FrameError> {
    let Some(header) = bytes.get(..5) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len < 4 || len > max {
        return Err(FrameError::BadLength {
            len: len as u64,
            max,
        });
    }
    Ok(Some(len + 1))
}

/// Checks whether `buf` starts with a whole startup packet; splits and decodes it if so.
pub fn parse_startup(buf: &mut BytesMut) -> Result<Option<Startup>, FrameError> {
    if buf.len() < 8 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if !(8..=MAX_STARTUP_BYTES).contains(&len) {
        return Err(FrameError::BadLength {
            len: len as u64,
            max: MAX_STARTUP_BYTES,
        });
    }
    if buf.len() < len {
        return Ok(None);
    }
    let raw = buf.split_to(len).freeze();
    let code = u32::from_be_bytes([raw[4], raw[5], raw[6], raw[7]]);
    match code {
        SSL_REQUEST if len == 8 => Ok(Some(Startup::Ssl)),
        GSSENC_REQUEST if len == 8 => Ok(Some(Startup::Gss)),
        CANCEL_REQUEST if len == 16 => Ok(Some(Startup::Cancel(raw))),
        PROTOCOL_V3 => {
            let mut body = &raw[8..];
            let mut params = Vec::new();
            loop {
                let name = read_cstr(&mut body).ok_or(FrameError::BadBody("startup"))?;
                if name.is_empty() {
                    break;
                }
                let value = read_cstr(&mut body).ok_or(FrameError::BadBody("startup"))?;
                params.push((name, value));
            }
            if !body.is_empty() {
                return Err(FrameError::BadBody("startup"));
            }
            Ok(Some(Startup::Message(params)))
        }
        other => Err(FrameError::BadStartup(other)),
    }
}

/// Reads a NUL-terminated UTF-8 string and advances past it.
pub fn read_cstr(body: &mut &[u8]) -> Option<String> {
    read_str(body).map(str::to_owned)
}

/// [`read_cstr`], borrowed from the message.
fn read_str<'a>(body: &mut &'a [u8]) -> Option<&'a str> {
    let end = memchr::memchr(0, body)?;
    let text = std::str::from_utf8(&body[..end]).ok()?;
    *body = &body[end + 1..];
    Some(text)
}

/// A name (a portal's, a statement's) borrowed from the message. Names are short (the server
/// keeps 63 bytes), and for a few bytes a plain loop finds the NUL sooner than `memchr`, whose
/// vector search costs more to set up than it saves (issue 18's profile: about 120
/// instructions per name read, two per Bind).
fn read_name<'a>(body: &mut &'a [u8]) -> Option<&'a str> {
    let end = body.iter().position(|&b| b == 0)?;
    let text = std::str::from_utf8(&body[..end]).ok()?;
    *body = &body[end + 1..];
    Some(text)
}

/// A `Query` message's SQL text.
/// Borrowed from the frame: the text of every simple query is read here, and a copy of it was
/// an allocation per query (issue 18).
pub fn query_text<B: AsRef<[u8]>>(frame: &Frame<B>) -> Result<&str, FrameError> {
    let mut body = frame.body();
    read_str(&mut body).ok_or(FrameError::BadBody("Query"))
}

/// A `Parse` message's statement name and SQL text.
pub fn parse_fields<B: AsRef<[u8]>>(frame: &Frame<B>) -> Result<(String, String), FrameError> {
    let mut body = frame.body();
    let name = read_cstr(&mut body).ok_or(FrameError::BadBody("Parse"))?;
    let query = read_cstr(&mut body).ok_or(FrameError::BadBody("Parse"))?;
    Ok((name, query))
}

/// An `Execute` message's portal name, borrowed from the frame.
pub fn execute_portal<B: AsRef<[u8]>>(frame: &Frame<B>) -> Result<&str, FrameError> {
    let mut body = frame.body();
    read_name(&mut body).ok_or(FrameError::BadBody("Execute"))
}

/// A `Bind` message's portal and statement names, borrowed from the frame (a copy was an
/// allocation per Bind, issue 18).
pub fn bind_fields<B: AsRef<[u8]>>(frame: &Frame<B>) -> Result<(&str, &str), FrameError> {
    let mut body = frame.body();
    let portal = read_name(&mut body).ok_or(FrameError::BadBody("Bind"))?;
    let statement = read_name(&mut body).ok_or(FrameError::BadBody("Bind"))?;
    Ok((portal, statement))
}

/// A `Close` or `Describe` message's kind (`S` or `P`) and name.
pub fn target_fields<B: AsRef<[u8]>>(frame: &Frame<B>) -> Result<(u8, String), FrameError> {
    let mut body = frame.body();
    if body.is_empty() {
        return Err(FrameError::BadBody("Close/Describe"));
    }
    let kind = body.get_u8();
    let name = read_cstr(&mut body).ok_or(FrameError::BadBody("Close/Describe"))?;
    Ok((kind, name))
}

/// Encodes a `StartupMessage` with `params`.
pub fn startup_message(params: &[(String, String)]) -> Bytes {
    let mut buf = BytesMut::new();
    postgres_protocol::message::frontend::startup_message(
        params.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        &mut buf,
    )
    .expect("startup parameters never contain NUL (they were read as C strings)");
    buf.freeze()
}

/// The fields of an `ErrorResponse` the gateway synthesizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFields {
    /// `ERROR` or `FATAL`.
    pub severity: &'static str,
    /// The SQLSTATE.
    pub code: String,
    /// The primary message.
    pub message: String,
    /// An optional detail.
    pub detail: Option<String>,
}

/// Encodes a backend `ErrorResponse`.
pub fn error_response(fields: &ErrorFields) -> Bytes {
    let mut body = BytesMut::new();
    for (tag, value) in [
        (b'S', fields.severity),
        (b'V', fields.severity),
        (b'C', fields.code.as_str()),
        (b'M', fields.message.as_str()),
    ]
    .into_iter()
    .chain(fields.detail.as_deref().map(|d| (b'D', d)))
    {
        body.put_u8(tag);
        body.put_slice(value.replace('\0', " ").as_bytes());
        body.put_u8(0);
    }
    body.put_u8(0);
    typed(b'E', &body)
}

/// Encodes a backend `ReadyForQuery` with transaction `status` (`I`, `T`, `E`).
pub fn ready_for_query(status: u8) -> Bytes {
    typed(b'Z', &[status])
}

/// How many `ReadyForQuery` messages `bytes` (whole backend messages, back to back) holds; a
/// cut-off message at the end, and anything after a bad length, is not counted.
pub fn ready_for_query_count(bytes: &[u8]) -> u32 {
    let mut count = 0;
    let mut rest = bytes;
    while let Ok(Some(size)) = announced_size(rest, usize::MAX) {
        let Some(next) = rest.get(size..) else {
            break;
        };
        count += u32::from(rest[0] == b'Z');
        rest = next;
    }
    count
}

/// Encodes a backend `CommandComplete` with `tag`.
pub fn command_complete(tag: &str) -> Bytes {
    let mut body = BytesMut::from(tag.as_bytes());
    body.put_u8(0);
    typed(b'C', &body)
}

fn typed(tag: u8, body: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(body.len() + 5);
    buf.put_u8(tag);
    buf.put_u32(body.len() as u32 + 4);
    buf.put_slice(body);
    buf.freeze()
}

/// SQLSTATE and detail of a backend `ErrorResponse` frame, if it is one and decodes.
pub fn error_code_and_detail<B: AsRef<[u8]>>(frame: &Frame<B>) -> Option<(String, Option<String>)> {
    let mut buf = BytesMut::from(frame.raw.as_ref());
    let Ok(Some(backend::Message::ErrorResponse(body))) = backend::Message::parse(&mut buf) else {
        return None;
    };
    let mut code = None;
    let mut detail = None;
    let mut fields = body.fields();
    while let Ok(Some(field)) = fields.next() {
        match field.type_() {
            b'C' => code = Some(String::from_utf8_lossy(field.value_bytes()).into_owned()),
            b'D' => detail = Some(String::from_utf8_lossy(field.value_bytes()).into_owned()),
            _ => {}
        }
    }
    code.map(|c| (c, detail))
}

/// The capacity of a frame reader's buffer while in use.
const BUFFER: usize = 8 * 1024;

/// Reads frames from one side of a connection.
///
/// The buffer exists only while the connection is busy: an empty buffer is given back once the
/// reader has waited [`IdleTimer::KEEP_BUFFER`], and taken again, at full capacity, when bytes
/// arrive. So an idle connection holds none.
pub struct FrameReader<R> {
    stream: R,
    buffer: BytesMut,
    max: usize,
    idle: IdleTimer,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader that refuses frames longer than `max` bytes.
    pub fn new(stream: R, max: usize) -> Self {
        Self {
            stream,
            buffer: BytesMut::new(),
            max,
            idle: IdleTimer::lax(IdleTimer::KEEP_BUFFER),
        }
    }

    /// The next typed frame, split off the buffer to be kept or handed on; `Ok(None)` on a
    /// clean end of stream between frames.
    pub async fn read_frame(&mut self) -> Result<Option<Frame>, PostgresError> {
        if self.next().await?.is_none() {
            return Ok(None);
        }
        parse_frame(&mut self.buffer, self.max).map_err(|e| PostgresError::Protocol(e.to_string()))
    }

    /// The next typed frame, lent where it was read; `Ok(None)` on a clean end of stream
    /// between frames. Cancel safe. It stays at the front of the buffer until
    /// [`FrameReader::consume`]: a frame only looked at and relayed is neither split off nor
    /// counted (issue 18's profile of the PostgreSQL loops: about 120 instructions per message
    /// for the split, its count and its release).
    pub async fn next(&mut self) -> Result<Option<Frame<&[u8]>>, PostgresError> {
        let size = loop {
            if let Some(size) = frame_size(&mut self.buffer, self.max)
                .map_err(|e| PostgresError::Protocol(e.to_string()))?
            {
                break size;
            }
            if !self.fill().await? {
                return Ok(None);
            }
        };
        Ok(Some(Frame {
            tag: self.buffer[0],
            raw: &self.buffer[..size],
        }))
    }

    /// The whole frame that starts `offset` bytes into the buffer, lent where it was read, if all
    /// of it is there and its length is within `4..=max`; otherwise `None`, and
    /// [`FrameReader::next`] is what waits for the rest or reports the bad length. For judging
    /// every message already read in one go ([`FrameReader::front`], [`FrameReader::consume_bytes`]).
    pub fn frame_at(&self, offset: usize) -> Option<Frame<&[u8]>> {
        let rest = self.buffer.get(offset..)?;
        let size = announced_size(rest, self.max).ok()??;
        let raw = rest.get(..size)?;
        Some(Frame { tag: raw[0], raw })
    }

    /// The first `len` bytes of the buffer (whole frames lent by [`FrameReader::frame_at`]).
    pub fn front(&self, len: usize) -> &[u8] {
        &self.buffer[..len.min(self.buffer.len())]
    }

    /// Drops the first `len` bytes of the buffer (whole frames lent by [`FrameReader::frame_at`]).
    pub fn consume_bytes(&mut self, len: usize) {
        self.buffer.advance(len.min(self.buffer.len()));
    }

    /// Drops the frame at the front of the buffer (nothing if there is no whole one).
    pub fn consume(&mut self) {
        if let Some(size) = self.front_size() {
            self.buffer.advance(size);
        }
    }

    /// The size of the whole frame at the front, if one is there (its length is not checked
    /// against the limit: [`FrameReader::next`] did that).
    fn front_size(&self) -> Option<usize> {
        let header = self.buffer.get(..5)?;
        let size = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize + 1;
        (size >= 5 && self.buffer.len() >= size).then_some(size)
    }

    /// The startup packet; `Ok(None)` on end of stream before it.
    pub async fn read_startup(&mut self) -> Result<Option<Startup>, PostgresError> {
        loop {
            if let Some(startup) = parse_startup(&mut self.buffer)
                .map_err(|e| PostgresError::Protocol(e.to_string()))?
            {
                return Ok(Some(startup));
            }
            if !self.fill().await? {
                return Ok(None);
            }
        }
    }

    /// Whether a whole typed frame is already buffered (then a flush can wait).
    pub fn has_complete_frame(&self) -> bool {
        self.front_size().is_some()
    }

    /// Whether bytes were received beyond the last frame (a client must not pipeline after
    /// `SSLRequest`).
    pub fn has_buffered(&self) -> bool {
        self.buffer.has_remaining()
    }

    /// Reads more bytes; `false` at end of stream (an error if a frame was cut off).
    async fn fill(&mut self) -> Result<bool, PostgresError> {
        let n = if self.buffer.is_empty() {
            self.read_idle().await
        } else {
            self.stream.read_buf(&mut self.buffer).await
        }
        .map_err(PostgresError::io("reading"))?;
        if n == 0 {
            if self.buffer.is_empty() {
                return Ok(false);
            }
            return Err(PostgresError::Protocol(
                "connection closed in the middle of a message".to_owned(),
            ));
        }
        Ok(true)
    }

    /// Reads into an empty buffer; `Ok(0)` only at end of stream. A busy connection's next
    /// message usually follows within microseconds, so the buffer held is kept for
    /// [`IdleTimer::KEEP_BUFFER`]; a connection quiet for longer gives it back, and the first byte to
    /// arrive is then read on its own (a stream offers no wait for readability) into a fresh
    /// buffer of `BUFFER` bytes. The hot path thus costs a flag, not an allocation and an extra
    /// read, nor a clock read ([`IdleTimer`] ticks once a period on its own). Cancel safe: every
    /// byte read is in the buffer before the next wait.
    async fn read_idle(&mut self) -> std::io::Result<usize> {
        if self.buffer.capacity() > 0 {
            self.idle.start();
            tokio::select! {
                biased;
                result = self.stream.read_buf(&mut self.buffer) => return result,
                () = self.idle.expired() => {}
            }
        }
        self.buffer = BytesMut::new();
        let mut first = [0u8; 1];
        let n = self.stream.read(&mut first).await?;
        if n > 0 {
            // Never read into no room: that would return 0 and look like end of stream.
            self.buffer = BytesMut::with_capacity(BUFFER);
            self.buffer.put_slice(&first[..n]);
        }
        Ok(n)
    }

    /// The underlying stream.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.stream
    }

    /// The stream and the bytes read past the last frame.
    pub fn into_parts(self) -> (R, BytesMut) {
        (self.stream, self.buffer)
    }

    /// A reader that starts with `buffer` already received.
    pub fn with_buffer(stream: R, buffer: BytesMut, max: usize) -> Self {
        Self {
            stream,
            buffer,
            max,
            idle: IdleTimer::lax(IdleTimer::KEEP_BUFFER),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn frames_split_only_when_complete() {
        let mut buf = BytesMut::from(&b"Q\0\0\0\x0dSELECT 1\0Z"[..]);
        let frame = parse_frame(&mut buf, 1024).unwrap().unwrap();
        assert_eq!(frame.tag, b'Q');
        assert_eq!(query_text(&frame).unwrap(), "SELECT 1");
        assert_eq!(&buf[..], b"Z");
        assert_eq!(parse_frame(&mut buf, 1024), Ok(None));
    }

    #[test]
    fn bind_names_end_at_their_nul_and_are_utf8() {
        let bind = |body: &[u8]| {
            let mut raw = vec![b'B'];
            raw.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
            raw.extend_from_slice(body);
            let mut buf = BytesMut::from(&raw[..]);
            let frame = parse_frame(&mut buf, 1024).unwrap().unwrap();
            bind_fields(&frame).map(|(p, s)| (p.to_owned(), s.to_owned()))
        };
        let names = |p: &str, s: &str| Ok((p.to_owned(), s.to_owned()));
        assert_eq!(bind(b"\0P0_1\0\0\0"), names("", "P0_1"));
        assert_eq!(bind(b"c1\0\0"), names("c1", ""));
        assert_eq!(bind(b"\0P0_1"), Err(FrameError::BadBody("Bind")), "no NUL");
        assert_eq!(bind(b""), Err(FrameError::BadBody("Bind")));
        assert_eq!(
            bind(b"\0\xff\0"),
            Err(FrameError::BadBody("Bind")),
            "not UTF-8"
        );
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut buf = BytesMut::from(&b"Q\0\0\0\x02"[..]);
        assert!(parse_frame(&mut buf, 1024).is_err());
        let mut buf = BytesMut::from(&b"Q\x7f\0\0\0"[..]);
        assert!(parse_frame(&mut buf, 1024).is_err());
    }

    #[test]
    fn startup_round_trips() {
        let params = vec![
            ("user".to_owned(), "alice".to_owned()),
            ("database".to_owned(), "db".to_owned()),
        ];
        let mut buf = BytesMut::from(&startup_message(&params)[..]);
        assert_eq!(
            parse_startup(&mut buf).unwrap(),
            Some(Startup::Message(params))
        );
        let mut ssl = BytesMut::from(&[0u8, 0, 0, 8, 4, 210, 22, 47][..]);
        assert_eq!(parse_startup(&mut ssl).unwrap(), Some(Startup::Ssl));
        let mut garbage = BytesMut::from(&b"GET / HTTP/1.1\r\n\r\n"[..]);
        assert!(parse_startup(&mut garbage).is_err());
    }

    #[test]
    fn synthesized_errors_decode() {
        let bytes = error_response(&ErrorFields {
            severity: "ERROR",
            code: "FG002".into(),
            message: "no token".into(),
            detail: Some("d".into()),
        });
        let frame = parse_frame(&mut BytesMut::from(&bytes[..]), 1024)
            .unwrap()
            .unwrap();
        assert_eq!(
            error_code_and_detail(&frame),
            Some(("FG002".to_owned(), Some("d".to_owned())))
        );
    }

    /// Hands out its chunks one read at a time, as a socket whose bytes arrive in pieces.
    struct Chunked(std::collections::VecDeque<Vec<u8>>);

    impl AsyncRead for Chunked {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if let Some(mut chunk) = self.0.pop_front() {
                let n = chunk.len().min(buf.remaining());
                buf.put_slice(&chunk[..n]);
                if n < chunk.len() {
                    self.0.push_front(chunk.split_off(n));
                }
            }
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// What a reader yields, read three ways: frames by `read_frame`; by `next` and `consume`;
    /// and by `next`, then every whole frame already read by `frame_at`, dropped together by
    /// `consume_bytes` (the reply loop's runs). Then how it ended (`None`: a clean end, else
    /// the error's text).
    fn read_both_ways(bytes: &[u8], cuts: &[usize]) -> [(Vec<Vec<u8>>, Option<String>); 3] {
        let chunks = || {
            let mut chunks = std::collections::VecDeque::new();
            let mut at = 0;
            for &cut in cuts.iter().chain([&bytes.len()]) {
                let cut = cut.clamp(at, bytes.len());
                chunks.push_back(bytes[at..cut].to_vec());
                at = cut;
            }
            Chunked(chunks)
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let mut split = (Vec::new(), None);
            let mut reader = FrameReader::new(chunks(), 64);
            loop {
                match reader.read_frame().await {
                    Ok(Some(frame)) => split.0.push(frame.raw.to_vec()),
                    Ok(None) => break,
                    Err(e) => {
                        split.1 = Some(e.to_string());
                        break;
                    }
                }
            }
            let mut lent = (Vec::new(), None);
            let mut reader = FrameReader::new(chunks(), 64);
            loop {
                match reader.next().await {
                    Ok(Some(frame)) => {
                        assert_eq!(frame.tag, frame.raw[0]);
                        lent.0.push(frame.raw.to_vec());
                        reader.consume();
                    }
                    Ok(None) => break,
                    Err(e) => {
                        lent.1 = Some(e.to_string());
                        break;
                    }
                }
            }
            let mut runs = (Vec::new(), None);
            let mut reader = FrameReader::new(chunks(), 64);
            loop {
                match reader.next().await {
                    Ok(Some(_)) => {
                        let mut at = 0;
                        while let Some(frame) = reader.frame_at(at) {
                            assert_eq!(frame.tag, frame.raw[0]);
                            runs.0.push(frame.raw.to_vec());
                            at += frame.raw.len();
                        }
                        assert!(at > 0, "the frame `next` lent is lent by `frame_at`");
                        assert_eq!(reader.front(at).len(), at);
                        reader.consume_bytes(at);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        runs.1 = Some(e.to_string());
                        break;
                    }
                }
            }
            [split, lent, runs]
        })
    }

    #[test]
    fn a_lent_frame_is_the_split_one() {
        let mut bytes = b"Q\0\0\0\x0dSELECT 1\0".to_vec();
        bytes.extend_from_slice(b"Z\0\0\0\x05I");
        let [split, lent, runs] = read_both_ways(&bytes, &[3, 14, 16]);
        assert_eq!(split.0.len(), 2);
        assert_eq!(split, lent);
        assert_eq!(split, runs);
        // Both frames in one read: one run.
        let [split, _, runs] = read_both_ways(&bytes, &[]);
        assert_eq!(split, runs);
        // A length beyond the limit, and a stream cut in the middle of a frame.
        let [split, lent, runs] = read_both_ways(b"D\0\0\x01\0", &[]);
        assert!(split.1.is_some());
        assert_eq!(split, lent);
        assert_eq!(split, runs);
        let [split, lent, runs] = read_both_ways(b"D\0\0\0\x09abc", &[2]);
        assert!(split.1.is_some());
        assert_eq!(split, lent);
        assert_eq!(split, runs);
    }

    proptest! {
        #[test]
        fn lending_frames_reads_what_splitting_them_does(
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
            cuts in proptest::collection::vec(0usize..200, 0..6),
            framed in proptest::collection::vec((any::<u8>(), 0usize..70), 0..6),
        ) {
            // Arbitrary bytes (mostly bad lengths), then well-formed frames (some over the
            // limit of 64), each cut into reads at arbitrary places.
            let [split, lent, runs] = read_both_ways(&bytes, &cuts);
            prop_assert_eq!(&split, &lent);
            prop_assert_eq!(split, runs);
            let mut well = Vec::new();
            for (tag, size) in framed {
                well.push(tag);
                well.extend_from_slice(&(size as u32 + 4).to_be_bytes());
                well.extend(std::iter::repeat_n(tag, size));
            }
            let [split, lent, runs] = read_both_ways(&well, &cuts);
            prop_assert_eq!(&split, &lent);
            prop_assert_eq!(split, runs);
        }

        /// A Bind's names read as `postgres-protocol`'s encoder wrote them, whatever the
        /// parameters after them hold (NUL bytes included).
        #[test]
        fn bind_names_read_as_encoded(
            portal in "[^\\x00]{0,70}",
            statement in "[^\\x00]{0,70}",
            values in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..12), 0..4),
        ) {
            let mut buf = BytesMut::new();
            postgres_protocol::message::frontend::bind(
                &portal,
                &statement,
                [1i16],
                values.iter(),
                |v, buf| {
                    buf.extend_from_slice(v);
                    Ok(postgres_protocol::IsNull::No)
                },
                [1i16],
                &mut buf,
            )
            .map_err(|_| TestCaseError::fail("the encoder refused the Bind"))?;
            let frame = parse_frame(&mut buf, 1 << 20).unwrap().unwrap();
            prop_assert_eq!(bind_fields(&frame), Ok((portal.as_str(), statement.as_str())));
        }

        /// An Execute's portal name reads as `postgres-protocol`'s encoder wrote it.
        #[test]
        fn execute_portal_reads_as_encoded(portal in "[^\\x00]{0,70}", rows in any::<i32>()) {
            let mut buf = BytesMut::new();
            postgres_protocol::message::frontend::execute(&portal, rows, &mut buf)
                .map_err(|_| TestCaseError::fail("the encoder refused the Execute"))?;
            let frame = parse_frame(&mut buf, 1 << 20).unwrap().unwrap();
            prop_assert_eq!(execute_portal(&frame), Ok(portal.as_str()));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(frame)) = parse_frame(&mut buf, 1 << 20) {
                let _ = query_text(&frame);
                let _ = parse_fields(&frame);
                let _ = bind_fields(&frame);
                let _ = execute_portal(&frame);
                let _ = target_fields(&frame);
                let _ = error_code_and_detail(&frame);
            }
            let mut buf = BytesMut::from(&bytes[..]);
            let _ = parse_startup(&mut buf);
            prop_assert!(ready_for_query_count(&bytes) as usize <= bytes.len() / 5);
        }

        #[test]
        fn ready_for_query_is_counted_per_whole_message(
            tags in proptest::collection::vec((prop_oneof![Just(b'Z'), Just(b'D'), Just(b'C')], 0usize..9), 0..8),
            cut in 0usize..120,
        ) {
            // The count over whole messages is the number of `Z` tags; over a prefix cut
            // anywhere, the number of `Z` messages whole within it.
            let mut all = Vec::new();
            let mut ends = Vec::new();
            for (tag, size) in &tags {
                all.push(*tag);
                all.extend_from_slice(&(*size as u32 + 4).to_be_bytes());
                all.extend(std::iter::repeat_n(b'Z', *size));
                ends.push((*tag, all.len()));
            }
            let whole = tags.iter().filter(|(t, _)| *t == b'Z').count() as u32;
            prop_assert_eq!(ready_for_query_count(&all), whole);
            let cut = cut.min(all.len());
            let within = ends.iter().filter(|(t, end)| *t == b'Z' && *end <= cut).count() as u32;
            prop_assert_eq!(ready_for_query_count(&all[..cut]), within);
        }

        #[test]
        fn framing_is_split_invariant(sizes in proptest::collection::vec(0usize..40, 1..8), cut in 0usize..200) {
            let mut all = BytesMut::new();
            for (i, size) in sizes.iter().enumerate() {
                all.put_u8(b'd');
                all.put_u32(*size as u32 + 4);
                all.put_slice(&vec![i as u8; *size]);
            }
            let cut = cut.min(all.len());
            let mut buf = BytesMut::from(&all[..cut]);
            let mut got = Vec::new();
            while let Ok(Some(f)) = parse_frame(&mut buf, 1024) { got.push(f); }
            buf.extend_from_slice(&all[cut..]);
            while let Ok(Some(f)) = parse_frame(&mut buf, 1024) { got.push(f); }
            prop_assert_eq!(got.len(), sizes.len());
            for (f, size) in got.iter().zip(&sizes) { prop_assert_eq!(f.body().len(), *size); }
        }
    }
}
