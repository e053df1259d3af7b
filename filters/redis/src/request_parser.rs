//! Client requests parsed incrementally: the parse position and the arguments found so far are
//! kept across reads, so a request that arrives a byte at a time costs time linear in its
//! size (re-parsing the buffered prefix on every read made a trickling client quadratic).
//!
//! Accepts exactly what [`crate::frame::parse_request`] accepts (a proptest checks it); the
//! caller removes `wire_len` bytes from the front of its buffer after each request.

use bytes::BytesMut;

use crate::error::FrameError;
use crate::frame::{parse_i64, Args, Limits, Request};

/// The longest header line (`*<n>` or `$<n>`, or an inline command up to 64 KiB).
const MAX_LINE: usize = 64 * 1024;

/// The size of the block requests' arguments are copied into, one after another. A request
/// larger than half of it gets a buffer of its own, so a block never grows past this size.
const ARENA: usize = 4096;

/// Resumable state for the request at the front of the caller's buffer.
#[derive(Debug, Default)]
pub struct RequestParser {
    /// Where the next element starts.
    pos: usize,
    /// Elements still to read; `None` before the `*<n>` header.
    remaining: Option<usize>,
    /// Where the arguments read so far are in the caller's buffer (it keeps the request until
    /// it is complete and handled, so positions stay valid across reads). Kept between
    /// requests: no allocation per request.
    ranges: Vec<std::ops::Range<usize>>,
    /// Bytes before this were already searched for the end of the current line.
    scanned: usize,
    /// The current bulk string's header was read: its data starts here and is this long.
    bulk: Option<(usize, usize)>,
    /// Where requests' arguments are copied: the free part of a block whose front part earlier
    /// requests' arguments still slice (see [`arguments`]).
    arena: BytesMut,
}

impl RequestParser {
    /// The next whole request at the front of `buf`, or `Ok(None)` to read more. `buf` must
    /// hold the same bytes as at the last call plus any appended since.
    pub fn next(&mut self, buf: &[u8], limits: &Limits) -> Result<Option<Request>, FrameError> {
        let result = self.step(buf, limits);
        match &result {
            Ok(Some(_)) | Err(_) => self.reset(),
            Ok(None) => {
                if buf.len() > limits.max_frame_bytes {
                    self.reset();
                    return Err(FrameError::TooLarge {
                        limit: limits.max_frame_bytes,
                    });
                }
            }
        }
        result
    }

    fn step(&mut self, buf: &[u8], limits: &Limits) -> Result<Option<Request>, FrameError> {
        let Some(&first) = buf.first() else {
            return Ok(None);
        };
        let remaining = match self.remaining {
            Some(n) => n,
            None if first != b'*' => return self.inline(buf, limits),
            None => {
                let Some((n, end)) = self.header_number(buf, 1)? else {
                    return Ok(None);
                };
                if n < 0 {
                    return Err(FrameError::Protocol("expected an array of bulk strings"));
                }
                let n =
                    usize::try_from(n).map_err(|_| FrameError::Protocol("length out of range"))?;
                if n > limits.max_frame_bytes / 3 {
                    return Err(FrameError::TooLarge {
                        limit: limits.max_frame_bytes,
                    });
                }
                self.pos = end + 2;
                self.scanned = self.pos;
                self.ranges.clear();
                self.ranges.reserve(n.min(1024));
                self.remaining = Some(n);
                n
            }
        };
        for _ in 0..remaining {
            let (start, len) = match self.bulk {
                Some(bulk) => bulk,
                None => {
                    let Some(&kind) = buf.get(self.pos) else {
                        return Ok(None);
                    };
                    if kind != b'$' {
                        return Err(FrameError::Protocol("expected an array of bulk strings"));
                    }
                    let Some((n, end)) = self.header_number(buf, self.pos + 1)? else {
                        return Ok(None);
                    };
                    let len = match n {
                        -1 => {
                            return Err(FrameError::Protocol("expected an array of bulk strings"))
                        }
                        n if n < 0 => return Err(FrameError::Protocol("negative length")),
                        n => usize::try_from(n)
                            .map_err(|_| FrameError::Protocol("length out of range"))?,
                    };
                    if len > limits.max_frame_bytes {
                        return Err(FrameError::TooLarge {
                            limit: limits.max_frame_bytes,
                        });
                    }
                    self.bulk = Some((end + 2, len));
                    (end + 2, len)
                }
            };
            let data_end = start
                .checked_add(len)
                .ok_or(FrameError::Protocol("length out of range"))?;
            if buf.len() < data_end + 2 {
                return Ok(None);
            }
            if &buf[data_end..data_end + 2] != b"\r\n" {
                return Err(FrameError::Protocol("bulk string not terminated by CRLF"));
            }
            self.ranges.push(start..data_end);
            self.bulk = None;
            self.pos = data_end + 2;
            self.scanned = self.pos;
            self.remaining = Some(self.remaining.unwrap_or(1) - 1);
        }
        Ok(Some(Request {
            args: arguments(buf, &self.ranges, &mut self.arena),
            wire_len: self.pos,
        }))
    }

