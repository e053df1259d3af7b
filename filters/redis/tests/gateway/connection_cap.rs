//! The gateway's bound on client connections (`max_client_connections`, DESIGN rule 10): a
//! client over it gets exactly what redis-server answers over its own `maxclients`, whether it
//! writes first or not; the clients within it are still served; a freed slot admits the next.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fencegate_redis::{ProtectRule, RedisConfig};
use fencegate_testkit::redis_server::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A connection that answered `PING`; `None` if it was refused instead.
async fn admitted(addr: SocketAddr) -> Option<TcpStream> {
    let mut c = TcpStream::connect(addr).await.expect("connected");
    c.write_all(b"PING\r\n").await.expect("sent");
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
        .await
        .expect("an answer within 10 s")
        .unwrap_or(0);
    (&buf[..n] == b"+PONG\r\n").then_some(c)
}

/// Everything a new connection reads until it is closed, having sent `first` (if any).
async fn answer(addr: SocketAddr, first: &[u8]) -> Vec<u8> {
    let mut c = TcpStream::connect(addr).await.expect("connected");
    c.write_all(first).await.expect("sent");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut out))
        .await
        .expect("closed within 10 s")
        .expect("closed cleanly, not reset");
    out
}

async fn ping(c: &mut TcpStream) -> Vec<u8> {
    c.write_all(b"PING\r\n").await.expect("sent");
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
        .await
        .expect("an answer within 10 s")
        .expect("read");
    buf[..n].to_vec()
}

#[tokio::test]
async fn a_client_over_the_cap_gets_what_redis_answers_over_maxclients() {
    // redis-server's own answer over its `maxclients`: one client held (retried until the
    // readiness check's connection is gone), the next one refused.
    let full = RedisServer::start_with(&["--maxclients", "1"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let _held = loop {
        if let Some(c) = admitted(full.addr).await {
            break c;
        }
        assert!(
            Instant::now() < deadline,
            "redis-server never admitted one client"
        );
    };
    let redis_answer = answer(full.addr, b"").await;
    assert!(redis_answer.starts_with(b"-ERR"), "{redis_answer:?}");

    let server = RedisServer::start();
    let config = RedisConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: server.addr.to_string(),
        protect: Some(vec![ProtectRule::every_key()]),
        max_client_connections: 2,
        ..RedisConfig::default()
    };
    let (addr, sink) = super::harness::serve(config).await;
    let mut a = admitted(addr).await.expect("the first client admitted");
    let mut b = admitted(addr).await.expect("the second client admitted");

    assert_eq!(answer(addr, b"").await, redis_answer, "a silent client");
    // A client that writes before it reads still gets the answer, not a reset.
    assert_eq!(answer(addr, b"SET k v\r\n").await, redis_answer);
    assert_eq!(sink.connections_refused(), 2);
    assert_eq!(ping(&mut a).await, b"+PONG\r\n");
    assert_eq!(ping(&mut b).await, b"+PONG\r\n");
    // Nothing a refused client sent reached the server.
    let mut direct = TcpStream::connect(server.addr).await.expect("connected");
    direct.write_all(b"EXISTS k\r\n").await.expect("sent");
    let mut buf = [0u8; 16];
    let n = direct.read(&mut buf).await.expect("read");
    assert_eq!(&buf[..n], b":0\r\n");

    // A freed slot admits the next client, once its session ended.
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut refused = 2;
    loop {
        if admitted(addr).await.is_some() {
            break;
        }
        refused += 1;
        assert!(
            Instant::now() < deadline,
            "no client admitted after one left"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sink.connections_refused(), refused);
}
