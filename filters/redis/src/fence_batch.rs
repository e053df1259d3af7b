//! A pipelined run of fenced writes under one token, sent upstream as one call of the batch
//! fence script (`fence_batch.lua`): which writes may join a run, and how the call's reply is
//! split back into one reply per write, each exactly what the write would have got from its own
//! fence call. Pure; the session does the I/O.

use std::sync::Arc;

use bytes::Bytes;
use smallvec::SmallVec;

use crate::classify::MAX_FENCED_ARGS;
use crate::frame::{self, Frame, Limits};
use crate::rewrite::FenceToken;

/// The most writes in one call: Redis serves nobody else while the call runs.
pub const MAX_WRITES: usize = 64;

/// The most request bytes in one call; a write larger than this runs alone (its own call).
pub const MAX_BYTES: usize = 128 * 1024;

/// The most arguments plus declared keys in one call, as for one fenced command.
pub const MAX_ARGS: usize = MAX_FENCED_ARGS;

/// Writes a run makes room for when it turns out to be a pipeline (redis-benchmark's and many
/// clients' `-P 16`); deeper ones grow from there.
const PIPELINE: usize = 16;

/// Writes collected for one call, in request order. `W` is what the caller keeps per write.
#[derive(Debug)]
pub struct Run<W> {
    /// Shared with the session (and each write's reply context), not copied per write.
    token: Arc<FenceToken>,
    resp3: bool,
    /// Inline while the run holds one write: an unpipelined fenced write makes a run of one,
    /// and a `Vec` was an allocation and a free per write (issue 18).
    writes: SmallVec<[W; 1]>,
    bytes: usize,
    args: usize,
}

impl<W> Run<W> {
    /// An empty run for writes under `token`, whose client speaks RESP3 or not.
    pub fn new(token: Arc<FenceToken>, resp3: bool) -> Self {
        Self {
            token,
            resp3,
            writes: SmallVec::new(),
            bytes: 0,
            args: 0,
        }
    }

    /// Whether a write under `token` with `args` arguments plus keys and `bytes` request bytes
    /// may join: same token, same protocol, within the caps. An empty run admits any one write.
    pub fn admits(&self, token: &FenceToken, resp3: bool, args: usize, bytes: usize) -> bool {
        *self.token == *token
            && self.resp3 == resp3
            && (self.writes.is_empty()
                || (self.writes.len() < MAX_WRITES
                    && self.bytes + bytes <= MAX_BYTES
                    && self.args + args <= MAX_ARGS))
    }

    /// Adds a write (the caller checked [`Run::admits`]).
    pub fn push(&mut self, write: W, args: usize, bytes: usize) {
        if self.writes.len() == 1 {
            // A second write means a pipeline: room for a client's usual depth at once, not
            // grown 2, 4, 8, 16 (four reallocations moving every write so far; issue 18).
            self.writes.reserve(PIPELINE - 1);
        }
        self.writes.push(write);
        self.args += args;
        self.bytes += bytes;
    }

    /// The token, the protocol and the writes.
    pub fn into_parts(self) -> (Arc<FenceToken>, bool, SmallVec<[W; 1]>) {
        (self.token, self.resp3, self.writes)
    }
}

/// A batch call's reply, seen per write.
#[derive(Debug, Clone, PartialEq)]
pub enum Split {
    /// One reply per write, in order: the frame and the bytes to relay.
    Each(Vec<(Frame, Bytes)>),
    /// The call failed as a whole (a stale fence, a missing function, a server error such as
    /// `-OOM` or `-READONLY`): every write gets this same reply, as each would have alone.
    Whole(Frame),
}

/// Splits the reply (`frame`, parsed from exactly `raw`: each write is handed its element of
/// `frame` with that element's bytes of `raw`) of a batch call of `writes` writes. An answer
/// that is neither an error nor the script's array of `writes + 1` values is an error: nobody
/// can tell which writes applied, so the caller must close the connection.
///
/// Each write gets its element of `frame` itself (moved, not parsed again: issue 18's profile
/// put a second parse and the first one's drop at 250 instructions per write of a pipeline) and
/// that element's own bytes of `raw`, so that what is relayed is exactly what Redis wrote
/// (verbatim strings, doubles and big numbers keep their form).
pub fn split(frame: Frame, raw: &Bytes, writes: usize, resp3: bool) -> Result<Split, String> {
    let items = match frame {
        Frame::Error(_) => return Ok(Split::Whole(frame)),
        Frame::Array(items) if items.len() == writes + 1 => items,
        other => {
            return Err(format!(
                "the batch fence call of {writes} writes was answered with {}",
                shape(&other)
            ))
        }
    };
    let mut items = items.into_iter();
    let nulls = match items.next() {
        Some(Frame::Bulk(flags))
            if flags.len() == writes && flags.iter().all(|f| matches!(f, b'0' | b'1')) =>
        {
            flags
        }
        _ => return Err("the batch fence call's null flags are malformed".into()),
    };
    let header = raw
        .windows(2)
        .position(|w| w == b"\r\n")
        .ok_or("the batch fence reply has no header")?
        + 2;
    // Each element's bytes, one after the other from the array's header on.
    let mut at = header;
    let mut next = || {
        let len = element_len(raw, at).ok_or("the batch fence reply's elements do not parse")?;
        at += len;
        Ok::<_, &str>(at - len..at)
    };
    next()?; // The null flags'.
    let mut out = Vec::with_capacity(writes);
    for (item, flag) in items.zip(nulls.iter()) {
        let element = next()?;
        if *flag == b'1' {
            // Sent as false because a Lua array cannot hold a null; what the write alone got.
            if !matches!(item, Frame::Boolean(false) | Frame::Null) {
                return Err("the batch fence reply flags a null that is not false".into());
            }
            let null: &'static [u8] = if resp3 { b"_\r\n" } else { b"$-1\r\n" };
            out.push((Frame::Null, Bytes::from_static(null)));
        } else {
            out.push((item, raw.slice(element)));
        }
    }
    if at != raw.len() {
        return Err("the batch fence reply has bytes after its elements".into());
    }
    Ok(Split::Each(out))
}

