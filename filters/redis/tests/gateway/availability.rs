//! A client cannot take the gateway down or hide behind someone else's name: partial requests
//! have a deadline and a global budget, trickled bytes cost linear time, and the audit identity
//! comes only from an accepted AUTH. Against a real `redis-server`, gateway in-process.

use fencegate_testkit::redis_server;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_core::{MemoryAuditSink, TokenPolicy};
use fencegate_redis::{Gateway, ProtectRule, RedisConfig};
use redis_server::RedisServer;

struct Setup {
    _server: RedisServer,
    addr: SocketAddr,
    sink: Arc<MemoryAuditSink>,
    gateway: Arc<Gateway>,
}

async fn setup(tweak: impl FnOnce(&mut RedisConfig)) -> Setup {
    let server = RedisServer::start();
    let mut config = RedisConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: server.addr.to_string(),
        protect: Some(vec![ProtectRule::every_key()]),
        ..RedisConfig::default()
    };
    tweak(&mut config);
    let sink = Arc::new(MemoryAuditSink::default());
    let gateway = Gateway::new(config, TokenPolicy::unsigned(), sink.clone()).unwrap();
    let listener = gateway.bind().await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gateway.clone().serve(listener));
    Setup {
        _server: server,
        addr,
        sink,
        gateway,
    }
}

/// Reads until the peer closes (or 10 s pass); returns what came.
fn read_to_close(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn request(s: &mut TcpStream, wire: &[u8]) -> String {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(wire).unwrap();
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_left_incomplete_is_closed_at_its_deadline() {
    let s = setup(|c| c.partial_request_timeout_seconds = 1).await;
    let addr = s.addr;
    let (reply, waited) = tokio::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        let started = Instant::now();
        c.write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$10\r\nabc")
            .unwrap();
        // More bytes keep coming, but the deadline counts from the request's first byte.
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(300));
            let _ = c.write_all(b"d");
        }
        (read_to_close(&mut c), started.elapsed())
    })
    .await
    .unwrap();
    assert!(
        reply.starts_with("-ERR fencegate: a request was still incomplete 1s after it began"),
        "{reply:?}"
    );
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    // Other connections are unaffected.
    let mut other = TcpStream::connect(s.addr).unwrap();
    assert_eq!(request(&mut other, b"PING\r\n"), "+PONG\r\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_global_budget_for_partial_requests_closes_the_connection_that_exceeds_it() {
    let s = setup(|c| {
        c.max_request_bytes = 4096;
        c.max_buffered_bytes = 4096;
    })
    .await;
    let addr = s.addr;
    let gateway = s.gateway.clone();
    tokio::task::spawn_blocking(move || {
        let mut a = TcpStream::connect(addr).unwrap();
        let mut head = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3000\r\n".to_vec();
        head.extend(std::iter::repeat_n(b'x', 2900));
        a.write_all(&head).unwrap();
        // Wait until the gateway holds a's bytes before b arrives.
        let deadline = Instant::now() + Duration::from_secs(10);
        while gateway.buffered_bytes() < head.len() {
            assert!(
                Instant::now() < deadline,
                "the gateway never buffered a's request"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut b = TcpStream::connect(addr).unwrap();
        let mut partial = b"*3\r\n$3\r\nSET\r\n$1\r\nj\r\n$3000\r\n".to_vec();
        partial.extend(std::iter::repeat_n(b'y', 2000));
        b.write_all(&partial).unwrap();
        let reply = read_to_close(&mut b);
        assert!(
            reply.starts_with("-ERR fencegate: the gateway's budget for partial requests"),
            "{reply:?}"
        );
        // a completes its request and gets the normal answer (NOFENCE: every key protected).
        let mut rest = vec![b'x'; 100];
        rest.extend_from_slice(b"\r\n");
        let reply = request(&mut a, &rest);
        assert!(reply.starts_with("-NOFENCE"), "{reply:?}");
        assert_eq!(gateway.buffered_bytes(), 0);
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_failed_auth_does_not_become_the_audit_identity() {
    let s = setup(|_| {}).await;
    let addr = s.addr;
    tokio::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        let reply = request(&mut c, b"*3\r\n$4\r\nAUTH\r\n$7\r\nmallory\r\n$1\r\nx\r\n");
        assert!(reply.starts_with("-WRONGPASS"), "{reply:?}");
        let reply = request(
            &mut c,
            b"*4\r\n$5\r\nHELLO\r\n$1\r\n2\r\n$4\r\nAUTH\r\n$5\r\nalice\r\n",
        );
        assert!(reply.starts_with("-"), "{reply:?}");
        let reply = request(&mut c, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n");
        assert!(reply.starts_with("-NOFENCE"), "{reply:?}");
        // The default user has no password: AUTH default <anything> succeeds.
        let reply = request(&mut c, b"*3\r\n$4\r\nAUTH\r\n$7\r\ndefault\r\n$1\r\nx\r\n");
        assert_eq!(reply, "+OK\r\n");
        let reply = request(&mut c, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n");
        assert!(reply.starts_with("-NOFENCE"), "{reply:?}");
    })
    .await
    .unwrap();
    let identities: Vec<Option<String>> = s
        .sink
        .events()
        .into_iter()
        .map(|e| e.client_identity)
        .collect();
    assert_eq!(identities, [None, Some("default".to_owned())]);
}

/// `idle_timeout_seconds` counts each silence on its own: a client that keeps sending within
/// the timeout is never closed however long it stays, and a silent one is closed once the
/// timeout has passed, not before (the session moves one timer lazily instead of arming one
/// per request, `fencegate_core::IdleTimer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_closes_a_silent_client_and_spares_a_busy_one() {
    let s = setup(|c| c.idle_timeout_seconds = 1).await;
    let addr = s.addr;
    let (replies, reply, silent) = tokio::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        // 2.4 s of requests 400 ms apart: well past the timeout in all, never silent for it.
        let mut replies = Vec::new();
        for _ in 0..6 {
            replies.push(request(&mut c, b"*1\r\n$4\r\nPING\r\n"));
            std::thread::sleep(Duration::from_millis(400));
        }
        replies.push(request(&mut c, b"*1\r\n$4\r\nPING\r\n"));
        let silent = Instant::now();
        (replies, read_to_close(&mut c), silent.elapsed())
    })
    .await
    .unwrap();
    assert!(replies.iter().all(|r| r == "+PONG\r\n"), "{replies:?}");
    assert!(
        reply.starts_with("-ERR fencegate: no request for 1s; closing the connection"),
        "{reply:?}"
    );
    assert!(
        silent >= Duration::from_secs(1) && silent < Duration::from_secs(5),
        "closed after {silent:?} of silence"
    );
}
