//! `fencegate-chaos worker`: the job that `fencegate lock run` starts. It reads its token from
//! the environment and writes sequence-numbered records, each to a randomly chosen store through
//! a randomly chosen node's gateway, logging every invoke and outcome to its history before and
//! after the write.
//!
//! A refusal means the lock was lost: the worker stops (exit 3), as a real job would.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;

use crate::error::ChaosError;
use crate::history::{last_seq, monotonic_ns, parse_record, Event, HistoryWriter, Op};
use crate::s3_store::{Answer, S3Client};

/// Exit code after a refusal: the worker's lock is gone.
pub const EXIT_REFUSED: u8 = 3;

/// The Redis list every worker appends its records to.
pub const REDIS_KEY: &str = "chaos:records";
/// The PostgreSQL table every worker inserts its records into.
pub const PG_TABLE: &str = "chaos.records";

/// Error words of the Redis gateway's refusals (README, Redis section).
const REDIS_REFUSALS: [&str; 4] = ["FENCED", "NOFENCE", "BADFENCE", "UNFENCEABLE"];
/// SQLSTATEs of fencing refusals (README, PostgreSQL section); `55P03` (lock timeout) is not
/// one: nothing is written, but it is no verdict on the token.
const PG_REFUSALS: [&str; 5] = ["FG001", "FG002", "FG003", "FG004", "FG005"];

/// How long one write may take before its outcome is unknown.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// A store the worker writes to, as `--redis` / `--postgres` / `--s3` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Store {
    Redis,
    Postgres,
    S3,
}

impl Store {
    pub fn name(self) -> &'static str {
        match self {
            Store::Redis => "redis",
            Store::Postgres => "postgres",
            Store::S3 => "s3",
        }
    }
}

pub struct WorkerOptions {
    pub id: u32,
    pub history: PathBuf,
    /// `(store, node id, host:port)` of every gateway; node 0 is the store itself (fencing
    /// bypassed).
    pub targets: Vec<(Store, u64, String)>,
    /// Pause between writes.
    pub interval: Duration,
    /// The worker stops by itself after this long, whatever happens to its runner.
    pub max_time: Duration,
    /// Where to write the process id, so the nemesis can pause or kill this job.
    pub pid_file: Option<PathBuf>,
}

/// What one write got.
enum Outcome {
    Ok,
    Refused(String),
    Unknown(String),
    /// Nothing was sent.
    Fail(String),
}

enum Connection {
    Redis(redis::Connection),
    Postgres(tokio_postgres::Client),
    /// Through a gateway with the token, or (fencing bypassed) straight to moto, appending to
    /// the manifest's log from position `next`.
    S3 {
        client: S3Client,
        token: Option<String>,
        next: u64,
    },
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
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| ChaosError::Spawn {
            what: "the worker's runtime".into(),
            source,
        })?;
    let mut history = HistoryWriter::open(&opts.history)?;
    let mut seq = last_seq(&opts.history);
    let event = |op, seq, store: Option<Store>, node, detail| Event {
        t: monotonic_ns(),
        worker: opts.id,
        rev,
        op,
        seq,
        store: store.map(|s| s.name().to_owned()),
        node,
        detail,
        pid: (op == Op::Start).then(std::process::id),
    };
    history.append(&event(Op::Start, None, None, None, None))?;

    let mut connections: HashMap<(Store, u64), Connection> = HashMap::new();
    let started = Instant::now();
    let mut rng = rand::thread_rng();
    while started.elapsed() < opts.max_time {
        seq += 1;
        let (store, node, addr) = opts.targets.choose(&mut rng).expect("at least one target");
        let (store, node) = (*store, *node);
        let record = crate::history::record(opts.id, seq, rev);
        let fenced = (node != 0).then_some(token.as_str());
        let connection = match connections.remove(&(store, node)) {
            Some(c) => Ok(c),
            None => connect(&runtime, store, addr, fenced),
        };
        let outcome = match connection {
            Err(e) => Outcome::Fail(e),
            Ok(mut connection) => {
                history.append(&event(Op::Invoke, Some(seq), Some(store), Some(node), None))?;
                let outcome = write(&runtime, &mut connection, &record);
                if matches!(outcome, Outcome::Ok) {
                    connections.insert((store, node), connection);
                }
                outcome
            }
        };
        let (op, detail) = match outcome {
            Outcome::Ok => (Op::Ok, None),
            Outcome::Refused(code) => (Op::Refused, Some(code)),
            Outcome::Unknown(e) => (Op::Unknown, Some(e)),
            Outcome::Fail(e) => (Op::Fail, Some(e)),
        };
        history.append(&event(op, Some(seq), Some(store), Some(node), detail))?;
        if op == Op::Refused {
            return Ok(EXIT_REFUSED);
        }
        std::thread::sleep(opts.interval);
    }
    Ok(0)
}

