//! RESP2 and RESP3 frames: check-then-parse decoding and encoding.
//!
//! [`parse`] looks at a buffer and returns `Ok(None)` when a whole frame has not arrived yet, so
//! the caller reads more and tries again (as `tokio-rs/mini-redis` does). Every length is checked
//! against [`Limits`] before anything is buffered for it, and nesting depth is bounded, so
//! arbitrary bytes produce a value or an error and never a panic or an unbounded allocation.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::FrameError;

/// One RESP value.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// `+OK`
    Simple(Bytes),
    /// `-ERR ...` or RESP3 `!<len>` blob error.
    Error(Bytes),
    /// `:42`
    Integer(i64),
    /// `$<len>`, or RESP3 `=<len>` verbatim string (kept with its `txt:` prefix).
    Bulk(Bytes),
    /// `$-1`, `*-1` or RESP3 `_`.
    Null,
    /// `*<n>`
    Array(Vec<Frame>),
    /// RESP3 `,<double>`, `(<big number>` kept as text.
    Number(Bytes),
    /// RESP3 `#t` / `#f`.
    Boolean(bool),
    /// RESP3 `%<n>` map.
    Map(Vec<(Frame, Frame)>),
    /// RESP3 `~<n>` set.
    Set(Vec<Frame>),
    /// RESP3 `><n>` push (out-of-band: pub/sub messages, invalidations).
    Push(Vec<Frame>),
    /// RESP3 `|<n>` attributes followed by the reply they describe.
    Attributed(Vec<(Frame, Frame)>, Box<Frame>),
}

/// Bounds on what a peer may make us buffer.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The largest frame, in bytes (a bulk string's declared length counts at once).
    pub max_frame_bytes: usize,
    /// The deepest nesting of aggregates.
    pub max_depth: usize,
}

impl Limits {
    /// For replies from the upstream Redis: they are relayed as Redis wrote them, so only
    /// loosely bounded (large values and deep nesting are legitimate answers).
    pub const UPSTREAM: Limits = Limits {
        max_frame_bytes: usize::MAX / 4,
        max_depth: 1024,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_bytes: 512 * 1024 * 1024,
            max_depth: 64,
        }
    }
}

/// A request's command name and arguments. Up to three inline (`GET key`, `SET key value`):
/// no allocation per request for the list (issue 18's profile: one per request, a tenth of a
/// pipelined fenced write's work in malloc and free).
pub type Args = smallvec::SmallVec<[Bytes; 3]>;

/// A client request: a command and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Command name first, then the arguments, as sent.
    pub args: Args,
    /// Size of the request on the wire.
    pub wire_len: usize,
}

impl Request {
    /// The command name in upper case (lossy for non-UTF-8 names).
    pub fn name(&self) -> String {
        command_name(&self.args)
    }
}

/// The name of the command `args` (name first) in upper case, lossy for non-UTF-8 names; empty
/// for no arguments.
pub fn command_name(args: &[Bytes]) -> String {
    args.first()
        .map(|a| String::from_utf8_lossy(a).to_ascii_uppercase())
        .unwrap_or_default()
}

/// Parses one frame from the front of `buf`. `Ok(None)`: incomplete, read more.
pub fn parse(buf: &[u8], limits: &Limits) -> Result<Option<(Frame, usize)>, FrameError> {
    parse_from(buf, None, limits)
}

/// [`parse`] of `buf` whose frames hold slices of `buf` rather than copies (a slice of a shared
/// `Bytes` costs a count, a copy an allocation). For replies already split off as `Bytes`.
pub fn parse_shared(buf: &Bytes, limits: &Limits) -> Result<Option<(Frame, usize)>, FrameError> {
    parse_from(buf, Some(buf), limits)
}

/// The length of the frame at the front of `buf`, as [`parse`] would consume it, without
/// building the frame: the same `Ok(None)` and the same errors (a proptest and the fuzz target
/// check it).
pub fn frame_len(buf: &[u8], limits: &Limits) -> Result<Option<usize>, FrameError> {
    let mut cursor = Cursor {
        buf,
        source: None,
        pos: 0,
        limits,
    };
    let skipped = cursor.skip(0).map(|()| cursor.pos);
    whole(skipped, buf, limits)
}

