//! The nightly billing job of the README's story: writes one day's invoices in chunks, each
//! chunk to three stores through the fencegate gateway, and stops as soon as a store says its
//! lock is gone.
//!
//! Run it under `fencegate lock run`, which hands it the lock's token:
//!
//! ```sh
//! fencegate lock run billing:2026-09-28 --ttl 10s --margin 2s -- \
//!     target/debug/examples/billing --chunks 10
//! ```
//!
//! Each chunk is one unit per store: one PostgreSQL transaction of invoice rows, one S3 object,
//! one Redis hash. The job is resumable: a chunk already in a store (written by an earlier
//! holder) is not written again there. Its first act, before reading or writing anything, is to
//! raise the fence in every store to its token, so a previous holder that wakes up is refused
//! even for chunks this job has not reached yet.
//!
//! It prints one JSON event per line on stdout (what the story test and the demo table read).
//! Exit codes: 0 done, 3 a store refused a write (this job no longer holds the lock), 1 error.
//!
//! Environment: `FENCING_TOKEN` (from `lock run`); `BILLING_PG` (a libpq key/value DSN of the
//! PostgreSQL gateway), `BILLING_REDIS` (`redis://` URL of the Redis gateway), `BILLING_S3`
//! (the S3 gateway's URL), `BILLING_S3_BUCKET` (default `billing`), `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` (default `us-east-1`).

mod event;
mod invoice;
mod outcome;
mod postgres_store;
mod redis_store;
mod s3_store;

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use fencegate_core::Token;

use event::Events;
use invoice::Chunk;
use outcome::Report;
use postgres_store::PostgresStore;
use redis_store::RedisStore;
use s3_store::S3Store;

/// Exit code when a store refused a write: the lock was lost.
const EXIT_FENCED: u8 = 3;

#[derive(Parser)]
#[command(name = "billing", about = "The billing job of fencegate's story")]
struct Args {
    /// The billing day; every key and row carries it.
    #[arg(long, default_value = "2026-09-28")]
    day: String,
    /// Number of chunks the day's invoices are written in.
    #[arg(long, default_value_t = 10)]
    chunks: u32,
    /// Invoices per chunk.
    #[arg(long, default_value_t = 5)]
    invoices: u32,
    /// Stop this process (SIGSTOP) once chunk N is prepared, before it is written; may be
    /// repeated. Someone else sends SIGCONT.
    #[arg(long = "pause-before", value_name = "N")]
    pause_before: Vec<u32>,
    /// Time spent computing each chunk before it is written.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    chunk_time: Duration,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let events = Events::new();
    match run(Args::parse(), &events).await {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            events.emit("error", serde_json::json!({ "detail": format!("{e:#}") }));
            eprintln!("billing: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args, events: &Events) -> anyhow::Result<u8> {
    let token_text = std::env::var("FENCING_TOKEN")
        .context("FENCING_TOKEN is not set; run the job under `fencegate lock run`")?;
    let token = Token::parse(&token_text)
        .map_err(|e| anyhow::anyhow!("FENCING_TOKEN is not a fencing token: {e}"))?;
    events.emit(
        "start",
        serde_json::json!({ "pid": std::process::id(), "token": token_text }),
    );

    let mut postgres = PostgresStore::connect(&env("BILLING_PG")?, &token_text, &args.day).await?;
    let mut redis = RedisStore::connect(&env("BILLING_REDIS")?, &token_text, &args.day).await?;
    let s3 = S3Store::new(
        &env("BILLING_S3")?,
        &std::env::var("BILLING_S3_BUCKET").unwrap_or_else(|_| "billing".into()),
        &token_text,
        &args.day,
    )?;

    // First act: raise the fence everywhere, before reading or writing anything.
    let raised = [
        ("postgres", postgres.raise_fence(&token).await?),
        ("redis", redis.raise_fence().await?),
        ("s3", s3.raise_fence().await?),
    ];
    let report = Report::of(&raised);
    events.emit("fence", report.json(None));
    if report.refused {
        return Ok(EXIT_FENCED);
    }

    let pauses: BTreeSet<u32> = args.pause_before.iter().copied().collect();
    for n in 0..args.chunks {
        let chunk = Chunk::new(&args.day, n, args.invoices, &token_text);
        // Which stores still need this chunk: decided now, written later. A worker frozen
        // between the two still has the chunk "in its buffers" when it wakes.
        let needs = [
            !postgres.has(&chunk).await?,
            !redis.has(&chunk).await?,
            !s3.has(&chunk).await?,
        ];
        if needs == [false; 3] {
            events.emit(
                "chunk",
                serde_json::json!({ "chunk": n, "result": "present" }),
            );
            continue;
        }
        if pauses.contains(&n) {
            events.emit("paused", serde_json::json!({ "chunk": n }));
            nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP)?;
            events.emit("resumed", serde_json::json!({ "chunk": n }));
        }
        tokio::time::sleep(args.chunk_time).await;
        // Each store fences on its own: the chunk goes to every store that needs it, so a
        // refusal shows in each of them; then the job stops.
        let mut written = Vec::new();
        if needs[0] {
            written.push(("postgres", postgres.write(&chunk).await?));
        }
        if needs[1] {
            written.push(("redis", redis.write(&chunk).await?));
        }
        if needs[2] {
            written.push(("s3", s3.write(&chunk).await?));
        }
        let report = Report::of(&written);
        events.emit("chunk", report.json(Some(n)));
        if report.refused {
            return Ok(EXIT_FENCED);
        }
    }
    events.emit("done", serde_json::json!({}));
    Ok(0)
}

fn env(name: &str) -> anyhow::Result<String> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => Ok(v),
        _ => bail!("{name} is not set (see the top of examples/billing/main.rs)"),
    }
}