/// A connection to `addr` with short timeouts, fenced with `token` when it is a gateway.
fn connect(
    runtime: &tokio::runtime::Runtime,
    store: Store,
    addr: &str,
    token: Option<&str>,
) -> Result<Connection, String> {
    match store {
        Store::Redis => {
            let client =
                redis::Client::open(format!("redis://{addr}/")).map_err(|e| e.to_string())?;
            let mut connection = client
                .get_connection_with_timeout(Duration::from_secs(1))
                .map_err(|e| format!("connect: {e}"))?;
            connection
                .set_read_timeout(Some(WRITE_TIMEOUT))
                .and_then(|()| connection.set_write_timeout(Some(WRITE_TIMEOUT)))
                .map_err(|e| e.to_string())?;
            if let Some(token) = token {
                // Answered by the gateway itself; a failure here means nothing was written.
                redis::cmd("FENCE")
                    .arg(token)
                    .query::<()>(&mut connection)
                    .map_err(|e| format!("FENCE: {e}"))?;
            }
            Ok(Connection::Redis(connection))
        }
        Store::Postgres => {
            let (host, port) = addr.rsplit_once(':').ok_or("address without a port")?;
            let mut config = tokio_postgres::Config::new();
            config
                .host(host)
                .port(port.parse().map_err(|_| "bad port")?)
                .user("postgres")
                .dbname("postgres")
                .connect_timeout(Duration::from_secs(1));
            if let Some(token) = token {
                config.options(format!("-c fencegate.token={token}"));
            }
            runtime.block_on(async {
                let connected =
                    tokio::time::timeout(WRITE_TIMEOUT, config.connect(tokio_postgres::NoTls))
                        .await
                        .map_err(|_| "connect: timed out".to_owned())?;
                let (client, connection) = connected.map_err(|e| format!("connect: {e}"))?;
                tokio::spawn(connection);
                Ok(Connection::Postgres(client))
            })
        }
        Store::S3 => {
            let client = S3Client::new(addr, WRITE_TIMEOUT)?;
            // Bypassing, the worker appends to the log itself: find its end once.
            let next = match token {
                Some(_) => 0,
                None => runtime
                    .block_on(client.log_end())
                    .map_err(|e| format!("connect: {e}"))?,
            };
            Ok(Connection::S3 {
                client,
                token: token.map(str::to_owned),
                next,
            })
        }
    }
}

/// Writes `record` on `connection` and classifies the answer.
fn write(runtime: &tokio::runtime::Runtime, connection: &mut Connection, record: &str) -> Outcome {
    match connection {
        Connection::Redis(connection) => {
            let answer = redis::cmd("RPUSH")
                .arg(REDIS_KEY)
                .arg(record)
                .query::<i64>(connection);
            match answer {
                Ok(_) => Outcome::Ok,
                Err(e) => match e.code().filter(|c| REDIS_REFUSALS.contains(c)) {
                    Some(code) => Outcome::Refused(code.to_owned()),
                    None => Outcome::Unknown(e.to_string()),
                },
            }
        }
        Connection::Postgres(client) => {
            // The record is digits and colons only: a literal is safe, and one simple Query is
            // one implicit transaction (guard and insert together).
            let sql = format!("INSERT INTO {PG_TABLE} (record) VALUES ('{record}')");
            // The timer must be made inside the runtime.
            let answer = runtime.block_on(async {
                tokio::time::timeout(WRITE_TIMEOUT, client.simple_query(&sql)).await
            });
            match answer {
                Err(_) => Outcome::Unknown("timed out".into()),
                Ok(Ok(_)) => Outcome::Ok,
                Ok(Err(e)) => match e.code().map(|c| c.code()) {
                    Some(code) if PG_REFUSALS.contains(&code) => Outcome::Refused(code.to_owned()),
                    _ => Outcome::Unknown(e.to_string()),
                },
            }
        }
        Connection::S3 {
            client,
            token,
            next,
        } => {
            let answer = runtime.block_on(async {
                match token {
                    Some(token) => client.put_record(record, token).await,
                    None => {
                        let rev = parse_record(record).map_or(0, |(_, _, rev)| rev);
                        client.append_unfenced(next, record, rev).await
                    }
                }
            });
            match answer {
                Answer::Ok => Outcome::Ok,
                Answer::Refused(code) => Outcome::Refused(code),
                Answer::Other(e) => Outcome::Unknown(e),
            }
        }
    }
}
