//! `fencegate postgres ...`: tools for the PostgreSQL gateway and the store-side fence.

use std::process::ExitCode;
use std::time::Duration;

use fencegate_postgres::{Enforce, InstallOptions, Target};

use crate::cli::{EndpointArg, EnforceArg, PostgresCommand};
use crate::client::Client;

/// The cluster's token keys (id, secret, retired), read from an admin snapshot.
async fn cluster_keys(endpoint: &EndpointArg) -> anyhow::Result<Vec<(u32, Vec<u8>, bool)>> {
    use base64::Engine;
    let answer = Client::new(endpoint, Duration::from_secs(10))?
        .call(
            reqwest::Method::GET,
            "/v1/snapshot",
            None,
            Duration::from_secs(10),
        )
        .await?;
    if !answer.status.is_success() {
        anyhow::bail!(
            "the authority refused to give its keys ({}): {}; sync-keys needs an admin credential",
            answer.status,
            answer.body
        );
    }
    // None yet (no lock acquired), or none ever (the operator's own key signs): the caller
    // decides whether that leaves anything to install.
    let Some(keys) = answer.body["state"]["token_keys"].as_object() else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (kid, key) in keys {
        let kid: u32 = kid.parse()?;
        let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(key["secret"].as_str().unwrap_or_default())?;
        out.push((kid, secret, key["retired"].as_bool().unwrap_or(false)));
    }
    Ok(out)
}

/// The operator's own key (id 0) named by the node config at `path`, as the store keeps it.
/// It is not replicated, so the authority's snapshot does not hold it.
fn operator_key(path: &std::path::Path) -> anyhow::Result<Option<(u32, Vec<u8>, bool)>> {
    let config = crate::config::Config::load(path)?;
    let key = crate::server::operator_key(&config)?;
    if key.is_none() {
        eprintln!(
            "note: {} names no operator key (authority.token_key_env or token_key_file); only the cluster's keys are installed",
            path.display()
        );
    }
    Ok(key.map(|key| (key.id(), key.secret().to_vec(), false)))
}

pub async fn run(command: PostgresCommand) -> anyhow::Result<ExitCode> {
    match command {
        PostgresCommand::Install {
            dsn,
            lock_timeout_ms,
            enforce,
        } => {
            let enforce = enforce.map(|e| match e {
                EnforceArg::Plpgsql => Enforce::Plpgsql,
                EnforceArg::C => Enforce::C,
            });
            let options = InstallOptions {
                lock_timeout: Duration::from_millis(lock_timeout_ms),
                enforce,
            };
            let report = fencegate_postgres::install_with(&dsn, &options).await?;
            for warning in &report.warnings {
                eprintln!("warning: {warning}");
            }
            println!(
                "installed fencegate schema, fencegate.fences and fencegate.guard (owner {}, guard lock_timeout {lock_timeout_ms} ms, guard(text) and enforce() in {}); \
                 run `fencegate postgres protect` to make the store refuse unguarded writes",
                report.owner, report.enforce
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
        PostgresCommand::SyncKeys {
            dsn,
            config,
            endpoint,
        } => {
            let mut keys = cluster_keys(&endpoint).await?;
            if let Some(path) = &config {
                keys.extend(operator_key(path)?);
                keys.sort_by_key(|(kid, _, _)| *kid);
            }
            // Installing no key would delete the store's keys and stop its signature checks.
            if keys.is_empty() {
                anyhow::bail!(
                    "no token keys to install, nothing changed: the authority holds none yet (acquire a lock once, then retry){}",
                    if config.is_some() {
                        ""
                    } else {
                        ", or the cluster signs with an operator key (authority.token_key_env or token_key_file): pass the node's config with --config"
                    }
                );
            }
            let (mut client, task) = fencegate_postgres::connect::connect(&dsn).await?;
            fencegate_postgres::install_token_keys(&mut client, &keys).await?;
            drop(client);
            let _ = task.await;
            let ids: Vec<String> = keys
                .iter()
                .map(|(kid, _, retired)| {
                    format!("{kid}{}", if *retired { " (retired)" } else { "" })
                })
                .collect();
            println!(
                "installed {} token key(s) in the store: {}; the guard now refuses unsigned and forged tokens",
                keys.len(),
                ids.join(", ")
            );
            Ok(ExitCode::SUCCESS)
        }
        PostgresCommand::PrintSql => {
            print!("{}", fencegate_postgres::FENCE_SQL);
            Ok(ExitCode::SUCCESS)
        }
    }
}
