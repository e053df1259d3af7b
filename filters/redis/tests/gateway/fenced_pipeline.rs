//! Pipelined fenced writes under one token run upstream as one call of the batch fence function
//! (`fence_batch.lua`), against a real redis-server: each write still gets exactly the reply it
//! gets alone (compared byte for byte with the same writes sent one at a time, RESP2 and RESP3),
//! a stale token refuses every write of the batch with one audit record each and changes nothing,
//! and the batch library lives beside the single-write one.

use fencegate_testkit::redis_server;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate_core::MemoryAuditSink;
use fencegate_redis::frame::{self, Frame, Limits};
use fencegate_redis::rewrite::function_source;
use redis_server::RedisServer;

const END: &[u8] = b"$6\r\nfg-end\r\n";

struct Setup {
    behind: RedisServer,
    gateway: SocketAddr,
    sink: Arc<MemoryAuditSink>,
}

async fn setup() -> Setup {
    let behind = RedisServer::start();
    let (addr, sink) = super::harness::serve_every_key(behind.addr).await;
    Setup {
        behind,
        gateway: addr,
        sink,
    }
}

fn wire(commands: &[String]) -> Vec<u8> {
    let mut out = bytes::BytesMut::new();
    for c in commands {
        Frame::command(c.split(' ').map(|a| Bytes::copy_from_slice(a.as_bytes()))).encode(&mut out);
    }
    out.to_vec()
}

fn strings(commands: &[&str]) -> Vec<String> {
    commands.iter().map(|c| c.to_string()).collect()
}

/// Sends `commands` in one write; reads until the stream ends with `until`.
fn exchange(s: &mut TcpStream, commands: &[String], until: &[u8]) -> Vec<u8> {
    exchange_raw(s, &wire(commands), until)
}

/// The replies in `bytes`, each as its own wire bytes.
fn replies(bytes: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let (_, len) = frame::parse(&bytes[at..], &Limits::default())
            .unwrap()
            .unwrap();
        out.push(String::from_utf8_lossy(&bytes[at..at + len]).into_owned());
        at += len;
    }
    out
}

/// Sends one command at a time, each after the previous reply: every fenced write its own call.
fn one_at_a_time(s: &mut TcpStream, commands: &[String]) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = Vec::new();
    for c in commands {
        s.write_all(&wire(std::slice::from_ref(c))).unwrap();
        let mut reply = Vec::new();
        let mut buf = [0u8; 8192];
        while frame::parse(&reply, &Limits::default()).unwrap().is_none() {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "closed after {c}");
            reply.extend_from_slice(&buf[..n]);
        }
        out.extend_from_slice(&reply);
    }
    out
}

fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).unwrap()
}

fn fence(c: &mut TcpStream, token: &str) {
    assert_eq!(
        exchange(c, &[format!("FENCE {token}")], b"\r\n"),
        b"+OK\r\n"
    );
}

/// Calls of `FCALL` the upstream served so far (`INFO commandstats`).
fn fcalls(direct: &mut TcpStream) -> u64 {
    let out = exchange(direct, &strings(&["INFO commandstats", "ECHO fg-end"]), END);
    let text = String::from_utf8_lossy(&out);
    text.lines()
        .find_map(|l| l.strip_prefix("cmdstat_fcall:calls="))
        .map(|rest| rest.split(',').next().unwrap().parse().unwrap())
        .unwrap_or(0)
}

