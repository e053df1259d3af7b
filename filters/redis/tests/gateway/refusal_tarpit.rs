//! A tokenless flood from several connections over a small refusal budget: the flooders are
//! tarpitted, yet every request of theirs is still answered, in order, byte for byte, every
//! refusal is audited once, nothing of theirs is written, and a fenced writer on another
//! connection has every write applied (and is never left in the tarpit). Latency is measured
//! by the ignored `tests/redis_flood.rs`, not asserted here. Gateway in-process against a real
//! `redis-server`.

use fencegate_testkit::redis_server;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_core::{MemoryAuditSink, TokenPolicy};
use fencegate_redis::frame::Frame;
use fencegate_redis::{Gateway, ProtectRule, RedisConfig};
use redis_server::RedisServer;

const FLOODERS: usize = 4;
const ROUNDS: usize = 2;
const PIPELINE: usize = 50;
const FENCED_WRITES: usize = 200;
/// Every third request is a read, which passes: its reply must sit between the refusals.
const COMMANDS: &[&str] = &[
    "SET k v",
    "INCR k",
    "GET k",
    "HSET k f v",
    "APPEND k v",
    "EXISTS k",
];

fn encode(line: &str, key: &str) -> Vec<u8> {
    let mut out = bytes::BytesMut::new();
    Frame::command(line.split(' ').map(|a| {
        bytes::Bytes::from(if a == "k" {
            key.to_owned()
        } else {
            a.to_owned()
        })
    }))
    .encode(&mut out);
    out.to_vec()
}

/// What Redis through the gateway answers `line` on a tokenless connection (keys absent).
fn expected(line: &str) -> Vec<u8> {
    let name = line.split(' ').next().unwrap();
    match name {
        "GET" => b"$-1\r\n".to_vec(),
        "EXISTS" => b":0\r\n".to_vec(),
        _ => format!(
            "-NOFENCE {name} writes a protected key; send FENCE <token> on this connection first\r\n"
        )
        .into_bytes(),
    }
}

fn read_exactly(c: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut got = vec![0u8; n];
    c.read_exact(&mut got)
        .unwrap_or_else(|e| panic!("reading {n} reply bytes: {e}"));
    got
}

/// One flooding connection: `ROUNDS` pipelines of `PIPELINE` requests; returns how many were
/// refused. Panics unless the reply stream is exactly the expected one.
fn flood(addr: SocketAddr, f: usize) -> usize {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut refused = 0;
    for round in 0..ROUNDS {
        let (mut wire, mut want) = (Vec::new(), Vec::new());
        for i in 0..PIPELINE {
            let line = COMMANDS[(f + i) % COMMANDS.len()];
            wire.extend(encode(line, &format!("flood:{f}:{round}:{i}")));
            want.extend(expected(line));
            refused += usize::from(!matches!(&line[..3], "GET" | "EXI"));
        }
        c.write_all(&wire).unwrap();
        let got = read_exactly(&mut c, want.len());
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&want),
            "flooder {f} round {round}: every request answered, in order"
        );
    }
    refused
}

/// Fenced SETs one at a time; each must be `+OK`.
fn fenced_writer(addr: SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(&encode("FENCE fg1~3~ledger", "")).unwrap();
    assert_eq!(read_exactly(&mut c, 5), b"+OK\r\n");
    for i in 0..FENCED_WRITES {
        c.write_all(&encode(&format!("SET k {i}"), &format!("ledger:{i}")))
            .unwrap();
        assert_eq!(read_exactly(&mut c, 5), b"+OK\r\n", "fenced write {i}");
    }
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_over_the_refusal_budget_is_tarpitted_and_still_answered_in_order() {
    let server = RedisServer::start();
    let config = RedisConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: server.addr.to_string(),
        protect: Some(vec![ProtectRule::every_key()]),
        refusals_per_second: 100,
        refusal_burst: 20,
        tarpit_initial_ms: 1,
        tarpit_max_ms: 20,
        ..RedisConfig::default()
    };
    let sink = Arc::new(MemoryAuditSink::default());
    let gateway = Gateway::new(config, TokenPolicy::unsigned(), sink.clone()).unwrap();
    let listener = gateway.bind().await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gateway.clone().serve(listener));

    let (refused, writer) = tokio::task::spawn_blocking(move || {
        let flooders: Vec<_> = (0..FLOODERS)
            .map(|f| std::thread::spawn(move || flood(addr, f)))
            .collect();
        let writer = fenced_writer(addr);
        let refused: usize = flooders.into_iter().map(|f| f.join().unwrap()).sum();
        (refused, writer)
    })
    .await
    .unwrap();

    assert!(
        gateway.tarpit_waits() > 0,
        "the flood went over the budget of 20 + 100/s and was tarpitted"
    );
    // Flood sessions end once their clients are gone; the fenced writer's is still open, and
    // a connection that writes with a valid token is never in the tarpit.
    let deadline = Instant::now() + Duration::from_secs(10);
    while gateway.tarpitted_connections() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} connections still tarpitted with only the fenced writer open",
            gateway.tarpitted_connections()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(writer);

    let events = sink.events();
    let missing = events.iter().filter(|e| e.reason == "missing").count();
    assert_eq!(missing, refused, "every refusal audited exactly once");
    assert_eq!(events.len(), refused, "nothing else was refused");
    assert_eq!(sink.applied_count(), FENCED_WRITES as u64);

    let mut direct = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let flood_keys: Vec<String> = redis::cmd("KEYS")
        .arg("flood:*")
        .query_async(&mut direct)
        .await
        .unwrap();
    assert!(flood_keys.is_empty(), "the flood wrote {flood_keys:?}");
    for i in [0, FENCED_WRITES / 2, FENCED_WRITES - 1] {
        let v: String = redis::cmd("GET")
            .arg(format!("ledger:{i}"))
            .query_async(&mut direct)
            .await
            .unwrap();
        assert_eq!(v, i.to_string());
    }
}