/// Takes the frame at the front of `buf` off it: its bytes, and the frame read from them
/// ([`parse_shared`]: its strings are slices of those bytes, not copies). The reply reader's
/// step: a bulk reply then costs no allocation of its own (issue 18). `Ok(None)`: incomplete.
pub fn split_frame(
    buf: &mut BytesMut,
    limits: &Limits,
) -> Result<Option<(Frame, Bytes)>, FrameError> {
    let Some(len) = frame_len(buf, limits)? else {
        return Ok(None);
    };
    let raw = buf.split_to(len).freeze();
    match parse_shared(&raw, limits)? {
        Some((frame, used)) if used == len => Ok(Some((frame, raw))),
        // `frame_len` and `parse` agree (tested); should they ever not, the reply is refused
        // rather than misread.
        _ => Err(FrameError::Protocol(
            "frame length and frame disagree (a gateway bug)",
        )),
    }
}

fn parse_from(
    buf: &[u8],
    source: Option<&Bytes>,
    limits: &Limits,
) -> Result<Option<(Frame, usize)>, FrameError> {
    let mut cursor = Cursor {
        buf,
        source,
        pos: 0,
        limits,
    };
    let parsed = cursor.frame(0).map(|frame| (frame, cursor.pos));
    whole(parsed, buf, limits)
}

/// A cursor's result at the front of `buf`: `Ok(None)` while incomplete, unless `buf` is
/// already longer than a frame may be.
fn whole<T>(
    result: Result<T, FrameError>,
    buf: &[u8],
    limits: &Limits,
) -> Result<Option<T>, FrameError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(FrameError::Incomplete) => {
            if buf.len() > limits.max_frame_bytes {
                return Err(FrameError::TooLarge {
                    limit: limits.max_frame_bytes,
                });
            }
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Parses one client request (a RESP array of bulk strings, or an inline command) from the
/// front of `buf`. An empty inline line yields a request with no arguments.
pub fn parse_request(buf: &[u8], limits: &Limits) -> Result<Option<Request>, FrameError> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    if first != b'*' {
        return parse_inline(buf, limits);
    }
    let Some((frame, wire_len)) = parse(buf, limits)? else {
        return Ok(None);
    };
    let Frame::Array(items) = frame else {
        return Err(FrameError::Protocol("expected an array of bulk strings"));
    };
    let mut args = Args::with_capacity(items.len());
    for item in items {
        match item {
            Frame::Bulk(b) => args.push(b),
            _ => return Err(FrameError::Protocol("expected an array of bulk strings")),
        }
    }
    Ok(Some(Request { args, wire_len }))
}

fn parse_inline(buf: &[u8], limits: &Limits) -> Result<Option<Request>, FrameError> {
    let Some(end) = memchr_newline(buf) else {
        if buf.len() > limits.max_frame_bytes.min(64 * 1024) {
            return Err(FrameError::TooLarge {
                limit: limits.max_frame_bytes.min(64 * 1024),
            });
        }
        return Ok(None);
    };
    let line = &buf[..end];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.contains(&0) {
        return Err(FrameError::Protocol("unbalanced or binary inline request"));
    }
    let args = line
        .split(|b| *b == b' ' || *b == b'\t')
        .filter(|a| !a.is_empty())
        .map(Bytes::copy_from_slice)
        .collect();
    Ok(Some(Request {
        args,
        wire_len: end + 1,
    }))
}

fn memchr_newline(buf: &[u8]) -> Option<usize> {
    buf.iter().position(|&b| b == b'\n')
}

struct Cursor<'a> {
    buf: &'a [u8],
    /// `buf` as `Bytes`, when the frames may hold slices of it.
    source: Option<&'a Bytes>,
    pos: usize,
    limits: &'a Limits,
}

