//! A cache of [`classify`] results keyed by a statement's *shape*: its text with each numeric
//! and plain string literal masked. Applications send the same few statements over and over
//! with different values (`... WHERE aid = 4711`), and parsing each one with `pg_query` (the
//! server's parser, plus a protobuf round trip of the whole tree) cost the gateway about 170,000
//! instructions per statement, most of its CPU on a read-heavy load.
//!
//! What a statement is (read, write, transaction control), where each statement starts and
//! ends, the tables it writes and its comment token do not depend on literal values, so two
//! texts with the same shape classify alike, up to offsets, which are mapped through the
//! literals' lengths. The shape is taken by a deliberately small lexer that only masks what it
//! is sure is a literal and gives up (no caching: a full parse) on anything it does not fully
//! understand: escape strings and other prefixed literals (`E'..'`, `U&'..'`, `B'..'`),
//! Unicode-escaped identifiers (`U&".."`), dollar quotes, backslashes in strings, nested
//! comments, exponents, NUL bytes. Results that depend on a
//! literal value (`SET fencegate.token = '...'`) or failed to parse are never cached.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use crate::classify::{classify, Classified, Kind, Statement};

/// Shapes longer than this are not cached (their parse is the cost of their size anyway).
const MAX_KEY_BYTES: usize = 4096;

/// Keys and literal lists up to these sizes live on the stack: a cache hit allocates nothing
/// for its shape (issue 18's profile). Longer ones spill to the heap, still cached.
const INLINE_KEY_BYTES: usize = 512;
const INLINE_LITERALS: usize = 8;

/// Marks in the key where a masked literal was; NUL never occurs in a query text.
const NUMBER_MARK: &[u8] = b"\0n";
const STRING_MARK: &[u8] = b"\0s";

/// One masked literal: where it is in the text, and where its mark is in the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Literal {
    at: usize,
    len: usize,
    key_at: usize,
}

impl Literal {
    /// How much longer the literal is than its 2-byte mark.
    fn grows(&self) -> isize {
        self.len as isize - 2
    }
}

/// A query text's shape: the cache key and the literals masked in it.
#[derive(Debug, Default, PartialEq, Eq)]
struct Shape {
    key: SmallVec<[u8; INLINE_KEY_BYTES]>,
    literals: SmallVec<[Literal; INLINE_LITERALS]>,
}

/// A 256-entry table of a predicate on bytes, built at compile time: the lexer asks per byte
/// of every query it shapes, and the chains of comparisons cost about 16 instructions a byte
/// (issue 18's profile: a third of a `pgbench -S` query's shaping). Built from the very
/// predicate, so the answers cannot differ.
macro_rules! byte_table {
    (|$b:ident| $test:expr) => {{
        let mut table = [false; 256];
        let mut i = 0;
        while i < 256 {
            let $b = i as u8;
            table[i] = $test;
            i += 1;
        }
        table
    }};
}

/// Bytes that continue an identifier or keyword.
const IDENT: [bool; 256] =
    byte_table!(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80);

/// Bytes that may begin one of [`mentions_lexing`]'s words (the cases its `match` compares).
const LEXING_WORD_START: [bool; 256] =
    byte_table!(|b| matches!(b | 0x20, b'u' | b'c' | b's' | b'n'));

fn is_ident_byte(b: u8) -> bool {
    IDENT[b as usize]
}

/// Whether `sql` contains, in any case, `uescape`, `client_encoding`, `standard_conforming`,
/// or both `names` and `set`: words of the settings and syntax that change how text is lexed.
/// One pass that compares a word only where its first letter is (issue 18's profile: five
/// scans comparing every window cost about 3,400 instructions per `pgbench -S` statement).
fn mentions_lexing(sql: &[u8]) -> bool {
    let (mut names, mut set) = (false, false);
    for (i, &c) in sql.iter().enumerate() {
        if !LEXING_WORD_START[c as usize] {
            continue;
        }
        let at = |word: &[u8]| {
            sql.get(i..i + word.len())
                .is_some_and(|w| w.eq_ignore_ascii_case(word))
        };
        match c | 0x20 {
            b'u' if at(b"uescape") => return true,
            b'c' if at(b"client_encoding") => return true,
            b's' if at(b"standard_conforming") => return true,
            b'n' if at(b"names") => names = true,
            b's' if at(b"set") => set = true,
            _ => {}
        }
    }
    names && set
}

