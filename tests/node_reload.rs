//! SIGHUP reloads what a running node can change (here: Redis protect rules) without dropping
//! a session, and keeps the config in force when the file is broken.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use nix::sys::signal::Signal;
use support::redis_gateway::RedisGateway;

fn send(stream: &mut TcpStream, args: &[&str]) {
    let mut out = format!("*{}\r\n", args.len());
    for a in args {
        out += &format!("${}\r\n{a}\r\n", a.len());
    }
    stream.write_all(out.as_bytes()).unwrap();
}

/// Reads one line-shaped reply (`+OK`, `-ERR ...`, `:1`).
fn reply(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut byte = [0u8; 1];
    while !out.ends_with(b"\r\n") {
        stream.read_exact(&mut byte).unwrap();
        out.push(byte[0]);
    }
    String::from_utf8_lossy(&out).trim_end().to_owned()
}

fn count(text: &str, line: &str) -> usize {
    text.lines().filter(|l| l.contains(line)).count()
}

/// Done-means 2 of issue 15.
#[test]
fn sighup_applies_a_new_protect_rule_to_an_open_session_and_keeps_rules_on_a_broken_file() {
    let rules = "[[redis.protect]]\npattern = \"billing:*\"\nresource = \"billing\"\n";
    let mut gw = RedisGateway::start(rules, &[]);
    let mut c = TcpStream::connect(gw.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    send(&mut c, &["SET", "orders:1", "a"]);
    assert_eq!(reply(&mut c), "+OK", "orders:* is not protected yet");

    // A rule for orders:* is added; the open connection's next write is fenced.
    let config = std::fs::read_to_string(&gw.node.config).unwrap();
    let added = config.replace(
        rules,
        &format!("{rules}\n[[redis.protect]]\npattern = \"orders:*\"\nresource = \"orders\"\n"),
    );
    assert_ne!(added, config);
    std::fs::write(&gw.node.config, &added).unwrap();
    gw.node.signal(Signal::SIGHUP);
    gw.node
        .wait_for_log("SIGHUP: config reloaded", Duration::from_secs(10));
    send(&mut c, &["SET", "orders:1", "b"]);
    let refused = reply(&mut c);
    assert!(refused.starts_with("-NOFENCE"), "after reload: {refused}");
    send(&mut c, &["PING"]);
    assert_eq!(reply(&mut c), "+PONG", "the session was kept");

    // A broken file (a rule without its resource) is refused with its line; the rules in force
    // stay, on the same connection.
    let broken = added.replace("resource = \"orders\"\n", "");
    std::fs::write(&gw.node.config, &broken).unwrap();
    let broken_line = broken
        .lines()
        .position(|l| l.contains("pattern = \"orders:*\""))
        .unwrap(); // the [[redis.protect]] header is the line before (1-based: this index)
    gw.node.signal(Signal::SIGHUP);
    gw.node.wait_for_log(
        "SIGHUP: the config was not reloaded",
        Duration::from_secs(10),
    );
    let log = gw.log_text();
    let line = log
        .lines()
        .find(|l| l.contains("SIGHUP: the config was not reloaded"))
        .unwrap();
    let at = format!("fencegate.toml:{broken_line}: redis.protect.1:");
    assert!(line.contains(&at), "{at} not in: {line}");
    assert_eq!(count(&log, "SIGHUP: config reloaded"), 1);
    send(&mut c, &["SET", "orders:1", "c"]);
    let refused = reply(&mut c);
    assert!(refused.starts_with("-NOFENCE"), "old rules kept: {refused}");
    send(&mut c, &["SET", "billing:1", "c"]);
    assert!(reply(&mut c).starts_with("-NOFENCE"));
    send(&mut c, &["GET", "orders:1"]);
    assert_eq!(reply(&mut c), "$1");
    assert_eq!(reply(&mut c), "a", "no refused write applied");
    println!("done-means 2: orders:* protected on the open session after SIGHUP; broken file refused at {at}, old rules kept");
}

/// SIGHUP reads the API credentials file again: a credential added to it works, and one
/// removed from it no longer does, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_api_credentials() {
    use support::cluster::{Cluster, Security};
    let cluster = Cluster::start_secured(Security::Tls, 1, "", |_| String::new(), &[]).await;
    let creds = cluster.certs().join("credentials");
    let before = std::fs::read_to_string(&creds).unwrap();
    let ca = std::fs::read(cluster.certs().join("ca.crt")).unwrap();
    let http = reqwest::Client::builder()
        .use_rustls_tls()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
        .build()
        .unwrap();
    let status = |secret: &'static str| {
        let http = http.clone();
        let url = format!("{}/v1/cluster", cluster.url(1));
        async move {
            http.get(url)
                .bearer_auth(secret)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    const NEW: &str = "a-new-client-secret-added-while-running-0123456789";
    assert_eq!(status(NEW).await, 401);
    std::fs::write(&creds, format!("{before}\nops client {NEW}\n")).unwrap();
    cluster.signal(1, Signal::SIGHUP);
    wait_for(&cluster.log_path(1), "SIGHUP: API credentials read again");
    assert_eq!(status(NEW).await, 200, "the added credential works");

    std::fs::write(&creds, &before).unwrap();
    cluster.signal(1, Signal::SIGHUP);
    wait_for_count(
        &cluster.log_path(1),
        "SIGHUP: API credentials read again",
        2,
    );
    assert_eq!(
        status(NEW).await,
        401,
        "the removed credential no longer works"
    );
    println!("SIGHUP: an added API credential works, a removed one gets 401, no restart");
}

fn wait_for(log: &std::path::Path, line: &str) {
    wait_for_count(log, line, 1);
}

/// Waits (bounded) until `log` has `n` lines containing `line`.
fn wait_for_count(log: &std::path::Path, line: &str, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if count(&text, line) >= n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{line:?} x{n} not logged:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A TLS client that trusts `ca` (PEM) and, for the peer port, presents `identity`.
fn tls_connector(ca: &[u8], identity: Option<(&[u8], &[u8])>) -> tokio_rustls::TlsConnector {
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut &ca[..]) {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let mut config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                rustls_pemfile::certs(&mut &cert[..])
                    .collect::<Result<_, _>>()
                    .unwrap(),
                rustls_pemfile::private_key(&mut &key[..]).unwrap().unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    // Every handshake a full one: a resumed session carries the certificate of the handshake
    // it resumes, and would tell nothing about what the server presents now.
    config.resumption = rustls::client::Resumption::disabled();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// Connects over TLS (bounded: 10 s) and returns the stream and the certificate the server
/// presented (its leaf, DER).
async fn handshake(addr: &str, connector: &tokio_rustls::TlsConnector) -> (Tls, Vec<u8>) {
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio::time::timeout(Duration::from_secs(10), async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        connector.connect(name, tcp).await
    })
    .await
    .expect("handshake within 10 s")
    .unwrap_or_else(|e| panic!("TLS handshake with {addr}: {e}"));
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    (tls, leaf)
}

/// One HTTP/1.1 GET on a kept-alive connection; returns the status code (the body is read
/// whole, so the connection is ready for the next request). Bounded: 10 s.
async fn http_get(tls: &mut Tls, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    tokio::time::timeout(Duration::from_secs(10), async {
        tls.write_all(request.as_bytes()).await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert!(head.len() < 16 * 1024, "no end of headers");
            tls.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .unwrap_or_else(|| panic!("no content-length in {head}"))
            .trim()
            .parse()
            .unwrap();
        let mut body = vec![0u8; length];
        tls.read_exact(&mut body).await.unwrap();
        head.split_whitespace().nth(1).unwrap().parse().unwrap()
    })
    .await
    .expect("HTTP answer within 10 s")
}

/// PING on an open Redis connection (bounded: 10 s).
async fn ping(tls: &mut Tls) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::time::timeout(Duration::from_secs(10), async {
        tls.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
        let mut out = Vec::new();
        let mut byte = [0u8; 1];
        while !out.ends_with(b"\r\n") {
            tls.read_exact(&mut byte).await.unwrap();
            out.push(byte[0]);
        }
        String::from_utf8_lossy(&out).trim_end().to_owned()
    })
    .await
    .expect("PING answered within 10 s")
}

/// A server certificate for "localhost" signed by `ca` (PEM: ca, cert, key).
fn gateway_cert(ca: &(rcgen::Certificate, rcgen::KeyPair)) -> (String, String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca.0, &ca.1)
        .unwrap();
    (ca.0.pem(), cert.pem(), key.serialize_pem())
}