fn sets(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("SET {prefix}{i} v{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_pipelined_fenced_sets_apply_in_one_call_and_each_is_ok() {
    let s = setup().await;
    let (addr, behind) = (s.gateway, s.behind.addr);
    tokio::task::spawn_blocking(move || {
        let mut direct = connect(behind);
        let before = fcalls(&mut direct);
        let mut c = connect(addr);
        fence(&mut c, "fg1~5~job");
        let mut pipeline = sets("k", 16);
        pipeline.push("ECHO fg-end".into());
        let out = exchange(&mut c, &pipeline, END);
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("{}$6\r\nfg-end\r\n", "+OK\r\n".repeat(16))
        );
        assert_eq!(fcalls(&mut direct) - before, 1, "one batch call for the 16");
        let mut gets: Vec<String> = (0..16).map(|i| format!("GET k{i}")).collect();
        gets.push("GET fencegate:fence:{job}".into());
        gets.push("ECHO fg-end".into());
        let got = replies(&exchange(&mut direct, &gets, END));
        for (i, reply) in got.iter().take(16).enumerate() {
            let value = format!("v{i}");
            assert_eq!(*reply, format!("${}\r\n{value}\r\n", value.len()));
        }
        assert_eq!(got[16], "$1\r\n5\r\n", "the fence raised to the token");
        // 200 in one write: within the cap of 64 writes per call.
        let before = fcalls(&mut direct);
        let mut pipeline = sets("m", 200);
        pipeline.push("ECHO fg-end".into());
        let out = exchange(&mut c, &pipeline, END);
        assert_eq!(replies(&out).len(), 201);
        assert!(String::from_utf8_lossy(&out).starts_with(&"+OK\r\n".repeat(200)));
        assert_eq!(fcalls(&mut direct) - before, 4, "64 + 64 + 64 + 8");
    })
    .await
    .unwrap();
    assert!(s.sink.events().is_empty(), "{:?}", s.sink.events());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_token_refuses_the_whole_pipeline_with_one_audit_record_per_write() {
    let s = setup().await;
    let (addr, behind) = (s.gateway, s.behind.addr);
    tokio::task::spawn_blocking(move || {
        // The new holder raises the fence to 9 and writes k0.
        let mut holder = connect(addr);
        fence(&mut holder, "fg1~9~job");
        assert_eq!(
            exchange(&mut holder, &strings(&["SET k0 new"]), b"\r\n"),
            b"+OK\r\n"
        );
        let mut zombie = connect(addr);
        fence(&mut zombie, "fg1~5~job");
        let mut pipeline = sets("k", 16);
        pipeline.push("ECHO fg-end".into());
        let out = exchange(&mut zombie, &pipeline, END);
        let got = replies(&out);
        assert_eq!(got.len(), 17);
        for reply in &got[..16] {
            assert_eq!(reply, "-FENCED job token 5 is below fence 9\r\n");
        }
        let mut direct = connect(behind);
        let out = exchange(
            &mut direct,
            &strings(&[
                "GET k0",
                "EXISTS k1 k2 k3 k4 k5 k6 k7 k8 k9 k10 k11 k12 k13 k14 k15",
            ]),
            b":0\r\n",
        );
        assert_eq!(
            out, b"$3\r\nnew\r\n:0\r\n",
            "nothing of the stale batch applied"
        );
    })
    .await
    .unwrap();
    let events = s.sink.events();
    assert_eq!(events.len(), 16, "{events:?}");
    let mut ids: Vec<&str> = events.iter().map(|e| e.request_id.as_str()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 16, "one record per write: {events:?}");
    for e in &events {
        assert_eq!(
            (e.reason.as_str(), e.fence, e.revision),
            ("stale", Some(9), Some(5))
        );
        assert_eq!(e.operation.command, "SET");
    }
    let objects: Vec<String> = events
        .iter()
        .map(|e| e.operation.objects.join(","))
        .collect();
    assert_eq!(
        objects,
        (0..16).map(|i| format!("k{i}")).collect::<Vec<_>>()
    );
}

/// Fenced writes with every kind of reply: errors in the middle, nulls, RESP3 doubles, sets,
/// booleans, nested arrays; reads and a transaction in between close a batch.
const MIX: &[&str] = &[
    "SET a 1",
    "SET a 2 NX",
    "SET a 3 GET",
    "LPUSH l x y",
    "INCR l",
    "INCR n",
    "INCRBYFLOAT f 1.5",
    "GETDEL missing",
    "LPOP missing",
    "LMPOP 1 missing LEFT",
    "SADD s m",
    "SPOP s 3",
    "ZADD z 1.5 m",
    "ZINCRBY z 1 m",
    "ZADD z INCR 2 m",
    "ZPOPMIN z",
    "HSET h f v",
    "HINCRBYFLOAT h g 2.5",
    "XADD st 1-1 f v",
    "XADD st 1-1 f v",
    "BITFIELD bf INCRBY u8 0 1",
    "PFADD hll a",
    "SETNX a 9",
    "COPY a a2",
    "GET a",
    "SET b 1",
    "APPEND b 2",
    "MULTI",
    "SET c 1",
    "EXEC",
    "SET d 1",
    "DEL a b c d",
    "SET a x GET",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_replies_equal_one_write_at_a_time_byte_for_byte() {
    let s = setup().await;
    let (addr, behind) = (s.gateway, s.behind.addr);
    tokio::task::spawn_blocking(move || {
        let mix = strings(MIX);
        let mut direct = connect(behind);
        for hello3 in [false, true] {
            let mut streams = Vec::new();
            for batched in [true, false] {
                assert_eq!(
                    exchange(&mut direct, &strings(&["FLUSHALL"]), b"\r\n"),
                    b"+OK\r\n"
                );
                let mut c = connect(addr);
                if hello3 {
                    exchange(&mut c, &strings(&["HELLO 3", "ECHO fg-end"]), END);
                }
                fence(&mut c, "fg1~3~mix");
                let before = fcalls(&mut direct);
                let out = if batched {
                    let mut pipeline = mix.clone();
                    pipeline.push("ECHO fg-end".into());
                    let out = exchange(&mut c, &pipeline, END);
                    out[..out.len() - END.len()].to_vec()
                } else {
                    one_at_a_time(&mut c, &mix)
                };
                let calls = fcalls(&mut direct) - before;
                streams.push((out, calls));
            }
            let label = if hello3 { "RESP3" } else { "RESP2" };
            let (batched, one) = (&streams[0], &streams[1]);
            assert_eq!(
                replies(&batched.0),
                replies(&one.0),
                "{label}: batched (left) and one at a time (right) differ"
            );
            assert_eq!(replies(&one.0).len(), MIX.len());
            assert!(
                batched.1 < one.1,
                "{label}: {} calls batched, {} one at a time",
                batched.1,
                one.1
            );
            let text = String::from_utf8_lossy(&batched.0);
            assert!(text.contains("-WRONGTYPE"), "{label}: {text}");
            if hello3 {
                assert!(text.contains(",2.5\r\n") && text.contains("~1\r\n"), "{text}");
                assert!(text.contains("\r\n_\r\n"), "{text}");
            }
            println!(
                "{label}: {} replies, {} bytes identical batched ({} fence calls) and one at a time ({} calls)",
                MIX.len(),
                batched.0.len(),
                batched.1,
                one.1
            );
        }
    })
    .await
    .unwrap();
    assert!(s.sink.events().is_empty(), "{:?}", s.sink.events());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_library_coexists_with_the_single_one_and_is_reloaded_when_missing() {
    let s = setup().await;
    let (addr, behind) = (s.gateway, s.behind.addr);
    tokio::task::spawn_blocking(move || {
        let mut direct = connect(behind);
        let mut c = connect(addr);
        fence(&mut c, "fg1~5~job");
        let mut pipeline = sets("k", 8);
        pipeline.push("ECHO fg-end".into());
        exchange(&mut c, &pipeline, END);
        let listed = exchange(
            &mut direct,
            &strings(&["FUNCTION LIST", "ECHO fg-end"]),
            END,
        );
        let text = String::from_utf8_lossy(&listed);
        assert!(
            text.contains("fencegate_v1") && text.contains("fencegate_batch_v1"),
            "{text}"
        );
        // A gateway of the previous version (re)loads only its own library: the batch one stays.
        let load = ["FUNCTION", "LOAD", "REPLACE", &function_source()]
            .map(|a| Bytes::copy_from_slice(a.as_bytes()));
        direct.write_all(&Frame::command(load).to_bytes()).unwrap();
        let loaded = exchange(&mut direct, &[], b"\r\n");
        assert_eq!(loaded, b"$12\r\nfencegate_v1\r\n");
        let mut pipeline = sets("k", 8);
        pipeline.push("ECHO fg-end".into());
        let out = exchange(&mut c, &pipeline, END);
        assert!(out.starts_with("+OK\r\n".repeat(8).as_bytes()), "{out:?}");
        // The batch library deleted (by hand): the next batch reloads it and is sent again.
        assert_eq!(
            exchange(
                &mut direct,
                &strings(&["FUNCTION DELETE fencegate_batch_v1"]),
                b"\r\n"
            ),
            b"+OK\r\n"
        );
        // Nothing pipelined behind the batch, so it is resent (with a request behind it, it
        // would be answered TRYAGAIN, as a single fenced write is).
        c.write_all(&wire(&sets("r", 8))).unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 8192];
        while out.len() < 8 * 5 {
            let n = c.read(&mut buf).unwrap();
            assert!(n > 0);
            out.extend_from_slice(&buf[..n]);
        }
        assert_eq!(String::from_utf8_lossy(&out), "+OK\r\n".repeat(8));
        let out = exchange(
            &mut direct,
            &strings(&["EXISTS r0 r1 r2 r3 r4 r5 r6 r7"]),
            b"\r\n",
        );
        assert_eq!(out, b":8\r\n");
    })
    .await
    .unwrap();
    assert!(s.sink.events().is_empty(), "{:?}", s.sink.events());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_in_the_middle_of_a_batch_answers_that_write_only() {
    let s = setup().await;
    let (addr, behind) = (s.gateway, s.behind.addr);
    tokio::task::spawn_blocking(move || {
        let mut c = connect(addr);
        fence(&mut c, "fg1~2~job");
        let out = exchange(&mut c, &strings(&["LPUSH l x", "ECHO fg-end"]), END);
        assert_eq!(out, b":1\r\n$6\r\nfg-end\r\n");
        let mut direct = connect(behind);
        let before = fcalls(&mut direct);
        let out = exchange(
            &mut c,
            &strings(&["SET a 1", "INCR l", "SET b 2", "ECHO fg-end"]),
            END,
        );
        assert_eq!(
            replies(&out),
            [
                "+OK\r\n",
                "-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
                "+OK\r\n",
                "$6\r\nfg-end\r\n"
            ]
        );
        assert_eq!(fcalls(&mut direct) - before, 1, "one batch call");
        let out = exchange(&mut direct, &strings(&["MGET a b"]), b"\r\n2\r\n");
        assert_eq!(out, b"*2\r\n$1\r\n1\r\n$1\r\n2\r\n");
    })
    .await
    .unwrap();
}

/// One RESP command from exact arguments (spaces allowed, unlike `wire`).
fn command(args: &[&str]) -> Vec<u8> {
    let mut out = bytes::BytesMut::new();
    Frame::command(args.iter().map(|a| Bytes::copy_from_slice(a.as_bytes()))).encode(&mut out);
    out.to_vec()
}

/// Sends raw bytes in one write; reads until the stream ends with `until`.
fn exchange_raw(s: &mut TcpStream, bytes: &[u8], until: &[u8]) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(bytes).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    while !out.ends_with(until) {
        let n = s
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("{e}; so far: {:?}", String::from_utf8_lossy(&out)));
        assert!(n > 0, "closed; so far: {:?}", String::from_utf8_lossy(&out));
        out.extend_from_slice(&buf[..n]);
    }
    out
}

/// Review findings on the batch path: writes pipelined behind a `HELLO 3` that fails are not
/// batched under the protocol it would have set (their nulls stay RESP2 nulls, the connection
/// lives), and an authenticated connection never batches (a user's per-key ACL must refuse
/// only its own key's write).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_batch_behind_a_pending_hello_or_after_auth() {
    let s = setup().await;
    let (addr, behind) = (s.gateway, s.behind.addr);
    tokio::task::spawn_blocking(move || {
        let mut direct = connect(behind);
        let mut c = connect(addr);
        fence(&mut c, "fg1~5~job");
        let before = fcalls(&mut direct);
        let mut bytes = command(&["HELLO", "3", "SETNAME", "no spaces allowed"]);
        bytes.extend(command(&["SET", "h1", "v", "GET"]));
        bytes.extend(command(&["SET", "h2", "v", "GET"]));
        bytes.extend(command(&["ECHO", "fg-end"]));
        let got = replies(&exchange_raw(&mut c, &bytes, END));
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(got[0].starts_with("-ERR"), "HELLO fails: {got:?}");
        assert_eq!(&got[1..3], ["$-1\r\n", "$-1\r\n"], "RESP2 nulls");
        assert_eq!(fcalls(&mut direct) - before, 2, "one call each");
        // Still RESP2 and still batching afterwards (the HELLO's reply has settled it).
        let before = fcalls(&mut direct);
        let mut pipeline = sets("h", 16);
        pipeline.push("ECHO fg-end".into());
        let out = exchange(&mut c, &pipeline, END);
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("{}$6\r\nfg-end\r\n", "+OK\r\n".repeat(16))
        );
        assert_eq!(fcalls(&mut direct) - before, 1, "batched again");

        let mut authed = connect(addr);
        assert_eq!(
            exchange(&mut authed, &strings(&["AUTH default any"]), b"\r\n"),
            b"+OK\r\n"
        );
        fence(&mut authed, "fg1~5~job");
        let before = fcalls(&mut direct);
        let out = exchange(&mut authed, &pipeline, END);
        assert_eq!(replies(&out).len(), 17);
        assert_eq!(fcalls(&mut direct) - before, 16, "no batch after AUTH");
    })
    .await
    .unwrap();
    assert!(s.sink.events().is_empty(), "{:?}", s.sink.events());
}