    /// Ready for the next request, keeping the ranges' capacity and the arena.
    fn reset(&mut self) {
        // Field by field (rebuilding `Self` dropped two empty buffers per request); named all,
        // so a field added later cannot be forgotten here.
        let Self {
            pos,
            remaining,
            ranges,
            scanned,
            bulk,
            arena: _,
        } = self;
        *pos = 0;
        *remaining = None;
        ranges.clear();
        *scanned = 0;
        *bulk = None;
    }

    /// Gives back the arena's block (the connection is quiet); arguments still alive keep
    /// theirs until they are dropped.
    pub fn release(&mut self) {
        self.arena = BytesMut::new();
    }

    /// The number of the `*<n>` or `$<n>` header whose digits start at `from`, and the index of
    /// its `\r`; `Ok(None)` when its line is not all here yet. The common form in one pass
    /// ([`plain_number`]), anything else by the line search and [`parse_i64`].
    fn header_number(
        &mut self,
        buf: &[u8],
        from: usize,
    ) -> Result<Option<(i64, usize)>, FrameError> {
        if let Some(found) = plain_number(buf, from) {
            return Ok(Some(found));
        }
        let Some(end) = self.line_end(buf, from)? else {
            return Ok(None);
        };
        let n = parse_i64(&buf[from..end]).ok_or(FrameError::Protocol("invalid integer"))?;
        Ok(Some((n, end)))
    }

    /// The index of the `\r` ending the line that starts at `from`, searching only bytes not
    /// searched before.
    fn line_end(&mut self, buf: &[u8], from: usize) -> Result<Option<usize>, FrameError> {
        // A `\r` seen last time may have been the last byte: look at it again.
        let start = self.scanned.saturating_sub(1).max(from);
        match buf[start.min(buf.len())..]
            .windows(2)
            .position(|w| w == b"\r\n")
        {
            Some(i) => Ok(Some(start + i)),
            None => {
                self.scanned = buf.len();
                if buf.len() - from.min(buf.len()) > MAX_LINE {
                    return Err(FrameError::Protocol("header line longer than 64 KiB"));
                }
                Ok(None)
            }
        }
    }

    fn inline(&mut self, buf: &[u8], limits: &Limits) -> Result<Option<Request>, FrameError> {
        let start = self.scanned.min(buf.len());
        let Some(i) = buf[start..].iter().position(|&b| b == b'\n') else {
            self.scanned = buf.len();
            let limit = limits.max_frame_bytes.min(MAX_LINE);
            if buf.len() > limit {
                return Err(FrameError::TooLarge { limit });
            }
            return Ok(None);
        };
        let end = start + i;
        crate::frame::parse_request(&buf[..=end], limits)
    }
}

/// The common header, `<digits>\r\n` starting at `from`, read in one pass: its number and the
/// index of its `\r`. `None` for anything else (a sign, no digit, more than 18 digits, another
/// byte, or the line not all here yet), which the general path (line search, then
/// [`parse_i64`]) reads as before: for what this accepts, both give the same answer. Issue 18:
/// the search and the parse were most of a request's parsing, which was 700 instructions.
#[inline]
fn plain_number(buf: &[u8], from: usize) -> Option<(i64, usize)> {
    let mut n: i64 = 0;
    for (i, &b) in buf.get(from..)?.iter().enumerate() {
        match b {
            b'0'..=b'9' if i < 18 => n = n * 10 + i64::from(b - b'0'),
            b'\r' if i > 0 => {
                return (buf.get(from + i + 1) == Some(&b'\n')).then_some((n, from + i));
            }
            _ => return None,
        }
    }
    None
}

