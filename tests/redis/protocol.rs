//! Done-means 5 and 6 of the Redis filter: unchanged clients (`redis-cli`, the `redis` crate),
//! pipelining order, RESP3, and garbage on a connection. Through a real `fencegate serve`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::redis_client::connect;
use crate::support::redis_gateway::RedisGateway;
use redis::Value;

/// Sends `request` on a fresh raw connection and reads until `expect` bytes arrived.
fn raw(gw: &RedisGateway, request: &[u8], expect: usize) -> Vec<u8> {
    let mut s = TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while out.len() < expect {
        let n = s.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    out
}

fn redis_cli(gw: &RedisGateway, extra: &[&str], stdin: &str) -> String {
    let mut child = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &gw.addr.port().to_string()])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("redis-cli is installed with redis-server (apt-get install redis-server)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn redis_cli_and_the_redis_crate_work_unchanged() {
    let gw = RedisGateway::start("", &[]);
    // redis-cli, commands on stdin, one connection.
    let out = redis_cli(
        &gw,
        &[],
        "FENCE fg1~3~cli\nSET greeting hello\nGET greeting\nHSET h a 1 b 2\nHGETALL h\nFENCE\nSET greeting bye\n",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        &lines[..9],
        ["OK", "OK", "hello", "2", "a", "1", "b", "2", "OK"],
        "{out}"
    );
    assert!(lines[9].starts_with("NOFENCE"), "{out}");

    // The redis crate: FENCE is an ordinary command; 10,000 pipelined commands in order.
    let mut con = connect(&gw.url()).await;
    let mut pipe = redis::pipe();
    pipe.cmd("FENCE").arg("fg1~3~cli");
    for i in 0..5_000 {
        pipe.cmd("INCR").arg("seq");
        pipe.cmd("SET").arg(format!("p:{i}")).arg(i);
    }
    let replies: Vec<Value> = pipe.query_async(&mut con).await.unwrap();
    assert_eq!(replies.len(), 10_001);
    assert_eq!(replies[0], Value::Okay);
    for i in 0..5_000 {
        assert_eq!(replies[1 + 2 * i], Value::Int(i as i64 + 1), "reply {i}");
        assert_eq!(replies[2 + 2 * i], Value::Okay, "reply {i}");
    }
    let mut gets = redis::pipe();
    for i in 0..10_000 {
        gets.cmd("GET").arg(format!("p:{}", i % 5_000));
    }
    let values: Vec<i64> = gets.query_async(&mut con).await.unwrap();
    assert!(values
        .iter()
        .enumerate()
        .all(|(i, v)| *v == (i % 5_000) as i64));
    println!("done-means 5: redis-cli and the redis crate work through the gateway; 10,000 pipelined writes and 10,000 reads came back in order");
}

#[tokio::test]
async fn local_and_relayed_replies_keep_pipeline_order() {
    let gw = RedisGateway::start("", &[]);
    // Inline commands; local replies (FENCE) interleaved with relayed ones.
    let request = b"ECHO a\r\nFENCE fg1~x~job\r\nECHO b\r\nFENCE fg1~4~job\r\nSET k v\r\nFENCE\r\nSET k w\r\nGET k\r\n";
    let expected = "$1\r\na\r\n-BADFENCE fencing token revision is not a number from 1 to 9223372036854775807\r\n$1\r\nb\r\n+OK\r\n+OK\r\n+OK\r\n-NOFENCE SET writes a protected key; send FENCE <token> on this connection first\r\n$1\r\nv\r\n";
    let out = raw(&gw, request, expected.len());
    assert_eq!(String::from_utf8_lossy(&out), expected);
}

#[tokio::test]
async fn resp3_clients_get_resp3_replies_from_fenced_writes() {
    let gw = RedisGateway::start("", &[]);
    let hello = raw(&gw, b"HELLO 3\r\n", 10);
    assert!(
        hello.starts_with(b"%"),
        "{}",
        String::from_utf8_lossy(&hello)
    );
    let request = b"*2\r\n$5\r\nHELLO\r\n$1\r\n3\r\nFENCE fg1~2~z\r\nZINCRBY z 1.5 m\r\nHSET h f v\r\nHGETALL h\r\n";
    let mut s = TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut text = Vec::new();
    let mut buf = [0u8; 4096];
    let tail = b"%1\r\n$1\r\nf\r\n$1\r\nv\r\n";
    while !text.ends_with(tail) {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&text));
        text.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&text);
    let after_hello = &text[text.find("+OK\r\n").expect("FENCE ok")..];
    // ZINCRBY answers a RESP3 double, not a RESP2 bulk string, through the fence script.
    assert_eq!(
        after_hello, "+OK\r\n,1.5\r\n:1\r\n%1\r\n$1\r\nf\r\n$1\r\nv\r\n",
        "{text}"
    );
}

#[tokio::test]
async fn garbage_closes_that_connection_only() {
    let gw = RedisGateway::start("max_request_bytes = 65536", &[]);
    let mut other = connect(&gw.url()).await;
    for garbage in [
        &b"*2\r\n$abc\r\n"[..],
        &b"\x00\x01\x02\xff\r\n"[..],
        &b"*1\r\n:5\r\n"[..],
    ] {
        let mut s = TcpStream::connect(gw.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(garbage).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(
            text.starts_with("-ERR Protocol error"),
            "{garbage:?}: {text}"
        );
        assert!(text.ends_with("\r\n"), "then closed: {text}");
    }
    // A request above max_request_bytes is refused, not buffered.
    let mut s = TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let big = "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$100000\r\n";
    s.write_all(big.as_bytes()).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out),
        "-ERR fencegate: request is larger than max_request_bytes (65536 bytes)\r\n"
    );
    let pong: String = redis::cmd("PING").query_async(&mut other).await.unwrap();
    assert_eq!(pong, "PONG");
    println!("done-means 6: three kinds of garbage and an oversized request each got an error and a close; another connection kept working");
}

#[tokio::test]
async fn the_fence_function_cannot_be_replaced_through_the_gateway() {
    let gw = RedisGateway::start("", &[]);
    let mut c = connect(&gw.url()).await;
    let fake = "#!lua name=fencegate_v1\nredis.register_function('fencegate_fence_v1', function(k, a) return redis.call(unpack(a, 4)) end)";
    for args in [
        vec!["FUNCTION", "LOAD", "REPLACE", fake],
        vec!["FUNCTION", "DELETE", "fencegate_v1"],
        vec!["FUNCTION", "FLUSH"],
    ] {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        let err = cmd.query_async::<Value>(&mut c).await.unwrap_err();
        assert_eq!(err.code(), Some("UNFENCEABLE"), "{args:?}: {err}");
    }
    let listed: Value = redis::cmd("FUNCTION")
        .arg("LIST")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(format!("{listed:?}").contains("fencegate_v1"));
    assert_eq!(gw.audit_records().len(), 3);
}
