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