/// `MULTI` with an argument is refused by Redis, which stays outside a transaction: the gateway
/// must not enter one, or a stale write's `-FENCED` would be relayed as a queued reply and go
/// unaudited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_multi_leaves_no_transaction_behind() {
    let s = setup().await;
    let (addr, behind) = (s.gateway, s.behind.addr);
    tokio::task::spawn_blocking(move || {
        let mut holder = connect(addr);
        fence(&mut holder, "fg1~9~job");
        assert_eq!(
            exchange(&mut holder, &strings(&["SET k new"]), b"\r\n"),
            b"+OK\r\n"
        );
        let mut zombie = connect(addr);
        fence(&mut zombie, "fg1~5~job");
        let got = replies(&exchange(
            &mut zombie,
            &strings(&["MULTI x", "SET k old", "ECHO fg-end"]),
            END,
        ));
        assert_eq!(
            got,
            [
                "-ERR wrong number of arguments for 'multi' command\r\n",
                "-FENCED job token 5 is below fence 9\r\n",
                "$6\r\nfg-end\r\n"
            ]
        );
        let mut direct = connect(behind);
        assert_eq!(
            exchange(&mut direct, &strings(&["GET k"]), b"new\r\n"),
            b"$3\r\nnew\r\n"
        );
    })
    .await
    .unwrap();
    let events = s.sink.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].reason, "stale");
}

