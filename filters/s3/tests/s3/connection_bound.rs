//! DESIGN rule 10 on the S3 listener: it holds at most `max_client_connections` clients. One
//! over it reads S3's own `503 SlowDown` and is closed, whether it writes first or not, and
//! none of its requests begins; the clients within it are still served, across keep-alive
//! requests; a freed slot admits the next client.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::harness::Harness;

/// An unsigned request: the gateway answers it `403` itself, and keeps the connection open.
const UNSIGNED_GET: &[u8] = b"GET /open/some-key HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

fn addr(h: &Harness) -> String {
    h.endpoint.trim_start_matches("http://").to_owned()
}

/// Sends `request` and reads one whole response (head and `content-length` body); the status.
fn exchange(c: &mut TcpStream, request: &[u8]) -> Option<u16> {
    c.write_all(request).ok()?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = c.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        got.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().expect("a content-length"));
    while got.len() < head_end + length {
        let n = c.read(&mut buf).ok()?;
        if n == 0 {
            return None;
        }
        got.extend_from_slice(&buf[..n]);
    }
    head.split_whitespace().nth(1)?.parse().ok()
}

/// A connection the gateway admitted (it answered a request other than `503`), or `None`.
fn admitted(h: &Harness) -> Option<TcpStream> {
    let mut c = TcpStream::connect(addr(h)).expect("connected");
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    match exchange(&mut c, UNSIGNED_GET) {
        Some(503) | None => None,
        Some(_) => Some(c),
    }
}

/// [`admitted`], retried for 10 s: a slot is given back once the gateway saw its client close.
fn admitted_soon(h: &Harness) -> TcpStream {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(c) = admitted(h) {
            return c;
        }
        assert!(Instant::now() < deadline, "no client admitted within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Everything a new connection reads until it is closed, having sent `first`.
fn answer(h: &Harness, first: &[u8]) -> String {
    let mut c = TcpStream::connect(addr(h)).expect("connected");
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(first).expect("sent");
    let mut out = Vec::new();
    c.read_to_end(&mut out)
        .expect("closed cleanly within 10 s, not reset");
    String::from_utf8(out).expect("text")
}

#[test]
fn clients_over_max_client_connections_get_slow_down_and_begin_nothing() {
    let h = Harness::with_config(|c| c.max_client_connections = 2);
    // The harness's readiness probe holds a slot until the gateway saw it close, so a client
    // may be refused before these two are admitted.
    let mut a = admitted_soon(&h);
    let mut b = admitted_soon(&h);
    let begun = h.requests_begun();
    let refused = h.audit.connections_refused();

    let silent = answer(&h, b"");
    assert!(silent.starts_with("HTTP/1.1 503 "), "{silent}");
    assert!(silent.contains("<Code>SlowDown</Code>"), "{silent}");
    assert!(silent.contains("max_client_connections (2)"), "{silent}");
    // A client that sends its request (with a body) before it reads gets the same answer,
    // not a reset.
    let put = b"PUT /open/refused HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello";
    assert_eq!(answer(&h, put), silent);
    assert_eq!(h.audit.connections_refused(), refused + 2);
    assert_eq!(
        h.requests_begun(),
        begun,
        "a refused client began a request"
    );

    // The admitted clients are served on, on their kept-alive connections.
    assert_eq!(exchange(&mut a, UNSIGNED_GET), Some(403));
    assert_eq!(exchange(&mut b, UNSIGNED_GET), Some(403));
    assert_eq!(h.requests_begun(), begun + 2);

    // A freed slot admits the next client; the bound holds again behind it.
    drop(a);
    let _c = admitted_soon(&h);
    // (admitted_soon's tries before the slot was given back were refused and counted.)
    let refused = h.audit.connections_refused();
    assert!(answer(&h, b"").starts_with("HTTP/1.1 503 "));
    assert_eq!(h.audit.connections_refused(), refused + 1);
}
