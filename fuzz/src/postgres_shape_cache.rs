//! The PostgreSQL classification cache (`fencegate_postgres::classify_cache`), as a
//! differential: texts of equal shape share a cache entry, so a cached answer must equal what a
//! fresh parse (`classify`, i.e. libpg_query) gives for the very text. Each input is read as a
//! "token soup" (keywords, quotes, comments, `\r`, backslashes, dollar quotes, prefixed
//! literals, `U&""` with `UESCAPE`, ...) with literal slots; the soup is filled twice with
//! different literals of the same class, both texts are classified through one cache, and each
//! answer is compared with a fresh parse. Where the cache's lexer sees the two texts as one
//! shape the second answer comes from the cache; where it does not, both are parsed.

use fencegate_postgres::classify::classify;
use fencegate_postgres::classify_cache::{ClassifyCache, RecentShapes};

/// Pieces of SQL glued together as the input says (with or without a space after each).
const PIECES: &[&str] = &[
    "SELECT",
    "INSERT INTO t VALUES",
    "UPDATE t SET a =",
    "DELETE FROM t",
    "WHERE",
    "FROM",
    "t",
    "a",
    "(",
    ")",
    ",",
    ";",
    "=",
    "+",
    "-",
    "*",
    "/",
    ".",
    "::",
    "'",
    "\"",
    "''",
    "\\",
    "E",
    "U&",
    "B",
    "X",
    "N",
    "$$",
    "$q$",
    "$1",
    "--",
    "/*",
    "*/",
    "\n",
    "\r",
    "\t",
    " ",
    "UESCAPE",
    "'!'",
    "U&\"d!0061t\"",
    "/* fencing_token='fg1~7~job' */",
    "BEGIN",
    "COMMIT",
    "SET fencegate.token =",
    "nextval(",
    "WITH d AS (",
    "RETURNING *",
    "0x1F",
    "1e5",
    ".5",
    "\u{e9}",
    "COPY t FROM STDIN",
    "CALL f(",
    "SET standard_conforming_strings = off",
    "e",
    "&",
    "!",
    "$",
    "0",
    "_",
    "SET client_encoding =",
    "DO",
    "LANGUAGE",
    "'a\\'",
];

/// Characters string literals are made of.
const STRING_CHARS: &[&str] = &[
    "a", "b", " ", ";", "--", "/*", "*/", "''", "\"", "$", "$$", "\\", "\r", "\n", "1", "é",
];

/// A literal of one class: `which` picks the class, `seed` its value.
fn literal(class: u8, seed: u32) -> String {
    match class % 3 {
        0 => seed.to_string(),
        1 => format!("{}.{}", seed % 1000, seed / 1000),
        _ => {
            let mut text = String::from("'");
            let mut s = seed;
            for _ in 0..(seed % 6) {
                text.push_str(STRING_CHARS[(s % STRING_CHARS.len() as u32) as usize]);
                s = s / 7 + 3;
            }
            text.push('\'');
            text
        }
    }
}

/// The two texts an input stands for.
fn texts(data: &[u8]) -> (String, String) {
    let mut first = String::new();
    let mut second = String::new();
    let mut bytes = data.iter().copied().take(96);
    while let Some(b) = bytes.next() {
        let index = usize::from(b & 0x7f);
        if index < PIECES.len() {
            first.push_str(PIECES[index]);
            second.push_str(PIECES[index]);
        } else {
            // A literal slot: its class and two values.
            let seed = u32::from(bytes.next().unwrap_or(0));
            let class = (index - PIECES.len()) as u8;
            first.push_str(&literal(class, seed * 7919 + 11));
            second.push_str(&literal(class, (seed + 1) * 104_729 % 1_000_003));
        }
        if b & 0x80 != 0 {
            first.push(' ');
            second.push(' ');
        }
    }
    (first, second)
}

/// The fuzz target's body. Both ways into the cache: the shared entries alone (`classify`), and
/// through a session's recent shapes (`classify_recent`), where the second text of a shape is
/// found among them.
pub fn check(data: &[u8]) {
    let (first, second) = texts(data);
    let cache = ClassifyCache::new(8);
    assert_eq!(cache.classify(&first), classify(&first), "{first:?}");
    assert_eq!(
        cache.classify(&second),
        classify(&second),
        "{second:?} after {first:?}"
    );
    assert_eq!(
        cache.classify(&first),
        classify(&first),
        "{first:?} after {second:?}"
    );
    let cache = ClassifyCache::new(8);
    let mut recent = RecentShapes::default();
    for (text, after) in [(&first, ""), (&second, first.as_str()), (&first, second.as_str())] {
        assert_eq!(
            cache.classify_recent(text, &mut recent),
            classify(text),
            "{text:?} after {after:?}, recent shapes"
        );
    }
}
