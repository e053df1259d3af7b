//! The arguments of a fence command, read without Redis: the same layout as `FCALL` of the fence
//! functions (filters/redis/src/fence.lua and fence_batch.lua), so the gateway builds one call
//! for both and only the command's name differs.
//!
//! ```text
//! FENCEGATE.FENCE       numkeys fence-key key... resource token resp command arg...
//! FENCEGATE.FENCE_BATCH numkeys fence-key key... resource token resp n count... command arg... ...
//! ```

use std::ops::Range;

use smallvec::SmallVec;

/// Where each wrapped command is: a single call's one range without an allocation.
pub type Commands = SmallVec<[Range<usize>; 1]>;

/// A fence command's arguments, as positions in `argv` (the command's name at 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Where the declared keys are; the first is the fence key.
    pub keys: Range<usize>,
    /// Where the resource name is (for the refusal's text).
    pub resource: usize,
    /// Where the token's revision is.
    pub token: usize,
    /// Whether the client asked for RESP3 replies (`resp` is `3`).
    pub resp3: bool,
    /// Where each wrapped command is, its name first.
    pub commands: Commands,
}

/// Why the arguments cannot be a fence command: the text of the error reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadLayout {
    /// Fewer arguments than the layout needs.
    Arity,
    /// `numkeys` is not a number from 1 to the number of arguments left.
    NumKeys,
    /// The revision is not canonical decimal (digits, no leading zero, at most 2^63-1).
    Token,
    /// `resp` is neither `2` nor `3`.
    Resp,
    /// The batch's `n` or counts do not add up to the commands given.
    Counts,
}

impl BadLayout {
    /// The error reply's text (a Redis error: its first word is the code).
    pub fn message(self) -> &'static std::ffi::CStr {
        match self {
            BadLayout::Arity => c"ERR wrong number of arguments for a fencegate fence command",
            BadLayout::NumKeys => {
                c"ERR numkeys must be at least 1 (the fence key) and at most the arguments given"
            }
            BadLayout::Token => {
                c"ERR the token's revision must be canonical decimal from 0 to 9223372036854775807"
            }
            BadLayout::Resp => c"ERR resp must be 2 or 3",
            BadLayout::Counts => {
                c"ERR the batch's command counts must be positive and add up to the commands given"
            }
        }
    }
}

/// The declared keys of a call: positions 2 to 2 + numkeys, or none when `numkeys` is not valid
/// (then the call itself is refused too). What `COMMAND GETKEYS`, ACL and cluster routing see.
pub fn keys(argv: &[&[u8]]) -> Range<usize> {
    match argv.get(1).and_then(|n| number(n)) {
        Some(n) if n >= 1 && n <= argv.len().saturating_sub(2) => 2..2 + n,
        _ => 0..0,
    }
}

/// Reads a single fence command (`FENCEGATE.FENCE`).
pub fn single(argv: &[&[u8]]) -> Result<Layout, BadLayout> {
    let (keys, resource, token, resp3) = head(argv)?;
    let first = token + 2;
    if first >= argv.len() {
        return Err(BadLayout::Arity);
    }
    Ok(Layout {
        keys,
        resource,
        token,
        resp3,
        commands: std::iter::once(first..argv.len()).collect(),
    })
}

/// Reads a batch fence command (`FENCEGATE.FENCE_BATCH`).
pub fn batch(argv: &[&[u8]]) -> Result<Layout, BadLayout> {
    let (keys, resource, token, resp3) = head(argv)?;
    let at_n = token + 2;
    let n = argv
        .get(at_n)
        .ok_or(BadLayout::Arity)
        .and_then(|n| number(n).ok_or(BadLayout::Counts))?;
    let counts = at_n + 1;
    if n == 0 || n > argv.len() - counts {
        return Err(BadLayout::Counts);
    }
    let mut at = counts + n;
    let mut commands = Commands::with_capacity(n);
    for count in &argv[counts..counts + n] {
        let count = number(count).filter(|c| *c >= 1).ok_or(BadLayout::Counts)?;
        let end = at.checked_add(count).ok_or(BadLayout::Counts)?;
        if end > argv.len() {
            return Err(BadLayout::Counts);
        }
        commands.push(at..end);
        at = end;
    }
    if at != argv.len() {
        return Err(BadLayout::Counts);
    }
    Ok(Layout {
        keys,
        resource,
        token,
        resp3,
        commands,
    })
}

/// Whether a stored fence is above the token: the fence function's comparison (canonical
/// decimals: longer is larger, equal lengths compare as bytes).
pub fn is_below(token: &[u8], fence: &[u8]) -> bool {
    fence.len() > token.len() || (fence.len() == token.len() && fence > token)
}

fn head(argv: &[&[u8]]) -> Result<(Range<usize>, usize, usize, bool), BadLayout> {
    if argv.len() < 7 {
        return Err(BadLayout::Arity);
    }
    let keys = keys(argv);
    if keys.is_empty() {
        return Err(BadLayout::NumKeys);
    }
    let resource = keys.end;
    let token = resource + 1;
    let resp = token + 1;
    if resp >= argv.len() {
        return Err(BadLayout::Arity);
    }
    if !canonical_revision(argv[token]) {
        return Err(BadLayout::Token);
    }
    let resp3 = match argv[resp] {
        b"2" => false,
        b"3" => true,
        _ => return Err(BadLayout::Resp),
    };
    Ok((keys, resource, token, resp3))
}

