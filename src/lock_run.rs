//! `fencegate lock run`: hold a lock for exactly as long as a command runs.
//!
//! The runner acquires the lock, starts the command with the token in its environment, renews
//! the lease every ttl/3 and, if renewals stop succeeding, stops the command at its own stop
//! time: `sent_at + ttl - margin`, where `sent_at` is read on this process's monotonic clock
//! *before* the last successful renewal was sent. It never compares its clock with another
//! machine's.
//!
//! Its limit: the runner renews for a command it cannot see inside. A command that is frozen
//! (SIGSTOP, a GC pause) while the runner keeps running keeps its lease alive. What protects the
//! data in that case is the fence at the store, not the runner.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use reqwest::{Method, StatusCode};
use serde_json::json;
use thiserror::Error;
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::client::{request_id, Client, ClientError};
use crate::stop_file::StopFile;

/// Exit code when the lock could not be acquired (held past `--wait`): try again later
/// (sysexits' EX_TEMPFAIL).
pub const EXIT_NOT_ACQUIRED: u8 = 75;
/// Exit code when the lease was lost and the command was stopped (as `timeout(1)` does).
pub const EXIT_LEASE_LOST: u8 = 124;

#[derive(Debug, Error)]
pub enum RunError {
    #[error("--margin ({margin:?}) must be shorter than --ttl ({ttl:?})")]
    Margin { ttl: Duration, margin: Duration },
    #[error("no command given; usage: fencegate lock run RESOURCE [options] -- CMD ARGS...")]
    NoCommand,
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("the authority refused the acquire ({status}): {body}")]
    Refused {
        status: StatusCode,
        body: serde_json::Value,
    },
    #[error("waiting for the command failed: {0}")]
    Wait(std::io::Error),
    #[error("--stop-file {0}: its directory does not exist; create it or name another path")]
    StopFileDir(PathBuf),
}

pub struct RunOptions {
    pub resource: String,
    pub ttl: Duration,
    pub margin: Duration,
    pub wait: Duration,
    pub grace: Duration,
    pub holder: Option<String>,
    pub endpoint: crate::cli::EndpointArg,
    pub command: Vec<String>,
    /// Where to keep the stop time for the command to read (`crate::stop_file`).
    pub stop_file: Option<PathBuf>,
}

/// What ended the run.
enum End {
    Exited(ExitStatus),
    /// The command was stopped because the lease could not be kept.
    LeaseLost,
}