impl Cursor<'_> {
    /// The bytes at `range` of `buf`: a slice of `source`, else a copy.
    fn bytes(&self, range: std::ops::Range<usize>) -> Bytes {
        match self.source {
            Some(source) => source.slice(range),
            None => Bytes::copy_from_slice(&self.buf[range]),
        }
    }

    fn line(&mut self) -> Result<&[u8], FrameError> {
        self.line_up_to(64 * 1024)
    }

    /// A simple string's or error's text: as long as a frame may be ([`parse`] checks that),
    /// not a header's 64 KiB (Redis echoes a key of any length in some errors,
    /// `-NOGROUP No such key '<key>' ...`).
    fn text(&mut self) -> Result<Bytes, FrameError> {
        self.line_bytes(usize::MAX)
    }

    /// [`Cursor::line_up_to`] as `Bytes`.
    fn line_bytes(&mut self, max: usize) -> Result<Bytes, FrameError> {
        let start = self.pos;
        let line = self.line_up_to(max)?;
        let (len, ok) = (line.len(), line == b"OK");
        if ok && self.source.is_none() {
            // `+OK`, the reply to most writes (each of a fenced pipeline's too): not a copy,
            // and so not an allocation, per reply (issue 18).
            return Ok(Bytes::from_static(b"OK"));
        }
        Ok(self.bytes(start..start + len))
    }

    fn line_up_to(&mut self, max: usize) -> Result<&[u8], FrameError> {
        let rest = &self.buf[self.pos..];
        let Some(end) = rest.windows(2).position(|w| w == b"\r\n") else {
            if rest.len() > max {
                return Err(FrameError::Protocol("header line longer than 64 KiB"));
            }
            return Err(FrameError::Incomplete);
        };
        self.pos += end + 2;
        Ok(&rest[..end])
    }

    fn integer(&mut self) -> Result<i64, FrameError> {
        let line = self.line()?;
        parse_i64(line).ok_or(FrameError::Protocol("invalid integer"))
    }

    fn length(&mut self) -> Result<Option<usize>, FrameError> {
        let n = self.integer()?;
        match n {
            -1 => Ok(None),
            n if n < 0 => Err(FrameError::Protocol("negative length")),
            n => {
                let n =
                    usize::try_from(n).map_err(|_| FrameError::Protocol("length out of range"))?;
                if n > self.limits.max_frame_bytes {
                    return Err(FrameError::TooLarge {
                        limit: self.limits.max_frame_bytes,
                    });
                }
                Ok(Some(n))
            }
        }
    }

    fn blob(&mut self, len: usize) -> Result<Bytes, FrameError> {
        let range = self.blob_range(len)?;
        Ok(self.bytes(range))
    }

    /// Steps over a string of `len` bytes and its CRLF; returns where the string is.
    fn blob_range(&mut self, len: usize) -> Result<std::ops::Range<usize>, FrameError> {
        let end = self
            .pos
            .checked_add(len)
            .ok_or(FrameError::Protocol("length out of range"))?;
        if self.buf.len() < end + 2 {
            return Err(FrameError::Incomplete);
        }
        if &self.buf[end..end + 2] != b"\r\n" {
            return Err(FrameError::Protocol("bulk string not terminated by CRLF"));
        }
        let start = self.pos;
        self.pos = end + 2;
        Ok(start..end)
    }

    /// Refuses an aggregate of `count` elements the limit cannot hold, before anything is
    /// allocated for it: each element takes at least 3 bytes (`_\r\n`).
    fn check_count(&self, count: usize) -> Result<(), FrameError> {
        if count > self.limits.max_frame_bytes / 3 {
            return Err(FrameError::TooLarge {
                limit: self.limits.max_frame_bytes,
            });
        }
        Ok(())
    }

    fn items(&mut self, count: usize, depth: usize) -> Result<Vec<Frame>, FrameError> {
        self.check_count(count)?;
        let mut items = Vec::with_capacity(count.min(1024));
        for _ in 0..count {
            items.push(self.frame(depth + 1)?);
        }
        Ok(items)
    }

    fn pairs(&mut self, count: usize, depth: usize) -> Result<Vec<(Frame, Frame)>, FrameError> {
        let flat = self.items(pair_count(count)?, depth)?;
        let mut pairs = Vec::with_capacity(flat.len() / 2);
        let mut it = flat.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            pairs.push((k, v));
        }
        Ok(pairs)
    }

    /// [`Cursor::frame`] without building the frame: the same checks, in the same order.
    fn skip(&mut self, depth: usize) -> Result<(), FrameError> {
        if depth > self.limits.max_depth {
            return Err(FrameError::Protocol("aggregates nested too deeply"));
        }
        let Some(&kind) = self.buf.get(self.pos) else {
            return Err(FrameError::Incomplete);
        };
        self.pos += 1;
        match kind {
            b'+' | b'-' => {
                self.line_up_to(usize::MAX)?;
            }
            b':' => {
                self.integer()?;
            }
            b'$' | b'=' | b'!' => {
                if let Some(len) = self.length()? {
                    self.blob_range(len)?;
                }
            }
            b'*' => {
                if let Some(n) = self.length()? {
                    self.skip_items(n, depth)?;
                }
            }
            b'~' | b'>' => {
                let n = self.length()?.unwrap_or(0);
                self.skip_items(n, depth)?;
            }
            b'%' => {
                let n = self.length()?.unwrap_or(0);
                self.skip_items(pair_count(n)?, depth)?;
            }
            b'|' => {
                let n = self.length()?.unwrap_or(0);
                self.skip_items(pair_count(n)?, depth)?;
                self.skip(depth + 1)?;
            }
            b'_' => {
                if !self.line()?.is_empty() {
                    return Err(FrameError::Protocol("null with a payload"));
                }
            }
            b'#' => match self.line()? {
                b"t" | b"f" => {}
                _ => return Err(FrameError::Protocol("invalid boolean")),
            },
            b',' | b'(' => {
                self.line_up_to(64 * 1024)?;
            }
            _ => return Err(FrameError::Protocol("unknown type byte")),
        }
        Ok(())
    }

    fn skip_items(&mut self, count: usize, depth: usize) -> Result<(), FrameError> {
        self.check_count(count)?;
        for _ in 0..count {
            self.skip(depth + 1)?;
        }
        Ok(())
    }

    fn frame(&mut self, depth: usize) -> Result<Frame, FrameError> {
        if depth > self.limits.max_depth {
            return Err(FrameError::Protocol("aggregates nested too deeply"));
        }
        let Some(&kind) = self.buf.get(self.pos) else {
            return Err(FrameError::Incomplete);
        };
        self.pos += 1;
        Ok(match kind {
            b'+' => Frame::Simple(self.text()?),
            b'-' => Frame::Error(self.text()?),
            b':' => Frame::Integer(self.integer()?),
            b'$' => match self.length()? {
                None => Frame::Null,
                Some(len) => Frame::Bulk(self.blob(len)?),
            },
            b'=' => match self.length()? {
                None => Frame::Null,
                Some(len) => Frame::Bulk(self.blob(len)?),
            },
            b'!' => match self.length()? {
                None => Frame::Null,
                Some(len) => Frame::Error(self.blob(len)?),
            },
            b'*' => match self.length()? {
                None => Frame::Null,
                Some(n) => Frame::Array(self.items(n, depth)?),
            },
            b'~' => {
                let n = self.length()?.unwrap_or(0);
                Frame::Set(self.items(n, depth)?)
            }
            b'>' => {
                let n = self.length()?.unwrap_or(0);
                Frame::Push(self.items(n, depth)?)
            }
            b'%' => {
                let n = self.length()?.unwrap_or(0);
                Frame::Map(self.pairs(n, depth)?)
            }
            b'|' => {
                let n = self.length()?.unwrap_or(0);
                let attrs = self.pairs(n, depth)?;
                Frame::Attributed(attrs, Box::new(self.frame(depth + 1)?))
            }
            b'_' => {
                if !self.line()?.is_empty() {
                    return Err(FrameError::Protocol("null with a payload"));
                }
                Frame::Null
            }
            b'#' => match self.line()? {
                b"t" => Frame::Boolean(true),
                b"f" => Frame::Boolean(false),
                _ => return Err(FrameError::Protocol("invalid boolean")),
            },
            b',' | b'(' => Frame::Number(self.line_bytes(64 * 1024)?),
            _ => return Err(FrameError::Protocol("unknown type byte")),
        })
    }
}

