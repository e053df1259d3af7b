//! The proxy hop beside its peers: each store direct, through the proxy its users would pick
//! instead (twemproxy for Redis, PgBouncer in session mode for PostgreSQL) and through
//! fencegate, interleaved in one run.
//!
//! Every path does the same work: the same client (redis-benchmark, pgbench), the same keys and
//! tables, the same store instance, and fencegate as a pass-through (no key or database
//! protected). Besides throughput and latency, each run measures the CPU time the proxy process
//! used (user + system, from /proc) per request: the figure that does not depend on how busy
//! the shared machine is.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;

use crate::cpu;
use crate::load::median;
use crate::machine;
use crate::peer::{Pgbouncer, Twemproxy};
use crate::postgres::{pgbench, pgbench_init, pgbench_path, Workload, WRITE_SCRIPT};
use crate::redis::{redis_benchmark, set_load};
use crate::report::{Section, Table};
use crate::resp::Connection;
use crate::servers::{
    pg_bin, postgres_passthrough_section, redis_fenced_prefix_section, Node, Postgres, Redis,
};

/// The three paths, in table order.
const PATHS: [&str; 3] = ["direct", "peer", "fencegate"];

/// How one case is run.
#[derive(Clone, Copy)]
enum Load {
    /// redis-benchmark's test `test` (`get`, `set`).
    Redis {
        test: &'static str,
        clients: usize,
        pipeline: usize,
    },
    Pgbench {
        workload: Workload,
        clients: usize,
    },
    /// fencegate-bench's RESP generator: `SET bench:set:<client> xxx`, plain on the direct and
    /// peer paths, fenced (`FENCE` once per connection, key protected) through fencegate.
    FencedSet {
        clients: usize,
        pipeline: usize,
    },
}

/// One measured run of one path.
struct Measure {
    rate: f64,
    p50_us: f64,
    p99_us: f64,
    /// CPU time of the proxy per request, µs (none for the direct path).
    cpu_us: Option<f64>,
    /// CPU time of redis-server per request, µs (none for PostgreSQL, whose backends are
    /// processes of their own).
    store_us: Option<f64>,
}

/// The figures of one case, per path, one entry per repetition.
#[derive(Default)]
struct Figures {
    rate: [Vec<f64>; 3],
    p50: [Vec<f64>; 3],
    p99: [Vec<f64>; 3],
    cpu: [Vec<f64>; 3],
    store: [Vec<f64>; 3],
}

impl Figures {
    fn push(&mut self, path: usize, m: &Measure) {
        self.rate[path].push(m.rate);
        self.p50[path].push(m.p50_us);
        self.p99[path].push(m.p99_us);
        if let Some(c) = m.cpu_us {
            self.cpu[path].push(c);
        }
        if let Some(c) = m.store_us {
            self.store[path].push(c);
        }
    }
}