const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the runner keeps trying beyond `--wait` to get its acquire answered (a failover
/// during the wait, say): patience is `wait + PATIENCE_MARGIN`, so the legitimate wait never
/// eats into the time for retries.
const PATIENCE_MARGIN: Duration = Duration::from_secs(10);
/// Pause between failed renewals.
const RETRY_AFTER: Duration = Duration::from_millis(200);

pub async fn run(opts: RunOptions) -> Result<u8, RunError> {
    if opts.margin >= opts.ttl {
        return Err(RunError::Margin {
            ttl: opts.ttl,
            margin: opts.margin,
        });
    }
    let (program, args) = opts.command.split_first().ok_or(RunError::NoCommand)?;
    // Checked before the lock is taken, so a typo costs no lease.
    if let Some(path) = &opts.stop_file {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        if !dir.is_none_or(|d| d.is_dir()) {
            return Err(RunError::StopFileDir(path.clone()));
        }
    }
    let client = Client::new(&opts.endpoint, opts.wait + PATIENCE_MARGIN)?;

    let sent_at = Instant::now();
    // One request id for every attempt: a retry after a failover gets the grant the old leader
    // committed, if it did, rather than a second lease. Each attempt asks the node to wait only
    // for what is left of `--wait`.
    let request_id = request_id();
    let answer = client
        .call_with(
            Method::POST,
            &format!("/v1/locks/{}", opts.resource),
            |left| {
                Some(json!({
                    "ttl_ms": opts.ttl.as_millis() as u64,
                    "wait_ms": left.saturating_sub(PATIENCE_MARGIN).as_millis() as u64,
                    "request_id": request_id,
                    "holder": opts.holder,
                }))
            },
            |left| left.saturating_sub(PATIENCE_MARGIN) + REQUEST_TIMEOUT,
        )
        .await?;
    if answer.status == StatusCode::CONFLICT {
        eprintln!(
            "fencegate lock run: {} is held (revision {}); not running the command",
            opts.resource, answer.body["revision"]
        );
        return Ok(EXIT_NOT_ACQUIRED);
    }
    if !answer.status.is_success() {
        return Err(RunError::Refused {
            status: answer.status,
            body: answer.body,
        });
    }
    let grant = answer.body;
    // The handle is a credential: it goes to the command and the API, never to the log, which
    // names the lease by its number.
    let handle = grant["lease_id"].as_str().unwrap_or_default().to_owned();
    let lease_id = handle.split('.').next().unwrap_or_default().to_owned();
    let granted_ttl = grant["ttl_ms"]
        .as_u64()
        .map_or(opts.ttl, Duration::from_millis);
    let mut stop_time = sent_at + granted_ttl - opts.margin;
    // When the lease ends as far as this runner knows (stop time + margin), for the stop file.
    let mut expires = sent_at + granted_ttl;
    let renew_every = granted_ttl / 3;
    let keepalive = format!("/v1/leases/{handle}/keepalive");
    let mut next_renewal = sent_at + renew_every;

    // A waited acquire was granted at some unknown point of the wait, so `sent_at` may say
    // nothing useful about the lease. Renew once first: a renewal that succeeds proves the lease
    // alive for a full ttl from the moment it was sent, whatever happened during the wait.
    if Instant::now() >= next_renewal {
        let deadline = Instant::now() + granted_ttl;
        loop {
            match renew(&client, &keepalive, deadline, granted_ttl).await {
                Renewal::Renewed { sent, ttl } => {
                    stop_time = sent + ttl - opts.margin.min(ttl);
                    expires = sent + ttl;
                    next_renewal = sent + renew_every;
                    break;
                }
                Renewal::Failed(_) if Instant::now() < deadline => {
                    tokio::time::sleep(RETRY_AFTER).await
                }
                Renewal::Expired | Renewal::Failed(_) => {
                    eprintln!("fencegate lock run: lease {lease_id} could not be renewed after the wait for the lock; not running the command");
                    return Ok(EXIT_LEASE_LOST);
                }
            }
        }
    }

    let revision = grant["revision"].as_u64().unwrap_or_default();
    let stop_file = opts
        .stop_file
        .as_deref()
        .map(|p| StopFile::new(p, revision));
    let mut stop_file_failed = false;
    let mut publish = |stop: Instant, expires: Instant| {
        let Some(file) = &stop_file else { return };
        match file.write(stop, expires) {
            Ok(()) => stop_file_failed = false,
            // Said once per streak: the runner still stops the command at its stop time.
            Err(e) if !stop_file_failed => {
                stop_file_failed = true;
                eprintln!("fencegate lock run: cannot update the stop file ({e}); the command may read an old stop time, which is earlier, never later");
            }
            Err(_) => {}
        }
    };
    publish(stop_time, expires);
    let mut command = Command::new(program);
    if let Some(path) = &opts.stop_file {
        command.env("FENCING_STOP_FILE", path);
    }
    let mut child = command
        .args(args)
        .env("FENCING_TOKEN", grant["token"].as_str().unwrap_or_default())
        .env("FENCING_RESOURCE", &opts.resource)
        .env("FENCING_LEASE_ID", &handle)
        .env("FENCING_REVISION", grant["revision"].to_string())
        // Its own process group, so stopping it reaches whatever it started too.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| RunError::Spawn {
            program: program.clone(),
            source,
        })?;

    let mut failed_renewals = 0u32;
    let mut term = signal(tokio::signal::unix::SignalKind::terminate());
    let mut int = signal(tokio::signal::unix::SignalKind::interrupt());

    let end = loop {
        tokio::select! {
            status = child.wait() => break End::Exited(status.map_err(RunError::Wait)?),
            _ = tokio::time::sleep_until(stop_time) => {
                eprintln!("fencegate lock run: lease {lease_id} not renewed in time; stopping the command");
                stop(&mut child, opts.grace).await?;
                break End::LeaseLost;
            }
            _ = tokio::time::sleep_until(next_renewal) => {
                // Bounded by the stop time: a hung authority must not keep us past it.
                let failure = match renew(&client, &keepalive, stop_time, granted_ttl).await {
                    Renewal::Renewed { sent, ttl } => {
                        stop_time = sent + ttl - opts.margin.min(ttl);
                        expires = sent + ttl;
                        publish(stop_time, expires);
                        next_renewal = sent + renew_every;
                        if failed_renewals > 0 {
                            eprintln!("fencegate lock run: lease {lease_id} renewed after {failed_renewals} failed attempt(s)");
                            failed_renewals = 0;
                        }
                        continue;
                    }
                    Renewal::Expired => {
                        eprintln!("fencegate lock run: lease {lease_id} has expired; stopping the command");
                        stop(&mut child, opts.grace).await?;
                        break End::LeaseLost;
                    }
                    Renewal::Failed(failure) => failure,
                };
                // Unreachable or refused for now (e.g. a leader election): keep trying until
                // the stop time. Said once per streak, so a failover is visible in the log.
                if failed_renewals == 0 {
                    let left = stop_time.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        eprintln!("fencegate lock run: renewing lease {lease_id} failed ({failure}) and its stop time has passed");
                    } else {
                        eprintln!("fencegate lock run: renewing lease {lease_id} failed ({failure}); retrying until the stop time, {left:.1?} from now");
                    }
                }
                failed_renewals += 1;
                next_renewal = Instant::now() + RETRY_AFTER;
            }
            _ = term.recv() => forward(&child, Signal::SIGTERM),
            _ = int.recv() => forward(&child, Signal::SIGINT),
        }
    };

    let path = format!("/v1/leases/{handle}");
    match end {
        End::Exited(status) => {
            if let Err(e) = client
                .with_patience(Duration::from_secs(5))
                .call(Method::DELETE, &path, None, REQUEST_TIMEOUT)
                .await
            {
                eprintln!("fencegate lock run: could not release lease {lease_id} ({e}); it expires by itself");
            }
            Ok(exit_code(status))
        }
        End::LeaseLost => Ok(EXIT_LEASE_LOST),
    }
}

