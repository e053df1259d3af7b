//! Protect patterns must match exactly the keys Redis's own glob matches (`KEYS`, `SCAN
//! MATCH`): a key the gateway thinks unprotected but an operator's `KEYS billing:*` lists is a
//! hole. Unusual patterns, each checked against the real server's `KEYS` over a set of keys.

use fencegate_testkit::redis_server;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use fencegate_redis::frame::{parse, Frame, Limits};
use fencegate_redis::glob;
use redis_server::RedisServer;

const KEYS: &[&str] = &[
    "a",
    "b",
    "c",
    "z",
    "[",
    "]",
    "^",
    "-",
    "\\",
    "*",
    "?",
    "!",
    "ab",
    "a]",
    "a-b",
    "[a",
    "]a",
    "a\\b",
    "a*b",
    "axb",
    "billing:1",
    "billing:",
    "billing",
    "b:x:y",
    "hello",
    "hallo",
    "h]llo",
    "h-llo",
    "h^llo",
    "h\\llo",
    "x[y",
    "x]y",
    "_",
    "`",
];

const PATTERNS: &[&str] = &[
    "*",
    "?",
    "[",
    "[a",
    "[]",
    "[]a]",
    "[^]",
    "[^]a]",
    "[a-]",
    "[a-]]",
    "[]-a]",
    "[z-a]",
    "\\",
    "a\\",
    "[\\]]",
    "[\\",
    "[a-c",
    "*[",
    "?[",
    "[*]",
    "[?]",
    "\\*",
    "\\?",
    "a\\*b",
    "[^a]",
    "[!a]",
    "[-]",
    "[a-b-c]",
    "[[]",
    "*]",
    "]",
    "h[^e]llo",
    "h[]-e]llo",
    "h[\\]]llo",
    "billing:*",
    "billing*",
    "b*:*",
    "x[]y",
    "x[]]y",
    "x[^]]y",
    "[a-\\]]",
    "[\\-a]",
    "a*",
    "*b",
    "**",
    "[]]*",
    "[^-]",
    "a[-]b",
    "h[a-]llo",
];

fn request(s: &mut TcpStream, buf: &mut BytesMut, args: &[&[u8]]) -> Frame {
    let mut out = BytesMut::new();
    Frame::command(args.iter().map(|a| Bytes::copy_from_slice(a))).encode(&mut out);
    s.write_all(&out).unwrap();
    loop {
        if let Some((frame, len)) = parse(buf, &Limits::default()).unwrap() {
            buf.advance(len);
            return frame;
        }
        let mut chunk = [0u8; 65536];
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0);
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn protect_patterns_match_what_redis_keys_matches() {
    let server = RedisServer::start();
    let mut s = TcpStream::connect(server.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = BytesMut::new();
    for k in KEYS {
        request(&mut s, &mut buf, &[b"SET", k.as_bytes(), b"1"]);
    }
    let mut wrong = Vec::new();
    for p in PATTERNS {
        let Frame::Array(items) = request(&mut s, &mut buf, &[b"KEYS", p.as_bytes()]) else {
            panic!("KEYS {p}");
        };
        let redis: BTreeSet<String> = items
            .iter()
            .map(|f| match f {
                Frame::Bulk(b) => String::from_utf8_lossy(b).into_owned(),
                other => panic!("{other:?}"),
            })
            .collect();
        let ours: BTreeSet<String> = KEYS
            .iter()
            .filter(|k| glob::matches(p.as_bytes(), k.as_bytes()))
            .map(|k| k.to_string())
            .collect();
        if ours != redis {
            wrong.push(format!("{p:?}: gateway {ours:?}, Redis {redis:?}"));
        }
    }
    println!(
        "{} patterns x {} keys: {} differ from Redis's KEYS",
        PATTERNS.len(),
        KEYS.len(),
        wrong.len()
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
