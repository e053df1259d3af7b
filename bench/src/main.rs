//! `fencegate-bench`: measures each path direct and through fencegate, interleaved, and
//! writes the figures to docs/BENCHMARKS.md. Not a test: nothing here asserts a number.
//!
//!     cargo build --release -p fencegate -p fencegate-bench
//!     ./target/release/fencegate-bench authority

mod authority;
mod load;
mod machine;
mod process;
mod report;

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
    /// The report to update (only this suite's section is replaced).
    #[arg(long, global = true, default_value = "docs/BENCHMARKS.md")]
    out: PathBuf,
}

#[derive(Subcommand)]
enum Suite {
    /// Acquires/s and keepalives/s of a 3-node fencegate authority against a 3-node etcd 3.4,
    /// both over HTTP/JSON on loopback with fsync on; plus the disk's raw fsync rate.
    Authority,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let run = Duration::from_secs_f64(cli.seconds);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let section = match cli.suite {
        Suite::Authority => authority::run(run, cli.reps).await?,
    };
    report::write(&cli.out, &section.name, &section.render(&command))?;
    println!("{}", section.render(&command));
    println!("written to {}", cli.out.display());
    Ok(())
}
