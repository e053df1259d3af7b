//! One seed, end to end: start the world and the workers, let the nemesis loose for the run's
//! duration, stop everything, gather the evidence and check it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rand::SeedableRng;
use serde::Serialize;

use crate::check::{check, AuditRow, Evidence, Verdict};
use crate::error::ChaosError;
use crate::history::{read_all, Event, Op};
use crate::nemesis::{Fault, FaultKind, Nemesis};
use crate::s3_store::S3Client;
use crate::worker::{PG_TABLE, REDIS_KEY};
use crate::workload::{WorkerSpec, Workload};
use crate::world::World;
use fencegate_testkit::postgres_server::PgServer;
use fencegate_testkit::redis_server::RedisServer;
use fencegate_testkit::s3_server::MotoServer;

pub struct RunOptions {
    pub seed: u64,
    pub duration: Duration,
    pub workers: u32,
    /// Workers write straight to the store, without gateway or token: the checker must then
    /// find violations.
    pub bypass: bool,
    /// The faults the nemesis chooses from (all when empty).
    pub faults: Vec<FaultKind>,
    /// Which stores the workers write to.
    pub redis: bool,
    pub postgres: bool,
    pub s3: bool,
    /// Where the run's histories and logs go (kept); a temp dir otherwise.
    pub dir: Option<PathBuf>,
}

/// Time from a fault until the next acknowledged write, per kind.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Unavailability {
    pub total_ms: u64,
    pub max_ms: u64,
}

pub struct SeedReport {
    pub seed: u64,
    pub duration: Duration,
    pub runs: u32,
    pub faults: BTreeMap<FaultKind, usize>,
    pub unavailability: BTreeMap<FaultKind, Unavailability>,
    pub torn_lines: usize,
    pub verdict: Verdict,
}

pub async fn run_seed(opts: &RunOptions) -> Result<SeedReport, ChaosError> {
    let temp = tempfile::tempdir().map_err(|e| ChaosError::file(Path::new("/tmp"), e))?;
    let dir = match &opts.dir {
        Some(dir) => {
            let dir = dir.join(format!("seed-{}", opts.seed));
            std::fs::create_dir_all(&dir).map_err(|e| ChaosError::file(&dir, e))?;
            dir
        }
        None => temp.path().to_owned(),
    };
    let mut world = World::start(3, opts.redis, opts.postgres, opts.s3, opts.bypass).await;
    let fencegate = fencegate_testkit::fencegate_bin();
    let me = std::env::current_exe().map_err(|e| ChaosError::file(Path::new("self"), e))?;
    let workload = Workload::start(
        &dir,
        opts.workers,
        WorkerSpec {
            fencegate: fencegate.clone(),
            me,
            endpoints: world.cluster.endpoints(),
            targets: world.worker_targets(opts.bypass),
            max_time: opts.duration + Duration::from_secs(60),
        },
    );
    let mut nemesis = Nemesis::new(rand::rngs::StdRng::seed_from_u64(opts.seed), &opts.faults);
    let until = tokio::time::Instant::now() + opts.duration;
    nemesis.run(&mut world, &workload, until).await;
    let runs = workload.runs();
    workload.stop(Duration::from_secs(15)).await;

    let (events, torn_lines) = read_all(&dir)?;
    let mut stored = BTreeMap::new();
    if let Some(redis) = &world.redis {
        stored.insert("redis".to_owned(), redis_records(redis)?);
    }
    if let Some(pg) = &world.pg {
        stored.insert("postgres".to_owned(), pg_records(pg).await?);
    }
    if let Some(moto) = &world.s3 {
        stored.insert("s3".to_owned(), s3_records(moto).await?);
    }
    let mut audit = Vec::new();
    let mut verify = BTreeMap::new();
    for id in world.cluster.ids() {
        let audit_dir = world.audit_dir(id);
        audit.extend(audit_rows(&fencegate, id, &audit_dir)?);
        verify.insert(id, audit_verify(&fencegate, &audit_dir));
    }
    let verdict = check(&Evidence {
        events: events.clone(),
        stored,
        audit,
        verify,
        lease_ends: crate::stop_times::read_all(&dir)?,
    });
    if opts.dir.is_some() {
        let faults = serde_json::to_vec_pretty(&nemesis.faults).unwrap_or_default();
        let _ = std::fs::write(dir.join("faults.json"), faults);
        let logs = dir.join("nodes");
        let _ = std::fs::create_dir_all(&logs);
        for id in world.cluster.ids() {
            let _ = std::fs::copy(
                world.cluster.log_path(id),
                logs.join(format!("node{id}.log")),
            );
        }
    }
    Ok(SeedReport {
        seed: opts.seed,
        duration: opts.duration,
        runs,
        faults: nemesis.counts(),
        unavailability: unavailability(&nemesis.faults, &events),
        torn_lines,
        verdict,
    })
}

