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