/// The elements of a map or attribute of `count` pairs.
fn pair_count(count: usize) -> Result<usize, FrameError> {
    count
        .checked_mul(2)
        .ok_or(FrameError::Protocol("length out of range"))
}

/// A decimal integer exactly as `str::parse::<i64>` reads it (an optional `+` or `-`, then at
/// least one ASCII digit, no overflow), without the UTF-8 check and the generic parse per length
/// header: requests and replies have one per element (issue 18).
pub(crate) fn parse_i64(text: &[u8]) -> Option<i64> {
    let (negative, digits) = match text {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        _ => (false, text),
    };
    if digits.is_empty() {
        return None;
    }
    let mut n: i64 = 0;
    for &digit in digits {
        if !digit.is_ascii_digit() {
            return None;
        }
        let digit = i64::from(digit - b'0');
        // Accumulated towards the sign, so that i64::MIN is read too.
        n = if negative {
            n.checked_mul(10)?.checked_sub(digit)?
        } else {
            n.checked_mul(10)?.checked_add(digit)?
        };
    }
    Some(n)
}

impl Frame {
    /// A simple string.
    pub fn simple(text: &str) -> Self {
        Frame::Simple(Bytes::copy_from_slice(text.as_bytes()))
    }

    /// An error reply; CR and LF in `text` are replaced by spaces.
    pub fn error(text: &str) -> Self {
        Frame::Error(Bytes::from(text.replace(['\r', '\n'], " ")))
    }

