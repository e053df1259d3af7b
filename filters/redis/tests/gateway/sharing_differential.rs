//! The sharing rule ([`fencegate_redis::sharing`]) held to a real redis-server: every command
//! and subcommand the rule lets run on a shared upstream connection, as the server's own
//! `COMMAND` table lists it, is sent straight to Redis with argument lists generated from its
//! arity (all keys, all numbers, mixed, longer, with trailing keywords), against an empty
//! database and against keys of the command's type. After each, on the same connection:
//! exactly one reply came before a `PING` marker sent in the same write, and `CLIENT INFO`
//! shows the state a fresh connection has (db, transaction, subscriptions, flags, user,
//! protocol, redirection, name). A command that fails this would let one client change what
//! the others sharing its connection get.

use fencegate_testkit::redis_server;

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use fencegate_redis::command_table::{CommandInfo, CommandTable};
use fencegate_redis::frame::{parse, Frame, Limits};
use redis_server::RedisServer;

/// A bound on the whole run (it takes seconds; the bound only stops a hang).
const TIME_BOUND: Duration = Duration::from_secs(240);

/// How long one reply may take before the case counts as blocked.
const REPLY_WAIT: Duration = Duration::from_secs(2);

/// The `CLIENT INFO` fields that make up a connection's state. Fields this server does not
/// report (Redis 7.0 has no `watch`, `lib-name`, `lib-ver`) must be absent after every case
/// too; `watch` is then covered by the `d` flag (see [`Case::run`]).
const STATE_FIELDS: &[&str] = &[
    "db", "multi", "watch", "sub", "psub", "ssub", "flags", "user", "resp", "redir", "name",
    "lib-name", "lib-ver",
];

/// Commands this test will not run, with why. None of them may be shareable: if the rule ever
/// lets one share, the test fails so that somebody reviews it (and finds a way to test it).
const NEVER_RUN: &[(&str, &str)] = &[
    ("shutdown", "stops the test server"),
    ("debug", "can crash, sleep or reload the whole server"),
    ("failover", "changes the server's replication role"),
    ("replicaof", "makes the test server a replica"),
    ("slaveof", "makes the test server a replica"),
    ("sync", "turns the connection into a replication stream"),
    ("psync", "turns the connection into a replication stream"),
    (
        "monitor",
        "turns the connection into a feed of every command",
    ),
    ("client|pause", "stops every client"),
    ("client|kill", "ends other connections"),
    (
        "config|set",
        "changes the server's settings (requirepass, dir, ...)",
    ),
    (
        "acl|setuser",
        "changes users, other connections' permissions",
    ),
    ("acl|deluser", "ends other connections"),
    ("acl|load", "replaces every user"),
    ("module|load", "loads code into the server"),
    ("save", "writes the dataset to disk, blocking the server"),
    ("bgrewriteaof", "rewrites the append-only file"),
    ("script|kill", "ends another connection's script"),
    ("function|kill", "ends another connection's function"),
];

/// Requests the rule must keep off shared connections whatever the server's table says
/// (mixed case on purpose: lookups must not depend on it).
const MUST_NOT_SHARE: &[&[&str]] = &[
    &["SELECT", "1"],
    &["AUTH", "pw"],
    &["AUTH", "user", "pw"],
    &["HELLO", "3"],
    &["HELLO"],
    &["CLIENT", "SETNAME", "x"],
    &["client", "setname", "x"],
    &["CLIENT", "REPLY", "OFF"],
    &["CLIENT", "REPLY", "SKIP"],
    &["CLIENT", "TRACKING", "ON"],
    &["CLIENT", "CACHING", "YES"],
    &["CLIENT", "NO-EVICT", "ON"],
    &["CLIENT", "SETINFO", "lib-name", "x"],
    &["CLIENT", "KILL", "TYPE", "normal"],
    &["CLIENT", "PAUSE", "1000"],
    &["CLIENT", "UNBLOCK", "1"],
    &["CLIENT", "ID"],
    &["CLIENT"],
    &["MULTI"],
    &["multi"],
    &["EXEC"],
    &["DISCARD"],
    &["WATCH", "k"],
    &["UNWATCH"],
    &["SUBSCRIBE", "c"],
    &["PSUBSCRIBE", "c*"],
    &["SSUBSCRIBE", "c"],
    &["UNSUBSCRIBE"],
    &["PUBLISH", "c", "m"],
    &["QUIT"],
    &["RESET"],
    &["READONLY"],
    &["READWRITE"],
    &["ASKING"],
    &["BLPOP", "k", "0"],
    &["BRPOP", "k", "0"],
    &["BLMOVE", "a", "b", "LEFT", "LEFT", "0"],
    &["BZPOPMIN", "k", "0"],
    &["BLMPOP", "0", "1", "k", "LEFT"],
    &["XREAD", "STREAMS", "k", "0"],
    &["XREAD", "BLOCK", "0", "STREAMS", "k", "$"],
    &["XREADGROUP", "GROUP", "g", "c", "STREAMS", "k", ">"],
    &["WAIT", "1", "0"],
    &["EVAL", "return 1", "0"],
    &["EVALSHA", "0000000000000000000000000000000000000000", "0"],
    &["EVAL_RO", "return 1", "0"],
    &["FCALL", "f", "0"],
    &["FCALL_RO", "f", "0"],
    &["FUNCTION", "LOAD", "x"],
    &["SCRIPT", "LOAD", "return 1"],
    &["MONITOR"],
    &["SYNC"],
    &["PSYNC", "?", "-1"],
    &["SHUTDOWN"],
    &["DEBUG", "SLEEP", "1"],
    &["CONFIG", "SET", "timeout", "1"],
];

