//! `fencegate-chaos worker`: the job that `fencegate lock run` starts. It reads its token from
//! the environment and writes sequence-numbered records, each through a randomly chosen node's
//! gateway, logging every invoke and outcome to its history before and after the write.
//!
//! A refusal means the lock was lost: the worker stops (exit 3), as a real job would.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;

use crate::error::ChaosError;
use crate::history::{last_seq, monotonic_ns, Event, HistoryWriter, Op};

/// Exit code after a refusal: the worker's lock is gone.
pub const EXIT_REFUSED: u8 = 3;

/// The Redis list every worker appends its records to.
pub const REDIS_KEY: &str = "chaos:records";

/// Error words of the Redis gateway's refusals (README, Redis section).
const REFUSAL_CODES: [&str; 4] = ["FENCED", "NOFENCE", "BADFENCE", "UNFENCEABLE"];

pub struct WorkerOptions {
    pub id: u32,
    pub history: PathBuf,
    /// `node id=host:port` of each Redis gateway; node 0 is the store itself (fencing bypassed).
    pub redis: Vec<(u64, String)>,
    /// Pause between writes.
    pub interval: Duration,
    /// The worker stops by itself after this long, whatever happens to its runner.
    pub max_time: Duration,
    /// Where to write the process id, so the nemesis can pause or kill this job.
    pub pid_file: Option<PathBuf>,
}

pub fn run(opts: WorkerOptions) -> Result<u8, ChaosError> {
    let token =
        std::env::var("FENCING_TOKEN").map_err(|_| ChaosError::Environment("FENCING_TOKEN"))?;
    let rev: u64 = std::env::var("FENCING_REVISION")
        .ok()
        .and_then(|r| r.parse().ok())
        .ok_or(ChaosError::Environment("FENCING_REVISION"))?;
    if let Some(path) = &opts.pid_file {
        std::fs::write(path, std::process::id().to_string())
            .map_err(|e| ChaosError::file(path, e))?;
    }
    let mut history = HistoryWriter::open(&opts.history)?;
    let mut seq = last_seq(&opts.history);
    let event = |op, seq, node, detail| Event {
        t: monotonic_ns(),
        worker: opts.id,
        rev,
        op,
        seq,
        store: seq.map(|_| "redis".to_owned()),
        node,
        detail,
        pid: (op == Op::Start).then(std::process::id),
    };
    history.append(&event(Op::Start, None, None, None))?;

    let mut connections: HashMap<u64, redis::Connection> = HashMap::new();
    let started = Instant::now();
    let mut rng = rand::thread_rng();
    while started.elapsed() < opts.max_time {
        seq += 1;
        let (node, addr) = opts.redis.choose(&mut rng).expect("at least one gateway");
        let record = crate::history::record(opts.id, seq, rev);
        let connection = match connections.remove(node) {
            Some(c) => Ok(c),
            None => connect(addr, (*node != 0).then_some(token.as_str())),
        };
        let mut connection = match connection {
            Ok(c) => c,
            Err(e) => {
                history.append(&event(Op::Fail, Some(seq), Some(*node), Some(e)))?;
                std::thread::sleep(opts.interval);
                continue;
            }
        };
        history.append(&event(Op::Invoke, Some(seq), Some(*node), None))?;
        let answer = redis::cmd("RPUSH")
            .arg(REDIS_KEY)
            .arg(&record)
            .query::<i64>(&mut connection);
        match answer {
            Ok(_) => {
                history.append(&event(Op::Ok, Some(seq), Some(*node), None))?;
                connections.insert(*node, connection);
            }
            Err(e) => match e.code().filter(|c| REFUSAL_CODES.contains(c)) {
                Some(code) => {
                    let detail = Some(code.to_owned());
                    history.append(&event(Op::Refused, Some(seq), Some(*node), detail))?;
                    return Ok(EXIT_REFUSED);
                }
                None => {
                    let detail = Some(e.to_string());
                    history.append(&event(Op::Unknown, Some(seq), Some(*node), detail))?;
                }
            },
        }
        std::thread::sleep(opts.interval);
    }
    Ok(0)
}

/// A connection to `addr` with short timeouts, fenced with `token` when it is a gateway.
fn connect(addr: &str, token: Option<&str>) -> Result<redis::Connection, String> {
    let client = redis::Client::open(format!("redis://{addr}/")).map_err(|e| e.to_string())?;
    let mut connection = client
        .get_connection_with_timeout(Duration::from_secs(1))
        .map_err(|e| format!("connect: {e}"))?;
    let timeout = Some(Duration::from_secs(2));
    connection
        .set_read_timeout(timeout)
        .and_then(|()| connection.set_write_timeout(timeout))
        .map_err(|e| e.to_string())?;
    if let Some(token) = token {
        // Answered by the gateway itself; a failure here means nothing was written.
        redis::cmd("FENCE")
            .arg(token)
            .query::<()>(&mut connection)
            .map_err(|e| format!("FENCE: {e}"))?;
    }
    Ok(connection)
}
