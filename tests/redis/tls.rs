//! TLS on both Redis hops, against a real `redis-server` serving TLS (`--tls-port`): a client
//! connects to the gateway over TLS (`tls_cert`/`tls_key`), the gateway reaches Redis over TLS
//! (`upstream = "rediss://..."`, `upstream_ca_file`), and a fenced SET goes through; an upstream
//! signed by another CA, or whose certificate does not name the host, is refused with a clear
//! error (on the client's connection and in /healthz).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::free_port;
use crate::support::gateway_node::GatewayNode;
use crate::support::redis_server::RedisServer;
use bytes::BytesMut;
use fencegate_redis::frame::{parse, Frame, Limits};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

/// A CA and one server certificate it signed, as PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn make_pki(dir: &Path, name: &str, hosts: &[&str]) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} test CA"));
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let params =
        CertificateParams::new(hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    let pki = Pki {
        ca: dir.join(format!("{name}-ca.crt")),
        cert: dir.join(format!("{name}-server.crt")),
        key: dir.join(format!("{name}-server.key")),
    };
    std::fs::write(&pki.ca, ca.pem()).unwrap();
    std::fs::write(&pki.cert, cert.pem()).unwrap();
    std::fs::write(&pki.key, key.serialize_pem()).unwrap();
    pki
}

/// A redis-server with a plain port (for checking what was stored) and a TLS port.
fn tls_redis(pki: &Pki) -> (RedisServer, u16) {
    let port = free_port();
    let redis = RedisServer::start_with(&[
        "--tls-port",
        &port.to_string(),
        "--tls-cert-file",
        pki.cert.to_str().unwrap(),
        "--tls-key-file",
        pki.key.to_str().unwrap(),
        "--tls-ca-cert-file",
        pki.ca.to_str().unwrap(),
        "--tls-auth-clients",
        "no",
    ]);
    (redis, port)
}

fn node(upstream: &str, ca: &Path, client_tls: &Pki) -> (GatewayNode, SocketAddr) {
    let section = format!(
        "[redis]\nlisten = \"127.0.0.1:0\"\nupstream = \"{upstream}\"\nupstream_ca_file = \"{}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"\n\n[[redis.protect]]\npattern = \"*\"\nresource = \"*\"\n",
        ca.display(),
        client_tls.cert.display(),
        client_tls.key.display(),
    );
    let mut node = GatewayNode::start(&section, &[]);
    let port = node.bound_port("redis gateway listening");
    (node, format!("127.0.0.1:{port}").parse().unwrap())
}

async fn tls_client(
    addr: SocketAddr,
    ca: &Path,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    for cert in rustls_pemfile::certs(&mut &pem[..]) {
        let cert: CertificateDer = cert.unwrap();
        roots.add(cert).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("TLS handshake with the gateway")
}

/// Sends one command and reads its reply (bounded: 10 s).
async fn call<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, args: &[&str]) -> Frame {
    let mut out = BytesMut::new();
    Frame::command(
        args.iter()
            .map(|a| bytes::Bytes::copy_from_slice(a.as_bytes())),
    )
    .encode(&mut out);
    s.write_all(&out).await.unwrap();
    let mut buf = BytesMut::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some((frame, _)) = parse(&buf, &Limits::default()).unwrap() {
            return frame;
        }
        let n = tokio::time::timeout_at(deadline.into(), s.read_buf(&mut buf))
            .await
            .expect("a reply within 10 s")
            .unwrap();
        assert!(n > 0, "connection closed before a reply");
    }
}

async fn healthz(node: &GatewayNode) -> (u16, serde_json::Value) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = reqwest::get(format!("http://127.0.0.1:{}/healthz", node.api)).await {
            let status = r.status().as_u16();
            if let Ok(body) = r.json::<serde_json::Value>().await {
                if body["gateways"]["redis"].is_object() {
                    return (status, body);
                }
            }
        }
        assert!(Instant::now() < deadline, "no /healthz answer within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn fenced_writes_travel_over_tls_on_both_hops() {
    let dir = tempfile::tempdir().unwrap();
    // Redis's certificate names only "localhost": the gateway must be told that name.
    let pki = make_pki(dir.path(), "a", &["localhost"]);
    let (redis, tls_port) = tls_redis(&pki);
    let (node, gateway) = node(&format!("rediss://localhost:{tls_port}"), &pki.ca, &pki);

    let mut client = tls_client(gateway, &pki.ca).await;
    assert_eq!(
        call(&mut client, &["FENCE", "fg1~7~billing"]).await,
        Frame::Simple("OK".into())
    );
    assert_eq!(
        call(&mut client, &["SET", "billing:1", "paid"]).await,
        Frame::Simple("OK".into())
    );
    let mut tokenless = tls_client(gateway, &pki.ca).await;
    match call(&mut tokenless, &["SET", "billing:1", "forged"]).await {
        Frame::Error(e) => assert!(e.starts_with(b"NOFENCE"), "{e:?}"),
        other => panic!("a tokenless SET was answered {other:?}"),
    }
    let mut direct = tokio::net::TcpStream::connect(redis.addr).await.unwrap();
    assert_eq!(
        call(&mut direct, &["GET", "billing:1"]).await,
        Frame::Bulk("paid".into()),
        "the fenced SET reached Redis over TLS; the tokenless one did not"
    );
    match call(&mut direct, &["GET", "fencegate:fence:{billing}"]).await {
        Frame::Bulk(fence) => assert_eq!(&fence[..], b"7"),
        other => panic!("no fence key: {other:?}"),
    }
    // A plain-text client gets no Redis service from a TLS listener.
    let mut plain = tokio::net::TcpStream::connect(gateway).await.unwrap();
    plain.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), plain.read(&mut buf))
        .await
        .expect("the gateway closes a plain-text connection")
        .unwrap_or(0);
    assert!(!buf[..n].starts_with(b"+PONG"), "plain text answered");
    let (status, body) = healthz(&node).await;
    assert_eq!(status, 200, "{body}");
    println!("TLS both hops: fenced SET applied, tokenless refused, /healthz {status}");
}

#[tokio::test]
async fn an_upstream_of_another_ca_or_name_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path(), "a", &["localhost"]);
    let other = make_pki(dir.path(), "b", &["localhost"]);
    let (_redis, tls_port) = tls_redis(&pki);

    for (upstream, ca, says) in [
        (
            format!("rediss://localhost:{tls_port}"),
            &other.ca,
            "UnknownIssuer",
        ),
        (
            format!("rediss://127.0.0.1:{tls_port}"),
            &pki.ca,
            "not valid for name",
        ),
    ] {
        let (node, gateway) = node(&upstream, ca, &pki);
        let mut client = tls_client(gateway, &pki.ca).await;
        let reply = call(&mut client, &["PING"]).await;
        let Frame::Error(e) = reply else {
            panic!("{upstream}: PING through an untrusted upstream answered {reply:?}");
        };
        let e = String::from_utf8_lossy(&e).into_owned();
        assert!(
            e.contains("TLS handshake with upstream") && e.contains(says),
            "{upstream}: {e}"
        );
        let (status, body) = healthz(&node).await;
        assert_eq!(status, 503, "{body}");
        let reason = body["gateways"]["redis"]["reason"].as_str().unwrap();
        assert!(reason.contains(says), "{body}");
        println!("{upstream} with {}: client got -{e}", ca.display());
    }
}
