//! Done-means 7 of the Redis filter: the audit log written by refusals verifies, its CLI
//! answers, the counters count, and an edited line is named by `fencegate audit verify`.
//! Retention (issue 15, done-means 5): `audit prune --keep 2` on a log the node rotated, then
//! `audit verify` passes from the kept checkpoint and an edited kept record still fails. Disk
//! faults (issue 17, done-means 4): with the audit log on a full volume, refusals still refuse,
//! the node reports it, what was written still verifies, and writing resumes once space returns.

use std::time::{Duration, Instant};

use crate::support::gateway_node::NodeOptions;
use crate::support::redis_client::{cmd, connect};
use crate::support::redis_gateway::RedisGateway;
use crate::support::tmpfs::Tmpfs;
use redis::aio::MultiplexedConnection;

#[tokio::test]
async fn audit_log_verifies_and_an_edited_line_is_named() {
    let gw = RedisGateway::start("", &[]);
    let (mut old, _new) = gw.old_and_new().await;
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
    std::fs::write(&path, fence_edited(&text)).unwrap();
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

/// A write with the stale token `fg1~3~ledger` after `fg1~4~ledger` fenced the store: refused.
async fn refused_as_stale(old: &mut MultiplexedConnection, value: &str) {
    let e = cmd::<()>(old, &["SET", "balance", value])
        .await
        .expect_err("a stale write is refused");
    assert_eq!(e.code(), Some("FENCED"), "{e}");
}

#[tokio::test]
async fn audit_prune_keeps_two_files_and_verify_starts_from_their_checkpoint() {
    // A small rotate size, so the node rotates every two or three records.
    let gw = RedisGateway::start_with(
        &NodeOptions {
            audit: "max_file_bytes = 1500",
            ..NodeOptions::default()
        },
        "",
        &[],
    );
    let (mut old, _new) = gw.old_and_new().await;
    for n in 0..20 {
        refused_as_stale(&mut old, &n.to_string()).await;
    }
    let dir = gw.node.audit_dir.to_str().unwrap().to_owned();
    let rotated = |dir: &str| -> Vec<std::path::PathBuf> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                name.starts_with("audit-") && name.ends_with(".jsonl")
            })
            .collect();
        files.sort();
        files
    };
    let before = rotated(&dir);
    assert!(before.len() >= 5, "the node rotated: {before:?}");

    let (code, out, err) = gw.cli(&["audit", "prune", "--keep", "2", "--dir", &dir]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("it now verifies from checkpoint at seq"),
        "{out}"
    );
    println!("$ fencegate audit prune --keep 2\n{out}");
    let kept = rotated(&dir);
    assert_eq!(kept, before[before.len() - 2..]);
    assert!(
        gw.node.audit_dir.join("audit.jsonl").exists(),
        "never the active file"
    );

    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("verified from checkpoint at seq")
            && out.contains("older files removed by `audit prune`"),
        "{out}"
    );
    println!("$ fencegate audit verify\n{out}");

    // The node writes on after the prune; the log still verifies.
    for n in 20..25 {
        refused_as_stale(&mut old, &n.to_string()).await;
    }
    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 0, "{out}{err}");

    // Editing a kept record fails and names it.
    let text = std::fs::read_to_string(&kept[0]).unwrap();
    assert!(text.starts_with("{\"checkpoint\""), "{text}");
    std::fs::write(&kept[0], fence_edited(&text)).unwrap();
    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 1, "{out}{err}");
    let name = kept[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        err.contains(&format!("{name}:2: record seq")) && err.contains("was altered"),
        "{err}"
    );
    println!("$ fencegate audit verify   (after editing a kept record)\n{err}exit code {code}");
}

/// `text` (a log file) with the fence of its second line changed from 4 to 2: an edit that
/// `audit verify` must name.
fn fence_edited(text: &str) -> String {
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
    let edited = edited.join("\n") + "\n";
    assert_ne!(edited, text, "the second line has no \"fence\":4 to edit");
    edited
}

/// `/healthz`: status and body.
async fn healthz(gw: &RedisGateway) -> (u16, serde_json::Value) {
    let reply = reqwest::get(format!("http://127.0.0.1:{}/healthz", gw.node.api))
        .await
        .unwrap();
    let status = reply.status().as_u16();
    (status, reply.json().await.unwrap())
}

/// Polls `/healthz` until `done` holds (bounded: 15 s).
async fn healthz_until(
    gw: &RedisGateway,
    what: &str,
    done: impl Fn(u16, &serde_json::Value) -> bool,
) -> (u16, serde_json::Value) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, body) = healthz(gw).await;
        if done(status, &body) {
            return (status, body);
        }
        assert!(
            Instant::now() < deadline,
            "/healthz never {what}; last {status} {body}\n{}",
            gw.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A metric's value on `/metrics` (0 when absent).
async fn metric(gw: &RedisGateway, name: &str) -> f64 {
    let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", gw.node.api))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    crate::support::metrics::sample(&text, name).unwrap_or(0.0)
}

/// Fills the volume at `dir` with one file until it refuses even one more byte.
fn fill(dir: &std::path::Path) -> std::path::PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path).unwrap();
    let chunk = vec![0u8; 1 << 16];
    for size in [1 << 16, 4096, 512, 1] {
        // Bounded: the volume is small.
        for _ in 0..1_000_000 {
            match file.write(&chunk[..size]) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
    }
    let err = file.write(&chunk[..1]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(28), "ENOSPC: {err}");
    path
}

