//! The footprint suite: the resident memory (VmRSS) of a `fencegate serve` node running all
//! three gateways, idle, then after 1,000 idle client connections to each gateway in turn (all
//! kept open, so each figure adds to the one before).
//!
//! An idle connection is a session that has done one exchange and then waits: Redis `PING`
//! (the gateway holds an upstream connection for it), PostgreSQL startup until
//! `ReadyForQuery` (an upstream backend behind each), S3 one signed `GET` of a missing key on a
//! keep-alive connection.

use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::load::median;
use crate::machine;
use crate::process::free_port;
use crate::report::{Row, Section};
use crate::servers::{
    postgres_section, redis_section, s3_section, Moto, Node, Postgres, Redis, S3_ACCESS_KEY,
    S3_SECRET,
};
use crate::sigv4;

const CONNECTIONS: usize = 1000;

#[derive(Clone, Copy)]
enum Store {
    Redis,
    Postgres,
    S3,
}

async fn read_until(stream: &mut TcpStream, done: impl Fn(&[u8]) -> bool) -> anyhow::Result<()> {
    let mut seen = Vec::new();
    let mut chunk = [0u8; 4096];
    while !done(&seen) {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            bail!(
                "closed after {} bytes: {:?}",
                seen.len(),
                String::from_utf8_lossy(&seen)
            );
        }
        seen.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

/// Whether `buf` holds a complete ReadyForQuery ('Z') message at a message boundary.
fn has_ready_for_query(buf: &[u8]) -> bool {
    let mut at = 0;
    while buf.len() >= at + 5 {
        let len = u32::from_be_bytes([buf[at + 1], buf[at + 2], buf[at + 3], buf[at + 4]]) as usize;
        if buf[at] == b'Z' && buf.len() >= at + 1 + len {
            return true;
        }
        if buf[at] == b'E' && buf.len() >= at + 1 + len {
            return true;
        }
        at += 1 + len;
    }
    false
}

async fn open(store: Store, port: u16) -> anyhow::Result<TcpStream> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    match store {
        Store::Redis => {
            stream.write_all(b"*1\r\n$4\r\nPING\r\n").await?;
            read_until(&mut stream, |b| b.ends_with(b"\r\n")).await?;
        }
        Store::Postgres => {
            let mut body = Vec::new();
            body.extend_from_slice(&196_608u32.to_be_bytes());
            body.extend_from_slice(b"user\0postgres\0database\0postgres\0\0");
            let mut message = ((body.len() + 4) as u32).to_be_bytes().to_vec();
            message.extend_from_slice(&body);
            stream.write_all(&message).await?;
            read_until(&mut stream, has_ready_for_query).await?;
        }
        Store::S3 => {
            let host = format!("127.0.0.1:{port}");
            let path = "/bench/missing";
            let mut request = format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n");
            for (name, value) in
                sigv4::sign("GET", &host, path, S3_ACCESS_KEY, S3_SECRET, "us-east-1")
            {
                request.push_str(&format!("{name}: {value}\r\n"));
            }
            request.push_str("\r\n");
            stream.write_all(request.as_bytes()).await?;
            read_until(&mut stream, |b| b.windows(4).any(|w| w == b"\r\n\r\n")).await?;
        }
    }
    Ok(stream)
}

/// Opens `CONNECTIONS` sessions to `port`, 50 at a time.
async fn open_many(store: Store, port: u16) -> anyhow::Result<Vec<TcpStream>> {
    let mut all = Vec::with_capacity(CONNECTIONS);
    while all.len() < CONNECTIONS {
        let mut set = JoinSet::new();
        for _ in 0..50.min(CONNECTIONS - all.len()) {
            set.spawn(open(store, port));
        }
        while let Some(done) = set.join_next().await {
            all.push(done??);
        }
    }
    Ok(all)
}

/// Megabytes (10^6 bytes), the unit of the targets.
fn mb(kib: u64) -> f64 {
    kib as f64 * 1024.0 / 1e6
}

