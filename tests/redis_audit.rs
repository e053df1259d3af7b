//! Done-means 7 of the Redis filter: the audit log written by refusals verifies, its CLI
//! answers, the counters count, and an edited line is named by `fencegate audit verify`.

mod support;

use redis::aio::MultiplexedConnection;
use support::redis_gateway::RedisGateway;

async fn connect(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn cmd<T: redis::FromRedisValue>(
    con: &mut MultiplexedConnection,
    args: &[&str],
) -> redis::RedisResult<T> {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async(con).await
}

#[tokio::test]
async fn audit_log_verifies_and_an_edited_line_is_named() {
    let gw = RedisGateway::start("", &[]);
    let mut new = connect(&gw.url()).await;
    let mut old = connect(&gw.url()).await;
    cmd::<()>(&mut old, &["FENCE", "fg1~3~ledger"])
        .await
        .unwrap();
    cmd::<()>(&mut new, &["FENCE", "fg1~4~ledger"])
        .await
        .unwrap();
    cmd::<()>(&mut new, &["SET", "balance", "10"])
        .await
        .unwrap();
    for _ in 0..3 {
        let e = cmd::<()>(&mut old, &["SET", "balance", "99"])
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some("FENCED"));
    }
    let mut none = connect(&gw.url()).await;
    assert!(cmd::<()>(&mut none, &["DEL", "balance"]).await.is_err());
    assert!(cmd::<()>(&mut none, &["FENCE", "nonsense"]).await.is_err());

    let dir = gw.node.audit_dir.to_str().unwrap().to_owned();
    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("ok, 5 record(s) in 1 file(s)"), "{out}");
    println!("$ fencegate audit verify\n{out}");

    let (code, out, _) = gw.cli(&["audit", "tail", "-n", "2", "--dir", &dir]);
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(
        out.contains(" missing ") && out.contains(" malformed "),
        "{out}"
    );
    println!("$ fencegate audit tail -n 2\n{out}");

    let (code, out, _) = gw.cli(&[
        "audit",
        "query",
        "--resource",
        "ledger",
        "--store",
        "redis",
        "--since",
        "10m",
        "--json",
        "--dir",
        &dir,
    ]);
    assert_eq!(code, 0);
    let records: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 3, "{out}");
    assert!(records
        .iter()
        .all(|r| r["reason"] == "stale" && r["fence"] == 4 && r["revision"] == 3));

    // Counters on the admin port: refused by store and reason, applied by store.
    let metrics_port = std::fs::read_to_string(&gw.node.config)
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("api = \"127.0.0.1:")
                .map(|p| p.trim_end_matches('"').to_owned())
        })
        .unwrap();
    let text = reqwest::get(format!("http://127.0.0.1:{metrics_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "fencegate_fenced_writes_refused_total{store=\"redis\",reason=\"stale\"} 3",
        "fencegate_fenced_writes_refused_total{store=\"redis\",reason=\"missing\"} 1",
        "fencegate_fenced_writes_refused_total{store=\"redis\",reason=\"malformed\"} 1",
        "fencegate_fenced_writes_applied_total{store=\"redis\"} 1",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }

    // Delete the last line: the head file catches it.
    let path = gw.node.audit_dir.join("audit.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let shorter: Vec<&str> = text.lines().take(4).collect();
    std::fs::write(&path, shorter.join("\n") + "\n").unwrap();
    let (code, _, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("the log ends at seq 4 but its head file records seq 5"),
        "{err}"
    );
    std::fs::write(&path, &text).unwrap();

    // Edit one line: verify fails and names it.
    let edited: Vec<String> = text
        .lines()
        .enumerate()
        .map(|(i, l)| {
            if i == 1 {
                l.replace("\"fence\":4", "\"fence\":2")
            } else {
                l.to_owned()
            }
        })
        .collect();
    assert_ne!(edited.join("\n") + "\n", text);
    std::fs::write(&path, edited.join("\n") + "\n").unwrap();
    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("audit.jsonl:2: record seq 2 was altered"),
        "{err}"
    );
    println!("$ fencegate audit verify   (after editing line 2)\n{err}exit code {code}");
}

/// Fenced SETs one at a time on one connection for `run`; their latencies.
fn fenced_latencies(
    addr: std::net::SocketAddr,
    run: std::time::Duration,
) -> Vec<std::time::Duration> {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut buf = [0u8; 256];
    c.write_all(b"*2\r\n$5\r\nFENCE\r\n$11\r\nfg1~1~flood\r\n")
        .unwrap();
    let n = c.read(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"+OK\r\n");
    let mut out = Vec::new();
    let end = std::time::Instant::now() + run;
    while std::time::Instant::now() < end {
        let t = std::time::Instant::now();
        c.write_all(b"*3\r\n$3\r\nSET\r\n$2\r\nok\r\n$1\r\nv\r\n")
            .unwrap();
        let n = c.read(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"+OK\r\n");
        out.push(t.elapsed());
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenless_flood_is_aggregated_in_the_audit_log() {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;
    let secs: u64 = std::env::var("FENCEGATE_FLOOD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let gw = RedisGateway::start("", &[]);
    let addr = gw.addr;
    let (before, during, refused) = tokio::task::spawn_blocking(move || {
        let before = fenced_latencies(addr, Duration::from_secs(secs.min(5)));
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicU64::new(0));
        let flooders: Vec<_> = (0..2)
            .map(|_| {
                let (stop, refused) = (stop.clone(), refused.clone());
                std::thread::spawn(move || {
                    let mut c = std::net::TcpStream::connect(addr).unwrap();
                    let batch = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n".repeat(200);
                    let mut buf = vec![0u8; 1 << 16];
                    while !stop.load(Ordering::Relaxed) {
                        c.write_all(&batch).unwrap();
                        let mut lines = 0;
                        while lines < 200 {
                            let n = c.read(&mut buf).unwrap();
                            assert!(n > 0);
                            lines += buf[..n].iter().filter(|b| **b == b'\n').count();
                        }
                        refused.fetch_add(200, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        let during = fenced_latencies(addr, Duration::from_secs(secs));
        stop.store(true, Ordering::Relaxed);
        for f in flooders {
            f.join().unwrap();
        }
        (before, during, refused.load(Ordering::Relaxed))
    })
    .await
    .unwrap();
    // The last second's aggregates are written once that second is over.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let count = |records: &[serde_json::Value]| -> u64 {
        records
            .iter()
            .filter(|r| r["reason"] == "missing")
            .map(|r| {
                let detail = r["detail"].as_str().unwrap_or_default();
                match detail.strip_prefix("aggregate: ") {
                    Some(rest) => rest.split(' ').next().unwrap().parse().unwrap(),
                    None => 1,
                }
            })
            .sum()
    };
    let records = loop {
        let records = gw.audit_records();
        if count(&records) >= refused || std::time::Instant::now() > deadline {
            break records;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let bytes: u64 = std::fs::read_dir(&gw.node.audit_dir)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let p = |v: &[Duration], q: f64| v[((v.len() - 1) as f64 * q) as usize];
    println!(
        "tokenless flood {secs}s, 2 connections: {refused} refusals -> {} audit records, {bytes} bytes on disk; fenced SET p50/p99 before {:?}/{:?}, during {:?}/{:?}",
        records.len(),
        p(&before, 0.5),
        p(&before, 0.99),
        p(&during, 0.5),
        p(&during, 0.99)
    );
    assert!(refused > 1000, "the flood sent only {refused}");
    // Flooding connections are slowed (tarpit), not the others.
    let limit = (p(&before, 0.99) * 5).max(Duration::from_millis(100));
    assert!(
        p(&during, 0.99) < limit,
        "fenced SET p99 during the flood is above {limit:?}"
    );
    assert_eq!(
        count(&records),
        refused,
        "every refusal is in a record or an aggregate"
    );
    assert!(
        records.len() as u64 <= 2 * 11 * (secs + 2),
        "{} records for {secs}s",
        records.len()
    );
    let (code, out, err) = gw.cli(&[
        "audit",
        "verify",
        "--dir",
        gw.node.audit_dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
}