/// What one keepalive got.
enum Renewal {
    /// Renewed for `ttl` from `sent`, read on our clock before the request went out.
    Renewed { sent: Instant, ttl: Duration },
    /// The authority no longer knows the lease.
    Expired,
    /// No decision (unreachable, no leader, timed out): try again.
    Failed(String),
}

/// One keepalive of `path`, given up at `deadline`.
async fn renew(client: &Client, path: &str, deadline: Instant, granted_ttl: Duration) -> Renewal {
    let sent = Instant::now();
    // Each attempt gets a share of the time left (see `Client::call_within`), so a frozen node
    // costs part of it and the next endpoint still gets its turn before the stop time.
    let renewer = client.with_patience(deadline.saturating_duration_since(sent));
    let call = renewer.call_within(Method::POST, path, None);
    match tokio::time::timeout_at(deadline, call).await {
        // Read before the answering attempt was sent: the lease can only be longer than what
        // we assume.
        Ok(Ok(a)) if a.status.is_success() => Renewal::Renewed {
            sent: a.sent,
            ttl: a.body["ttl_ms"]
                .as_u64()
                .map_or(granted_ttl, Duration::from_millis),
        },
        Ok(Ok(a)) if a.status == StatusCode::NOT_FOUND => Renewal::Expired,
        Ok(Ok(a)) => Renewal::Failed(format!("the authority answered {}", a.status)),
        Ok(Err(e)) => Renewal::Failed(e.to_string()),
        Err(_) => Renewal::Failed("no answer in time".to_owned()),
    }
}

fn signal(kind: tokio::signal::unix::SignalKind) -> tokio::signal::unix::Signal {
    tokio::signal::unix::signal(kind).expect("installing a signal handler")
}

fn forward(child: &Child, signal: Signal) {
    if let Some(pid) = child.id() {
        let _ = killpg(Pid::from_raw(pid as i32), signal);
    }
}

/// SIGTERM to the command's process group, then SIGKILL after `grace`.
async fn stop(child: &mut Child, grace: Duration) -> Result<ExitStatus, RunError> {
    forward(child, Signal::SIGTERM);
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(status) => status.map_err(RunError::Wait),
        Err(_) => {
            forward(child, Signal::SIGKILL);
            child.wait().await.map_err(RunError::Wait)
        }
    }
}

/// The command's exit code, or 128 + signal as shells report a death by signal.
fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128u8.saturating_add(signal as u8),
        (None, None) => 1,
    }
}