/// The records the Redis list holds, in list order, read from the server itself.
fn redis_records(redis: &RedisServer) -> Result<Vec<String>, ChaosError> {
    let store = |e: redis::RedisError| ChaosError::Store(format!("redis: {e}"));
    let client = redis::Client::open(redis.url()).map_err(store)?;
    let mut connection = client
        .get_connection_with_timeout(Duration::from_secs(5))
        .map_err(store)?;
    redis::cmd("LRANGE")
        .arg(REDIS_KEY)
        .arg(0)
        .arg(-1)
        .query(&mut connection)
        .map_err(store)
}

/// The records the table holds, in commit order (the server tracks commit timestamps), read
/// from the server itself.
async fn pg_records(pg: &PgServer) -> Result<Vec<String>, ChaosError> {
    let store = |e: tokio_postgres::Error| ChaosError::Store(format!("postgres: {e}"));
    let (client, connection) = tokio_postgres::connect(&pg.dsn("postgres"), tokio_postgres::NoTls)
        .await
        .map_err(store)?;
    tokio::spawn(connection);
    let rows = client
        .query(
            &format!("SELECT record FROM {PG_TABLE} ORDER BY pg_xact_commit_timestamp(xmin), id"),
            &[],
        )
        .await
        .map_err(store)?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The records the manifest's commit log holds, in log order, read from moto itself.
async fn s3_records(moto: &MotoServer) -> Result<Vec<String>, ChaosError> {
    let store = |e: String| ChaosError::Store(format!("s3: {e}"));
    let addr = moto.endpoint.trim_start_matches("http://");
    let client = S3Client::new(addr, Duration::from_secs(10)).map_err(store)?;
    client.log_records().await.map_err(store)
}

/// Node `id`'s refusal records, through `fencegate audit query --json`.
fn audit_rows(fencegate: &Path, id: u64, dir: &Path) -> Result<Vec<AuditRow>, ChaosError> {
    let out = Command::new(fencegate)
        .args(["audit", "query", "--json", "--dir"])
        .arg(dir)
        .output()
        .map_err(|source| ChaosError::Spawn {
            what: "fencegate audit query".into(),
            source,
        })?;
    if !out.status.success() {
        return Err(ChaosError::Audit {
            node: id,
            message: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let mut rows = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let record: fencegate_core::AuditRecord =
            serde_json::from_str(line).map_err(|e| ChaosError::Audit {
                node: id,
                message: format!("unreadable record ({e}): {line}"),
            })?;
        rows.push(AuditRow {
            node: id,
            store: record.event.store,
            revision: record.event.revision,
        });
    }
    Ok(rows)
}

/// `fencegate audit verify` on one node's audit directory.
fn audit_verify(fencegate: &Path, dir: &Path) -> Result<(), String> {
    let out = Command::new(fencegate)
        .args(["audit", "verify", "--dir"])
        .arg(dir)
        .output()
        .map_err(|e| format!("cannot run fencegate audit verify: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Per fault kind: the time from each fault to the first acknowledged write after it.
fn unavailability(faults: &[Fault], events: &[Event]) -> BTreeMap<FaultKind, Unavailability> {
    let acks: Vec<u64> = events
        .iter()
        .filter(|e| e.op == Op::Ok)
        .map(|e| e.t)
        .collect();
    let mut out: BTreeMap<FaultKind, Unavailability> = BTreeMap::new();
    for fault in faults {
        let Some(next) = acks.iter().find(|t| **t >= fault.t) else {
            continue;
        };
        let ms = (next - fault.t) / 1_000_000;
        let entry = out.entry(fault.kind).or_default();
        entry.total_ms += ms;
        entry.max_ms = entry.max_ms.max(ms);
    }
    out
}