/// Canonical decimal from 0 to i64::MAX: what the gateway sends, so the byte comparison of
/// [`is_below`] is the numeric one. Anything else is refused rather than compared as text.
fn canonical_revision(token: &[u8]) -> bool {
    let digits = !token.is_empty() && token.iter().all(u8::is_ascii_digit);
    let no_leading_zero = token.len() == 1 || token.first() != Some(&b'0');
    digits
        && no_leading_zero
        && std::str::from_utf8(token)
            .ok()
            .and_then(|t| t.parse::<i64>().ok())
            .is_some()
}

/// A count: canonical decimal digits only (no sign, no spaces), as Redis reads `numkeys`.
fn number(text: &[u8]) -> Option<usize> {
    if text.is_empty() || text.len() > 10 || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn argv(words: &str) -> Vec<&[u8]> {
        words.split(' ').map(str::as_bytes).collect()
    }

    #[test]
    fn a_single_call_names_its_parts() {
        let a = argv("FENCEGATE.FENCE 2 fencegate:fence:{r} k r 7 2 SET k v");
        assert_eq!(
            single(&a),
            Ok(Layout {
                keys: 2..4,
                resource: 4,
                token: 5,
                resp3: false,
                commands: std::iter::once(7..10).collect(),
            })
        );
    }

    #[test]
    fn a_batch_call_names_each_command() {
        let a = argv("FENCEGATE.FENCE_BATCH 1 f r 12 3 3 3 2 1 SET a b INCR c PING");
        assert_eq!(
            batch(&a),
            Ok(Layout {
                keys: 2..3,
                resource: 3,
                token: 4,
                resp3: true,
                commands: smallvec::smallvec![10..13, 13..15, 15..16],
            })
        );
    }

    #[test]
    fn bad_calls_say_what_is_wrong() {
        let cases = [
            ("FENCEGATE.FENCE 1 f r 7 2", BadLayout::Arity),
            ("FENCEGATE.FENCE 0 f r 7 2 SET k v", BadLayout::NumKeys),
            ("FENCEGATE.FENCE 9 f r 7 2 SET k v", BadLayout::NumKeys),
            ("FENCEGATE.FENCE -1 f r 7 2 SET k v", BadLayout::NumKeys),
            ("FENCEGATE.FENCE 1 f r 07 2 SET k v", BadLayout::Token),
            ("FENCEGATE.FENCE 1 f r +7 2 SET k v", BadLayout::Token),
            (
                "FENCEGATE.FENCE 1 f r 9223372036854775808 2 SET k v",
                BadLayout::Token,
            ),
            ("FENCEGATE.FENCE 1 f r 7 4 SET k v", BadLayout::Resp),
            ("FENCEGATE.FENCE 4 f k r 7 2 SET", BadLayout::Arity),
        ];
        for (words, want) in cases {
            assert_eq!(single(&argv(words)), Err(want), "{words}");
        }
        let batches = [
            (
                "FENCEGATE.FENCE_BATCH 1 f r 7 2 0 SET k v",
                BadLayout::Counts,
            ),
            (
                "FENCEGATE.FENCE_BATCH 1 f r 7 2 1 0 SET k v",
                BadLayout::Counts,
            ),
            (
                "FENCEGATE.FENCE_BATCH 1 f r 7 2 1 2 SET k v",
                BadLayout::Counts,
            ),
            (
                "FENCEGATE.FENCE_BATCH 1 f r 7 2 1 4 SET k v",
                BadLayout::Counts,
            ),
            (
                "FENCEGATE.FENCE_BATCH 1 f r 7 2 2 3 SET k v",
                BadLayout::Counts,
            ),
        ];
        for (words, want) in batches {
            assert_eq!(batch(&argv(words)), Err(want), "{words}");
        }
    }

    #[test]
    fn the_comparison_is_numeric_for_canonical_decimals() {
        assert!(is_below(b"9", b"10"));
        assert!(is_below(b"41", b"42"));
        assert!(!is_below(b"42", b"42"));
        assert!(!is_below(b"100", b"99"));
    }

    proptest! {
        #[test]
        fn any_bytes_are_read_without_panicking(words in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 0..20)) {
            let a: Vec<&[u8]> = words.iter().map(Vec::as_slice).collect();
            for layout in [single(&a), batch(&a)].into_iter().flatten() {
                // Every position a layout names is inside argv.
                prop_assert!(layout.keys.end <= a.len() && layout.token < a.len());
                for c in &layout.commands {
                    prop_assert!(c.start < c.end && c.end <= a.len());
                }
            }
            let k = keys(&a);
            prop_assert!(k.end <= a.len());
        }

        #[test]
        fn the_comparison_agrees_with_numbers(a in 0..i64::MAX, b in 0..i64::MAX) {
            prop_assert_eq!(is_below(a.to_string().as_bytes(), b.to_string().as_bytes()), a < b);
        }
    }
}
