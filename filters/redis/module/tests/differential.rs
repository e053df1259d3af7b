//! The module against the fence functions, on one real redis-server with both loaded: the same
//! calls (refusals included) in RESP2 and RESP3 give byte-identical replies, leave identical
//! data and fences, and declare the same keys (`COMMAND GETKEYS`, Redis's own reading). What
//! the module adds (refusing non-canonical tokens and NUL in a command's name) is tested apart,
//! as are replication and the append-only file, which must not need the module to replay.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use bytes::Bytes;
use fencegate_redis::fence_batch::{split, Split};
use fencegate_redis::frame::{self, Limits};
use fencegate_redis::rewrite::{
    batch_function_source, function_source, BATCH_FUNCTION_NAME, FUNCTION_NAME,
};
use fencegate_testkit::redis_server::RedisServer;

/// A raw connection: requests encoded here, each reply kept as the bytes Redis wrote.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    fn open(server: &RedisServer, resp3: bool) -> Self {
        let stream = TcpStream::connect(server.addr).expect("connect to redis-server");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut conn = Self {
            stream,
            buf: Vec::new(),
        };
        if resp3 {
            let hello = conn.call(&[b"HELLO", b"3"]);
            assert!(hello.starts_with(b"%"), "HELLO 3: {:?}", text(&hello));
        }
        conn
    }

    fn call(&mut self, args: &[&[u8]]) -> Vec<u8> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        self.stream.write_all(&out).expect("send");
        loop {
            if let Some((_, used)) = frame::parse(&self.buf, &Limits::UPSTREAM).expect("RESP") {
                let reply = self.buf[..used].to_vec();
                self.buf.drain(..used);
                return reply;
            }
            let mut chunk = [0u8; 65536];
            let n = self.stream.read(&mut chunk).expect("read a reply");
            assert!(n > 0, "redis-server closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    fn words(&mut self, words: &[&str]) -> Vec<u8> {
        let args: Vec<&[u8]> = words.iter().map(|w| w.as_bytes()).collect();
        self.call(&args)
    }
}

fn text(reply: &[u8]) -> String {
    String::from_utf8_lossy(reply).into_owned()
}

fn server_with_both() -> RedisServer {
    let server = RedisServer::start_with_module();
    let mut c = Conn::open(&server, false);
    for source in [function_source(), batch_function_source()] {
        let loaded = c.call(&[b"FUNCTION", b"LOAD", b"REPLACE", source.as_bytes()]);
        assert!(loaded.starts_with(b"$"), "FUNCTION LOAD: {}", text(&loaded));
    }
    server
}

/// Wrapped commands, `K`/`H`/`Z`/`L`/`S` standing for keys of the side's own namespace: strings,
/// hashes, sorted sets (doubles in RESP3), lists, sets, nulls, errors raised while running.
const COMMANDS: &[&str] = &[
    "SET K v",
    "GET K",
    "SET K w GET",
    "INCR K",
    "APPEND K x",
    "HSET H a 1 b 2.5",
    "HGETALL H",
    "HINCRBYFLOAT H b 0.25",
    "ZADD Z 1.5 m 2 n",
    "ZSCORE Z m",
    "ZRANGE Z 0 -1 WITHSCORES",
    "LPUSH L x y",
    "LPOP L",
    "LPOP L 5",
    "LPOP L",
    "SADD S a",
    "SMEMBERS S",
    "HGETALL K",
    "EXPIRE K 1000",
    "GETDEL K",
    "GET K",
    "DEL H Z S",
];