/// The length of the element at `at` of `raw` (`None` when the bytes there are not one).
fn element_len(raw: &Bytes, at: usize) -> Option<usize> {
    frame::frame_len(raw.get(at..)?, &Limits::UPSTREAM)
        .ok()
        .flatten()
}

/// What a reply is, for an error message (never its data).
fn shape(frame: &Frame) -> String {
    match frame {
        Frame::Array(items) => format!("an array of {}", items.len()),
        Frame::Map(pairs) => format!("a map of {}", pairs.len()),
        Frame::Set(items) => format!("a set of {}", items.len()),
        Frame::Push(_) => "a push frame".into(),
        Frame::Attributed(..) => "an attributed reply".into(),
        Frame::Simple(_) => "a simple string".into(),
        Frame::Bulk(_) => "a bulk string".into(),
        Frame::Integer(_) => "an integer".into(),
        Frame::Null => "a null".into(),
        Frame::Number(_) => "a number".into(),
        Frame::Boolean(_) => "a boolean".into(),
        Frame::Error(_) => "an error".into(),
    }
}

#[cfg(test)]
mod tests {
    use fencegate_core::{Resource, Revision, Token};

    use super::*;

    fn token(revision: u64) -> FenceToken {
        FenceToken::new(Token::new(
            Resource::new("job").unwrap(),
            Revision::new(revision).unwrap(),
        ))
    }

    fn split_wire(wire: &[u8], writes: usize, resp3: bool) -> Result<Vec<String>, String> {
        let raw = Bytes::copy_from_slice(wire);
        let (frame, len) = frame::parse(&raw, &Limits::default()).unwrap().unwrap();
        assert_eq!(len, raw.len());
        Ok(match split(frame, &raw, writes, resp3)? {
            Split::Whole(_) => vec!["whole".into()],
            Split::Each(replies) => replies
                .into_iter()
                .map(|(frame, raw)| {
                    let reparsed = frame::parse(&raw, &Limits::default()).unwrap().unwrap();
                    assert_eq!(reparsed.1, raw.len(), "one whole frame each");
                    if !matches!(frame, Frame::Null) {
                        assert_eq!(reparsed.0, frame);
                    }
                    String::from_utf8_lossy(&raw).into_owned()
                })
                .collect(),
        })
    }

    #[test]
    fn golden_splits() {
        // RESP2: three OKs.
        assert_eq!(
            split_wire(b"*4\r\n$3\r\n000\r\n+OK\r\n+OK\r\n+OK\r\n", 3, false).unwrap(),
            ["+OK\r\n", "+OK\r\n", "+OK\r\n"]
        );
        // An error in the middle stays in its place; the others keep their replies.
        assert_eq!(
            split_wire(
                b"*4\r\n$3\r\n000\r\n+OK\r\n-WRONGTYPE Operation against a key holding the wrong kind of value\r\n:3\r\n",
                3,
                false
            )
            .unwrap(),
            [
                "+OK\r\n",
                "-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
                ":3\r\n"
            ]
        );
        // RESP2 nulls arrive as nulls already (Lua false), the flag says 0.
        assert_eq!(
            split_wire(b"*3\r\n$2\r\n00\r\n$-1\r\n$1\r\nv\r\n", 2, false).unwrap(),
            ["$-1\r\n", "$1\r\nv\r\n"]
        );
        // RESP3: a flagged false is a null; a real false stays a boolean; types kept as sent.
        assert_eq!(
            split_wire(
                b"*6\r\n$5\r\n10000\r\n#f\r\n#f\r\n,1.5\r\n%1\r\n$1\r\na\r\n:1\r\n=7\r\ntxt:abc\r\n",
                5,
                true
            )
            .unwrap(),
            [
                "_\r\n",
                "#f\r\n",
                ",1.5\r\n",
                "%1\r\n$1\r\na\r\n:1\r\n",
                "=7\r\ntxt:abc\r\n"
            ]
        );
        // Nested arrays and errors inside them are one element each.
        assert_eq!(
            split_wire(b"*3\r\n$2\r\n00\r\n*2\r\n:1\r\n-ERR x\r\n*0\r\n", 2, false).unwrap(),
            ["*2\r\n:1\r\n-ERR x\r\n", "*0\r\n"]
        );
    }