fn med(values: &[f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    median(&mut values.to_vec())
}

/// Everything the runs need: the stores, the peers and the gateway, and where each listens.
struct Rig {
    redis: [u16; 3],
    postgres: [u16; 3],
    /// The proxy process per path (none direct) for Redis and for PostgreSQL; fencegate's is the
    /// one node serving both.
    redis_pid: [Option<u32>; 3],
    postgres_pid: [Option<u32>; 3],
    redis_server: u32,
    log: std::path::PathBuf,
    /// pgbench's simple-update transaction (the postgres suite's write), plain on every path.
    write_script: std::path::PathBuf,
}

impl Rig {
    async fn run(
        &self,
        load: Load,
        path: usize,
        requests: u64,
        seconds: u64,
    ) -> anyhow::Result<Measure> {
        match load {
            Load::FencedSet { clients, pipeline } => {
                let proxy = self.redis_pid[path].map(cpu::CpuClock::new);
                let store = cpu::CpuClock::new(self.redis_server);
                let before = (proxy.as_ref().map(|c| c.used()).transpose()?, store.used()?);
                let token = (path == 2).then_some(crate::redis::TOKEN);
                let o = set_load(
                    self.redis[path],
                    clients,
                    pipeline,
                    token,
                    Duration::from_secs(seconds),
                )
                .await?;
                let after = (proxy.as_ref().map(|c| c.used()).transpose()?, store.used()?);
                let per_request = |c: Duration| c.as_secs_f64() * 1e6 / o.done.max(1) as f64;
                Ok(Measure {
                    rate: o.ops_per_sec,
                    p50_us: o.p50_us as f64,
                    p99_us: o.p99_us as f64,
                    cpu_us: before.0.zip(after.0).map(|(b, a)| per_request(a - b)),
                    store_us: Some(per_request(after.1 - before.1)),
                })
            }
            Load::Redis {
                test,
                clients,
                pipeline,
            } => {
                let ((b, store), cpu) = cpu::during(self.redis_pid[path], || {
                    cpu::during(Some(self.redis_server), || {
                        redis_benchmark(
                            self.redis[path],
                            &["-t", test],
                            clients,
                            pipeline,
                            requests,
                        )
                    })
                })?;
                let per_request = |c: Duration| c.as_secs_f64() * 1e6 / requests as f64;
                Ok(Measure {
                    rate: b.rps,
                    p50_us: b.p50_us,
                    p99_us: b.p99_us,
                    cpu_us: cpu.map(per_request),
                    store_us: store.map(per_request),
                })
            }
            Load::Pgbench { workload, clients } => {
                let (r, cpu) = cpu::during(self.postgres_pid[path], || {
                    pgbench(
                        self.postgres[path],
                        workload,
                        clients,
                        seconds,
                        None,
                        &self.write_script,
                        Some(self.log.as_path()),
                    )
                })?;
                Ok(Measure {
                    rate: r.tps,
                    p50_us: r.p50_us,
                    p99_us: r.p99_us,
                    cpu_us: cpu.map(|c| c.as_secs_f64() * 1e6 / r.transactions.max(1) as f64),
                    store_us: None,
                })
            }
        }
    }
}

pub async fn run(run: Duration, reps: usize, only: Option<&str>) -> anyhow::Result<Section> {
    let load_before = machine::load_average();
    let dir = tempfile::Builder::new()
        .prefix("fencegate-bench-hop")
        .tempdir()?;
    // The peers first: a missing one fails the suite before anything is measured. fencegate's
    // Redis module is loaded: the gateway runs its fence checks there (fence_module = "auto"),
    // the cheapest deployment; the redis suite compares it with the functions.
    let redis = Redis::start_with_module(dir.path())?;
    let twemproxy = Twemproxy::start(redis.port)?;
    let pg = Postgres::start(100)?;
    let pgbouncer = Pgbouncer::start(pg.port, 100)?;
    pgbench_init(&pg)?;
    pg.psql("VACUUM ANALYZE")?;
    let (redis_listen, pg_listen) = (crate::process::free_port(), crate::process::free_port());
    let node = Node::start(
        &format!(
            "{}{}",
            redis_fenced_prefix_section(redis_listen, redis.port),
            postgres_passthrough_section(pg_listen, pg.port)
        ),
        &[redis_listen, pg_listen],
    )?;
    let gateway = node.pid();
    // The value every GET reads (redis-benchmark's key without -r).
    Connection::connect(redis.port)
        .await?
        .call(&[b"SET", b"key:__rand_int__", b"xxx"])
        .await?;
    let rig = Rig {
        redis: [redis.port, twemproxy.port, redis_listen],
        postgres: [pg.port, pgbouncer.port, pg_listen],
        redis_pid: [None, Some(twemproxy.pid()), Some(gateway)],
        postgres_pid: [None, Some(pgbouncer.pid()), Some(gateway)],
        redis_server: redis.pid(),
        log: dir.path().join("pgbench-log"),
        write_script: dir.path().join("write.sql"),
    };
    std::fs::write(&rig.write_script, WRITE_SCRIPT)?;

    let redis_case = |test, clients, pipeline| Load::Redis {
        test,
        clients,
        pipeline,
    };
    let pg_case = |workload, clients| Load::Pgbench { workload, clients };
    let cases: Vec<(Load, &str)> = vec![
        (
            redis_case("get", 50, 1),
            "Redis GET, 50 clients (redis-benchmark), req/s",
        ),
        (redis_case("set", 50, 1), "Redis SET, 50 clients, req/s"),
        (
            Load::FencedSet {
                clients: 50,
                pipeline: 1,
            },
            "Redis SET, 50 clients, fenced through fencegate (plain on the others), req/s",
        ),
        (
            Load::FencedSet {
                clients: 50,
                pipeline: 16,
            },
            "Redis SET, 50 clients, -P 16, fenced through fencegate (plain on the others), req/s",
        ),
        (redis_case("get", 1, 1), "Redis GET, 1 client, req/s"),
        (
            redis_case("get", 50, 16),
            "Redis GET, 50 clients, -P 16, req/s",
        ),
        (
            pg_case(Workload::SelectOnly, 8),
            "`pgbench -S`, 8 clients, tps",
        ),
        (
            pg_case(Workload::SelectPrepared, 8),
            "`pgbench -S -M prepared`, 8 clients, tps",
        ),
        (
            pg_case(Workload::SelectOnly, 1),
            "`pgbench -S`, 1 client, tps",
        ),
        // What any hop adds to a durable write transaction of five statements: the floor under
        // the postgres suite's fenced-write ratios, which add the guard on top.
        (
            pg_case(Workload::Write, 1),
            "pgbench write transaction (durable, plain on every path), 1 client, tps",
        ),
        (
            pg_case(Workload::Write, 8),
            "pgbench write transaction (durable, plain on every path), 8 clients, tps",
        ),
    ];
    let cases: Vec<(Load, &str)> = match only {
        None => cases,
        Some(text) => {
            let text = text.to_lowercase();
            cases
                .into_iter()
                .filter(|(_, what)| what.to_lowercase().contains(&text))
                .collect()
        }
    };
    anyhow::ensure!(!cases.is_empty(), "no peers case matches --cases {only:?}");
    let seconds = run.as_secs_f64().ceil().max(1.0) as u64;
    // A short first run of each case on each path warms it up (PgBouncer opens its server
    // connections, the gateway its buffers); for redis-benchmark, which counts requests, not
    // seconds, it also gives the rate that sizes the measured runs.
    let mut rate = vec![[0.0f64; 3]; cases.len()];
    for (c, (load, what)) in cases.iter().enumerate() {
        for path in 0..3 {
            let guess = match load {
                Load::Redis { pipeline, .. } => 20_000 * *pipeline as u64,
                Load::Pgbench { .. } | Load::FencedSet { .. } => 0,
            };
            let m = rig.run(*load, path, guess, 1).await?;
            rate[c][path] = m.rate;
            eprintln!("hop warm-up: {what}: {} {:.0}", PATHS[path], m.rate);
        }
    }
    let mut figures: Vec<Figures> = cases.iter().map(|_| Figures::default()).collect();
    for rep in 0..reps {
        for (c, (load, what)) in cases.iter().enumerate() {
            // The order of the paths turns with each repetition: none always runs first.
            for turn in 0..3 {
                let path = (turn + rep) % 3;
                let requests = ((rate[c][path] * run.as_secs_f64()) as u64).max(2_000);
                let m = rig
                    .run(*load, path, requests, seconds)
                    .await
                    .with_context(|| format!("{what}, {}", PATHS[path]))
                    .with_context(|| {
                        format!(
                            "the gateway's log:\n{}\nPgBouncer's log:\n{}",
                            node.log_text(),
                            pgbouncer.log_text()
                        )
                    })?;
                if matches!(load, Load::Redis { .. }) {
                    rate[c][path] = m.rate;
                }
                eprintln!(
                    "hop rep {rep}: {what}: {} {:.0} (p50 {:.0} µs, p99 {:.0} µs{})",
                    PATHS[path],
                    m.rate,
                    m.p50_us,
                    m.p99_us,
                    m.cpu_us
                        .map_or(String::new(), |c| format!(", proxy CPU {c:.1} µs/request"))
                );
                figures[c].push(path, &m);
            }
        }
    }
    let load_after = machine::load_average();

    let peer_name = |load: &Load| match load {
        Load::Redis { .. } | Load::FencedSet { .. } => "twemproxy",
        Load::Pgbench { .. } => "PgBouncer",
    };
    let mut throughput = Table {
        headers: [
            "case",
            "direct",
            "peer",
            "fencegate",
            "peer/direct",
            "fencegate/direct",
            "fencegate/peer",
        ]
        .map(String::from)
        .to_vec(),
        rows: Vec::new(),
    };
    let mut cost = Table {
        headers: [
            "case",
            "p50 / p99 µs: direct",
            "peer",
            "fencegate",
            "proxy CPU µs per request: peer",
            "fencegate",
            "fencegate/peer",
        ]
        .map(String::from)
        .to_vec(),
        rows: Vec::new(),
    };
    let mut store = Table {
        headers: [
            "case",
            "redis-server CPU µs per request: direct",
            "via twemproxy",
            "via fencegate",
        ]
        .map(String::from)
        .to_vec(),
        rows: Vec::new(),
    };
    let mut per_rep = String::from(
        "Throughput fencegate/peer per repetition (the machine is shared, so single runs swing):",
    );
    for ((load, what), f) in cases.iter().zip(&figures) {
        let r = [0, 1, 2].map(|p| med(&f.rate[p]));
        let cpu = [1, 2].map(|p| med(&f.cpu[p]));
        throughput.rows.push(vec![
            what.to_string(),
            format!("{:.0}", r[0]),
            format!("{} {:.0}", peer_name(load), r[1]),
            format!("{:.0}", r[2]),
            format!("{:.2}", r[1] / r[0]),
            format!("{:.2}", r[2] / r[0]),
            format!("**{:.2}**", r[2] / r[1]),
        ]);
        let latency = |p: usize| format!("{:.0} / {:.0}", med(&f.p50[p]), med(&f.p99[p]));
        let label = what
            .rsplit_once(", ")
            .map_or(what.to_string(), |(case, _)| case.to_owned());
        cost.rows.push(vec![
            label.clone(),
            latency(0),
            latency(1),
            latency(2),
            format!("{:.1}", cpu[0]),
            format!("{:.1}", cpu[1]),
            format!("**{:.2}**", cpu[1] / cpu[0]),
        ]);
        if matches!(load, Load::Redis { .. } | Load::FencedSet { .. }) {
            let mut row = vec![label.clone()];
            row.extend((0..3).map(|p| format!("{:.1}", med(&f.store[p]))));
            store.rows.push(row);
        }
        let ratios: Vec<String> = f.rate[2]
            .iter()
            .zip(&f.rate[1])
            .map(|(g, p)| format!("{:.2}", g / p))
            .collect();
        let _ = write!(per_rep, " {label}: {};", ratios.join(", "));
    }
    per_rep.pop();
    per_rep.push('.');

    Ok(Section {
        name: "peers".into(),
        title: "The hop beside its peers: twemproxy and PgBouncer".into(),
        setup: vec![
            format!("Machine: {}", machine::describe()),
            format!(
                "Machine load (the 2 cores may be shared with builds and tests): load average {load_before} before, {load_after} after (1, 5, 15 min). Throughput depends on that load; CPU time per request much less"
            ),
            format!(
                "{}; {}; {}; {}; {}; {}; fencegate {} ({})",
                machine::version(&["redis-server", "--version"]),
                machine::version(&["redis-benchmark", "--version"]),
                machine::version(&["/usr/sbin/nutcracker", "--version"]),
                machine::version(&["/usr/sbin/pgbouncer", "--version"]),
                machine::version(&[&pg_bin()?.join("postgres").display().to_string(), "--version"]),
                machine::version(&[&pgbench_path(), "--version"]),
                env!("CARGO_PKG_VERSION"),
                machine::git_head()
            ),
            "Paths: direct = the store itself; peer = twemproxy (one server pool, one server connection, the same redis-server) or PgBouncer (`pool_mode = session`, `auth_type = trust`, the same PostgreSQL); fencegate = one `fencegate serve` node whose Redis gateway protects only `bench:*` (the fenced SET rows; redis-benchmark's `key:*` is unprotected) and whose PostgreSQL gateway protects no database (`databases = []`), so all three paths do the same work but in the fenced rows, where fencegate runs each SET (or each client's pipeline of 16) as a call of the fence check while the other paths send plain SETs; redis-server has fencegate's module loaded, so that call is `FENCEGATE.FENCE(_BATCH)` (docs/REDIS_MODULE.md)".into(),
            format!("Same client, keys and store on every path: `redis-benchmark -t get|set` on key `key:__rand_int__` (3-byte value; requests sized to about {seconds} s from the previous run of the same path), `pgbench -n -T {seconds}` on `pgbench -i -s 1` tables, `-j` = min(clients, 2); redis-server without persistence, PostgreSQL with fsync and synchronous_commit on; the write transaction is the postgres suite's (pgbench's simple update as a `-f` script: `BEGIN`, `UPDATE`, `SELECT`, `INSERT`, `END`), plain on every path (the gateway protects no database here), so it measures what the hop adds to a durable transaction of five statements"),
            format!("{reps} repetitions after one warm-up run of each case on each path; in each repetition, every case runs on the three paths one after another, the order turning with each repetition; medians. Latency: redis-benchmark's p50/p99 (per pipeline of 16 with -P 16), pgbench's per-transaction log (`-l`)"),
            "Proxy CPU per request: utime + stime of the proxy process from `/proc/<pid>/stat` (clock ticks of 10 ms) before and after the run, divided by the requests (pgbench: transactions) of the run; for fencegate the whole node process (all its threads, authority and the idle gateways included). The last table measures redis-server's own CPU time the same way, on each path: what each proxy's way of talking to the store costs the store".into(),
        ],
        headers: ["direct".into(), "fencegate".into()],
        rows: Vec::new(),
        tables: vec![throughput, cost, store],
        notes: vec![per_rep],
    })
}
