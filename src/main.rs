mod api;
mod api_listener;
mod audit;
mod authority;
mod cli;
mod cli_audit;
mod cli_certs;
mod cli_postgres;
mod cli_s3;
mod client;
mod config;
mod config_check;
mod config_source;
mod disk;
mod exposition;
mod fence_reset;
mod gateway_metrics;
mod lock_run;
mod metrics;
mod open_file_limit;
mod peer_reserve;
mod process_metrics;
mod raft_watch;
mod reload;
mod sampled_gauge;
mod server;
mod stop_file;
mod table;
mod tls;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use reqwest::Method;
use serde_json::json;

use cli::{
    CertsCommand, Cli, ClusterCommand, Command, EndpointArg, FenceCommand, LockCommand,
    SnapshotCommand, TokenKeyCommand,
};
use client::{Answer, Client};
use config::Config;

/// How long client commands keep trying while no endpoint answers or an election runs.
const PATIENCE: Duration = Duration::from_secs(10);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A restore goes through the log in parts: a state of `[authority] max_leases` leases takes a few
/// seconds (see `ops::RESTORE_TIMEOUT` on the node's side).
const RESTORE_TIMEOUT: Duration = Duration::from_secs(120);
/// Adding a node waits for it to catch up with the log (the leader gives up after a minute).
const MEMBERSHIP_TIMEOUT: Duration = Duration::from_secs(90);

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new().expect("starting the tokio runtime");
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fencegate: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Serve(arg) => {
            let (config, source) = Config::load_with_source(&arg.config)?;
            config_check::sources(&source, &config)?;
            let log = init_logging(&config.log);
            server::serve(config, arg.config.clone(), log).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig(arg) => {
            let (config, source) = Config::load_with_source(&arg.config)?;
            config_check::build(&source, &config)?;
            let members = if config.authority.join {
                "join mode: waits for cluster add-node".to_owned()
            } else {
                format!("{} member(s)", config.members().len())
            };
            println!(
                "{}: ok (node {}, {members})",
                arg.config.display(),
                config.node.id,
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Lock(command) => lock(command).await,
        Command::Cluster(ClusterCommand::Status { endpoint }) => print_answer(
            client(&endpoint)?
                .call(Method::GET, "/v1/cluster", None, REQUEST_TIMEOUT)
                .await?,
            endpoint.output,
        ),
        Command::Cluster(ClusterCommand::AddNode {
            id,
            api,
            peer,
            endpoint,
        }) => print_answer(
            client(&endpoint)?
                .call(
                    Method::POST,
                    "/v1/cluster/nodes",
                    Some(&json!({ "id": id, "api": api, "peer": peer })),
                    MEMBERSHIP_TIMEOUT,
                )
                .await?,
            endpoint.output,
        ),
        Command::Cluster(ClusterCommand::RemoveNode { id, endpoint }) => print_answer(
            client(&endpoint)?
                .call(
                    Method::DELETE,
                    &format!("/v1/cluster/nodes/{id}"),
                    None,
                    MEMBERSHIP_TIMEOUT,
                )
                .await?,
            endpoint.output,
        ),
        Command::Snapshot(command) => snapshot(command).await,
        Command::Audit(command) => cli_audit::run(command),
        Command::Postgres(command) => cli_postgres::run(command).await,
        Command::S3(command) => cli_s3::run(command).await,
        Command::TokenKey(command) => token_key(command).await,
        Command::Certs(CertsCommand::Init { dir, nodes }) => {
            cli_certs::init(&dir, &nodes)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Certs(CertsCommand::AddNode { dir, node }) => {
            cli_certs::add_node(&dir, &node)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Fence(FenceCommand::Reset {
            resource,
            store,
            current,
            to,
            dsn,
            bucket,
            endpoint,
        }) => print_answer(
            client(&endpoint)?
                .call(
                    Method::POST,
                    "/v1/fences/reset",
                    Some(&json!({
                        "store": store,
                        "resource": resource,
                        "current": current,
                        "to": to,
                        "dsn": dsn,
                        "bucket": bucket,
                    })),
                    REQUEST_TIMEOUT,
                )
                .await?,
            endpoint.output,
        ),
    }
}

async fn lock(command: LockCommand) -> anyhow::Result<ExitCode> {
    let (endpoint, method, path, body, timeout) = match command {
        LockCommand::Run {
            resource,
            ttl,
            margin,
            wait,
            grace,
            holder,
            endpoint,
            command,
            stop_file,
        } => {
            let opts = lock_run::RunOptions {
                resource,
                ttl,
                margin,
                wait,
                grace,
                holder,
                endpoint,
                command,
                stop_file,
            };
            return Ok(ExitCode::from(lock_run::run(opts).await?));
        }
        LockCommand::Acquire {
            resource,
            ttl,
            wait,
            holder,
            endpoint,
        } => {
            let body = json!({
                "ttl_ms": ttl.as_millis() as u64,
                "wait_ms": wait.as_millis() as u64,
                "request_id": client::request_id(),
                "holder": holder,
            });
            let path = format!("/v1/locks/{resource}");
            (
                endpoint,
                Method::POST,
                path,
                Some(body),
                wait + REQUEST_TIMEOUT,
            )
        }
        LockCommand::Keepalive { lease_id, endpoint } => {
            let path = format!("/v1/leases/{lease_id}/keepalive");
            (endpoint, Method::POST, path, None, REQUEST_TIMEOUT)
        }
        LockCommand::Release { lease_id, endpoint } => {
            let path = format!("/v1/leases/{lease_id}");
            (endpoint, Method::DELETE, path, None, REQUEST_TIMEOUT)
        }
        LockCommand::List { endpoint } => (
            endpoint,
            Method::GET,
            "/v1/locks".to_owned(),
            None,
            REQUEST_TIMEOUT,
        ),
        LockCommand::Status { resource, endpoint } => {
            let path = format!("/v1/locks/{resource}");
            (endpoint, Method::GET, path, None, REQUEST_TIMEOUT)
        }
    };
    let answer = client(&endpoint)?
        .call(method, &path, body.as_ref(), timeout)
        .await?;
    print_answer(answer, endpoint.output)
}

async fn snapshot(command: SnapshotCommand) -> anyhow::Result<ExitCode> {
    match command {
        SnapshotCommand::Save { file, endpoint } => {
            let answer = client(&endpoint)?
                .call(Method::GET, "/v1/snapshot", None, REQUEST_TIMEOUT)
                .await?;
            if !answer.status.is_success() {
                return print_answer(answer, endpoint.output);
            }
            let tmp = file.with_extension("partial");
            std::fs::write(&tmp, serde_json::to_vec_pretty(&answer.body)?)
                .with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, &file)
                .with_context(|| format!("renaming to {}", file.display()))?;
            println!(
                "{}",
                json!({ "saved": file.display().to_string(), "revision": answer.body["revision"] })
            );
            Ok(ExitCode::SUCCESS)
        }
        SnapshotCommand::Bump { by, endpoint } => print_answer(
            client(&endpoint)?
                .call(
                    Method::POST,
                    "/v1/revision/bump",
                    Some(&json!({ "by": by })),
                    REQUEST_TIMEOUT,
                )
                .await?,
            endpoint.output,
        ),
        SnapshotCommand::Restore { file, endpoint } => {
            let text =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let body: serde_json::Value = serde_json::from_slice(&text)
                .with_context(|| format!("{} is not a snapshot file", file.display()))?;
            print_answer(
                client(&endpoint)?
                    .call(
                        Method::POST,
                        "/v1/snapshot/restore",
                        Some(&body),
                        RESTORE_TIMEOUT,
                    )
                    .await?,
                endpoint.output,
            )
        }
    }
}

async fn token_key(command: TokenKeyCommand) -> anyhow::Result<ExitCode> {
    let (endpoint, method, path) = match command {
        TokenKeyCommand::List { endpoint } => (endpoint, Method::GET, "/v1/token-keys".to_owned()),
        TokenKeyCommand::Rotate { endpoint } => {
            (endpoint, Method::POST, "/v1/token-keys".to_owned())
        }
        TokenKeyCommand::Retire { kid, endpoint } => (
            endpoint,
            Method::POST,
            format!("/v1/token-keys/{kid}/retire"),
        ),
    };
    print_answer(
        client(&endpoint)?
            .call(method, &path, None, REQUEST_TIMEOUT)
            .await?,
        endpoint.output,
    )
}

fn client(endpoint: &EndpointArg) -> anyhow::Result<Client> {
    Ok(Client::new(endpoint, PATIENCE)?)
}

/// Prints the API's JSON on stdout; a refusal also exits 1 so scripts can test it.
fn print_answer(answer: Answer, output: table::Output) -> anyhow::Result<ExitCode> {
    match output {
        table::Output::Json => println!("{}", answer.body),
        table::Output::Table => print!("{}", table::render(&answer.body)),
    }
    Ok(if answer.status.is_success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Installs the log subscriber (text or JSON lines on stderr); returns how SIGHUP sets a new
/// `[log] level`.
fn init_logging(log: &config::LogConfig) -> reload::SetLogLevel {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_env("FENCEGATE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&log.level));
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let registry = tracing_subscriber::registry().with(filter);
    match log.format {
        // One object per line, fields flattened to the top level, for log shippers.
        config::LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_writer(std::io::stderr),
            )
            .init(),
        // Colours only on a terminal: a log file or journald gets plain text.
        config::LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
            )
            .init(),
    }
    Box::new(move |level: &str| {
        let filter = tracing_subscriber::EnvFilter::try_new(level)
            .map_err(|e| format!("[log] level {level:?}: {e}"))?;
        handle.reload(filter).map_err(|e| e.to_string())
    })
}