/// In RESP3 pub/sub messages are push frames; an ordinary array reply that happens to start
/// with "message" is a reply, not a message, or every later reply shifts one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resp3_subscriber_reading_a_message_shaped_array_keeps_its_replies_in_order() {
    let s = setup().await;
    let (addr, behind) = (s.gateway, s.behind.addr);
    tokio::task::spawn_blocking(move || {
        let mut direct = connect(behind);
        assert_eq!(
            exchange(&mut direct, &strings(&["RPUSH l message x"]), b"\r\n"),
            b":2\r\n"
        );
        let mut holder = connect(addr);
        fence(&mut holder, "fg1~9~job");
        assert_eq!(
            exchange(&mut holder, &strings(&["SET k new"]), b"\r\n"),
            b"+OK\r\n"
        );
        let mut c = connect(addr);
        exchange(&mut c, &strings(&["HELLO 3", "ECHO fg-end"]), END);
        let confirmed = exchange(&mut c, &strings(&["SUBSCRIBE ch"]), b":1\r\n");
        assert!(confirmed.starts_with(b">3\r\n"), "{confirmed:?}");
        fence(&mut c, "fg1~5~job");
        let got = replies(&exchange(
            &mut c,
            &strings(&["LRANGE l 0 -1", "SET k old", "PING", "ECHO fg-end"]),
            END,
        ));
        assert_eq!(
            got,
            [
                "*2\r\n$7\r\nmessage\r\n$1\r\nx\r\n",
                "-FENCED job token 5 is below fence 9\r\n",
                "+PONG\r\n",
                "$6\r\nfg-end\r\n"
            ]
        );
    })
    .await
    .unwrap();
    let events = s.sink.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].reason, "stale");
}
