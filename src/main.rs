mod cli;
mod config;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = cli::Cli::parse();
    let _ = cli;
    Ok(())
}