/// The fence call of `command` on side `side` (`L` for Lua, `M` for the module).
fn fence_call(side: &str, token: &str, resp3: bool, commands: &[&str]) -> Vec<String> {
    let fence_key = format!("fencegate:fence:{{{side}}}");
    let resp = if resp3 { "3" } else { "2" };
    let spelled: Vec<Vec<String>> = commands
        .iter()
        .map(|c| {
            c.split(' ')
                .map(|w| match w {
                    "K" | "H" | "Z" | "L" | "S" => format!("{{{side}}}{w}"),
                    w => w.to_owned(),
                })
                .collect()
        })
        .collect();
    let keys: Vec<String> = spelled
        .iter()
        .flat_map(|c| c.iter().filter(|w| w.starts_with('{')).cloned())
        .collect();
    let batch = commands.len() > 1;
    let mut call = match (side, batch) {
        ("L", false) => vec!["FCALL".to_owned(), FUNCTION_NAME.to_owned()],
        ("L", true) => vec!["FCALL".to_owned(), BATCH_FUNCTION_NAME.to_owned()],
        (_, false) => vec!["FENCEGATE.FENCE".to_owned()],
        (_, true) => vec!["FENCEGATE.FENCE_BATCH".to_owned()],
    };
    call.push((keys.len() + 1).to_string());
    call.push(fence_key);
    call.extend(keys);
    call.extend([side.to_owned(), token.to_owned(), resp.to_owned()]);
    if batch {
        call.push(spelled.len().to_string());
        call.extend(spelled.iter().map(|c| c.len().to_string()));
    }
    call.extend(spelled.into_iter().flatten());
    call
}

/// Reply bytes with the side's own names made neutral, for comparison.
fn neutral(reply: &[u8], side: &str) -> String {
    text(reply)
        .replace(&format!("{{{side}}}"), "{X}")
        .replace(&format!("FENCED {side} "), "FENCED X ")
}

/// What the gateway relays of a call's reply: a batch's reply split per write by the gateway's
/// own code (a null flagged in the first element is sent as `false` by Lua, as a null by the
/// module; both are relayed as the null the write alone would have got).
fn as_the_gateway_relays(reply: &[u8], writes: usize, resp3: bool) -> Vec<u8> {
    if writes == 1 {
        return reply.to_vec();
    }
    let (frame, _) = frame::parse(reply, &Limits::UPSTREAM)
        .expect("RESP")
        .expect("a whole reply");
    match split(frame, &Bytes::copy_from_slice(reply), writes, resp3)
        .expect("a batch reply the gateway reads")
    {
        Split::Whole(_) => reply.to_vec(),
        Split::Each(each) => each.into_iter().flat_map(|(_, raw)| raw.to_vec()).collect(),
    }
}

fn dump(c: &mut Conn, side: &str) -> Vec<String> {
    let mut state = Vec::new();
    for key in ["K", "H", "Z", "L", "S"] {
        let key = format!("{{{side}}}{key}");
        state.push(neutral(&c.words(&["DUMP", &key]), side));
        let ttl = c.words(&["TTL", &key]);
        state.push(text(&ttl));
    }
    state.push(text(
        &c.words(&["GET", &format!("fencegate:fence:{{{side}}}")]),
    ));
    state
}

/// Tokens in an order that raises, repeats, and goes back (the refusals).
const TOKENS: &[&str] = &["5", "5", "7", "6", "7", "12", "3", "12", "100"];

#[test]
fn the_module_answers_and_writes_as_the_functions_do() {
    let server = server_with_both();
    for resp3 in [false, true] {
        let mut c = Conn::open(&server, resp3);
        c.words(&["FLUSHALL"]);
        let mut compared = 0;
        for (round, token) in TOKENS.iter().enumerate() {
            // One command at a time, then the same commands as batches of three.
            let singles = COMMANDS.iter().map(std::slice::from_ref);
            let batches = COMMANDS.chunks(3);
            let calls: Vec<&[&str]> = if round % 2 == 0 {
                singles.collect()
            } else {
                batches.collect()
            };
            for commands in calls {
                let mut replies = Vec::new();
                for side in ["L", "M"] {
                    let call = fence_call(side, token, resp3, commands);
                    let words: Vec<&str> = call.iter().map(String::as_str).collect();
                    let reply = c.words(&words);
                    replies.push(neutral(
                        &as_the_gateway_relays(&reply, commands.len(), resp3),
                        side,
                    ));
                }
                assert_eq!(
                    replies[0], replies[1],
                    "resp3={resp3} token {token} {commands:?}: the function (left) and the module (right) answer differently"
                );
                assert_eq!(
                    dump(&mut c, "L"),
                    dump(&mut c, "M"),
                    "resp3={resp3} token {token} {commands:?}: the data differs after the call"
                );
                compared += 1;
            }
        }
        assert!(compared > 50, "only {compared} calls compared");
    }
}

