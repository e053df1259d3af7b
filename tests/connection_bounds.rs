//! DESIGN rule 10: every listener of a real `fencegate serve` node bounds its connections.
//! - The PostgreSQL gateway holds at most `max_client_connections` clients. One over it gets
//!   PostgreSQL's own "too many connections" (53300) through tokio-postgres and libpq (whose
//!   SSLRequest comes first), and runs nothing; a cancel request over the bound still reaches
//!   the server, as PostgreSQL serves cancels over its own `max_connections`; the sessions
//!   within it are served; a freed slot admits the next client; `/metrics` counts the
//!   connections turned away. (The Redis gateway's bound: filters/redis/tests/gateway.)
//! - The API holds at most `max_api_connections`: one more gets `503` with the API's error
//!   body and `Retry-After`, while the connections within it are served.

mod support;

use std::time::{Duration, Instant};

use support::gateway_node::{GatewayNode, NodeOptions};
use support::metrics::sample;
use support::postgres_server::{code, connect, PgGateway};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const REFUSED: &str = "fencegate_gateway_connections_refused_total{store=\"postgres\"}";

async fn refused_count(gw: &PgGateway) -> f64 {
    let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", gw.node.api))
        .await
        .expect("/metrics answers")
        .text()
        .await
        .expect("/metrics' text");
    sample(&text, REFUSED).unwrap_or_else(|| panic!("{REFUSED} is not exposed:\n{text}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_clients_over_max_client_connections_are_refused_as_postgres_refuses_them() {
    let gw = PgGateway::start("databases = []\nmax_client_connections = 2", &[]);
    let dsn = gw.dsn("postgres");
    let a = connect(&dsn).await;
    let b = connect(&dsn).await;
    assert_eq!(refused_count(&gw).await, 0.0);

    // tokio-postgres: the startup packet first.
    let e = tokio_postgres::connect(&dsn, tokio_postgres::NoTls)
        .await
        .err()
        .expect("a third client is refused");
    assert_eq!(code(&e), "53300");
    let message = e.as_db_error().map(|d| d.message()).unwrap_or_default();
    assert!(message.contains("max_client_connections = 2"), "{message}");

    // libpq (psql, sslmode=prefer): an SSLRequest first, answered with the error.
    let (status, _, stderr) = gw.psql(
        "postgres",
        "CREATE TABLE refused_client_ran (a int)",
        &[("PGSSLMODE", "prefer"), ("PGCONNECT_TIMEOUT", "10")],
    );
    assert_eq!(status, 2, "{stderr}");
    assert!(
        stderr.contains("too many client connections"),
        "libpq shows the gateway's error: {stderr}"
    );
    assert_eq!(refused_count(&gw).await, 2.0);
    assert_eq!(
        gw.pg.psql_as(
            "postgres",
            "SELECT count(*) FROM pg_class WHERE relname = 'refused_client_ran'"
        ),
        "0",
        "the refused client ran nothing"
    );

    // A cancel request over the cap reaches the backend running the query.
    let cancel = a.cancel_token();
    let sleeper = tokio::spawn(async move { a.simple_query("SELECT pg_sleep(30)").await });
    let deadline = Instant::now() + Duration::from_secs(20);
    while gw.pg.psql_as(
        "postgres",
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%pg_sleep(30)%' AND pid <> pg_backend_pid()",
    ) != "1"
    {
        assert!(Instant::now() < deadline, "the query never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel
        .cancel_query(tokio_postgres::NoTls)
        .await
        .expect("the cancel request sent");
    let result = tokio::time::timeout(Duration::from_secs(10), sleeper)
        .await
        .expect("the cancel reached the backend")
        .expect("the query task");
    assert_eq!(code(&result.expect_err("cancelled")), "57014");

    // The admitted sessions are served.
    assert_eq!(b.query("SELECT 1", &[]).await.expect("served").len(), 1);

    // A freed slot admits the next client once its session ended.
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio_postgres::connect(&dsn, tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                assert_eq!(
                    client.query("SELECT 1", &[]).await.expect("served").len(),
                    1
                );
                break;
            }
            Err(e) => {
                assert_eq!(code(&e), "53300");
                assert!(
                    Instant::now() < deadline,
                    "no client admitted after one left"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert!(
        gw.log_text().contains("max_client_connections"),
        "the node logs that it reached the cap"
    );
}

/// `GET /metrics` (always 200 when served) on `stream`, kept alive: the status code and the
/// body.
async fn get_metrics(stream: &mut TcpStream) -> (u16, String) {
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("sent");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        loop {
            let n = stream.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed before a whole response: {seen:?}");
            seen.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&seen).into_owned();
            let Some((head, body)) = text.split_once("\r\n\r\n") else {
                continue;
            };
            let length: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")?
                        .parse()
                        .ok()
                })
                .expect("a content-length");
            if body.len() >= length {
                let status = head[9..12].parse().expect("a status code");
                return (status, body.to_owned());
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("a response within 10 s")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_holds_at_most_max_api_connections() {
    let options = NodeOptions {
        node: "max_api_connections = 2",
        ..NodeOptions::default()
    };
    let mut node = GatewayNode::start_with(&options, "", &[]);
    let addr = ("127.0.0.1", node.api);
    // Each attempt's connection is closed before the next, so the bound never holds them up.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut held = Vec::new();
    while held.len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the API never answered:\n{}",
            node.log_text()
        );
        let Ok(mut c) = TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        assert_eq!(get_metrics(&mut c).await.0, 200);
        held.push(c);
    }

    for _ in 0..2 {
        let mut over = TcpStream::connect(addr).await.expect("connected");
        let (status, body) = get_metrics(&mut over).await;
        assert_eq!(status, 503, "{body}");
        let body: serde_json::Value = serde_json::from_str(&body).expect("a JSON error body");
        assert_eq!(body["error"], "too_many_connections");
        assert!(body["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_api_connections (2)")));
        let mut rest = Vec::new();
        over.read_to_end(&mut rest).await.expect("closed cleanly");
        assert!(rest.is_empty(), "nothing after the answer");
    }
    // The operator reads one line when the bound is reached, not one per refused client.
    let reached = "max_api_connections on this port";
    node.wait_for_log(reached, Duration::from_secs(10));
    assert_eq!(node.log_text().matches(reached).count(), 1);
    assert!(
        node.log_text().contains(r#"port="api""#),
        "{}",
        node.log_text()
    );

    // The connections within the bound are served.
    for c in &mut held {
        assert_eq!(get_metrics(c).await.0, 200);
    }
    // A freed slot admits the next connection.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = TcpStream::connect(addr).await.expect("connected");
        if get_metrics(&mut c).await.0 == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no connection admitted after one closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ... and one when it is left, with how many were refused meanwhile (2, or more if a
    // retry above came before the slot was freed).
    node.wait_for_log("admits connections again", Duration::from_secs(10));
    let log = node.log_text();
    let again = log
        .lines()
        .find(|l| l.contains("admits connections again"))
        .expect("the line");
    let refused: u64 = again
        .split("refused=")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("a refused count in {again:?}"));
    assert!(refused >= 2, "{again}");
}
