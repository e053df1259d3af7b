//! `fencegate audit tail|query|verify|prune`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use fencegate_core::now_millis;

use crate::audit::prune::prune;
use crate::audit::query::{human, Filter};
use crate::audit::read_records;
use crate::audit::verify::{verify, VerifyError};
use crate::cli::{AuditCommand, AuditSource};
use crate::config::Config;

/// Runs one `audit` subcommand.
pub fn run(command: AuditCommand) -> anyhow::Result<ExitCode> {
    match command {
        AuditCommand::Tail { n, json, source } => {
            let records = read_records(&dir(&source)?)?;
            let skip = records.len().saturating_sub(n);
            for record in &records[skip..] {
                print(record, json);
            }
            Ok(ExitCode::SUCCESS)
        }
        AuditCommand::Query {
            resource,
            store,
            since,
            json,
            source,
        } => {
            let filter = Filter {
                resource,
                store,
                since_ms: since.map(|d| now_millis().saturating_sub(d.as_millis() as u64)),
            };
            for record in read_records(&dir(&source)?)?
                .iter()
                .filter(|r| filter.accepts(r))
            {
                print(record, json);
            }
            Ok(ExitCode::SUCCESS)
        }
        AuditCommand::Verify { source } => {
            let dir = dir(&source)?;
            match verify(&dir) {
                Ok(report) => {
                    let from = match (&report.from, &report.mark) {
                        (None, _) => String::new(),
                        (Some(from), Some(mark)) if mark.seq == from.seq => format!(
                            ", verified from checkpoint at seq {} (older files removed by `audit prune` at {})",
                            from.seq, mark.time
                        ),
                        (Some(from), Some(mark)) => format!(
                            ", verified from checkpoint at seq {} (the last `audit prune`, at {}, kept the log from seq {})",
                            from.seq, mark.time, mark.seq
                        ),
                        (Some(from), None) => format!(
                            ", verified from checkpoint at seq {} (the files before it were removed, but not by `audit prune`: nothing records that this was intended)",
                            from.seq
                        ),
                    };
                    println!(
                        "audit log {}: ok, {} record(s) in {} file(s){from}, head {}",
                        dir.display(),
                        report.records,
                        report.files,
                        report.head
                    );
                    Ok(ExitCode::SUCCESS)
                }
                Err(VerifyError::Broken(broken)) => {
                    eprintln!("audit log {}: chain broken at {broken}", dir.display());
                    Ok(ExitCode::from(1))
                }
                Err(e) => Err(e.into()),
            }
        }
        AuditCommand::Prune { keep, source } => {
            let dir = dir(&source)?;
            let pruned = prune(&dir, keep)?;
            match pruned.from {
                None => println!(
                    "audit log {}: nothing to prune ({keep} rotated file(s) or fewer)",
                    dir.display()
                ),
                Some(from) => {
                    for path in &pruned.removed {
                        println!("removed {}", path.display());
                    }
                    println!(
                        "audit log {}: removed {} file(s); it now verifies from checkpoint at seq {}",
                        dir.display(),
                        pruned.removed.len(),
                        from.seq
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print(record: &fencegate_core::AuditRecord, json: bool) {
    if json {
        println!(
            "{}",
            serde_json::to_string(record).expect("a record always serializes")
        );
    } else {
        println!("{}", human(record));
    }
}

fn dir(source: &AuditSource) -> anyhow::Result<PathBuf> {
    if let Some(dir) = &source.dir {
        return Ok(dir.clone());
    }
    let config = Config::load(&source.config)
        .with_context(|| "finding the audit log (or pass --dir)".to_string())?;
    Ok(config.audit.dir(&config.node.data_dir))
}