/// Fills `shape` (empty) with the shape of `sql`, in place (a returned shape is a copy of its
/// inline buffers); `None` where the lexer does not fully understand the text (then `shape`
/// holds garbage).
fn shape_into(sql: &str, shape: &mut Shape) -> Option<()> {
    // PostgreSQL ends a `--` comment at `\r` too, and `UESCAPE` changes how a `U&` identifier
    // or string ends: texts with either are not shaped (issue 12, bypass 5).
    // Settings that change lexing are judged on their value (a literal): never shaped.
    // (`memchr`'s SIMD search: std's `contains` goes a word at a time, about 100
    // instructions for a `pgbench -S` query.)
    if memchr::memchr(b'\r', sql.as_bytes()).is_some() || mentions_lexing(sql.as_bytes()) {
        return None;
    }
    let b = sql.as_bytes();
    let n = b.len();
    let Shape { key, literals } = shape;
    let mut copied = 0;
    let mut i = 0;
    let at = |j: usize| b.get(j).copied();
    while i < n {
        let c = b[i];
        let literal_end = match c {
            0 => return None,
            b'\'' => {
                // Only a plain literal: a prefix (E, U&, B, X, N) glued to it changes its meaning.
                let prev = if i == 0 { b' ' } else { b[i - 1] };
                if !(prev.is_ascii_whitespace() || b"(,=<>[+-*/".contains(&prev)) {
                    return None;
                }
                let mut j = i + 1;
                loop {
                    match at(j)? {
                        b'\\' => return None,
                        b'\'' if at(j + 1) == Some(b'\'') => j += 2,
                        b'\'' => break,
                        _ => j += 1,
                    }
                }
                Some((j + 1, STRING_MARK))
            }
            b'0'..=b'9' => {
                let mut j = i;
                while at(j).is_some_and(|d| d.is_ascii_digit()) {
                    j += 1;
                }
                if at(j) == Some(b'.') {
                    j += 1;
                    if !at(j).is_some_and(|d| d.is_ascii_digit()) {
                        return None;
                    }
                    while at(j).is_some_and(|d| d.is_ascii_digit()) {
                        j += 1;
                    }
                }
                // `1e5`, `0x1F`, `1_000`, `1.2.3`, `1'a'`: not a plain number.
                if at(j).is_some_and(|d| is_ident_byte(d) || d == b'.' || d == b'\'') {
                    return None;
                }
                if i > 0 && b[i - 1] == b'.' {
                    return None;
                }
                Some((j, NUMBER_MARK))
            }
            b'.' if at(i + 1).is_some_and(|d| d.is_ascii_digit()) => return None,
            b'$' => {
                // `$1` parameters are kept; anything else is a dollar quote.
                if !at(i + 1).is_some_and(|d| d.is_ascii_digit()) {
                    return None;
                }
                i += 1;
                while at(i).is_some_and(|d| d.is_ascii_digit()) {
                    i += 1;
                }
                if at(i).is_some_and(is_ident_byte) {
                    return None;
                }
                None
            }
            b'"' => {
                // `U&"..."` spells its name in escapes: `U&"\0063lient_encoding"` is
                // `client_encoding` to the server, which no word search of the text finds.
                if i >= 2 && b[i - 1] == b'&' && b[i - 2] | 0x20 == b'u' {
                    return None;
                }
                let mut j = i + 1;
                loop {
                    match at(j)? {
                        b'"' if at(j + 1) == Some(b'"') => j += 2,
                        b'"' => break,
                        _ => j += 1,
                    }
                }
                i = j + 1;
                None
            }
            b'/' if at(i + 1) == Some(b'*') => {
                // Left to right, as the server's lexer reads it: a `/` and a `*` open a nested
                // comment before that `*` can close one (`/*/` opens a second level; a search
                // for the first `*/` took its `*` as a close). Nested comments are not shaped.
                let mut j = i + 2;
                loop {
                    match (at(j)?, at(j + 1)) {
                        (b'/', Some(b'*')) => return None,
                        (b'*', Some(b'/')) => break,
                        _ => j += 1,
                    }
                }
                i = j + 2;
                None
            }
            b'-' if at(i + 1) == Some(b'-') => {
                i = sql[i..].find('\n').map_or(n, |e| i + e + 1);
                None
            }
            c if is_ident_byte(c) => {
                while at(i).is_some_and(is_ident_byte) {
                    i += 1;
                }
                None
            }
            _ => {
                i += 1;
                None
            }
        };
        // The key only grows here and at the end, so its bound is checked only there (once
        // per byte, the check cost about 80 instructions per `pgbench -S` query): a text
        // whose key would outgrow it is scanned to its end, no further than the parse that
        // follows reads it anyway.
        if let Some((end, mark)) = literal_end {
            if key.len() + (i - copied) + mark.len() > MAX_KEY_BYTES {
                return None;
            }
            key.extend_from_slice(&b[copied..i]);
            literals.push(Literal {
                at: i,
                len: end - i,
                key_at: key.len(),
            });
            key.extend_from_slice(mark);
            copied = end;
            i = end;
        }
    }
    if key.len() + (n - copied) > MAX_KEY_BYTES {
        return None;
    }
    key.extend_from_slice(&b[copied..]);
    Some(())
}

