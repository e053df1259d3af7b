//! The Redis suite: redis-server direct against the same server through the gateway.
//!
//! Passthrough `GET` is measured with `redis-benchmark` on both paths. `redis-benchmark` cannot
//! send `FENCE <token>` once per connection before its `SET`s, so writes are measured with our
//! own RESP load generator ([`crate::resp`]) on both paths: plain `SET` direct, `FENCE` once per
//! connection then `SET` through the gateway (each one a fence function call upstream). A
//! `redis-benchmark` run of plain `SET` direct is reported beside it to calibrate the generator.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::load::{median, Outcome, Tally};
use crate::machine;
use crate::report::{Row, Section};
use crate::resp::{encode, Connection};
use crate::servers::{redis_section_with, Node, Redis};

pub const TOKEN: &str = "fg1~1~bench";

/// What one `redis-benchmark` run measured (latencies per request, or per pipeline with -P).
pub struct Benchmark {
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// One `redis-benchmark` run of `command` (`["-t", "get"]`, or a command and its arguments),
/// from the last row of its CSV output.
pub fn redis_benchmark(
    port: u16,
    command: &[&str],
    clients: usize,
    pipeline: usize,
    requests: u64,
) -> anyhow::Result<Benchmark> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", &clients.to_string(), "-P", &pipeline.to_string()])
        .args(["-n", &requests.to_string(), "--csv"])
        .args(command)
        .output()
        .context("redis-benchmark is needed: apt-get install redis-tools")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text
        .lines()
        .rfind(|l| l.starts_with('"') && !l.starts_with("\"test\""))
        .with_context(|| {
            format!(
                "redis-benchmark {command:?} printed no result: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    // The first field is the command, which may itself contain commas: take the numbers from
    // the end.
    let mut fields: Vec<f64> = row
        .rsplit(',')
        .take(7)
        .map(|f| f.trim_matches('"').parse().unwrap_or(0.0))
        .collect();
    fields.reverse();
    // rps, avg, min, p50, p95, p99, max
    let ms = |i: usize| fields.get(i).copied().unwrap_or(0.0) * 1000.0;
    Ok(Benchmark {
        rps: fields[0],
        p50_us: ms(3),
        p99_us: ms(5),
    })
}

/// `clients` connections each sending `SET` (in batches of `pipeline`) for `run`; with a
/// token, each connection sends `FENCE <token>` first.
pub async fn set_load(
    port: u16,
    clients: usize,
    pipeline: usize,
    token: Option<&str>,
    run: Duration,
) -> anyhow::Result<Outcome> {
    let mut connections = Vec::with_capacity(clients);
    for c in 0..clients {
        let mut conn = Connection::connect(port).await?;
        if let Some(token) = token {
            conn.call(&[b"FENCE", token.as_bytes()]).await?;
        }
        let key = format!("bench:set:{c}");
        let one = encode(&[b"SET", key.as_bytes(), b"xxx"]);
        connections.push((conn, one.repeat(pipeline)));
    }
    let started = Instant::now();
    let deadline = started + run;
    let mut handles = Vec::new();
    for (mut conn, batch) in connections {
        handles.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            while Instant::now() < deadline {
                let t = Instant::now();
                conn.send(&batch).await?;
                for _ in 0..pipeline {
                    if let Err(e) = conn.reply().await? {
                        tally.errors += 1;
                        bail!("SET failed: {e}");
                    }
                }
                tally.record(pipeline as u64, t.elapsed());
            }
            Ok::<_, anyhow::Error>(tally)
        }));
    }
    let mut all = Tally::default();
    for h in handles {
        all.merge(h.await??);
    }
    Ok(all.outcome(started.elapsed()))
}

/// A measured case: how to run it on each path.
enum Case {
    Benchmark {
        test: &'static str,
        clients: usize,
    },
    /// Fenced on the gateway's path: by the fence functions, or by the module when `module`.
    Set {
        clients: usize,
        pipeline: usize,
        module: bool,
    },
}