/// Entries of [`MUST_NOT_SHARE`] that an older server may not know (the gateway then pins a
/// session that sends one, as for every command missing from the table).
const NEWER_THAN_7_0: &[&str] = &["client|setinfo"];

/// Per-command leading arguments, with why (the generated ones follow).
const FIXED_LEADING: &[(&str, &[&str], &str)] = &[(
    "migrate",
    &["127.0.0.1", "1"],
    "a generated host would be resolved by DNS inside Redis's event loop; port 1 on loopback refuses at once",
)];

/// Keywords appended to variadic commands, one group or two.
const TRAILING: &[&[&str]] = &[
    &["COUNT", "1"],
    &["STORE", "k2"],
    &["WITHSCORES"],
    &["LIMIT", "0", "1"],
    &["GET", "#"],
    &["BY", "nosort"],
    &["REPLACE"],
    &["DB", "1"],
    &["KEYS", "k"],
    &["EX", "1"],
    &["NX"],
    &["MATCH", "*"],
    &["TYPE", "string"],
    &["STREAMS", "k", "0"],
    &["ASC"],
    &["IDLE", "0"],
    &["FROMMEMBER", "k", "BYRADIUS", "1", "m"],
];

struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(REPLY_WAIT)).unwrap();
        stream.set_nodelay(true).unwrap();
        Self {
            stream,
            buf: BytesMut::new(),
        }
    }

    fn send(&mut self, requests: &[Vec<Bytes>]) {
        let mut out = BytesMut::new();
        for args in requests {
            Frame::command(args.iter().cloned()).encode(&mut out);
        }
        self.stream.write_all(&out).unwrap();
    }

    /// The next reply, or why none came.
    fn reply(&mut self) -> Result<Frame, String> {
        loop {
            match parse(&self.buf, &Limits::UPSTREAM) {
                Ok(Some((frame, len))) => {
                    self.buf.advance(len);
                    return Ok(frame);
                }
                Ok(None) => {}
                Err(e) => return Err(format!("unreadable reply: {e}")),
            }
            let mut chunk = [0u8; 65536];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err("Redis closed the connection".into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(format!("no reply within {REPLY_WAIT:?}"))
                }
                Err(e) => return Err(format!("reading: {e}")),
            }
        }
    }

    fn request(&mut self, args: &[&str]) -> Result<Frame, String> {
        self.send(&[words(args)]);
        self.reply()
    }

    /// `CLIENT INFO` as field -> value.
    fn client_info(&mut self) -> Result<BTreeMap<String, String>, String> {
        match self.request(&["CLIENT", "INFO"])? {
            Frame::Bulk(line) | Frame::Simple(line) => Ok(String::from_utf8_lossy(&line)
                .trim()
                .split(' ')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()),
            other => Err(format!("CLIENT INFO answered {}", shown(&other))),
        }
    }
}

fn words(args: &[&str]) -> Vec<Bytes> {
    args.iter()
        .map(|a| Bytes::copy_from_slice(a.as_bytes()))
        .collect()
}