#[test]
fn a_stale_token_is_refused_and_nothing_is_written() {
    let server = RedisServer::start_with_module();
    let mut c = Conn::open(&server, false);
    let set = |token: &str, value: &str| -> Vec<String> {
        [
            "FENCEGATE.FENCE",
            "2",
            "fencegate:fence:{r}",
            "{r}k",
            "r",
            token,
            "2",
            "SET",
            "{r}k",
            value,
        ]
        .map(str::to_owned)
        .to_vec()
    };
    let mut run = |call: Vec<String>| {
        let words: Vec<&str> = call.iter().map(String::as_str).collect();
        text(&c.words(&words))
    };
    assert_eq!(run(set("9", "new")), "+OK\r\n");
    assert_eq!(
        run(set("8", "stale")),
        "-FENCED r token 8 is below fence 9\r\n"
    );
    let mut c = Conn::open(&server, false);
    assert_eq!(text(&c.words(&["GET", "{r}k"])), "$3\r\nnew\r\n");
    assert_eq!(
        text(&c.words(&["GET", "fencegate:fence:{r}"])),
        "$1\r\n9\r\n"
    );
}

#[test]
fn the_declared_keys_are_the_functions_keys() {
    let server = server_with_both();
    let mut c = Conn::open(&server, false);
    for commands in [&["SET K v"][..], &["HSET H a 1", "LPUSH L x", "GET K"][..]] {
        let lua = fence_call("X", "5", false, commands);
        let module = fence_call("X", "5", false, commands);
        let mut getkeys = |call: &[String]| {
            let mut words = vec!["COMMAND", "GETKEYS"];
            words.extend(call.iter().map(String::as_str));
            text(&c.words(&words))
        };
        let from_lua = getkeys(
            &lua.iter()
                .map(|w| w.replace("{L}", "{X}"))
                .collect::<Vec<_>>(),
        );
        let from_module = getkeys(&module);
        assert!(from_lua.starts_with('*'), "{from_lua}");
        assert_eq!(from_lua, from_module, "{commands:?}");
    }
    // A numkeys Redis cannot read declares no keys: refused by both.
    for name in ["FENCEGATE.FENCE", "FENCEGATE.FENCE_BATCH"] {
        let reply = text(&c.words(&[
            "COMMAND", "GETKEYS", name, "x", "f", "r", "5", "2", "SET", "k", "v",
        ]));
        assert!(reply.starts_with('-'), "{name}: {reply}");
    }
}

#[test]
fn what_the_module_refuses_that_the_functions_do_not_check() {
    let server = RedisServer::start_with_module();
    let mut c = Conn::open(&server, false);
    // `FENCEGATE.FENCE 1 fencegate:fence:{r} r <revision> 2 <command> {r}k v`.
    let single = |revision: &str, command: &str| -> Vec<u8> {
        let mut c = Conn::open(&server, false);
        c.words(&[
            "FENCEGATE.FENCE",
            "1",
            "fencegate:fence:{r}",
            "r",
            revision,
            "2",
            command,
            "{r}k",
            "v",
        ])
    };
    for (reply, want) in [
        (
            single("07", "SET"),
            "-ERR the token's revision must be canonical decimal",
        ),
        (
            single("abc", "SET"),
            "-ERR the token's revision must be canonical decimal",
        ),
        (
            single("5", "SET\0X"),
            "-ERR a wrapped command's name contains a NUL byte",
        ),
        (
            c.words(&[
                "FENCEGATE.FENCE_BATCH",
                "1",
                "fencegate:fence:{r}",
                "r",
                "5",
                "2",
                "2",
                "3",
                "3",
                "SET",
                "{r}k",
                "v",
            ]),
            "-ERR the batch's command counts",
        ),
    ] {
        let reply = text(&reply);
        assert!(reply.starts_with(want), "{reply}");
    }
    // None of them wrote or raised anything.
    assert_eq!(text(&c.words(&["DBSIZE"])), ":0\r\n");
    // A fence key of another type refuses the write rather than ignoring the fence.
    c.words(&["LPUSH", "fencegate:fence:{r}", "x"]);
    let reply = text(&single("5", "SET"));
    assert!(reply.starts_with("-WRONGTYPE"), "{reply}");
    assert_eq!(text(&c.words(&["EXISTS", "{r}k"])), ":0\r\n");
}

