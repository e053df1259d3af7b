//! One EMFILE on accept used to end the Redis gateway for good while the process lived on. In
//! its own test binary: it lowers the whole process's open-file limit for a moment.

use fencegate_testkit::fd_limit;
use fencegate_testkit::redis_server;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fd_limit::FdSqueeze;
use fencegate_core::{MemoryAuditSink, TokenPolicy};
use fencegate_redis::{Gateway, ProtectRule, RedisConfig};
use redis_server::RedisServer;

fn request(s: &mut TcpStream, wire: &[u8]) -> String {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(wire).unwrap();
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_file_descriptors_does_not_stop_the_gateway() {
    let server = RedisServer::start();
    let config = RedisConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: server.addr.to_string(),
        protect: Some(vec![ProtectRule::every_key()]),
        ..RedisConfig::default()
    };
    let gateway = Gateway::new(
        config,
        TokenPolicy::unsigned(),
        Arc::new(MemoryAuditSink::default()),
    )
    .unwrap();
    let listener = gateway.bind().await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gateway.serve(listener));
    tokio::task::spawn_blocking(move || {
        // Warm up: the gateway has its upstream info, and a session's sockets are counted.
        let mut c = TcpStream::connect(addr).unwrap();
        assert_eq!(request(&mut c, b"PING\r\n"), "+PONG\r\n");
        drop(c);
        // Leave room for a few client sockets (ours) but not for the gateway's accepts and
        // upstream connections: accept fails with EMFILE.
        let squeeze = FdSqueeze::leave_room(6);
        let mut held = Vec::new();
        for _ in 0..6 {
            if let Ok(c) = TcpStream::connect(addr) {
                held.push(c);
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        drop(held);
        drop(squeeze);
        // The gateway keeps accepting.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ok = TcpStream::connect(addr).ok().is_some_and(|mut c| {
                c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                c.write_all(b"PING\r\n").is_ok() && {
                    let mut buf = [0u8; 16];
                    c.read(&mut buf).is_ok_and(|n| &buf[..n] == b"+PONG\r\n")
                }
            });
            if ok {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway stopped accepting after EMFILE"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    })
    .await
    .unwrap();
}
