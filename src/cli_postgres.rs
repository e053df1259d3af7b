//! `fencegate postgres ...`: tools for the PostgreSQL gateway.

use std::process::ExitCode;

use crate::cli::PostgresCommand;

pub async fn run(command: PostgresCommand) -> anyhow::Result<ExitCode> {
    match command {
        PostgresCommand::Install { dsn } => {
            fencegate_postgres::install(&dsn).await?;
            println!("installed fencegate schema, fencegate.fences and fencegate.guard");
            Ok(ExitCode::SUCCESS)
        }
        PostgresCommand::PrintSql => {
            print!("{}", fencegate_postgres::FENCE_SQL);
            Ok(ExitCode::SUCCESS)
        }
    }
}