    /// An array of bulk strings (a command).
    pub fn command<I, B>(args: I) -> Self
    where
        I: IntoIterator<Item = B>,
        B: Into<Bytes>,
    {
        Frame::Array(args.into_iter().map(|a| Frame::Bulk(a.into())).collect())
    }

    /// The error text, if this is an error reply.
    pub fn as_error(&self) -> Option<&[u8]> {
        match self {
            Frame::Error(e) => Some(e),
            _ => None,
        }
    }

    /// Appends the RESP encoding to `out`. RESP3-only types are written as RESP3; only replies
    /// that came from a RESP3 upstream connection contain them.
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            Frame::Simple(s) => line(out, b'+', s),
            // A RESP3 blob error (`!`) may hold CRLF, which a `-` line cannot carry: written
            // as a line it would end early and the rest be read as further replies (found by
            // fuzzing, issue 17). Only a RESP3 upstream sends such an error, so `!` is understood.
            Frame::Error(e) if e.windows(2).any(|w| w == b"\r\n") => {
                header(out, b'!', e.len());
                out.put_slice(e);
                out.put_slice(b"\r\n");
            }
            Frame::Error(e) => line(out, b'-', e),
            Frame::Integer(i) => line(out, b':', itoa::Buffer::new().format(*i).as_bytes()),
            Frame::Bulk(b) => {
                bulk(out, b);
            }
            Frame::Null => out.put_slice(b"$-1\r\n"),
            Frame::Array(items) => aggregate(out, b'*', items),
            Frame::Set(items) => aggregate(out, b'~', items),
            Frame::Push(items) => aggregate(out, b'>', items),
            Frame::Number(n) => line(out, b',', n),
            Frame::Boolean(b) => out.put_slice(if *b { b"#t\r\n" } else { b"#f\r\n" }),
            Frame::Map(pairs) => {
                header(out, b'%', pairs.len());
                for (k, v) in pairs {
                    k.encode(out);
                    v.encode(out);
                }
            }
            Frame::Attributed(pairs, inner) => {
                header(out, b'|', pairs.len());
                for (k, v) in pairs {
                    k.encode(out);
                    v.encode(out);
                }
                inner.encode(out);
            }
        }
    }

    /// The encoding as a new buffer.
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::new();
        self.encode(&mut out);
        out.freeze()
    }
}

fn line(out: &mut BytesMut, kind: u8, text: &[u8]) {
    out.put_u8(kind);
    out.put_slice(text);
    out.put_slice(b"\r\n");
}

/// Appends `args` as a command (an array of bulk strings): what `Frame::command(args).encode`
/// writes, without building the frames (no allocation per request, issue 18).
pub fn encode_command(args: &[Bytes], out: &mut BytesMut) {
    header(out, b'*', args.len());
    for arg in args {
        bulk(out, arg);
    }
}

/// Appends the header of a command of `n` arguments; each follows as [`encode_argument`].
pub fn encode_command_header(n: usize, out: &mut BytesMut) {
    header(out, b'*', n);
}

/// Appends one argument of a command, given as the pieces it is made of, in order.
pub fn encode_argument(pieces: &[&[u8]], out: &mut BytesMut) {
    header(out, b'$', pieces.iter().map(|p| p.len()).sum());
    for piece in pieces {
        out.put_slice(piece);
    }
    out.put_slice(b"\r\n");
}

fn bulk(out: &mut BytesMut, b: &[u8]) {
    encode_argument(&[b], out);
}

/// A type byte and a length, formatted on the stack (a `to_string` per element was an allocation
/// per argument of every request relayed or rewritten, issue 18) and appended in one copy. Most
/// lengths of a fence call have one or two digits: they skip `itoa` (three appends and `itoa`
/// per header were 5 % of a pipelined fenced write's instructions).
fn header(out: &mut BytesMut, kind: u8, n: usize) {
    match n {
        0..=9 => out.put_slice(&[kind, b'0' + n as u8, b'\r', b'\n']),
        10..=99 => out.put_slice(&[
            kind,
            b'0' + (n / 10) as u8,
            b'0' + (n % 10) as u8,
            b'\r',
            b'\n',
        ]),
        _ => {
            let mut digits = itoa::Buffer::new();
            let digits = digits.format(n).as_bytes();
            // A `usize` has at most 20 digits.
            let mut line = [0u8; 23];
            line[0] = kind;
            line[1..=digits.len()].copy_from_slice(digits);
            line[digits.len() + 1..digits.len() + 3].copy_from_slice(b"\r\n");
            out.put_slice(&line[..digits.len() + 3]);
        }
    }
}