pub async fn run(reps: usize) -> anyhow::Result<Section> {
    let dir = tempfile::Builder::new()
        .prefix("fencegate-bench-fp")
        .tempdir()?;
    let redis = Redis::start(dir.path())?;
    let pg = Postgres::start(CONNECTIONS as u32 + 50)?;
    crate::servers::install_fence_sql(&pg)?;
    let moto = Moto::start(dir.path())?;
    crate::s3::put(&reqwest::Client::new(), moto.port, None, Vec::new(), None).await?;

    let stores = [
        (Store::Redis, "Redis"),
        (Store::Postgres, "PostgreSQL"),
        (Store::S3, "S3"),
    ];
    // [idle, after redis, after postgres, after s3] per repetition.
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); stores.len() + 1];
    for rep in 0..reps {
        let ports = [free_port(), free_port(), free_port()];
        let sections = format!(
            "{}{}{}",
            redis_section(ports[0], redis.port),
            postgres_section(ports[1], pg.port),
            s3_section(ports[2], moto.port)
        );
        let node = Node::start(&sections, &ports)?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let mut rss = vec![node.rss_kib()?];
        let mut held = Vec::new();
        for (i, (store, name)) in stores.iter().enumerate() {
            held.push(open_many(*store, ports[i]).await.with_context(|| {
                format!(
                    "opening {CONNECTIONS} {name} connections; node log:\n{}",
                    node.log_text()
                )
            })?);
            tokio::time::sleep(Duration::from_secs(1)).await;
            rss.push(node.rss_kib()?);
        }
        eprintln!(
            "footprint rep {rep}: idle {:.1} MB, +Redis {:.1}, +PostgreSQL {:.1}, +S3 {:.1} MB",
            mb(rss[0]),
            mb(rss[1]),
            mb(rss[2]),
            mb(rss[3])
        );
        for (i, kib) in rss.iter().enumerate() {
            samples[i].push(mb(*kib));
        }
        drop(held);
        drop(node);
        // Let PostgreSQL reap the backends before the next node opens as many again.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let figures: Vec<f64> = samples.iter_mut().map(|s| median(s)).collect();
    let mut rows = vec![Row {
        what: "RSS idle (all three gateways and the authority)".into(),
        direct: "-".into(),
        gateway: format!("{:.1} MB", figures[0]),
        ratio: None,
        target: "<= 30 MB".into(),
    }];
    for (i, (_, name)) in stores.iter().enumerate() {
        rows.push(Row {
            what: format!("+ {CONNECTIONS} idle {name} connections"),
            direct: format!("{:.1} MB", figures[i]),
            gateway: format!(
                "{:.1} MB (+{:.1})",
                figures[i + 1],
                figures[i + 1] - figures[i]
            ),
            ratio: None,
            target: "<= +10 MB".into(),
        });
    }
    Ok(Section {
        name: "footprint".into(),
        title: "Footprint: gateway memory".into(),
        setup: vec![
            format!("Machine: {}", machine::describe()),
            format!("fencegate {} ({}), release build; VmRSS of the `fencegate serve` process from /proc/PID/status", env!("CARGO_PKG_VERSION"), machine::git_head()),
            "One node: authority (one member), Redis, PostgreSQL and S3 gateways, each in front of its own server; idle = 2 s after start, before any client".into(),
            format!("Then {CONNECTIONS} idle connections to each gateway in turn, all kept open (each row adds to the one before): Redis after `PING`; PostgreSQL after startup to `ReadyForQuery` (each with its upstream backend); S3 after one signed `GET` of a missing key (keep-alive)"),
            format!("{reps} repetitions with a fresh node each; medians. 1 MB = 10^6 bytes"),
        ],
        headers: ["before".into(), "after".into()],
        rows,
        tables: Vec::new(),
        notes: Vec::new(),
    })
}
