//! The gateway's key extraction against Redis's own answer: for every write command in the real
//! server's `COMMAND` table, thousands of generated argument lists go to `COMMAND GETKEYS`, and
//! the gateway's decision for the same arguments (every key protected) must fence at least the
//! keys Redis names, or refuse the command as UNFENCEABLE. Anything else is a way around the
//! fence. The server has fencegate's module loaded, so module commands whose keys their own code
//! finds (`getkeys-api`) are in the table too.

use fencegate_testkit::redis_server;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use fencegate_redis::classify::{classify, Class};
use fencegate_redis::command_table::{BeginSearch, CommandTable};
use fencegate_redis::frame::{parse, Frame, Limits};
use fencegate_redis::{ProtectRule, RedisConfig};
use redis_server::RedisServer;

/// Cases per write command, and a bound on the whole run.
const CASES_PER_COMMAND: usize = 250;
const TIME_BOUND: Duration = Duration::from_secs(120);

struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    fn send(&mut self, requests: &[Vec<Bytes>]) {
        let mut out = BytesMut::new();
        for args in requests {
            Frame::command(args.iter().cloned()).encode(&mut out);
        }
        self.stream.write_all(&out).unwrap();
    }

    fn reply(&mut self) -> Frame {
        loop {
            if let Some((frame, len)) = parse(&self.buf, &Limits::default()).unwrap() {
                self.buf.advance(len);
                return frame;
            }
            let mut chunk = [0u8; 65536];
            let n = self.stream.read(&mut chunk).unwrap();
            assert!(n > 0, "redis-server closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// A small deterministic generator (xorshift), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const VOCABULARY: &[&str] = &[
    "k1",
    "k2",
    "k3",
    "0",
    "1",
    "2",
    "3",
    "-1",
    "STORE",
    "STOREDIST",
    "STREAMS",
    "GROUP",
    "COUNT",
    "BLOCK",
    "NOACK",
    "KEYS",
    "WEIGHTS",
    "AGGREGATE",
    "SUM",
    "DB",
    "REPLACE",
    "BY",
    "GET",
    "LIMIT",
    "LEFT",
    "RIGHT",
    "MIN",
    "MAX",
    "km",
    "WITHSCORES",
    "NX",
    "XX",
    "EX",
    "GT",
    ">",
    "$",
    "*",
    "FROMMEMBER",
    "BYRADIUS",
    "ASC",
    "COPY",
    "AUTH",
    "numkeys",
];

fn text(frame: &Frame) -> Option<Bytes> {
    match frame {
        Frame::Bulk(b) | Frame::Simple(b) => Some(b.clone()),
        _ => None,
    }
}

#[test]
fn key_extraction_agrees_with_command_getkeys_or_refuses() {
    let server = RedisServer::start_with_module();
    let stream = TcpStream::connect(server.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut conn = Conn {
        stream,
        buf: BytesMut::new(),
    };
    conn.send(&[vec![Bytes::from_static(b"COMMAND")]]);
    let table = CommandTable::from_reply(&conn.reply()).unwrap();
    let config = RedisConfig {
        protect: Some(vec![ProtectRule::every_key()]),
        ..RedisConfig::default()
    };

    let mut writes: Vec<_> = table
        .commands()
        .filter(|c| c.writes() && !c.container)
        .collect();
    writes.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(writes.len() > 100, "only {} write commands", writes.len());

    let started = Instant::now();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut cases, mut equal, mut superset, mut refused, mut redis_refused) = (0, 0, 0, 0, 0);
    let mut disagreements = Vec::new();
    for info in &writes {
        if started.elapsed() > TIME_BOUND {
            break;
        }
        let mut vocabulary: Vec<&str> = VOCABULARY.to_vec();
        for spec in &info.key_specs {
            if let BeginSearch::Keyword { keyword, .. } = &spec.begin {
                vocabulary.push(keyword);
                vocabulary.push(keyword);
            }
        }
        let prefix: Vec<Bytes> = info
            .name
            .split('|')
            .map(|p| Bytes::copy_from_slice(p.to_ascii_uppercase().as_bytes()))
            .collect();
        let min = info.arity.unsigned_abs() as usize;
        let batch: Vec<Vec<Bytes>> = (0..CASES_PER_COMMAND)
            .map(|_| {
                let argc = if info.arity >= 0 {
                    min
                } else {
                    min + rng.below(7)
                };
                let mut args = prefix.clone();
                while args.len() < argc.max(prefix.len()) {
                    let word = vocabulary[rng.below(vocabulary.len())];
                    args.push(Bytes::copy_from_slice(word.as_bytes()));
                }
                args
            })
            .collect();
        let requests: Vec<Vec<Bytes>> = batch
            .iter()
            .map(|args| {
                let mut r = vec![
                    Bytes::from_static(b"COMMAND"),
                    Bytes::from_static(b"GETKEYS"),
                ];
                r.extend(args.iter().cloned());
                r
            })
            .collect();
        conn.send(&requests);
        for args in &batch {
            cases += 1;
            let redis_keys: BTreeSet<Bytes> = match conn.reply() {
                Frame::Array(items) => items.iter().filter_map(text).collect(),
                _ => {
                    redis_refused += 1;
                    BTreeSet::new()
                }
            };
            let shown = || {
                args.iter()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            match classify(&table, &config, args) {
                Class::Refuse { .. } | Class::Unknown => refused += 1,
                Class::Fence { keys } => {
                    let ours: BTreeSet<Bytes> = keys.into_iter().collect();
                    if ours == redis_keys {
                        equal += 1;
                    } else if ours.is_superset(&redis_keys) {
                        // Safe (more is fenced than written); shown so a change is noticed.
                        if superset < 3 {
                            println!(
                                "superset example: {}: gateway {ours:?}, Redis {redis_keys:?}",
                                shown()
                            );
                        }
                        superset += 1;
                    } else {
                        disagreements.push(format!(
                            "{}: gateway fences {ours:?}, Redis names {redis_keys:?}",
                            shown()
                        ));
                    }
                }
                Class::Pass => {
                    if redis_keys.is_empty() {
                        equal += 1;
                    } else {
                        disagreements.push(format!(
                            "{}: gateway passes it unfenced, Redis names {redis_keys:?}",
                            shown()
                        ));
                    }
                }
            }
        }
    }
    println!(
        "{} write commands, {cases} generated cases in {:.1?}: {equal} same keys, {superset} gateway fences a superset, {refused} refused UNFENCEABLE, {} disagreements ({redis_refused} that Redis's GETKEYS rejected)",
        writes.len(),
        started.elapsed(),
        disagreements.len()
    );
    assert!(
        cases >= 20_000,
        "only {cases} cases ran within {TIME_BOUND:?}"
    );
    assert!(
        disagreements.is_empty(),
        "{} disagreements, first ones:\n{}",
        disagreements.len(),
        disagreements
            .iter()
            .take(30)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