impl Shape {
    /// A text offset as a key offset; `None` inside a literal.
    fn key_offset(&self, offset: usize) -> Option<usize> {
        let mut shift = 0isize;
        for l in &self.literals {
            if offset >= l.at + l.len {
                shift += l.grows();
            } else if offset > l.at {
                return None;
            }
        }
        Some((offset as isize - shift) as usize)
    }

    /// A key offset (at a mark's boundary) as an offset in this text.
    fn text_offset(&self, offset: usize) -> usize {
        let shift: isize = self
            .literals
            .iter()
            .filter(|l| offset >= l.key_at + 2)
            .map(Literal::grows)
            .sum();
        (offset as isize + shift) as usize
    }

    /// `statements` (offsets in the key) as this text's classification.
    fn classified(&self, statements: &[Statement]) -> Classified {
        Classified {
            statements: statements
                .iter()
                .map(|s| Statement {
                    start: self.text_offset(s.start),
                    end: self.text_offset(s.end),
                    ..s.clone()
                })
                .collect(),
            parse_error: None,
        }
    }
}

/// Whether a classification may be reused for every text of the same shape.
fn reusable(classified: &Classified) -> bool {
    classified.parse_error.is_none()
        && classified
            .statements
            .iter()
            .all(|s| !matches!(s.kind, Kind::SetToken(_)))
}

/// Statements by shape key, with offsets in the key. Both shared ([`RecentShapes`] holds them
/// too).
type Entries = HashMap<Arc<[u8]>, Arc<[Statement]>>;

/// Classifications by shape, shared by a gateway's sessions; bounded (cleared when full).
pub struct ClassifyCache {
    entries: Mutex<Entries>,
    capacity: usize,
}

/// A shape's key and its statements, as the shared cache holds them.
type Entry = (Arc<[u8]>, Arc<[Statement]>);

/// How many shapes a session remembers in its [`RecentShapes`].
const RECENT: usize = 4;

/// The longest key a session remembers. An entry the shared cache dropped stays alive while a
/// session remembers it, so this bounds what a connection can hold on its own: four keys of at
/// most 256 bytes and the statements in them. A longer text's lexing costs far more than the
/// lookup saved.
const RECENT_KEY_BYTES: usize = 256;