#[test]
fn replicas_and_the_append_only_file_replay_without_the_module() {
    let mut primary = RedisServer::start_with_module();
    let port = primary.addr.port().to_string();
    // The replica does not load the module: what it is sent must be plain commands.
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let mut c = Conn::open(&primary, false);
    let call = [
        "FENCEGATE.FENCE_BATCH",
        "3",
        "fencegate:fence:{r}",
        "{r}a",
        "{r}b",
        "r",
        "42",
        "2",
        "2",
        "3",
        "3",
        "SET",
        "{r}a",
        "1",
        "SET",
        "{r}b",
        "2",
    ];
    assert!(text(&c.words(&call)).starts_with("*3\r\n"));
    let waited = text(&c.words(&["WAIT", "1", "10000"]));
    assert_eq!(
        waited, ":1\r\n",
        "the replica did not acknowledge the write"
    );
    let mut r = Conn::open(&replica, false);
    for (key, want) in [("{r}a", "1"), ("{r}b", "2"), ("fencegate:fence:{r}", "42")] {
        assert_eq!(
            text(&r.words(&["GET", key])),
            format!("${}\r\n{want}\r\n", want.len()),
            "{key} on the replica"
        );
    }
    // The append-only file holds the same plain commands: a restart brings them back.
    drop(c);
    primary.restart();
    let mut c = Conn::open(&primary, false);
    assert_eq!(
        text(&c.words(&["GET", "fencegate:fence:{r}"])),
        "$2\r\n42\r\n"
    );
    assert_eq!(text(&c.words(&["GET", "{r}b"])), "$1\r\n2\r\n");
}

#[test]
fn the_callers_acl_applies_to_each_wrapped_command() {
    let server = server_with_both();
    let mut admin = Conn::open(&server, false);
    // May run anything on the fence keys and {r}k, nothing else.
    let created = admin.words(&[
        "ACL",
        "SETUSER",
        "app",
        "on",
        "nopass",
        "+@all",
        "~fencegate:fence:*",
        "~{r}k",
    ]);
    assert_eq!(text(&created), "+OK\r\n");
    let mut app = Conn::open(&server, false);
    assert_eq!(text(&app.words(&["AUTH", "app", "x"])), "+OK\r\n");
    // {r}k is declared (the outer command's key check passes); the write names {r}secret.
    // Each refuses in its own words (Lua: "-ERR The user executing the script can't access
    // ..."), and neither writes.
    for (name, refusal) in [
        (
            vec!["FCALL", FUNCTION_NAME],
            "-ERR The user executing the script can't access",
        ),
        (vec!["FENCEGATE.FENCE"], "-NOPERM"),
    ] {
        let mut call = name.clone();
        call.extend([
            "2",
            "fencegate:fence:{r}",
            "{r}k",
            "r",
            "5",
            "2",
            "SET",
            "{r}secret",
            "v",
        ]);
        let reply = text(&app.words(&call));
        assert!(reply.starts_with(refusal), "{name:?}: {reply}");
    }
    assert_eq!(text(&admin.words(&["EXISTS", "{r}secret"])), ":0\r\n");
}