fn shown(frame: &Frame) -> String {
    let text = String::from_utf8_lossy(&frame.to_bytes()).replace("\r\n", " ");
    if text.len() > 120 {
        format!("{}...", &text[..120])
    } else {
        text
    }
}

/// The connection state fields of `info` (absent ones as `None`).
fn state(info: &BTreeMap<String, String>) -> BTreeMap<&'static str, Option<String>> {
    STATE_FIELDS
        .iter()
        .map(|f| (*f, info.get(*f).cloned()))
        .collect()
}

/// What the database holds when a case runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Data {
    /// Nothing.
    Empty,
    /// `k`, `k1`, `k2`, `1`, `0` of the type the command's ACL categories name.
    Typed,
    /// The same keys as strings (wrong type for most commands).
    Strings,
}

/// The requests that create `key` with the type a command's ACL categories name.
fn fixture(categories: &[String], key: &str) -> Vec<Vec<Bytes>> {
    let has = |c: &str| categories.iter().any(|x| x == c);
    let requests: Vec<Vec<&str>> = if has("@list") {
        vec![vec!["RPUSH", key, "1", "k", "2", "k"]]
    } else if has("@hash") {
        vec![vec!["HSET", key, "1", "1", "k", "k"]]
    } else if has("@set") {
        vec![vec!["SADD", key, "1", "k", "2"]]
    } else if has("@sortedset") {
        vec![vec!["ZADD", key, "1", "k", "2", "1", "3", "m"]]
    } else if has("@geo") {
        vec![vec!["GEOADD", key, "1", "1", "k", "1.001", "1.001", "1"]]
    } else if has("@hyperloglog") {
        vec![vec!["PFADD", key, "1", "k"]]
    } else if has("@stream") {
        vec![
            vec!["XADD", key, "1-1", "f", "v"],
            vec!["XADD", key, "1-2", "f", "v"],
            vec!["XGROUP", "CREATE", key, "k", "0"],
            vec!["XGROUP", "CREATE", key, "1", "0"],
            vec![
                "XREADGROUP",
                "GROUP",
                "k",
                "k",
                "COUNT",
                "1",
                "STREAMS",
                key,
                ">",
            ],
        ]
    } else {
        vec![vec!["SET", key, "1"]]
    };
    requests.iter().map(|r| words(r)).collect()
}