fn gateway_ca() -> (rcgen::Certificate, rcgen::KeyPair) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let key = rcgen::KeyPair::generate().unwrap();
    (params.self_signed(&key).unwrap(), key)
}

/// The port of the log line `message`'s `listen=` field (bounded: 30 s).
fn logged_port(log: &std::path::Path, message: &str) -> u16 {
    wait_for(log, message);
    let text = std::fs::read_to_string(log).unwrap();
    text.lines()
        .filter(|l| l.contains(message))
        .find_map(|l| {
            let addr = l.split("listen=").nth(1)?.split_whitespace().next()?;
            addr.rsplit(':').next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no listen= in {message:?}:\n{text}"))
}

/// SIGHUP reads every TLS server certificate again: new handshakes on the API, the peer port
/// and the Redis gateway's TLS listener present the renewed certificate while connections
/// opened before keep working; a key that does not match its certificate, or a key file with no
/// key, is refused, named in the log, and the certificate in force stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_certificates_for_new_handshakes_and_keeps_open_connections() {
    use support::cluster::{Cluster, Security};
    let redis = support::redis_server::RedisServer::start();
    let gw_dir = tempfile::tempdir().unwrap();
    let ca = gateway_ca();
    let (gw_ca, gw_cert, gw_key) = gateway_cert(&ca);
    let (gw_cert_path, gw_key_path) = (gw_dir.path().join("gw.crt"), gw_dir.path().join("gw.key"));
    std::fs::write(&gw_cert_path, &gw_cert).unwrap();
    std::fs::write(&gw_key_path, &gw_key).unwrap();
    let section = format!(
        "[redis]\nlisten = \"127.0.0.1:0\"\nupstream = \"{}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"\n\n[[redis.protect]]\npattern = \"*\"\nresource = \"*\"\n",
        redis.addr,
        gw_cert_path.display(),
        gw_key_path.display(),
    );
    let cluster = Cluster::start_secured(Security::Tls, 1, "", |_| section.clone(), &[]).await;
    let log = cluster.log_path(1);
    let redis_addr = format!("127.0.0.1:{}", logged_port(&log, "redis gateway listening"));
    let api_addr = cluster.api_addr(1);
    let peer_addr = cluster.peer_addr(1);
    let certs = cluster.certs();
    let node_ca = std::fs::read(certs.join("ca.crt")).unwrap();
    let (node_cert, node_key) = (certs.join("node1.crt"), certs.join("node1.key"));
    let old_key = std::fs::read(&node_key).unwrap();
    let old_cert = std::fs::read(&node_cert).unwrap();
    let api = tls_connector(&node_ca, None);
    // A peer presents a certificate of the cluster CA: the node's first one, still valid.
    let peer = tls_connector(&node_ca, Some((&old_cert, &old_key)));
    let gw = tls_connector(gw_ca.as_bytes(), None);

    let (mut api_open, api_first) = handshake(&api_addr, &api).await;
    assert_eq!(http_get(&mut api_open, "/healthz").await, 200);
    let (_, peer_first) = handshake(&peer_addr, &peer).await;
    assert_eq!(
        peer_first, api_first,
        "both ports present the node's certificate"
    );
    let (mut redis_open, redis_first) = handshake(&redis_addr, &gw).await;
    assert_eq!(ping(&mut redis_open).await, "+PONG");

    // Renewal as an operator does it: a new node certificate from the same CA, and a new
    // gateway certificate, written over the old files.
    let renew = tempfile::tempdir().unwrap();
    for f in ["ca.crt", "ca.key"] {
        std::fs::copy(certs.join(f), renew.path().join(f)).unwrap();
    }
    let dir = renew.path().display().to_string();
    let (code, out) = cluster.cli(&[
        "certs",
        "add-node",
        "--dir",
        &dir,
        "--node",
        "1=127.0.0.1,localhost",
    ]);
    assert_eq!(code, 0, "{out}");
    std::fs::copy(renew.path().join("node1.crt"), &node_cert).unwrap();
    std::fs::copy(renew.path().join("node1.key"), &node_key).unwrap();
    let (_, gw_cert2, gw_key2) = gateway_cert(&ca);
    std::fs::write(&gw_cert_path, &gw_cert2).unwrap();
    std::fs::write(&gw_key_path, &gw_key2).unwrap();
    cluster.signal(1, Signal::SIGHUP);
    wait_for_count(&log, "SIGHUP: certificate read again", 2);

    let (_, api_second) = handshake(&api_addr, &api).await;
    assert_ne!(
        api_second, api_first,
        "a new API handshake gets the new certificate"
    );
    let (_, peer_second) = handshake(&peer_addr, &peer).await;
    assert_eq!(peer_second, api_second, "and so does a new peer handshake");
    let (_, redis_second) = handshake(&redis_addr, &gw).await;
    assert_ne!(
        redis_second, redis_first,
        "a new Redis handshake gets the new certificate"
    );
    assert_eq!(
        http_get(&mut api_open, "/healthz").await,
        200,
        "the API connection opened before the reload still works"
    );
    assert_eq!(
        ping(&mut redis_open).await,
        "+PONG",
        "the Redis connection opened before the reload still works"
    );

    // Bad files: the node's old key with its new certificate (a mismatched pair), and a key
    // file with no key in it. Both refused and named; new handshakes keep the second pair.
    std::fs::write(&node_key, &old_key).unwrap();
    std::fs::write(&gw_key_path, "not a key\n").unwrap();
    cluster.signal(1, Signal::SIGHUP);
    wait_for_count(&log, "SIGHUP: certificate not reloaded", 2);
    let text = std::fs::read_to_string(&log).unwrap();
    let refused: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("SIGHUP: certificate not reloaded"))
        .collect();
    let mismatch = format!(
        "security.key_file {} is not the key of security.cert_file {}",
        node_key.display(),
        node_cert.display()
    );
    assert!(
        refused.iter().any(|l| l.contains(&mismatch)),
        "{mismatch:?} not in {refused:#?}"
    );
    let no_key = format!("tls_key {}: no PEM private key", gw_key_path.display());
    assert!(
        refused.iter().any(|l| l.contains(&no_key)),
        "{no_key:?} not in {refused:#?}"
    );
    assert_eq!(count(&text, "SIGHUP: certificate read again"), 2);
    assert!(!text.contains("PRIVATE KEY"), "no key material in the log");
    let (_, api_third) = handshake(&api_addr, &api).await;
    assert_eq!(
        api_third, api_second,
        "the API keeps the second certificate"
    );
    let (_, peer_third) = handshake(&peer_addr, &peer).await;
    assert_eq!(peer_third, api_second, "the peer port too");
    let (_, redis_third) = handshake(&redis_addr, &gw).await;
    assert_eq!(redis_third, redis_second, "the Redis listener too");
    assert_eq!(ping(&mut redis_open).await, "+PONG");
    println!("SIGHUP: API, peer and Redis TLS listeners present the renewed certificates on new handshakes, open connections kept; a mismatched pair and a keyless file refused and named, the renewed certificates stay");
}