pub async fn run(run: Duration, reps: usize) -> anyhow::Result<Section> {
    let dir = tempfile::Builder::new()
        .prefix("fencegate-bench-redis")
        .tempdir()?;
    // One redis-server with fencegate's module loaded, two gateways in front of it: one calls
    // the fence functions (fence_module = "off"), one the module's commands ("require").
    let redis = Redis::start_with_module(dir.path())?;
    let listen = crate::process::free_port();
    let node = Node::start(
        &redis_section_with(listen, redis.port, "fence_module = \"off\""),
        &[listen],
    )?;
    let listen_module = crate::process::free_port();
    let node_module = Node::start(
        &redis_section_with(listen_module, redis.port, "fence_module = \"require\""),
        &[listen_module],
    )?;
    // A value for the GETs to read.
    Connection::connect(redis.port)
        .await?
        .call(&[b"SET", b"key:__rand_int__", b"xxx"])
        .await?;

    let cases: Vec<(Case, &str, &str)> = vec![
        (
            Case::Benchmark {
                test: "get",
                clients: 50,
            },
            "GET, 50 clients (redis-benchmark), req/s",
            ">= 0.85x",
        ),
        (
            Case::Set {
                clients: 50,
                pipeline: 1,
                module: false,
            },
            "SET, 50 clients, unpipelined: plain direct vs fenced, req/s",
            ">= 0.80x",
        ),
        (
            Case::Set {
                clients: 50,
                pipeline: 1,
                module: true,
            },
            "SET, 50 clients, unpipelined: plain direct vs fenced by the module, req/s",
            ">= 0.80x",
        ),
        (
            Case::Set {
                clients: 50,
                pipeline: 16,
                module: false,
            },
            "SET, 50 clients, -P 16: plain direct vs fenced, req/s",
            ">= 0.60x",
        ),
        (
            Case::Set {
                clients: 50,
                pipeline: 16,
                module: true,
            },
            "SET, 50 clients, -P 16: plain direct vs fenced by the module, req/s",
            ">= 0.60x",
        ),
        (
            Case::Benchmark {
                test: "get",
                clients: 1,
            },
            "GET p50 latency, 1 client (redis-benchmark), µs",
            "-",
        ),
        (
            Case::Set {
                clients: 1,
                pipeline: 1,
                module: false,
            },
            "SET p50 latency, 1 client: plain direct vs fenced, µs",
            "-",
        ),
        (
            Case::Set {
                clients: 1,
                pipeline: 1,
                module: true,
            },
            "SET p50 latency, 1 client: plain direct vs fenced by the module, µs",
            "-",
        ),
    ];
    let latency = |c: &Case| {
        matches!(
            c,
            Case::Benchmark { clients: 1, .. } | Case::Set { clients: 1, .. }
        )
    };
    let mut figures = vec![(Vec::new(), Vec::new()); cases.len()];
    let mut calibration = vec![(Vec::new(), Vec::new(), Vec::new()); 2];
    let mut batch_ceiling = Vec::new();
    let mut module_batch_ceiling = Vec::new();
    // redis-benchmark counts requests, not seconds: size each run from the last rate seen.
    let mut rate = vec![[30_000.0f64; 2]; cases.len()];
    let requests = |r: f64| ((r * run.as_secs_f64()) as u64).max(2_000);
    for rep in 0..reps {
        for (c, (case, what, _)) in cases.iter().enumerate() {
            let mut pair = [0.0f64; 2];
            let gateway = match case {
                Case::Set { module: true, .. } => listen_module,
                _ => listen,
            };
            for (path, port) in [redis.port, gateway].into_iter().enumerate() {
                let (ops, p50) = match case {
                    Case::Benchmark { test, clients } => {
                        let b = redis_benchmark(
                            port,
                            &["-t", test],
                            *clients,
                            1,
                            requests(rate[c][path]),
                        )?;
                        rate[c][path] = b.rps;
                        (b.rps, b.p50_us)
                    }
                    Case::Set {
                        clients, pipeline, ..
                    } => {
                        let token = (path == 1).then_some(TOKEN);
                        let o = set_load(port, *clients, *pipeline, token, run).await?;
                        (o.ops_per_sec, o.p50_us as f64)
                    }
                };
                pair[path] = if latency(case) { p50 } else { ops };
            }
            eprintln!(
                "redis rep {rep}: {what}: direct {:.0}, gateway {:.0}",
                pair[0], pair[1]
            );
            figures[c].0.push(pair[0]);
            figures[c].1.push(pair[1]);
        }
        // Calibration, direct only: redis-benchmark's own plain SET (checks our generator), and
        // the fence function called directly with FCALL, as the gateway calls it (what the
        // store itself can do for fenced writes; the gateway loaded the function above).
        for (i, pipeline) in [1usize, 16].into_iter().enumerate() {
            let n = requests(if pipeline == 1 { 40_000.0 } else { 200_000.0 });
            let set = redis_benchmark(redis.port, &["SET", "key", "xxx"], 50, pipeline, n)?.rps;
            let fcall = [
                "FCALL",
                "fencegate_fence_v1",
                "2",
                "fencegate:fence:{bench}",
                "key",
                "bench",
                "1",
                "2",
                "SET",
                "key",
                "xxx",
            ];
            let fenced = redis_benchmark(redis.port, &fcall, 50, pipeline, n)?.rps;
            // The same call to the module: its command takes the arguments after FCALL's name.
            let module = [&["FENCEGATE.FENCE"][..], &fcall[2..]].concat();
            let by_module = redis_benchmark(redis.port, &module, 50, pipeline, n)?.rps;
            calibration[i].0.push(set);
            calibration[i].1.push(fenced);
            calibration[i].2.push(by_module);
        }
        // The batch fence function called directly with 16 SETs per call, as the gateway
        // calls it for a client's pipeline of 16: the store's own ceiling for fenced
        // pipelines, in SETs/s.
        let batch = batch_call(16);
        let batch: Vec<&str> = batch.iter().map(String::as_str).collect();
        let calls = redis_benchmark(redis.port, &batch, 50, 1, requests(15_000.0))?.rps;
        batch_ceiling.push(calls * 16.0);
        let module_batch = [&["FENCEGATE.FENCE_BATCH"][..], &batch[2..]].concat();
        let calls = redis_benchmark(redis.port, &module_batch, 50, 1, requests(30_000.0))?.rps;
        module_batch_ceiling.push(calls * 16.0);
    }
    for node in [&node, &node_module] {
        if node.rss_kib().is_err() {
            bail!("a gateway exited during the run:\n{}", node.log_text());
        }
    }
    let rows = cases
        .iter()
        .zip(figures.iter_mut())
        .map(|((case, what, target), (d, g))| {
            let (d, g) = (median(d), median(g));
            if latency(case) {
                Row::added(*what, d, g, target)
            } else {
                Row::ratio(*what, d, g, target)
            }
        })
        .collect();
    Ok(Section {
        name: "redis".into(),
        title: "Redis: direct against through the gateway".into(),
        setup: vec![
            format!("Machine: {}", machine::describe()),
            format!(
                "{}; {}; fencegate {} ({})",
                machine::version(&["redis-server", "--version"]),
                machine::version(&["redis-benchmark", "--version"]),
                env!("CARGO_PKG_VERSION"),
                machine::git_head()
            ),
            "redis-server on loopback without persistence, fencegate's Redis module loaded; two gateways in front of it protect every key (`*` enforce): one calls the fence functions (`fence_module = \"off\"`), the other the module's commands (`fence_module = \"require\"`, the rows \"by the module\"); all processes share the 2 cores".into(),
            format!("{reps} repetitions, direct and gateway interleaved; medians. SET runs last {:.0} s; redis-benchmark runs are sized to about as long", run.as_secs_f64()),
            format!("SET rows use fencegate-bench's RESP generator on both paths (redis-benchmark cannot send `FENCE` once per connection): direct = plain `SET key xxx`; gateway = `FENCE {TOKEN}` once per connection, then the same `SET`s, each run by the gateway as one fence function call. Latency rows: p50 per round trip, gateway cell = p50 (+ added µs)"),
        ],
        headers: ["direct".into(), "gateway".into()],
        rows,
        tables: Vec::new(),
        notes: vec![format!(
            "Calibration, direct only, redis-benchmark at 50 clients: plain `SET key xxx` {:.0} req/s unpipelined, {:.0} with -P 16 (the generator's direct figures above are the baseline of the ratios); the fence function called directly (`FCALL fencegate_fence_v1 2 fencegate:fence:{{bench}} key bench 1 2 SET key xxx`, what the gateway sends for each fenced SET) {:.0} req/s unpipelined, {:.0} with -P 16: the store's own ceiling for fenced writes.",
            median(&mut calibration[0].0),
            median(&mut calibration[1].0),
            median(&mut calibration[0].1),
            median(&mut calibration[1].1),
        ), format!(
            "The module's command called directly with the same arguments (`FENCEGATE.FENCE 2 fencegate:fence:{{bench}} key bench 1 2 SET key xxx`, what the module gateway sends): {:.0} req/s unpipelined ({:.2}x plain), {:.0} with -P 16 ({:.2}x plain); `FENCEGATE.FENCE_BATCH` with 16 SETs per call: {:.0} SETs/s, {:.2}x the plain -P 16 SET: the store's ceiling for fenced pipelines with the module.",
            median(&mut calibration[0].2),
            median(&mut calibration[0].2) / median(&mut calibration[0].0),
            median(&mut calibration[1].2),
            median(&mut calibration[1].2) / median(&mut calibration[1].0),
            median(&mut module_batch_ceiling),
            median(&mut module_batch_ceiling) / median(&mut calibration[1].0),
        ), format!(
            "The batch fence function called directly (`FCALL fencegate_fence_batch_v1` with 16 `SET key xxx` per call, what the gateway sends for a client's pipeline of 16 fenced SETs; redis-benchmark, 50 clients): {:.0} SETs/s, {:.2}x the plain -P 16 SET above: the store's own ceiling for fenced pipelines (each write runs through Lua's `redis.pcall`).",
            median(&mut batch_ceiling),
            median(&mut batch_ceiling) / median(&mut calibration[1].0),
        )],
    })
}

/// `FCALL fencegate_fence_batch_v1` for `n` writes `SET key xxx` under revision 1 of resource
/// `bench` (the layout of fencegate_redis::rewrite::rewrite_batch).
fn batch_call(n: usize) -> Vec<String> {
    let mut call = vec![
        "FCALL".to_owned(),
        "fencegate_fence_batch_v1".to_owned(),
        (n + 1).to_string(),
        "fencegate:fence:{bench}".to_owned(),
    ];
    call.extend(std::iter::repeat_n("key".to_owned(), n));
    call.extend(["bench", "1", "2"].map(String::from));
    call.push(n.to_string());
    call.extend(std::iter::repeat_n("3".to_owned(), n));
    for _ in 0..n {
        call.extend(["SET", "key", "xxx"].map(String::from));
    }
    call
}