fn aggregate(out: &mut BytesMut, kind: u8, items: &[Frame]) {
    header(out, kind, items.len());
    for item in items {
        item.encode(out);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn limits() -> Limits {
        Limits {
            max_frame_bytes: 1024,
            max_depth: 8,
        }
    }

    /// The header's short forms write what `itoa` writes, at each length's edges.
    #[test]
    fn headers_equal_formatted_lengths() {
        for n in [
            0,
            1,
            9,
            10,
            11,
            42,
            99,
            100,
            101,
            999,
            1000,
            65_535,
            usize::MAX,
        ] {
            let mut out = BytesMut::new();
            header(&mut out, b'$', n);
            assert_eq!(out.as_ref(), format!("${n}\r\n").as_bytes(), "{n}");
        }
    }

    /// Fuzzing (issue 17, fuzz/ target `redis_frame`): a blob error holding CRLF was re-encoded
    /// as a `-` line, which ended at the CRLF and left the rest to be read as another reply.
    #[test]
    fn a_blob_error_with_crlf_reencodes_as_one_frame() {
        let input = b"!9\r\n*2\r\n*1\r\n*\r\n";
        let (frame, len) = parse(input, &limits()).unwrap().unwrap();
        assert_eq!(len, input.len());
        assert_eq!(frame, Frame::Error(Bytes::from_static(b"*2\r\n*1\r\n*")));
        let encoded = frame.to_bytes();
        assert_eq!(&encoded[..], &input[..]);
        assert_eq!(
            parse(&encoded, &limits()).unwrap(),
            Some((frame, input.len()))
        );
        // Errors without CRLF stay simple errors, as RESP2 clients expect.
        assert_eq!(&Frame::error("ERR x").to_bytes()[..], b"-ERR x\r\n");
        let lone = parse(b"-ERR a\nb\r\n", &limits()).unwrap().unwrap().0;
        assert_eq!(&lone.to_bytes()[..], b"-ERR a\nb\r\n");
    }

    #[test]
    fn parses_every_type_and_reports_length() {
        let input = b"*3\r\n$3\r\nSET\r\n:-5\r\n_\r\nrest";
        let (frame, len) = parse(input, &limits()).unwrap().unwrap();
        assert_eq!(len, input.len() - 4);
        assert_eq!(
            frame,
            Frame::Array(vec![
                Frame::Bulk("SET".into()),
                Frame::Integer(-5),
                Frame::Null
            ])
        );
        let resp3 = b"%1\r\n+a\r\n~2\r\n#t\r\n,1.5\r\n";
        let (frame, _) = parse(resp3, &limits()).unwrap().unwrap();
        assert_eq!(
            frame,
            Frame::Map(vec![(
                Frame::simple("a"),
                Frame::Set(vec![Frame::Boolean(true), Frame::Number("1.5".into())])
            )])
        );
        let (frame, _) = parse(b"!5\r\nERR x\r\n", &limits()).unwrap().unwrap();
        assert_eq!(frame.as_error(), Some(&b"ERR x"[..]));
    }

    #[test]
    fn incomplete_input_asks_for_more() {
        let full = b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n";
        for cut in 0..full.len() {
            assert_eq!(
                parse_request(&full[..cut], &limits()).unwrap(),
                None,
                "cut at {cut}"
            );
        }
        let req = parse_request(full, &limits()).unwrap().unwrap();
        assert_eq!(req.args[..], [Bytes::from("GET"), Bytes::from("k")]);
        assert_eq!(req.wire_len, full.len());
    }

    #[test]
    fn inline_commands_split_on_spaces() {
        let req = parse_request(b"SET  k v\r\nPING\r\n", &limits())
            .unwrap()
            .unwrap();
        assert_eq!(
            req.args[..],
            [Bytes::from("SET"), Bytes::from("k"), Bytes::from("v")]
        );
        assert_eq!(req.wire_len, 10);
        assert_eq!(req.name(), "SET");
    }

    #[test]
    fn oversized_lengths_are_refused_before_buffering() {
        assert_eq!(
            parse(b"$2000\r\n", &limits()),
            Err(FrameError::TooLarge { limit: 1024 })
        );
        assert_eq!(
            parse(b"*1000\r\n", &limits()),
            Err(FrameError::TooLarge { limit: 1024 })
        );
        assert!(parse(&[b'*'; 1100], &limits()).is_err());
        let deep = "*1\r\n".repeat(20);
        assert!(matches!(
            parse(deep.as_bytes(), &limits()),
            Err(FrameError::Protocol(_))
        ));
    }

    #[test]
    fn garbage_is_a_protocol_error() {
        assert!(parse(b"?what\r\n", &limits()).is_err());
        assert!(parse(b"$3\r\nabcd\r\n", &limits()).is_err());
        assert!(parse_request(b"*1\r\n:1\r\n", &limits()).is_err());
    }

    #[test]
    fn encode_round_trips() {
        let frame = Frame::Array(vec![
            Frame::Bulk("a".into()),
            Frame::Integer(3),
            Frame::error("ERR x\r\ny"),
            Frame::Map(vec![(Frame::simple("k"), Frame::Null)]),
        ]);
        let bytes = frame.to_bytes();
        let (back, len) = parse(&bytes, &limits()).unwrap().unwrap();
        assert_eq!(len, bytes.len());
        assert_eq!(back, frame);
    }

    #[test]
    fn integer_edges_read_as_str_parse_reads_them() {
        for text in [
            "",
            "+",
            "-",
            "0",
            "-0",
            "+0",
            "007",
            "9223372036854775807",
            "9223372036854775808",
            "-9223372036854775808",
            "-9223372036854775809",
            "+-1",
            "--1",
            "1-",
            " 1",
            "1 ",
            "١",
        ] {
            assert_eq!(
                parse_i64(text.as_bytes()),
                text.parse::<i64>().ok(),
                "{text:?}"
            );
        }
    }

    /// A line longer than its limit (64 KiB for headers and numbers, none for simple strings
    /// and errors) is refused or waited for alike by `frame_len` and `parse` (the proptest's
    /// inputs are too short to reach it).
    #[test]
    fn long_lines_are_judged_alike() {
        let small = Limits {
            max_frame_bytes: 64,
            max_depth: 2,
        };
        for kind in b"+-:$=!*~>%|_#,(".iter() {
            let mut buf = vec![*kind];
            buf.resize(64 * 1024 + 2, b'1');
            for limits in [Limits::default(), small, Limits::UPSTREAM] {
                let parsed = parse(&buf, &limits).map(|f| f.map(|(_, len)| len));
                assert_eq!(frame_len(&buf, &limits), parsed, "{:?}", char::from(*kind));
            }
        }
    }

    /// Any frame of every type, nested a few levels: what a reply may be.
    fn any_frame() -> impl Strategy<Value = Frame> {
        let text = || "[ -~]{0,12}".prop_map(|t| Bytes::from(t.into_bytes()));
        let leaf = prop_oneof![
            text().prop_map(Frame::Simple),
            text().prop_map(Frame::Error),
            proptest::collection::vec(any::<u8>(), 0..24)
                .prop_map(|b| Frame::Error(Bytes::from([b"x\r\n".as_slice(), &b].concat()))),
            any::<i64>().prop_map(Frame::Integer),
            proptest::collection::vec(any::<u8>(), 0..40).prop_map(|b| Frame::Bulk(b.into())),
            Just(Frame::Null),
            "-?[0-9]{1,8}(\\.[0-9]{1,3})?".prop_map(|n| Frame::Number(Bytes::from(n.into_bytes()))),
            any::<bool>().prop_map(Frame::Boolean),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            let items = || proptest::collection::vec(inner.clone(), 0..4);
            let pairs = || proptest::collection::vec((inner.clone(), inner.clone()), 0..3);
            prop_oneof![
                items().prop_map(Frame::Array),
                items().prop_map(Frame::Set),
                items().prop_map(Frame::Push),
                pairs().prop_map(Frame::Map),
                (pairs(), inner.clone()).prop_map(|(p, f)| Frame::Attributed(p, Box::new(f))),
            ]
        })
    }

    proptest! {
        #[test]
        fn encode_command_is_the_command_frame_encoded(
            args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..20),
        ) {
            let args: Vec<Bytes> = args.into_iter().map(Bytes::from).collect();
            let mut direct = BytesMut::new();
            encode_command(&args, &mut direct);
            prop_assert_eq!(&direct[..], &Frame::command(args.iter().cloned()).to_bytes()[..]);
            let (frame, used) = parse(&direct, &limits()).expect("valid").expect("complete");
            prop_assert_eq!(used, direct.len());
            prop_assert_eq!(frame, Frame::command(args));
        }

        #[test]
        fn integers_and_lengths_encode_as_decimal(i in any::<i64>(), n in 0usize..100_000) {
            let mut out = BytesMut::new();
            Frame::Integer(i).encode(&mut out);
            let expected = format!(":{i}\r\n");
            prop_assert_eq!(&out[..], expected.as_bytes());
            let mut out = BytesMut::new();
            Frame::Bulk(Bytes::from(vec![b'x'; n])).encode(&mut out);
            let head = format!("${n}\r\n");
            prop_assert!(out.starts_with(head.as_bytes()));
        }

        #[test]
        fn integers_are_read_as_str_parse_reads_them(
            text in "[-+]{0,2}[0-9]{0,21}[ x]?",
            i in any::<i64>(),
            bytes in proptest::collection::vec(any::<u8>(), 0..24),
        ) {
            let std = |b: &[u8]| std::str::from_utf8(b).ok()?.parse::<i64>().ok();
            prop_assert_eq!(parse_i64(text.as_bytes()), std(text.as_bytes()));
            prop_assert_eq!(parse_i64(&bytes), std(&bytes));
            let decimal = i.to_string();
            prop_assert_eq!(parse_i64(decimal.as_bytes()), Some(i));
            prop_assert_eq!(parse_i64(format!("+{decimal}").as_bytes()), std(format!("+{decimal}").as_bytes()));
        }

        #[test]
        fn shared_and_copied_parses_agree(text in "([*$%~>|:_#,(!=+-][-0-9a-z?]{0,4}\r\n){0,12}") {
            let shared = Bytes::from(text.clone().into_bytes());
            prop_assert_eq!(
                parse(text.as_bytes(), &Limits::default()),
                parse_shared(&shared, &Limits::default())
            );
        }

        #[test]
        fn lengths_are_what_the_parser_reads(
            text in "([*$%~>|:_#,(!=+-][-0-9a-z?]{0,4}\r\n){0,12}",
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            frame in any_frame(),
            cut in any::<usize>(),
            flip in any::<(usize, u8)>(),
        ) {
            let small = Limits { max_frame_bytes: 64, max_depth: 2 };
            let whole = frame.to_bytes();
            let cut = &whole[..cut % (whole.len() + 1)];
            let mut flipped = whole.to_vec();
            let at = flip.0 % flipped.len();
            flipped[at] = flip.1;
            for buf in [text.as_bytes(), &bytes[..], &whole[..], cut, &flipped[..]] {
                for limits in [Limits::default(), small] {
                    let parsed = parse(buf, &limits).map(|f| f.map(|(_, len)| len));
                    prop_assert_eq!(frame_len(buf, &limits), parsed);
                    let mut split = BytesMut::from(buf);
                    match (split_frame(&mut split, &limits), parse(buf, &limits)) {
                        (Ok(Some((frame, raw))), Ok(Some((expected, len)))) => {
                            prop_assert_eq!(frame, expected);
                            prop_assert_eq!(&raw[..], &buf[..len]);
                            prop_assert_eq!(&split[..], &buf[len..]);
                        }
                        (split, parsed) => {
                            prop_assert_eq!(split.map(|f| f.map(|(_, raw)| raw.len())), parsed.map(|f| f.map(|(_, len)| len)));
                        }
                    }
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse(&bytes, &limits());
            let _ = parse_request(&bytes, &limits());
        }

        #[test]
        fn resp_shaped_bytes_never_panic(text in "([*$%~>|:_#,(!=+-][-0-9a-z?]{0,4}\r\n){0,12}") {
            let _ = parse(text.as_bytes(), &limits());
            let _ = parse_request(text.as_bytes(), &limits());
        }

        #[test]
        fn commands_round_trip(args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 1..8)) {
            let frame = Frame::command(args.iter().map(|a| Bytes::copy_from_slice(a)));
            let bytes = frame.to_bytes();
            let req = parse_request(&bytes, &Limits::default()).unwrap().unwrap();
            prop_assert_eq!(req.wire_len, bytes.len());
            prop_assert_eq!(req.args.iter().map(|a| a.to_vec()).collect::<Vec<_>>(), args);
        }
    }
}
