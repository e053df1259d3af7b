//! Done-means 4 of issue 13: a tokenless flood for 60 s against a node whose Raft log and audit
//! log share a 50 MB volume (the worst layout: no separate `raft_dir`). Asserted: the audit log
//! stays within its budget (plus at most one write batch), the volume keeps the node's free-space
//! reservation, the node keeps issuing tokens and renewing leases, every fenced write of another
//! client succeeds, and the node logs no error but the audit budget alarm. Printed, not
//! asserted: that client's fenced-write latency (p50/p99/max) before and during the flood.
//!
//! Ignored by default (about 80 s; mounts a tmpfs, so it needs root); run it with
//! `cargo test --test redis flood -- --ignored --nocapture`.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::gateway_node::{GatewayNode, NodeOptions};
use crate::support::redis_server::RedisServer;
use crate::support::tmpfs::Tmpfs;
use bytes::BytesMut;
use fencegate_redis::frame::{parse, Frame, Limits};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MIB: u64 = 1024 * 1024;
const AUDIT_BUDGET: u64 = 16 * MIB;
const MIN_FREE: u64 = 8 * MIB;
/// The audit writer checks its budget before each batch, so it may end one batch over it: at
/// most `[audit] batch` (512) records of well under 2 KiB.
const ONE_BATCH: u64 = MIB;
const BEFORE: Duration = Duration::from_secs(10);
const FLOOD: Duration = Duration::from_secs(60);
const FLOODERS: usize = 6;
/// Requests per flood connection; each connection comes from another loopback address, so
/// neither a per-connection limit nor the per-client aggregation would help the node (the
/// gateway's refusal budget is shared by all connections).
const PIPELINE: usize = 100;
/// Write commands the flood cycles through (each is its own aggregation kind).
const WRITES: &[&str] = &[
    "SET k v",
    "APPEND k v",
    "INCR k",
    "DECR k",
    "INCRBY k 2",
    "SETNX k v",
    "SETRANGE k 0 v",
    "GETSET k v",
    "LPUSH k v",
    "RPUSH k v",
    "LPOP k",
    "SADD k v",
    "SPOP k",
    "HSET k f v",
    "HDEL k f",
    "ZADD k 1 m",
    "ZREM k m",
    "PFADD k a",
    "DEL k",
    "EXPIRE k 10",
];

// The field types differ between platforms.
#[allow(clippy::unnecessary_cast)]
fn free_bytes(path: &Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(path).unwrap();
    s.blocks_available() as u64 * s.fragment_size() as u64
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn percentiles(samples: &mut [Duration]) -> String {
    samples.sort();
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
    format!(
        "n={} p50={:?} p99={:?} max={:?}",
        samples.len(),
        at(0.50),
        at(0.99),
        samples.last().unwrap()
    )
}

/// Sends `PIPELINE` tokenless writes from `source` and reads every reply; returns how many were
/// refused with NOFENCE (anything else is a failure of the gateway).
async fn flood_once(gateway: SocketAddr, source: Ipv4Addr, n: usize) -> Result<u64, String> {
    let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
    socket
        .bind(SocketAddr::from((source, 0)))
        .map_err(|e| e.to_string())?;
    let mut s = socket.connect(gateway).await.map_err(|e| e.to_string())?;
    let mut out = BytesMut::new();
    for i in 0..PIPELINE {
        let line = WRITES[(n + i) % WRITES.len()];
        let args = line.split(' ').map(|a| {
            if a == "k" {
                format!("flood:{n}:{i}")
            } else {
                a.to_owned()
            }
        });
        Frame::command(args.map(bytes::Bytes::from)).encode(&mut out);
    }
    s.write_all(&out).await.map_err(|e| e.to_string())?;
    let mut buf = BytesMut::new();
    let mut refused = 0;
    let mut replies = 0;
    while replies < PIPELINE {
        while let Some((frame, len)) = parse(&buf, &Limits::default()).map_err(|e| e.to_string())? {
            let _ = buf.split_to(len);
            replies += 1;
            match frame {
                Frame::Error(e) if e.starts_with(b"NOFENCE") => refused += 1,
                other => return Err(format!("a tokenless write was answered {other:?}")),
            }
        }
        if replies == PIPELINE {
            break;
        }
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_buf(&mut buf))
            .await
            .map_err(|_| "no reply within 10 s".to_owned())?
            .map_err(|e| e.to_string())?;
        if read == 0 {
            return Err("the gateway closed the connection".into());
        }
    }
    Ok(refused)
}

