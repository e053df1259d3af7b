//! boto3 over HTTPS at default settings: it then sends every upload as aws-chunked with
//! `STREAMING-UNSIGNED-PAYLOAD-TRAILER` and a CRC32 trailer (the form recent AWS SDKs use by
//! default); the gateway decodes it, forwards the checksum, and fences the write.

mod harness;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{token, Harness};
use serde_json::json;

#[test]
fn boto3_default_chunked_uploads_over_https() {
    let h = Harness::with_tls();
    std::env::set_var("S3_CA_BUNDLE", h.ca_bundle());
    let size = 11 * 1024 * 1024;
    let results = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "tls.txt", "body": "over https, chunked", "token": token(3)},
        {"op": "get", "bucket": "fenced", "key": "tls.txt"},
        {"op": "put", "bucket": "fenced", "key": "big.bin", "size": 3 * 1024 * 1024 + 17, "token": token(3)},
        {"op": "get", "bucket": "fenced", "key": "big.bin"},
        {"op": "pattern_sha256", "size": 3 * 1024 * 1024 + 17},
        {"op": "multipart", "bucket": "fenced", "key": "mp.bin", "size": size, "token": token(3)},
        {"op": "get", "bucket": "fenced", "key": "mp.bin"},
        {"op": "pattern_sha256", "size": size, "seed": "multipart"},
        {"op": "put", "bucket": "fenced", "key": "tls.txt", "body": "stale", "token": token(2)},
        // Above the 16 MiB retry buffer: the fenced write streams its decoded body once.
        {"op": "put", "bucket": "fenced", "key": "streamed.bin", "size": 20 * 1024 * 1024 + 3, "token": token(3)},
        {"op": "get", "bucket": "fenced", "key": "streamed.bin"},
        {"op": "pattern_sha256", "size": 20 * 1024 * 1024 + 3},
        {"op": "presigned_get", "bucket": "fenced", "key": "tls.txt"},
    ]));
    for r in &results {
        let mut r = r.clone();
        if r["body"].as_str().is_some_and(|b| b.len() > 80) {
            r["body"] = json!("...");
        }
        println!("{r}");
    }
    assert_eq!(results[0]["ok"], true);
    // boto3 really sent aws-chunked with a trailer.
    assert_eq!(
        results[0]["sent"]["payload"],
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    );
    assert_eq!(results[0]["sent"]["encoding"], "aws-chunked");
    assert_eq!(results[1]["body"], "over https, chunked");
    assert_eq!(results[1]["metadata"]["fencegate-revision"], "3");
    assert_eq!(results[3]["sha256"], results[4]["sha256"]);
    assert_eq!(results[6]["sha256"], results[7]["sha256"]);
    assert_eq!(
        (results[8]["status"].clone(), results[8]["code"].clone()),
        (json!(412), json!("FencingTokenStale"))
    );
    assert_eq!(
        results[9]["sent"]["payload"],
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    );
    assert_eq!(results[10]["sha256"], results[11]["sha256"]);
    assert_eq!(results[10]["metadata"]["fencegate-revision"], "3");
    assert_eq!(h.audit.events().len(), 1);
}

/// A TLS connection to the gateway, handshake done; `None` if the gateway closed it instead.
fn tls_connect(h: &Harness) -> Option<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(h.ca_bundle()).expect("the CA file") {
        roots.add(cert.expect("a certificate")).expect("added");
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = "127.0.0.1".try_into().expect("a server name");
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).expect("a client");
    let mut tcp = TcpStream::connect(h.endpoint.trim_start_matches("https://")).expect("connected");
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp).ok()?;
    }
    Some(rustls::StreamOwned::new(conn, tcp))
}

/// [`tls_connect`] retried for 10 s (a slot is given back once the gateway saw its client go),
/// then one request answered on the connection.
fn tls_admitted_soon(h: &Harness) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(mut c) = tls_connect(h) {
            c.write_all(b"GET /open/k HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                .expect("sent");
            let mut buf = [0u8; 64];
            let n = c.read(&mut buf).expect("an answer");
            assert!(buf[..n].starts_with(b"HTTP/1.1 403 "), "{:?}", &buf[..n]);
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "no TLS client admitted within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// DESIGN rule 10 over HTTPS: a client over `max_client_connections` is closed before any
/// handshake, and an admitted client that never sends its ClientHello holds its slot for the
/// handshake limit (10 s), not pingora's 60 s.
#[test]
fn https_clients_are_bounded_and_a_silent_one_holds_its_slot_ten_seconds() {
    let h = Harness::with_tls_config(|c| c.max_client_connections = 1);
    let held = tls_admitted_soon(&h);
    // Counted from here: the harness's readiness probe may have had clients refused.
    let refused = h.audit.connections_refused();
    assert!(tls_connect(&h).is_none(), "a second client got a handshake");
    assert_eq!(h.audit.connections_refused(), refused + 1);
    drop(held);

    // A silent client: admitted once the slot is free (a refused one is closed at once; 2 s
    // leaves a loaded machine time for that).
    let addr = h.endpoint.trim_start_matches("https://").to_owned();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut silent, since) = loop {
        let mut c = TcpStream::connect(&addr).expect("connected");
        let since = Instant::now();
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut byte = [0u8; 1];
        match c.read(&mut byte) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break (c, since),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break (c, since),
            _ => assert!(Instant::now() < deadline, "the slot was never given back"),
        }
    };
    let refused = h.audit.connections_refused();
    assert!(
        tls_connect(&h).is_none(),
        "a client beside the silent one got a handshake"
    );
    assert_eq!(h.audit.connections_refused(), refused + 1);
    silent
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut rest = Vec::new();
    let _ = silent.read_to_end(&mut rest);
    let held_for = since.elapsed();
    assert!(rest.is_empty(), "{rest:?}");
    assert!(
        held_for >= Duration::from_secs(9) && held_for < Duration::from_secs(20),
        "the silent client was closed after {held_for:?}"
    );
    let _next = tls_admitted_soon(&h);
    println!("the silent client held its slot for {held_for:?}");
}