/// The arguments at `ranges` of `buf`, copied next to each other into `arena` and split off
/// as one shared buffer they slice (issue 18: a buffer per argument, then a buffer and its
/// shared count per request, were a third of a pipelined fenced write's allocations). The
/// arena's block is shared by the requests copied into it: a new block is taken only when it
/// is full while some of them are still alive, and a full block nobody uses any more is
/// reused in place, so a busy connection allocates about once per block, not per request.
fn arguments(buf: &[u8], ranges: &[std::ops::Range<usize>], arena: &mut BytesMut) -> Args {
    let total: usize = ranges.iter().map(|r| r.len()).sum();
    let mut own;
    let into = if total > ARENA / 2 {
        own = BytesMut::with_capacity(total);
        &mut own
    } else {
        if arena.capacity() < total {
            // Reuses the block in place when nothing slices it any more, else takes a new one.
            arena.reserve(ARENA);
        }
        arena
    };
    for r in ranges {
        into.extend_from_slice(&buf[r.clone()]);
    }
    let data = into.split().freeze();
    let mut at = 0;
    ranges
        .iter()
        .map(|r| {
            let arg = data.slice(at..at + r.len());
            at += r.len();
            arg
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::frame::parse_request;

    fn limits() -> Limits {
        Limits {
            max_frame_bytes: 1 << 20,
            ..Limits::default()
        }
    }

    /// Feeds `bytes` in pieces of `chunk` bytes; collects requests as the reader would.
    fn feed(bytes: &[u8], chunk: usize) -> Result<Vec<Request>, FrameError> {
        let mut parser = RequestParser::default();
        let mut buf = Vec::new();
        let mut out = Vec::new();
        for piece in bytes.chunks(chunk.max(1)) {
            buf.extend_from_slice(piece);
            while let Some(r) = parser.next(&buf, &limits())? {
                buf.drain(..r.wire_len);
                out.push(r);
            }
        }
        Ok(out)
    }

    fn whole(bytes: &[u8]) -> Result<Vec<Request>, FrameError> {
        let mut buf = bytes.to_vec();
        let mut out = Vec::new();
        while let Some(r) = parse_request(&buf, &limits())? {
            buf.drain(..r.wire_len);
            out.push(r);
        }
        Ok(out)
    }

    #[test]
    fn byte_at_a_time_equals_whole() {
        let wire =
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nv\r\nxy\r\nPING\r\n*1\r\n$4\r\nPING\r\n*0\r\n";
        let a = feed(wire, 1).unwrap();
        assert_eq!(a, whole(wire).unwrap());
        assert_eq!(a.len(), 4);
        assert_eq!(a[0].args[2].as_ref(), b"v\r\nxy");
    }

    #[test]
    fn trickled_megabyte_is_linear() {
        // 100,000 one-byte arguments, fed 7 bytes at a time: quadratic re-parsing would
        // take minutes here.
        let n = 100_000;
        let mut wire = format!("*{}\r\n$3\r\nDEL\r\n", n + 1).into_bytes();
        for _ in 0..n {
            wire.extend_from_slice(b"$1\r\nk\r\n");
        }
        let started = std::time::Instant::now();
        let out = feed(&wire, 7).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].args.len(), n + 1);
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    /// Requests' arguments share the arena's block: a block nobody slices any more is reused in
    /// place, one still sliced is left alone (its arguments intact), and a large request does
    /// not go through it (a block never grows).
    #[test]
    fn arguments_share_a_block_reused_once_free() {
        let wire = b"*3\r\n$3\r\nSET\r\n$5\r\nkey:1\r\n$3\r\nabc\r\n";
        let mut parser = RequestParser::default();
        let first = parser.next(wire, &limits()).unwrap().unwrap();
        let block = first.args[0].as_ptr();
        let second = parser.next(wire, &limits()).unwrap().unwrap();
        assert_eq!(
            second.args[0].as_ptr(),
            block.wrapping_add(11),
            "next to each other"
        );
        let large = format!("*2\r\n$3\r\nSET\r\n$3000\r\n{}\r\n", "v".repeat(3000));
        let large = parser.next(large.as_bytes(), &limits()).unwrap().unwrap();
        let third = parser.next(wire, &limits()).unwrap().unwrap();
        assert_eq!(large.args[1].len(), 3000);
        assert_eq!(
            third.args[0].as_ptr(),
            block.wrapping_add(22),
            "not after the large one"
        );
        drop((first, second, large, third));
        let starts_block = |r: &Request| r.args[0].as_ptr() == block;
        // Dropped as they go: the block is taken again from its start once full.
        let reused = (0..1_000)
            .filter(|_| starts_block(&parser.next(wire, &limits()).unwrap().unwrap()))
            .count();
        assert!(reused >= 2, "reused {reused} times");
        // Kept alive: a full block is left to them and a new one taken.
        let kept: Vec<Request> = (0..1_000)
            .map(|_| parser.next(wire, &limits()).unwrap().unwrap())
            .collect();
        assert!(kept.iter().filter(|r| starts_block(r)).count() <= 1);
        assert!(kept.iter().all(|r| r.args == whole(wire).unwrap()[0].args));
    }

    proptest! {
        /// Where the one-pass header read answers, it answers as the general path does: the
        /// first line end from `from`, and that line's number by `parse_i64`.
        #[test]
        fn a_plain_number_is_what_the_general_path_reads(
            pieces in proptest::collection::vec(
                prop::sample::select(vec![&b"0"[..], b"7", b"42", b"999999999", b"+", b"-", b"\r\n", b"\r", b"\n", b"x"]),
                0..12,
            ),
            from in 0usize..4,
        ) {
            let bytes: Vec<u8> = pieces.concat();
            if let Some((n, end)) = plain_number(&bytes, from) {
                let line = bytes[from..].windows(2).position(|w| w == b"\r\n").map(|i| from + i);
                prop_assert_eq!(line, Some(end));
                prop_assert_eq!(parse_i64(&bytes[from..end]), Some(n));
            }
        }
    }

    proptest! {
        // Each case parses up to a few hundred KiB in many pieces: fewer cases than the default.
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Many requests through one parser, some kept alive and some dropped as they come (in
        /// any pattern), some too large for the arena's block: every kept request still holds
        /// exactly its own arguments once all are parsed, whatever the blocks went through.
        #[test]
        fn kept_arguments_survive_later_requests(
            requests in prop::collection::vec(
                (
                    prop::collection::vec(
                        prop_oneof![
                            9 => prop::collection::vec(any::<u8>(), 0..64),
                            1 => prop::collection::vec(any::<u8>(), 1_500..3_000),
                        ],
                        1..5,
                    ),
                    any::<bool>(),
                ),
                1..200,
            ),
            chunk in 1usize..4_096,
        ) {
            let mut wire = Vec::new();
            for (args, _) in &requests {
                wire.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
                for a in args {
                    wire.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                    wire.extend_from_slice(a);
                    wire.extend_from_slice(b"\r\n");
                }
            }
            let mut parser = RequestParser::default();
            let mut buf = Vec::new();
            let mut seen = 0;
            let mut kept = Vec::new();
            for piece in wire.chunks(chunk) {
                buf.extend_from_slice(piece);
                while let Some(r) = parser.next(&buf, &limits()).unwrap() {
                    buf.drain(..r.wire_len);
                    if requests[seen].1 {
                        kept.push((seen, r));
                    }
                    seen += 1;
                }
            }
            prop_assert_eq!(seen, requests.len());
            for (i, r) in &kept {
                let got: Vec<&[u8]> = r.args.iter().map(|a| a.as_ref()).collect();
                let want: Vec<&[u8]> = requests[*i].0.iter().map(|a| a.as_slice()).collect();
                prop_assert_eq!(got, want, "request {}", i);
            }
        }
    }

    proptest! {
        #[test]
        fn any_split_equals_whole(
            args in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..20), 1..6),
            garbage in prop::collection::vec(any::<u8>(), 0..12),
            chunk in 1usize..16,
        ) {
            let mut wire = Vec::new();
            wire.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
            for a in &args {
                wire.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                wire.extend_from_slice(a);
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(&garbage);
            let split = feed(&wire, chunk);
            let all = whole(&wire);
            match (split, all) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(_)) => {}
                (a, b) => prop_assert!(false, "split {:?} whole {:?}", a, b),
            }
        }
    }
}