    #[test]
    fn a_failed_call_answers_every_write_alike() {
        for wire in [
            &b"-FENCED job token 7 is below fence 12\r\n"[..],
            b"-ERR Function not found\r\n",
            b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
            b"!10\r\nERR blobby\r\n",
        ] {
            assert_eq!(split_wire(wire, 3, false).unwrap(), ["whole"]);
        }
    }

    #[test]
    fn anything_else_is_refused_not_guessed() {
        for (wire, writes) in [
            (&b"+OK\r\n"[..], 2),
            (b"*3\r\n$3\r\n000\r\n+OK\r\n+OK\r\n", 3),
            (b"*3\r\n$2\r\n00\r\n+OK\r\n+OK\r\n", 3),
            (b"*4\r\n$2\r\n00\r\n+OK\r\n+OK\r\n+OK\r\n", 3),
            (b"*4\r\n$3\r\n0x0\r\n+OK\r\n+OK\r\n+OK\r\n", 3),
            (b"*4\r\n:000\r\n+OK\r\n+OK\r\n+OK\r\n", 3),
            (b"*3\r\n$2\r\n10\r\n+OK\r\n+OK\r\n", 2),
            (b"_\r\n", 2),
        ] {
            assert!(split_wire(wire, writes, false).is_err(), "{wire:?}");
        }
    }

    #[test]
    fn a_run_holds_one_token_one_protocol_and_stays_within_its_caps() {
        let mut run: Run<u32> = Run::new(Arc::new(token(7)), false);
        assert!(run.admits(&token(7), false, 3, 30));
        assert!(!run.admits(&token(8), false, 3, 30), "another token");
        assert!(!run.admits(&token(7), true, 3, 30), "another protocol");
        assert!(
            run.admits(&token(7), false, MAX_ARGS * 2, MAX_BYTES * 2),
            "alone, any size"
        );
        for i in 0..MAX_WRITES as u32 {
            assert!(run.admits(&token(7), false, 3, 30));
            run.push(i, 3, 30);
        }
        assert!(!run.admits(&token(7), false, 3, 30), "full");
        let mut run: Run<u32> = Run::new(Arc::new(token(7)), false);
        run.push(0, 3, MAX_BYTES - 10);
        assert!(run.admits(&token(7), false, 3, 10));
        assert!(!run.admits(&token(7), false, 3, 11), "bytes");
        run.push(1, MAX_ARGS - 10, 0);
        assert!(!run.admits(&token(7), false, 8, 0), "arguments");
        let (t, resp3, writes) = run.into_parts();
        assert_eq!(
            (t, resp3, writes.into_vec()),
            (Arc::new(token(7)), false, vec![0, 1])
        );
    }

    /// Pieces of RESP2 and RESP3, valid and not, so that concatenations are often whole
    /// frames, nested or not, and often not.
    const PIECES: [&[u8]; 25] = [
        b"+OK\r\n",
        b"-ERR x\r\n",
        b":12\r\n",
        b":+5\r\n",
        b"_\r\n",
        b"#f\r\n",
        b",1.5\r\n",
        b"(12345678901234567890\r\n",
        b"$3\r\nabc\r\n",
        b"$0\r\n\r\n",
        b"$-1\r\n",
        b"=7\r\ntxt:abc\r\n",
        b"!3\r\nERR\r\n",
        b"*2\r\n",
        b"*-1\r\n",
        b"%1\r\n",
        b"~1\r\n",
        b">1\r\n",
        b"|1\r\n",
        b"\r\n",
        b"$5\r\nab",
        b"x",
        b"=-1\r\n",
        b"!-1\r\n",
        b"+a\rb\r\n",
    ];

    proptest::proptest! {
        /// Wherever the parser accepts a frame, the element length the split uses is the
        /// parser's; on anything else it answers without panicking.
        #[test]
        fn element_lengths_agree_with_the_parser(
            picks in proptest::collection::vec(0..PIECES.len(), 1..10),
            cut in 0usize..64,
        ) {
            let mut wire: Vec<u8> = picks.iter().flat_map(|&i| PIECES[i].iter().copied()).collect();
            let whole = Bytes::from(wire.clone());
            if let Ok(Some((_, len))) = frame::parse(&whole, &Limits::UPSTREAM) {
                proptest::prop_assert_eq!(element_len(&whole, 0), Some(len));
            }
            wire.truncate(cut.min(wire.len()));
            let _ = element_len(&Bytes::from(wire), 0);
        }
    }
}