#[derive(Default)]
struct LeaseStats {
    acquired: u64,
    failed: Vec<String>,
    renewed: u64,
    acquire_ms: Vec<Duration>,
    last_revision: u64,
}

/// Until `stop`: every 200 ms a lock is acquired and released (a token issued), and the
/// writer's lease `lease_id` is kept alive.
async fn lease_traffic(api: String, lease_id: String, stop: Arc<AtomicBool>) -> LeaseStats {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut stats = LeaseStats::default();
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        let started = Instant::now();
        let grant = http
            .post(format!("{api}/v1/locks/probe"))
            .json(&json!({ "ttl_ms": 2000 }))
            .send()
            .await;
        match grant {
            Ok(r) if r.status().is_success() => {
                stats.acquire_ms.push(started.elapsed());
                let body: Value = r.json().await.unwrap();
                let revision = body["revision"].as_u64().unwrap();
                if revision <= stats.last_revision {
                    stats.failed.push(format!(
                        "revision went from {} to {revision}",
                        stats.last_revision
                    ));
                }
                stats.last_revision = revision;
                stats.acquired += 1;
                let id = body["lease_id"].as_str().unwrap();
                let released = http.delete(format!("{api}/v1/leases/{id}")).send().await;
                if !released.is_ok_and(|r| r.status().is_success()) {
                    stats.failed.push(format!("release {round} failed"));
                }
            }
            other => stats.failed.push(format!("acquire {round}: {other:?}")),
        }
        let renewed = http
            .post(format!("{api}/v1/leases/{lease_id}/keepalive"))
            .send()
            .await;
        match renewed {
            Ok(r) if r.status().is_success() => stats.renewed += 1,
            other => stats.failed.push(format!("keepalive {round}: {other:?}")),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stats
}

/// Fenced SETs, one at a time every 2 ms, for `how_long`; returns each one's latency.
async fn fenced_writes(
    con: &mut redis::aio::MultiplexedConnection,
    how_long: Duration,
    from: u64,
) -> Vec<Duration> {
    let mut samples = Vec::new();
    let until = Instant::now() + how_long;
    let mut i = from;
    while Instant::now() < until {
        i += 1;
        let started = Instant::now();
        let reply: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("ledger:{i}"))
            .arg(i)
            .query_async(con)
            .await;
        samples.push(started.elapsed());
        if let Err(e) = reply {
            panic!("fenced write {i} failed: {e}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    samples
}

fn metric(text: &str, name: &str) -> String {
    text.lines()
        .find(|l| l.starts_with(name))
        .map_or("(absent)".into(), |l| l.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "an 80-second measurement that mounts a tmpfs (root); run with --ignored --nocapture"]
async fn a_tokenless_flood_on_a_small_volume_leaves_the_lock_service_and_fenced_writes_alone() {
    let volume = Tmpfs::mount("50m");
    let redis = RedisServer::start();
    let section = format!(
        "[redis]\nlisten = \"127.0.0.1:0\"\nupstream = \"{}\"\n\n[[redis.protect]]\npattern = \"*\"\nresource = \"*\"\n",
        redis.addr
    );
    let node_lines = format!("min_free_bytes = {MIN_FREE}");
    let audit_lines = format!(
        "max_total_bytes = {AUDIT_BUDGET}\nmax_file_bytes = {}",
        4 * MIB
    );
    let mut node = GatewayNode::start_with(
        &NodeOptions {
            node: &node_lines,
            audit: &audit_lines,
            volume: Some(volume.path()),
            ..NodeOptions::default()
        },
        &section,
        &[],
    );
    let port = node.bound_port("redis gateway listening");
    let gateway: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let api = format!("http://127.0.0.1:{}", node.api);
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let grant: Value = loop {
        assert!(
            Instant::now() < deadline,
            "no lock granted within 30 s:\n{}",
            node.log_text()
        );
        let r = http
            .post(format!("{api}/v1/locks/ledger"))
            .json(&json!({ "ttl_ms": 3000 }))
            .send()
            .await;
        if let Ok(r) = r {
            if r.status().is_success() {
                break r.json().await.unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let lease_id = grant["lease_id"].as_str().unwrap().to_owned();
    let token = grant["token"].as_str().unwrap().to_owned();
    let mut writer = redis::Client::open(format!("redis://{gateway}/"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("FENCE")
        .arg(&token)
        .query_async(&mut writer)
        .await
        .unwrap();

    let stop_leases = Arc::new(AtomicBool::new(false));
    let leases = tokio::spawn(lease_traffic(api.clone(), lease_id, stop_leases.clone()));
    let free_at_start = free_bytes(volume.path());
    let mut before = fenced_writes(&mut writer, BEFORE, 0).await;

    // The flood, and a sampler of the volume's free space.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut flooders = Vec::new();
    for f in 0..FLOODERS {
        let (stop, sent) = (stop.clone(), sent.clone());
        flooders.push(tokio::spawn(async move {
            let mut n = f;
            let mut errors = Vec::new();
            while !stop.load(Ordering::Relaxed) && errors.len() < 10 {
                let source = Ipv4Addr::new(127, 0, (n / 250 % 250) as u8 + 1, (n % 250) as u8 + 2);
                match flood_once(gateway, source, n).await {
                    Ok(refused) => {
                        sent.fetch_add(refused, Ordering::Relaxed);
                    }
                    Err(e) => errors.push(e),
                }
                n += FLOODERS;
            }
            errors
        }));
    }
    let min_free = Arc::new(AtomicU64::new(u64::MAX));
    let sampler = {
        let (stop, min_free) = (stop.clone(), min_free.clone());
        let path = volume.path().to_owned();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                min_free.fetch_min(free_bytes(&path), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let flood_started = Instant::now();
    let mut during = fenced_writes(&mut writer, FLOOD, 1_000_000).await;
    stop.store(true, Ordering::Relaxed);
    let mut flood_errors = Vec::new();
    for f in flooders {
        flood_errors.extend(f.await.unwrap());
    }
    let flood_took = flood_started.elapsed();
    sampler.await.unwrap();
    stop_leases.store(true, Ordering::Relaxed);
    let mut stats = leases.await.unwrap();
    // The last second's aggregate records are written within a second of its end.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let audit_bytes = dir_bytes(&node.audit_dir);
    let metrics = http
        .get(format!("{api}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let refused = sent.load(Ordering::Relaxed);
    println!(
        "volume: 50 MB tmpfs, Raft log and audit log on it; free at start {} MiB, lowest during the flood {} MiB (reservation {} MiB)",
        free_at_start / MIB,
        min_free.load(Ordering::Relaxed) / MIB,
        MIN_FREE / MIB
    );
    println!(
        "flood: {FLOODERS} tasks, {refused} tokenless writes refused in {flood_took:?} ({:.0}/s), {} connection errors",
        refused as f64 / flood_took.as_secs_f64(),
        flood_errors.len()
    );
    println!(
        "audit log: {audit_bytes} bytes (budget {AUDIT_BUDGET}); {}; {}",
        metric(&metrics, "fencegate_audit_over_budget"),
        metric(&metrics, "fencegate_audit_suppressed_total")
    );
    println!(
        "lock service during the test: {} tokens issued (last revision {}), {} lease renewals, {} failures; acquire latency {}",
        stats.acquired,
        stats.last_revision,
        stats.renewed,
        stats.failed.len(),
        percentiles(&mut stats.acquire_ms)
    );
    println!(
        "redis gateway: {}",
        metric(&metrics, "fencegate_redis_tarpitted_connections")
    );
    println!("fenced SET before the flood: {}", percentiles(&mut before));
    println!("fenced SET during the flood: {}", percentiles(&mut during));

    let errors: Vec<String> = node
        .log_text()
        .lines()
        .filter(|l| l.contains("ERROR") && !l.contains("over its size budget"))
        .map(str::to_owned)
        .collect();
    assert!(errors.is_empty(), "the node logged errors: {errors:#?}");
    assert!(
        flood_errors.is_empty(),
        "flood connections failed: {flood_errors:?}"
    );
    assert!(refused > 0, "the flood was refused");
    assert!(
        audit_bytes <= AUDIT_BUDGET + ONE_BATCH,
        "the audit log grew to {audit_bytes} bytes, over its {AUDIT_BUDGET}-byte budget"
    );
    assert!(
        min_free.load(Ordering::Relaxed) >= MIN_FREE,
        "the volume fell below the node's reservation"
    );
    assert!(
        stats.failed.is_empty(),
        "lock service failures: {:?}",
        stats.failed
    );
    assert!(
        stats.acquired >= (BEFORE + FLOOD).as_secs() * 2,
        "tokens kept being issued (one every 200 ms plus the call)"
    );
    assert_eq!(
        stats.renewed, stats.acquired,
        "every round renewed the lease"
    );
}