#[tokio::test]
async fn a_full_audit_volume_still_refuses_reports_it_and_writing_resumes() {
    let test = "a_full_audit_volume_still_refuses_reports_it_and_writing_resumes";
    let Some(volume) = Tmpfs::mount_or_skip("1m", test) else {
        return;
    };
    // The audit log alone on a 1 MB volume (the Raft log elsewhere), no free-space reservation:
    // here the disk really fills up.
    let gw = RedisGateway::start_with(
        &NodeOptions {
            node: "min_free_bytes = 0",
            audit_volume: Some(volume.path()),
            ..NodeOptions::default()
        },
        "",
        &[],
    );
    let dir = gw.node.audit_dir.to_str().unwrap().to_owned();
    let (mut old, mut new) = gw.old_and_new().await;
    refused_as_stale(&mut old, "before").await;
    assert_eq!(gw.audit_records().len(), 1);
    // Healthy before the disk fills (awaited: /healthz also probes the upstream, which a loaded
    // machine may answer late).
    healthz_until(&gw, "healthy before the disk filled", |s, _| s == 200).await;

    let filler = fill(volume.path());
    // A value that must appear nowhere in the node's log.
    const VALUE: &str = "value-while-full-4711";
    for _ in 0..10 {
        refused_as_stale(&mut old, VALUE).await;
    }
    let mut tokenless = connect(&gw.url()).await;
    assert!(
        cmd::<()>(&mut tokenless, &["SET", "balance", VALUE])
            .await
            .is_err(),
        "a tokenless write is refused"
    );
    // The current holder's writes are not held up by the audit log.
    cmd::<()>(&mut new, &["SET", "balance", "11"])
        .await
        .unwrap();
    let mut direct = connect(&format!("redis://{}/", gw.redis.addr)).await;
    let balance: String = cmd(&mut direct, &["GET", "balance"]).await.unwrap();
    assert_eq!(balance, "11", "no refused write reached the store");

    // The node reports it: /healthz, metrics, one log line without data values.
    let (status, body) = healthz_until(&gw, "reported the audit log", |_, b| {
        b["audit"]["ok"] == false
    })
    .await;
    println!("while full: /healthz {status} {body}");
    assert_eq!(status, 503);
    let reason = body["audit"]["reason"].as_str().unwrap();
    assert!(reason.contains("No space left on device"), "{reason}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("audit log cannot be written"),
        "{body}"
    );
    let failing = metric(&gw, "fencegate_audit_write_failing").await;
    let errors = metric(&gw, "fencegate_audit_write_errors_total").await;
    let unrecorded = metric(&gw, "fencegate_audit_unrecorded_refusals_total").await;
    println!("while full: fencegate_audit_write_failing {failing}, fencegate_audit_write_errors_total {errors}, fencegate_audit_unrecorded_refusals_total {unrecorded}");
    assert_eq!(failing, 1.0);
    assert!(errors >= 1.0 && unrecorded >= 1.0);
    let log = gw.log_text();
    assert!(log.contains("audit log cannot be written"), "{log}");
    assert!(
        !log.contains(VALUE),
        "a data value in the node's log:\n{log}"
    );

    // Nothing already written is corrupted, and no failed write left half a record behind.
    let active = std::fs::read(gw.node.audit_dir.join("audit.jsonl")).unwrap();
    assert_eq!(
        active.last(),
        Some(&b'\n'),
        "the active file ends with a whole line"
    );
    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 0, "{out}{err}");
    println!("while full: $ fencegate audit verify\n{out}");
    let written = gw.audit_records().len();
    assert!(
        written < 12,
        "{written} records: some refusals could not be recorded"
    );

    // Space returns: the node says so by itself, and the chain goes on.
    std::fs::remove_file(filler).unwrap();
    let (status, body) = healthz_until(&gw, "healthy again", |s, _| s == 200).await;
    println!("space back: /healthz {status} {body}");
    refused_as_stale(&mut old, "after").await;
    assert_eq!(gw.audit_records().len(), written + 1);
    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 0, "{out}{err}");
    println!("space back: $ fencegate audit verify\n{out}");
    assert_eq!(metric(&gw, "fencegate_audit_write_failing").await, 0.0);
    assert!(gw.log_text().contains("audit log writable again"));
    let balance: String = cmd(&mut direct, &["GET", "balance"]).await.unwrap();
    assert_eq!(balance, "11");
}
