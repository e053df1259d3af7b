//! Redis-style glob matching on raw key bytes: `*`, `?`, `[abc]`, `[^a-z]`, and `\` escapes,
//! with the same meaning as `KEYS` and `SCAN MATCH`.

/// Whether `key` matches `pattern`.
pub fn matches(pattern: &[u8], key: &[u8]) -> bool {
    // The usual protect pattern, a literal prefix and one `*` (`billing:*`), is a prefix test:
    // the general loop below cost 150 instructions per key for it, twice per fenced write
    // (issue 18). Any other wildcard or escape in the prefix takes the general path.
    if let Some(prefix) = pattern.strip_suffix(b"*") {
        if !prefix
            .iter()
            .any(|b| matches!(b, b'*' | b'?' | b'[' | b']' | b'\\'))
        {
            return key.starts_with(prefix);
        }
    }
    general(pattern, key)
}

/// [`matches`] for any pattern, as Redis's `stringmatchlen` reads it.
fn general(pattern: &[u8], key: &[u8]) -> bool {
    // Iterative matcher with one backtrack point for the last `*` (linear in practice, no
    // recursion, so hostile patterns cannot blow the stack).
    let (mut p, mut k) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while k < key.len() {
        if p < pattern.len() {
            match pattern[p] {
                b'*' => {
                    while p < pattern.len() && pattern[p] == b'*' {
                        p += 1;
                    }
                    if p == pattern.len() {
                        return true;
                    }
                    star = Some((p, k));
                    continue;
                }
                b'?' => {
                    p += 1;
                    k += 1;
                    continue;
                }
                b'[' => {
                    let (hit, next) = class(pattern, p, key[k]);
                    if hit {
                        p = next;
                        k += 1;
                        continue;
                    }
                }
                b'\\' if p + 1 < pattern.len() => {
                    if pattern[p + 1] == key[k] {
                        p += 2;
                        k += 1;
                        continue;
                    }
                }
                c => {
                    if c == key[k] {
                        p += 1;
                        k += 1;
                        continue;
                    }
                }
            }
        }
        match star {
            Some((sp, sk)) => {
                p = sp;
                k = sk + 1;
                star = Some((sp, sk + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// Matches `c` against the class starting at `pattern[start] == b'['`, exactly as Redis's
/// `stringmatchlen` does (util.c): `]` right after `[` or `[^` closes an empty class, `a-]` is
/// a range ending at `]`, a range may be reversed, and an unterminated class is the class of
/// what it lists so far. Returns whether it hit and the index after the class.
fn class(pattern: &[u8], start: usize, c: u8) -> (bool, usize) {
    let mut i = start + 1;
    let negate = pattern.get(i) == Some(&b'^');
    if negate {
        i += 1;
    }
    let mut hit = false;
    loop {
        let Some(&b) = pattern.get(i) else {
            return (hit != negate, pattern.len());
        };
        if b == b'\\' && pattern.len() - i >= 2 {
            i += 1;
            hit |= pattern[i] == c;
        } else if b == b']' {
            return (hit != negate, i + 1);
        } else if pattern.len() - i >= 3 && pattern[i + 1] == b'-' {
            let (lo, hi) = (b.min(pattern[i + 2]), b.max(pattern[i + 2]));
            hit |= (lo..=hi).contains(&c);
            i += 2;
        } else {
            hit |= b == c;
        }
        i += 1;
    }
}

/// Whether `pattern` uses no wildcard other than `*` (then [`captures`] applies to it).
pub fn star_only(pattern: &[u8]) -> bool {
    !pattern
        .iter()
        .any(|b| matches!(b, b'?' | b'[' | b']' | b'\\'))
}

/// The texts the `*`s of a star-only `pattern` match in `key`, left to right; `None` when it
/// does not match. Each `*` takes the shortest text that lets the rest match (so in
/// `billing:*:*` against `billing:2026:09:28`, `{1}` is `2026` and `{2}` is `09:28`).
pub fn captures<'k>(pattern: &[u8], key: &'k [u8]) -> Option<Vec<&'k [u8]>> {
    debug_assert!(star_only(pattern));
    let segments: Vec<&[u8]> = pattern.split(|b| *b == b'*').collect();
    let (first, last) = (segments[0], segments[segments.len() - 1]);
    if segments.len() == 1 {
        return (key == first).then(Vec::new);
    }
    if key.len() < first.len() + last.len() || !key.starts_with(first) || !key.ends_with(last) {
        return None;
    }
    let middle = &key[first.len()..key.len() - last.len()];
    let mut out = Vec::with_capacity(segments.len() - 1);
    let mut at = 0;
    for segment in &segments[1..segments.len() - 1] {
        let found = if segment.is_empty() {
            Some(0)
        } else {
            middle[at..]
                .windows(segment.len())
                .position(|w| w == *segment)
        }?;
        out.push(&middle[at..at + found]);
        at += found + segment.len();
    }
    out.push(&middle[at..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{general, matches};

    #[test]
    fn redis_glob_semantics() {
        let cases: &[(&str, &str, bool)] = &[
            ("*", "", true),
            ("*", "anything", true),
            ("billing:*", "billing:2026", true),
            ("billing:*", "billing", false),
            ("h?llo", "hello", true),
            ("h?llo", "hllo", false),
            ("h[ae]llo", "hallo", true),
            ("h[ae]llo", "hillo", false),
            ("h[^e]llo", "hallo", true),
            ("h[^e]llo", "hello", false),
            ("h[a-b]llo", "hbllo", true),
            ("h[a-b]llo", "hcllo", false),
            ("a\\*b", "a*b", true),
            ("a\\*b", "axb", false),
            ("*:*:x", "a:b:c:x", true),
            ("*:*:x", "a:b:c:y", false),
            ("a*b*c", "aXbYbZc", true),
            // As redis-server 7.0 answers KEYS: an unterminated class is a class.
            ("[", "[", false),
            ("[a", "a", true),
            ("[]a]", "a]", false),
            ("[^]", "x", true),
            ("[a-]", "]", true),
            ("", "", true),
            ("", "a", false),
        ];
        for (pattern, key, want) in cases {
            assert_eq!(
                matches(pattern.as_bytes(), key.as_bytes()),
                *want,
                "{pattern:?} {key:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn the_prefix_test_agrees_with_the_general_matcher(pattern in "[ab*?\\[\\]\\\\^-]{0,6}\\*?", key in "[ab*?\\[\\]\\\\]{0,8}") {
            prop_assert_eq!(
                matches(pattern.as_bytes(), key.as_bytes()),
                general(pattern.as_bytes(), key.as_bytes())
            );
        }

        #[test]
        fn never_panics(pattern in proptest::collection::vec(any::<u8>(), 0..20), key in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = matches(&pattern, &key);
        }

        #[test]
        fn star_prefix_matches_every_suffix(prefix in "[a-z:]{0,8}", rest in "[a-z:]{0,8}") {
            let pattern = format!("{prefix}*");
            let key = format!("{prefix}{rest}");
            prop_assert!(matches(pattern.as_bytes(), key.as_bytes()));
        }
    }
}
