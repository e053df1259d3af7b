//! `fencegate-bench`: measures each path direct and through fencegate, interleaved, and
//! writes the figures to docs/BENCHMARKS.md. Not a test: nothing here asserts a number.
//!
//!     cargo build --release -p fencegate -p fencegate-bench
//!     ./target/release/fencegate-bench all

mod authority;
mod cpu;
mod footprint;
mod hop;
mod load;
mod machine;
mod peer;
mod postgres;
mod process;
mod redis;
mod report;
mod resp;
mod s3;
mod servers;
mod sigv4;
mod triggers;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "fencegate-bench", about)]
struct Cli {
    #[command(subcommand)]
    suite: Suite,
    /// Seconds each measured run lasts.
    #[arg(long, global = true, default_value_t = 5.0)]
    seconds: f64,
    /// Repetitions of each (direct, gateway) pair; medians are reported.
    #[arg(long, global = true, default_value_t = 3)]
    reps: usize,
    /// The report to update (only the sections of the suites run are replaced).
    #[arg(long, global = true, default_value = "docs/BENCHMARKS.md")]
    out: PathBuf,
    /// Runs only the cases whose label contains this text, ignoring case (peers suite only;
    /// e.g. `--cases redis`). A partial run replaces the whole section: write it elsewhere
    /// with `--out`.
    #[arg(long, global = true)]
    cases: Option<String>,
}

#[derive(Subcommand, Clone, Copy, PartialEq)]
enum Suite {
    /// Acquires/s and keepalives/s of a 3-node fencegate authority against a 3-node etcd 3.4,
    /// both over HTTP/JSON on loopback with fsync on; plus the disk's raw fsync rate.
    Authority,
    /// redis-benchmark GET and a RESP generator's plain vs fenced SET, direct and through the
    /// Redis gateway.
    Redis,
    /// pgbench -S and a durable write transaction (plain direct, fenced through the gateway).
    Postgres,
    /// Signed PUTs to moto directly and fenced through the S3 gateway; upstream requests per PUT.
    S3,
    /// The guarded write transaction with 8 writers, the store's triggers off, plpgsql and C
    /// (needs postgresql-server-dev to build the C library).
    Triggers,
    /// Redis and PostgreSQL direct, through their usual proxy (twemproxy, PgBouncer) and
    /// through fencegate as a pass-through, interleaved: throughput, latency and the proxy's CPU
    /// time per request.
    Peers,
    /// The gateway's RSS idle and after 1,000 idle connections per gateway.
    Footprint,
    /// Every suite above but triggers, in one invocation.
    All,
}

const EVERY: [Suite; 6] = [
    Suite::Redis,
    Suite::Peers,
    Suite::Postgres,
    Suite::S3,
    Suite::Footprint,
    Suite::Authority,
];

async fn run_suite(
    suite: Suite,
    run: Duration,
    reps: usize,
    cases: Option<&str>,
) -> anyhow::Result<report::Section> {
    match suite {
        Suite::Authority => authority::run(run, reps).await,
        Suite::Redis => redis::run(run, reps).await,
        Suite::Postgres => postgres::run(run, reps).await,
        Suite::Peers => hop::run(run, reps, cases).await,
        Suite::S3 => s3::run(run, reps).await,
        Suite::Triggers => triggers::run(run, reps).await,
        Suite::Footprint => footprint::run(reps).await,
        Suite::All => unreachable!("expanded by main"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let run = Duration::from_secs_f64(cli.seconds);
    let command = std::env::args()
        .enumerate()
        .map(|(i, a)| {
            if i == 0 {
                "./target/release/fencegate-bench".to_owned()
            } else {
                a
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    let suites = if cli.suite == Suite::All {
        EVERY.to_vec()
    } else {
        vec![cli.suite]
    };
    for suite in suites {
        let section = run_suite(suite, run, cli.reps, cli.cases.as_deref()).await?;
        let text = section.render(&command);
        // Each suite's section is written as soon as it is done.
        report::write(&cli.out, &section.name, &text)?;
        println!("{text}");
    }
    println!("written to {}", cli.out.display());
    Ok(())
}