/// The shapes one session classified last, each with its entry of the shared
/// [`ClassifyCache`]: a session that repeats its statements (most do, with new values) finds
/// them here by comparing keys, without hashing the key or taking the shared cache's lock
/// (issue 18's profile: about 300 instructions per `pgbench -S` query). What a shape
/// classifies as does not change, so an entry stays right after the shared cache drops it.
/// Holds references, not copies: a few words per session.
#[derive(Debug, Default)]
pub struct RecentShapes {
    slots: [Option<Entry>; RECENT],
    /// The slot the next shape not found replaces.
    next: usize,
}

impl RecentShapes {
    fn find(&self, key: &[u8]) -> Option<&[Statement]> {
        self.slots
            .iter()
            .flatten()
            .find(|(k, _)| **k == *key)
            .map(|(_, statements)| &**statements)
    }

    fn remember(&mut self, key: Arc<[u8]>, statements: Arc<[Statement]>) {
        if key.len() > RECENT_KEY_BYTES {
            return;
        }
        self.slots[self.next] = Some((key, statements));
        self.next = (self.next + 1) % RECENT;
    }
}

impl ClassifyCache {
    /// A cache of at most `capacity` shapes.
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            capacity,
        }
    }

    /// The same as [`classify`]`(sql)`, parsing only the first text of each shape (no
    /// session's recent shapes: for tests and one-off texts).
    pub fn classify(&self, sql: &str) -> Classified {
        self.classify_recent(sql, &mut RecentShapes::default())
    }

    /// The same as [`classify`]`(sql)`, parsing only the first text of each shape, and
    /// looking first among a session's `recent` shapes.
    pub fn classify_recent(&self, sql: &str, recent: &mut RecentShapes) -> Classified {
        if self.capacity == 0 {
            return classify(sql);
        }
        let mut shape = Shape::default();
        if shape_into(sql, &mut shape).is_none() {
            return classify(sql);
        }
        if let Some(statements) = recent.find(&shape.key) {
            return shape.classified(statements);
        }
        let hit = self
            .entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_key_value(shape.key.as_slice())
            .map(|(key, statements)| (key.clone(), statements.clone()));
        if let Some((key, statements)) = hit {
            let classified = shape.classified(&statements);
            recent.remember(key, statements);
            return classified;
        }
        let classified = classify(sql);
        if reusable(&classified) {
            let in_key: Option<Vec<Statement>> = classified
                .statements
                .iter()
                .map(|s| {
                    Some(Statement {
                        start: shape.key_offset(s.start)?,
                        end: shape.key_offset(s.end)?,
                        ..s.clone()
                    })
                })
                .collect();
            if let Some(in_key) = in_key {
                let (key, statements): (Arc<[u8]>, Arc<[Statement]>) =
                    (shape.key.as_slice().into(), in_key.into());
                let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
                if entries.len() >= self.capacity {
                    entries.clear();
                }
                entries.insert(key.clone(), statements.clone());
                drop(entries);
                recent.remember(key, statements);
            }
        }
        classified
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The shape of `sql`, or `None` where it is not shaped.
    fn shape(sql: &str) -> Option<Shape> {
        let mut shape = Shape::default();
        shape_into(sql, &mut shape).map(|()| shape)
    }

    /// The shape's key as text, for readable comparisons.
    fn key(sql: &str) -> Option<String> {
        shape(sql).map(|s| String::from_utf8(s.key.to_vec()).expect("a key of UTF-8 text"))
    }

    /// Issue 12, bypass 5: a read and a DELETE must never share a shape.
    #[test]
    fn carriage_returns_and_uescape_are_not_shaped() {
        assert_eq!(shape("SELECT 1 -- x\rDELETE FROM t"), None);
        assert_eq!(shape("SELECT U&\"d!0061t\" UESCAPE '!' FROM t"), None);
        assert_eq!(shape("SELECT U&\"d\\0061t\" FROM t"), None);
        assert_eq!(shape("SELECT u&\"t\" FROM t"), None);
        assert!(shape("SELECT \"u\"&\"t\" FROM t").is_some(), "no U& prefix");
        // `/*/` opens a second level: the text after it is still comment to the server.
        assert_eq!(shape("SELECT 1 /*/*/ 'x' */ */"), None);
        assert!(
            shape("SELECT 1 /*/ 'x' */").is_some(),
            "a lone slash inside"
        );
        assert!(shape("SELECT 1 /**/ 'x'").is_some());
        assert_eq!(shape("SET client_encoding = 'UTF8'"), None);
        assert_eq!(shape("set names 'x'"), None);
        let cache = ClassifyCache::new(16);
        let kinds = |sql: &str| -> Vec<Kind> {
            cache
                .classify(sql)
                .statements
                .into_iter()
                .map(|s| s.kind)
                .collect()
        };
        assert_eq!(
            kinds("SELECT 1; -- x\nDELETE FROM t"),
            vec![Kind::Read, Kind::Write]
        );
        assert_eq!(kinds("SELECT 1; -- x DELETE FROM t"), vec![Kind::Read]);
        assert_eq!(
            kinds("SELECT 1; -- x\rDELETE FROM t"),
            vec![Kind::Read, Kind::Write]
        );
    }

    #[test]
    fn lexing_words_are_found_in_any_case_and_place() {
        for sql in [
            "SELECT 1 UESCAPE",
            "uescape",
            "SET Client_Encoding TO x",
            "show STANDARD_CONFORMING_strings",
            "SeT nAmEs 'x'",
            "NAMES ... set",
            "xsetnames",
        ] {
            assert!(mentions_lexing(sql.as_bytes()), "{sql}");
        }
        for sql in [
            "",
            "SELECT 1",
            "SELECT names FROM t",
            "SET x = 1",
            "uescap",
            "clientencoding",
        ] {
            assert!(!mentions_lexing(sql.as_bytes()), "{sql}");
        }
    }

    #[test]
    fn literals_are_masked_and_the_rest_kept() {
        let s = key("SELECT abalance FROM pgbench_accounts WHERE aid = 4711;").unwrap();
        assert_eq!(s, "SELECT abalance FROM pgbench_accounts WHERE aid = \0n;");
        let t = key("SELECT abalance FROM pgbench_accounts WHERE aid = 1;").unwrap();
        assert_eq!(s, t);
        let s = key("INSERT INTO t VALUES ('it''s', -1.5, $1) /* fencing_token='fg1~7~job' */")
            .unwrap();
        assert_eq!(
            s,
            "INSERT INTO t VALUES (\0s, -\0n, $1) /* fencing_token='fg1~7~job' */"
        );
        let s = key("SELECT \"a'b\", x1, t.c2 FROM t -- it's 42\nWHERE y = 3").unwrap();
        assert_eq!(
            s,
            "SELECT \"a'b\", x1, t.c2 FROM t -- it's 42\nWHERE y = \0n"
        );
    }

    #[test]
    fn anything_unclear_is_not_shaped() {
        for sql in [
            "SELECT E'a\\'b'",
            "SELECT U&'d\\0061t'",
            "SELECT B'101'",
            "SELECT x'1F'",
            "SELECT 'a\\'",
            "SELECT $$ 'x' $$",
            "SELECT $tag$x$tag$",
            "SELECT 1e5",
            "SELECT 0x1F",
            "SELECT 1_000",
            "SELECT .5",
            "SELECT 1.",
            "SELECT 'unterminated",
            "SELECT \"unterminated",
            "SELECT /* a /* nested */ */ 1",
            "SELECT /* unterminated",
            "SELECT 'a'::text||'b'",
        ] {
            assert_eq!(shape(sql), None, "{sql}");
        }
    }

    #[test]
    fn a_hit_gives_what_a_parse_gives() {
        let cache = ClassifyCache::new(64);
        for (first, second) in [
            (
                "SELECT abalance FROM pgbench_accounts WHERE aid = 1;",
                "SELECT abalance FROM pgbench_accounts WHERE aid = 123456;",
            ),
            (
                "UPDATE t SET a = a + 5 WHERE id = 1 /* fencing_token='fg1~7~job' */",
                "UPDATE t SET a = a + -12345 WHERE id = 99999 /* fencing_token='fg1~7~job' */",
            ),
            (
                "BEGIN; INSERT INTO t VALUES (1, 'x'); SELECT 'yy', 2; COMMIT;",
                "BEGIN; INSERT INTO t VALUES (1234567, 'a much longer string'); SELECT '', 20; COMMIT;",
            ),
            (
                "  SELECT 1 ;  SELECT 'a' ;",
                "  SELECT 100 ;  SELECT 'abcdef' ;",
            ),
            ("SELECT nextval('s')", "SELECT nextval('other_sequence')"),
        ] {
            assert_eq!(cache.classify(first), classify(first), "{first}");
            assert_eq!(cache.classify(second), classify(second), "{second}");
            assert_eq!(cache.classify(first), classify(first), "{first}");
        }
    }

    #[test]
    fn literal_dependent_results_are_not_reused() {
        let cache = ClassifyCache::new(64);
        for sql in [
            "SET fencegate.token = 'fg1~7~job'",
            "SET fencegate.token = 'fg1~8~job'",
            "SELEC 'x'",
            "SELEC 'yy'",
        ] {
            assert_eq!(cache.classify(sql), classify(sql), "{sql}");
        }
        assert!(cache.entries.lock().unwrap().is_empty());
    }

    #[test]
    fn the_cache_stays_bounded() {
        let cache = ClassifyCache::new(4);
        for i in 0..10 {
            cache.classify(&format!("SELECT c{i} FROM t WHERE a = {i}"));
        }
        assert!(cache.entries.lock().unwrap().len() <= 4);
    }

    /// A shape longer than the inline buffers spills to the heap and is still cached right.
    #[test]
    fn a_long_shape_is_cached_like_a_short_one() {
        let fill = |base: usize| {
            let values: Vec<String> = (0..3 * INLINE_LITERALS)
                .map(|i| format!("({}, 'v{}')", base + i, base * i))
                .collect();
            let column = "c".repeat(INLINE_KEY_BYTES);
            format!("INSERT INTO t ({column}, d) VALUES {}", values.join(", "))
        };
        let (first, second) = (fill(1), fill(1_000_000));
        let shaped = shape(&first).expect("a plain INSERT is shaped");
        assert!(shaped.key.len() > INLINE_KEY_BYTES && shaped.key.spilled());
        assert!(shaped.literals.len() > INLINE_LITERALS && shaped.literals.spilled());
        let cache = ClassifyCache::new(4);
        assert_eq!(cache.classify(&first), classify(&first));
        assert_eq!(cache.entries.lock().unwrap().len(), 1);
        assert_eq!(cache.classify(&second), classify(&second));
        assert_eq!(
            cache.entries.lock().unwrap().len(),
            1,
            "the second is a hit"
        );
    }

    /// A key of up to `MAX_KEY_BYTES` is shaped, a byte more is not, wherever the last byte
    /// comes from: a literal's mark, or the text after the last literal.
    #[test]
    fn the_key_bound_is_exact() {
        // `1` is masked as a 2-byte mark: the key is one byte longer than the text.
        let literal_last = |k: usize| format!("SELECT {} FROM t WHERE a = 1", "c".repeat(k));
        let text_last = |k: usize| format!("SELECT 1 FROM t WHERE {} = a", "c".repeat(k));
        for (sql, grows) in [(literal_last as fn(usize) -> String, 1), (text_last, 1)] {
            let base = sql(0).len() + grows;
            let at_bound = sql(MAX_KEY_BYTES - base);
            let over = sql(MAX_KEY_BYTES - base + 1);
            assert_eq!(shape(&at_bound).map(|s| s.key.len()), Some(MAX_KEY_BYTES));
            assert_eq!(shape(&over), None);
        }
    }

    /// A session's recent shape answers as a parse would, after the shared cache dropped it,
    /// and without touching the shared cache.
    #[test]
    fn a_recent_shape_is_found_without_the_shared_cache() {
        let cache = ClassifyCache::new(1);
        let mut recent = RecentShapes::default();
        let (read, write) = (
            "SELECT abalance FROM pgbench_accounts WHERE aid = 1",
            "UPDATE t SET a = 5 WHERE id = 1 /* fencing_token='fg1~7~job' */",
        );
        assert_eq!(cache.classify_recent(read, &mut recent), classify(read));
        // Full: the shared cache is cleared and holds the write's shape alone.
        assert_eq!(cache.classify_recent(write, &mut recent), classify(write));
        let again = "SELECT abalance FROM pgbench_accounts WHERE aid = 987654";
        assert_eq!(cache.classify_recent(again, &mut recent), classify(again));
        let shared: Vec<Arc<[u8]>> = cache.entries.lock().unwrap().keys().cloned().collect();
        assert_eq!(
            shared,
            vec![Arc::from(key(write).unwrap().as_bytes())],
            "the read was answered from the recent shapes, not parsed and cached again"
        );
    }

    /// A session remembers its last `RECENT` shapes, the oldest making room.
    #[test]
    fn recent_shapes_keep_the_last_few() {
        let cache = ClassifyCache::new(64);
        let mut recent = RecentShapes::default();
        let text = |i: usize| format!("SELECT c{i} FROM t WHERE a = {i}");
        for i in 0..=RECENT {
            cache.classify_recent(&text(i), &mut recent);
        }
        let found = |recent: &RecentShapes, i: usize| {
            recent.find(key(&text(i)).unwrap().as_bytes()).is_some()
        };
        assert!(!found(&recent, 0), "the oldest made room");
        assert!((1..=RECENT).all(|i| found(&recent, i)));

        // A long shape is not remembered (and takes no one's place).
        let long = format!("SELECT {} FROM t WHERE a = 1", "c".repeat(RECENT_KEY_BYTES));
        assert_eq!(cache.classify_recent(&long, &mut recent), classify(&long));
        assert!(recent.find(key(&long).unwrap().as_bytes()).is_none());
        assert!((1..=RECENT).all(|i| found(&recent, i)));
    }

    /// Two literals of the same class (so their texts have the same shape).
    fn literal() -> impl Strategy<Value = (String, String)> {
        let text = "[a-zA-Z0-9 ;/*$\"-]{0,12}";
        prop_oneof![
            (0u64..10_000_000_000, 0u64..10).prop_map(|(a, b)| (a.to_string(), b.to_string())),
            (0u32..100_000, 0u32..1000).prop_map(|(a, b)| (format!("{a}.{b}"), format!("{b}.{a}"))),
            (text, text).prop_map(|(a, b)| (format!("'{a}'"), format!("'{b}'"))),
            ("[a-z]{0,3}", "[a-z]{0,3}")
                .prop_map(|(a, b)| (format!("'{a}''{a}'"), format!("'{b}''{b}'"))),
        ]
    }

    /// Whatever a comment holds, a cached answer equals a fresh parse. Every comment body of up
    /// to five of `/`, `*` and a space (they open, close and share the characters of comment
    /// delimiters: `/*/` opens a second level), then a string that, wherever the server thinks
    /// the comment still runs, ends it and writes, warmed with a harmless string of the same
    /// shape, and closers after it so that the harmless text parses whatever the depth.
    #[test]
    fn comments_never_let_a_cached_answer_differ() {
        let mut bodies = vec![String::new()];
        let mut last = bodies.clone();
        for _ in 0..5 {
            last = last
                .iter()
                .flat_map(|b| ["/", "*", " "].map(|c| format!("{b}{c}")))
                .collect();
            bodies.extend(last.iter().cloned());
        }
        for body in &bodies {
            for closers in 0..4 {
                let closers = " */".repeat(closers);
                let fill = |lit: &str| format!("SELECT 1 /*{body}*/ {lit}{closers}");
                for evil in ["'*/ */; DELETE FROM t; --'", "'*/; DELETE FROM t; --'"] {
                    let cache = ClassifyCache::new(8);
                    for sql in [fill("'x'"), fill(evil)] {
                        assert_eq!(cache.classify(&sql), classify(&sql), "{sql}");
                    }
                }
            }
        }
    }

    /// A setting that changes lexing, named with Unicode escapes for any of its letters.
    fn escaped_setting() -> impl Strategy<Value = String> {
        let names = prop_oneof![Just("client_encoding"), Just("standard_conforming_strings"),];
        (names, proptest::collection::vec(any::<bool>(), 27)).prop_map(|(name, escape)| {
            name.chars()
                .zip(escape)
                .map(|(c, e)| {
                    if e {
                        format!("\\{:04x}", c as u32)
                    } else {
                        c.to_string()
                    }
                })
                .collect()
        })
    }

    proptest! {
        /// A session setting that changes how the server lexes SQL is judged on its value:
        /// however its name is spelled, the cache never gives one value's answer to another.
        #[test]
        fn lexing_settings_are_judged_on_their_value_however_named(
            name in escaped_setting(),
            prefix in prop_oneof![Just("U&"), Just("u&")],
            statement in 0usize..3,
        ) {
            let statements = [
                "SET {name} TO {value}",
                "SET SESSION {name} = {value}; SELECT 1",
                "SELECT set_config('x', 'y', false); SET LOCAL {name} TO {value}",
            ];
            let sql = |value: &str| {
                statements[statement]
                    .replace("{name}", &format!("{prefix}\"{name}\""))
                    .replace("{value}", value)
            };
            let cache = ClassifyCache::new(8);
            let mut recent = RecentShapes::default();
            for value in ["'UTF8'", "'on'", "'SJIS'", "'off'", "'BIG5'"] {
                let sql = sql(value);
                prop_assert_eq!(cache.classify_recent(&sql, &mut recent), classify(&sql), "{}", sql);
            }
        }

        /// Whatever literals fill a template, a cached answer equals a fresh parse.
        #[test]
        fn cached_equals_parsed(
            template in 0usize..6,
            a in literal(),
            b in literal(),
            c in literal(),
        ) {
            let templates = [
                "SELECT abalance FROM pgbench_accounts WHERE aid = {a} AND x = {b}; -- it's\nSELECT {c}",
                "BEGIN; UPDATE t SET v = {a} WHERE k = {b} /* fencing_token='fg1~3~r' */; SELECT {c}; END;",
                "INSERT INTO s.t (a, b) VALUES ({a}, {b}), ({c}, {a}) RETURNING *",
                "WITH d AS (DELETE FROM t WHERE a = {a} RETURNING *) SELECT {b}, {c} FROM d",
                "SELECT {a}; SELECT {b} ;SELECT {c}",
                "SELECT lower({a}) || {b}, count(*) FROM t GROUP BY {c}",
            ];
            let fill = |a: &str, b: &str, c: &str| {
                templates[template].replace("{a}", a).replace("{b}", b).replace("{c}", c)
            };
            let cache = ClassifyCache::new(8);
            // Warm the cache with other literals of the same classes, then compare.
            let warm = fill(&a.1, &b.1, &c.1);
            prop_assert_eq!(cache.classify(&warm), classify(&warm));
            let sql = fill(&a.0, &b.0, &c.0);
            let shaped = key(&sql);
            prop_assert!(shaped.is_some(), "{sql}");
            prop_assert_eq!(shaped, key(&warm));
            prop_assert_eq!(cache.classify(&sql), classify(&sql));
            // And through a session's recent shapes, warmed by the other text.
            let cache = ClassifyCache::new(8);
            let mut recent = RecentShapes::default();
            prop_assert_eq!(cache.classify_recent(&warm, &mut recent), classify(&warm));
            prop_assert_eq!(cache.classify_recent(&sql, &mut recent), classify(&sql));
        }
    }
}
