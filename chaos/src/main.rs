//! `fencegate-chaos`: fault injection against a real 3-node fencegate cluster with a checker
//! of the final histories (docs/CHAOS.md).
//!
//! `fencegate-chaos [--seeds N] [--duration 60s] [--workers 3] [--bypass-fencing]` runs N seeds
//! and exits 1 if any violation was found; `fencegate-chaos worker ...` is the job each
//! `fencegate lock run` starts.

mod check;
mod error;
mod history;
mod nemesis;
mod run;
mod s3_store;
mod stop_times;
mod summary;
mod worker;
mod workload;
mod world;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "fencegate-chaos", args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args)]
struct RunArgs {
    /// How many seeds to run, one after the other.
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// The first seed (the nemesis's choices follow from it).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How long the nemesis injects faults, per seed.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Workers competing for the lock.
    #[arg(long, default_value_t = 3)]
    workers: u32,
    /// Workers write straight to the store, no gateway, no token check: the checker must
    /// report violations (its self-test).
    #[arg(long)]
    bypass_fencing: bool,
    /// Only these faults (comma-separated: pause-worker, kill-worker, kill-leader,
    /// kill-follower, restart-store, partition, delay, drop); all by default.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<nemesis::FaultKind>,
    /// The stores written to (comma-separated: redis, postgres, s3).
    #[arg(long, value_delimiter = ',', default_value = "redis,postgres")]
    stores: Vec<String>,
    /// Keep each seed's histories and node logs under DIR/seed-N.
    #[arg(long)]
    keep: Option<PathBuf>,
    /// Write the summary as JSON to this file.
    #[arg(long)]
    report: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// The job run under `fencegate lock run` (not for direct use).
    Worker {
        #[arg(long)]
        id: u32,
        #[arg(long)]
        history: PathBuf,
        /// `NODE=HOST:PORT` of a Redis gateway (node 0: the store itself). Repeatable.
        #[arg(long = "redis", value_parser = parse_target)]
        redis: Vec<(u64, String)>,
        /// `NODE=HOST:PORT` of a PostgreSQL gateway (node 0: the server itself). Repeatable.
        #[arg(long = "postgres", value_parser = parse_target)]
        postgres: Vec<(u64, String)>,
        /// `NODE=HOST:PORT` of an S3 gateway (node 0: moto itself). Repeatable.
        #[arg(long = "s3", value_parser = parse_target)]
        s3: Vec<(u64, String)>,
        #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
        interval: Duration,
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        max_time: Duration,
        #[arg(long)]
        pid_file: Option<PathBuf>,
    },
}

fn parse_target(text: &str) -> Result<(u64, String), String> {
    let (node, addr) = text
        .split_once('=')
        .ok_or_else(|| format!("expected NODE=HOST:PORT, got {text:?}"))?;
    let node = node
        .parse()
        .map_err(|_| format!("node must be a number in {text:?}"))?;
    Ok((node, addr.to_owned()))
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    if let Some(Cmd::Worker {
        id,
        history,
        redis,
        postgres,
        s3,
        interval,
        max_time,
        pid_file,
    }) = cli.command
    {
        let stores = [
            (worker::Store::Redis, redis),
            (worker::Store::Postgres, postgres),
            (worker::Store::S3, s3),
        ];
        let targets: Vec<(worker::Store, u64, String)> = stores
            .into_iter()
            .flat_map(|(store, list)| list.into_iter().map(move |(n, a)| (store, n, a)))
            .collect();
        anyhow::ensure!(
            !targets.is_empty(),
            "give at least one --redis, --postgres or --s3"
        );
        let code = worker::run(worker::WorkerOptions {
            id,
            history,
            targets,
            interval,
            max_time,
            pid_file,
        })?;
        return Ok(ExitCode::from(code));
    }
    let args = cli.run;
    if let Some(unknown) = args
        .stores
        .iter()
        .find(|s| !["redis", "postgres", "s3"].contains(&s.as_str()))
    {
        anyhow::bail!("unknown store {unknown:?} in --stores: choose from redis, postgres, s3");
    }
    let runtime = tokio::runtime::Runtime::new()?;
    let mut reports = Vec::new();
    for seed in args.seed..args.seed + args.seeds {
        let report = runtime.block_on(run::run_seed(&run::RunOptions {
            seed,
            duration: args.duration,
            workers: args.workers,
            bypass: args.bypass_fencing,
            faults: args.faults.clone(),
            redis: args.stores.iter().any(|s| s == "redis"),
            postgres: args.stores.iter().any(|s| s == "postgres"),
            s3: args.stores.iter().any(|s| s == "s3"),
            dir: args.keep.clone(),
        }))?;
        print!("{}", summary::seed_text(&report, args.bypass_fencing));
        reports.push(report);
    }
    print!("{}", summary::overall_text(&reports));
    let json = summary::json(&reports);
    if let Some(path) = &args.report {
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)?;
    }
    let violations = json["violations"].as_u64().unwrap_or(0);
    println!("total violations: {violations}");
    Ok(if violations == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