/// The argument lists generated for one command (its name words first).
fn shapes(info: &CommandInfo) -> Vec<Vec<String>> {
    let mut prefix: Vec<String> = info
        .name
        .split('|')
        .map(|p| p.to_ascii_uppercase())
        .collect();
    if let Some((_, leading, _)) = FIXED_LEADING.iter().find(|(n, _, _)| *n == info.name) {
        prefix.extend(leading.iter().map(|s| s.to_string()));
    }
    let min = (info.arity.unsigned_abs() as usize).saturating_sub(prefix.len());
    let variadic = info.arity < 0;
    // Keys, numbers, and the words that switch a connection's modes on (`HELLO 3`, `CLIENT
    // REPLY OFF`, `CLIENT TRACKING ON`, ...), so that a connection command let through by
    // mistake shows here and not only in `MUST_NOT_SHARE`.
    let fills: [&dyn Fn(usize) -> &'static str; 11] = [
        &|_| "k",
        &|_| "1",
        &|i| if i % 2 == 0 { "k" } else { "1" },
        &|i| if i % 2 == 0 { "1" } else { "k" },
        &|i| ["k", "0", "-1", "2", "k2"][i % 5],
        &|i| ["k", "k1", "k2", "0", "1"][i % 5],
        &|_| "3",
        &|_| "ON",
        &|_| "OFF",
        &|_| "SKIP",
        &|_| "YES",
    ];
    let lengths: Vec<usize> = if variadic {
        vec![min, min + 1, min + 2, min + 4]
    } else {
        // One argument too many: Redis must answer the arity error once, too.
        vec![min, min + 1]
    };
    let mut out = Vec::new();
    for &n in &lengths {
        for fill in &fills {
            let mut args = prefix.clone();
            args.extend((0..n).map(|i| fill(i).to_owned()));
            out.push(args);
        }
    }
    if variadic {
        for (i, group) in TRAILING.iter().enumerate() {
            for fill in &fills[..3] {
                let mut args = prefix.clone();
                args.extend((0..min).map(|i| fill(i).to_owned()));
                args.extend(group.iter().map(|s| s.to_string()));
                out.push(args.clone());
                // Two groups.
                let next = TRAILING[(i + 3) % TRAILING.len()];
                args.extend(next.iter().map(|s| s.to_string()));
                out.push(args);
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

struct Case<'a> {
    admin: &'a mut Conn,
    tested: &'a mut Conn,
    fresh: &'a BTreeMap<&'static str, Option<String>>,
}

impl Case<'_> {
    /// Runs `args` on the tested connection with `fixtures` in place; `Err`: what went wrong.
    fn run(
        &mut self,
        args: &[String],
        fixtures: &[Vec<Bytes>],
        marker: &str,
    ) -> Result<(), String> {
        let mut setup = vec![words(&["FLUSHALL"])];
        setup.extend(fixtures.iter().cloned());
        self.admin.send(&setup);
        for request in &setup {
            let reply = self.admin.reply().unwrap();
            assert!(
                reply.as_error().is_none(),
                "fixture {request:?} failed: {}",
                shown(&reply)
            );
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.tested.send(&[words(&args), words(&["PING", marker])]);
        let mut before = Vec::new();
        loop {
            let frame = self.tested.reply().map_err(|e| {
                format!(
                    "{e} after {} replies (the marker PING never answered)",
                    before.len()
                )
            })?;
            if frame == Frame::Bulk(Bytes::copy_from_slice(marker.as_bytes())) {
                break;
            }
            before.push(frame);
            if before.len() > 3 {
                return Err(format!(
                    "more than 3 replies before the marker: {}",
                    before.iter().map(shown).collect::<Vec<_>>().join(" | ")
                ));
            }
        }
        if before.len() != 1 {
            return Err(format!(
                "{} replies before the marker: {}",
                before.len(),
                before.iter().map(shown).collect::<Vec<_>>().join(" | ")
            ));
        }
        // FLUSHALL from elsewhere marks a connection that WATCHes an existing key dirty (flag
        // `d`): how a WATCH shows on a server whose CLIENT INFO has no `watch` field.
        let flushed = self.admin.request(&["FLUSHALL"]).unwrap();
        assert_eq!(flushed, Frame::simple("OK"));
        let now = state(&self.tested.client_info()?);
        if &now != self.fresh {
            let diff: Vec<String> = now
                .iter()
                .filter(|(k, v)| self.fresh.get(*k) != Some(*v))
                .map(|(k, v)| format!("{k}: {:?} -> {v:?}", self.fresh[k]))
                .collect();
            return Err(format!(
                "the connection's state changed: {} (reply {})",
                diff.join(", "),
                shown(&before[0])
            ));
        }
        Ok(())
    }
}

fn learn(addr: SocketAddr) -> (CommandTable, BTreeMap<String, Vec<String>>) {
    let mut conn = Conn::open(addr);
    let reply = conn.request(&["COMMAND"]).unwrap();
    let table = CommandTable::from_reply(&reply).unwrap();
    // The ACL categories by name, for the fixtures (the table keeps only what the gateway uses).
    let mut categories = BTreeMap::new();
    fn walk(entry: &Frame, out: &mut BTreeMap<String, Vec<String>>) {
        let Frame::Array(fields) = entry else { return };
        let text = |f: &Frame| match f {
            Frame::Bulk(b) | Frame::Simple(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        };
        let Some(name) = fields.first().and_then(text) else {
            return;
        };
        let cats = match fields.get(6) {
            Some(Frame::Array(items)) => items.iter().filter_map(text).collect(),
            _ => Vec::new(),
        };
        out.insert(name.to_ascii_lowercase(), cats);
        if let Some(Frame::Array(subs)) = fields.get(9) {
            for sub in subs {
                walk(sub, out);
            }
        }
    }
    if let Frame::Array(entries) = &reply {
        for entry in entries {
            walk(entry, &mut categories);
        }
    }
    (table, categories)
}

#[test]
fn sharing_rule_keeps_connection_changing_commands_unshared() {
    let server = RedisServer::start();
    let (table, _) = learn(server.addr);
    let mut wrong = Vec::new();
    for args in MUST_NOT_SHARE {
        let args = words(args);
        match table.lookup(&args) {
            Some(info) if info.shareable => wrong.push(format!("{args:?} shares ({})", info.name)),
            Some(_) => {}
            None => {
                let name = String::from_utf8_lossy(&args[0]).to_ascii_lowercase();
                let full = args.get(1).map_or(name.clone(), |sub| {
                    format!(
                        "{name}|{}",
                        String::from_utf8_lossy(sub).to_ascii_lowercase()
                    )
                });
                if !NEWER_THAN_7_0.contains(&full.as_str()) {
                    wrong.push(format!("{args:?} is not in the server's table"));
                }
            }
        }
    }
    for (name, why) in NEVER_RUN {
        let args: Vec<Bytes> = name
            .split('|')
            .map(|p| Bytes::copy_from_slice(p.as_bytes()))
            .collect();
        if table.lookup(&args).is_some_and(|info| info.shareable) {
            wrong.push(format!(
                "{name} is now shareable but this test never runs it ({why}): review it"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn every_shareable_command_leaves_the_connection_as_it_was() {
    let server = RedisServer::start();
    let (table, categories) = learn(server.addr);
    let mut shareable: Vec<&CommandInfo> = table.commands().filter(|c| c.shareable).collect();
    shareable.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(
        shareable.len() > 100,
        "only {} shareable commands: was the table learned?",
        shareable.len()
    );
    let never: Vec<&str> = shareable
        .iter()
        .filter(|c| NEVER_RUN.iter().any(|(n, _)| *n == c.name))
        .map(|c| c.name.as_str())
        .collect();
    assert!(
        never.is_empty(),
        "shareable but never run by this test (review them): {never:?}"
    );

    let mut admin = Conn::open(server.addr);
    let mut tested = Conn::open(server.addr);
    let fresh = state(&tested.client_info().unwrap());
    // What a fresh connection must look like, so a server that starts connections otherwise
    // is noticed (and so the comparison below means "unchanged from plain").
    assert_eq!(fresh["db"].as_deref(), Some("0"), "{fresh:?}");
    assert_eq!(fresh["multi"].as_deref(), Some("-1"), "{fresh:?}");
    assert_eq!(fresh["flags"].as_deref(), Some("N"), "{fresh:?}");
    assert_eq!(fresh["resp"].as_deref(), Some("2"), "{fresh:?}");
    let unreported: Vec<&str> = fresh
        .iter()
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| *k)
        .collect();

    let started = Instant::now();
    let (mut cases, mut commands_run) = (0usize, 0usize);
    let mut failures = Vec::new();
    let mut failing: Vec<String> = Vec::new();
    for info in &shareable {
        assert!(
            started.elapsed() < TIME_BOUND,
            "ran out of time at {} after {cases} cases",
            info.name
        );
        let cats = categories.get(&info.name).cloned().unwrap_or_default();
        let typed: Vec<Vec<Bytes>> = ["k", "k1", "k2", "1", "0"]
            .iter()
            .flat_map(|k| fixture(&cats, k))
            .collect();
        let strings: Vec<Vec<Bytes>> = ["k", "k1", "k2", "1", "0"]
            .iter()
            .map(|k| words(&["SET", k, "1"]))
            .collect();
        let mut ran = 0;
        for args in shapes(info) {
            for data in [Data::Empty, Data::Typed, Data::Strings] {
                let fixtures: &[Vec<Bytes>] = match data {
                    Data::Empty => &[],
                    Data::Typed => &typed,
                    Data::Strings if typed == strings => continue,
                    Data::Strings => &strings,
                };
                cases += 1;
                ran += 1;
                let marker = format!("fg-marker-{cases}");
                let mut case = Case {
                    admin: &mut admin,
                    tested: &mut tested,
                    fresh: &fresh,
                };
                if let Err(e) = case.run(&args, fixtures, &marker) {
                    failures.push(format!("{} ({data:?}): {e}", args.join(" ")));
                    if failing.last() != Some(&info.name) {
                        failing.push(info.name.clone());
                    }
                    // Later cases start from a fresh connection again.
                    tested = Conn::open(server.addr);
                }
            }
        }
        assert!(ran > 0, "no case ran for {}", info.name);
        commands_run += 1;
    }
    println!(
        "{commands_run} shareable commands of {} in the table, {cases} cases in {:.1?}, {} failures; fields this server does not report: {unreported:?}",
        table.len(),
        started.elapsed(),
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} cases of {} commands left the connection otherwise than it was: {failing:?}; first ones:\n{}",
        failures.len(),
        failing.len(),
        failures
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
