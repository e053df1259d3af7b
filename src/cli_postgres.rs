//! `fencegate postgres ...`: tools for the PostgreSQL gateway and the store-side fence.

use std::process::ExitCode;
use std::time::Duration;

use fencegate_postgres::{InstallOptions, Target};

use crate::cli::PostgresCommand;

pub async fn run(command: PostgresCommand) -> anyhow::Result<ExitCode> {
    match command {
        PostgresCommand::Install {
            dsn,
            lock_timeout_ms,
        } => {
            let options = InstallOptions {
                lock_timeout: Duration::from_millis(lock_timeout_ms),
            };
            let report = fencegate_postgres::install_with(&dsn, &options).await?;
            for warning in &report.warnings {
                eprintln!("warning: {warning}");
            }
            println!(
                "installed fencegate schema, fencegate.fences and fencegate.guard (owner {}, guard lock_timeout {lock_timeout_ms} ms); \
                 run `fencegate postgres protect` to make the store refuse unguarded writes",
                report.owner
            );
            Ok(ExitCode::SUCCESS)
        }
        PostgresCommand::Protect {
            dsn,
            schema,
            table,
            resource,
        } => {
            let target = match (schema, table) {
                (Some(schema), None) => Target::Schema(schema),
                (None, Some(table)) => Target::Table(table),
                _ => anyhow::bail!("give exactly one of --schema or --table"),
            };
            let (client, task) = fencegate_postgres::connect::connect(&dsn).await?;
            let report = fencegate_postgres::protect(&client, &target, resource.as_deref()).await?;
            println!(
                "protected {} table(s), resource {}",
                report.tables,
                resource.as_deref().unwrap_or("(any)")
            );
            match report.future_tables {
                Some(Ok(())) => println!(
                    "tables created later in this schema are protected by the event trigger"
                ),
                Some(Err(why)) => eprintln!("warning: {why}"),
                None => {}
            }
            drop(client);
            let _ = task.await;
            Ok(ExitCode::SUCCESS)
        }
        PostgresCommand::Status { dsn } => {
            let (client, task) = fencegate_postgres::connect::connect(&dsn).await?;
            let status = fencegate_postgres::status(&client).await?;
            print!("{status}");
            drop(client);
            let _ = task.await;
            Ok(ExitCode::SUCCESS)
        }
        PostgresCommand::PrintSql => {
            print!("{}", fencegate_postgres::FENCE_SQL);
            Ok(ExitCode::SUCCESS)
        }
    }
}
