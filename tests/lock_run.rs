//! `fencegate lock run` holds a lock exactly while its command runs, and stops the command
//! when the lease can no longer be renewed.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use reqwest::StatusCode;
use support::cluster::{Cluster, BIN};

/// Starts `fencegate lock run` with stdout piped; returns the child and a reader of its lines.
fn run(
    endpoint: &str,
    args: &[&str],
) -> (std::process::Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(BIN)
        .args(["lock", "run"])
        .args(args)
        .env("FENCEGATE_ENDPOINT", endpoint)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, out)
}

async fn line(
    mut out: BufReader<std::process::ChildStdout>,
) -> (String, BufReader<std::process::ChildStdout>) {
    tokio::task::spawn_blocking(move || {
        let mut text = String::new();
        out.read_line(&mut text).unwrap();
        (text.trim().to_owned(), out)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_runs_with_the_token_past_its_ttl_and_the_lock_is_released_after() {
    let cluster = Cluster::start(1, "").await;
    let script = r#"echo "$FENCING_TOKEN $FENCING_RESOURCE $FENCING_LEASE_ID"; read _; exit 7"#;
    let mut child = Command::new(BIN)
        .args([
            "lock",
            "run",
            "billing:job",
            "--ttl",
            "1500ms",
            "--margin",
            "300ms",
            "--",
            "sh",
            "-c",
            script,
        ])
        .env("FENCEGATE_ENDPOINT", cluster.url(1))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (first, _out) = line(BufReader::new(child.stdout.take().unwrap())).await;
    let fields: Vec<&str> = first.split(' ').collect();
    assert_eq!(fields[1], "billing:job");
    let token = fencegate_core::Token::parse(fields[0]).expect("FENCING_TOKEN is a token");
    let started = Instant::now();

    // Three ttls later the command still holds the lock: the runner renewed it.
    while started.elapsed() < Duration::from_millis(4500) {
        let (status, lock) = cluster.get(1, "/v1/locks/billing:job").await.unwrap();
        assert_eq!(
            status,
            StatusCode::OK,
            "lost after {:?}: {lock}",
            started.elapsed()
        );
        assert_eq!(lock["revision"].as_u64(), Some(token.revision().get()));
        assert_eq!(
            Some(lock["lease"].to_string().as_str()),
            fields[2].split('.').next()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    drop(child.stdin.take()); // the script's `read` returns; it exits 7
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(
        status.code(),
        Some(7),
        "the runner exits with the command's code"
    );
    let (status, _) = cluster.get(1, "/v1/locks/billing:job").await.unwrap();
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "released when the command exited"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_exits_75_without_running_the_command() {
    let cluster = Cluster::start(1, "").await;
    cluster.acquire(1, "busy", 30_000).await;
    let marker = cluster.path().join("ran");
    let out = Command::new(BIN)
        .args(["lock", "run", "busy", "--", "touch"])
        .arg(&marker)
        .env("FENCEGATE_ENDPOINT", cluster.url(1))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(75),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !marker.exists(),
        "the command must not run without the lock"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_outlives_its_lease_is_stopped_at_the_stop_time() {
    let cluster = Cluster::start(1, "").await;
    let (mut child, out) = run(
        &cluster.url(1),
        &[
            "doomed",
            "--ttl",
            "2s",
            "--margin",
            "500ms",
            "--grace",
            "1s",
            "--",
            "sh",
            "-c",
            "echo started; exec sleep 60",
        ],
    );
    let (first, _out) = line(out).await;
    assert_eq!(first, "started");

    // The authority freezes: renewals hang, then the runner must stop the command by itself,
    // no later than ttl - margin after its last successful renewal.
    cluster.signal(1, Signal::SIGSTOP);
    let frozen_at = Instant::now();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    let took = frozen_at.elapsed();
    cluster.signal(1, Signal::SIGCONT);
    println!("runner stopped the command {took:?} after the authority froze");
    assert_eq!(status.code(), Some(124), "the documented lease-lost code");
    assert!(
        took <= Duration::from_millis(1500 + 500),
        "stopped too late: {took:?}"
    );
    assert!(
        took >= Duration::from_millis(500),
        "stopped before any stop time could pass: {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_acquire_renews_before_the_command_starts() {
    // Found by the billing story: after waiting longer than ttl - margin for the lock, the stop
    // time measured from the acquire's send time had already passed, and the runner stopped the
    // command it had just started.
    let cluster = Cluster::start(1, "").await;
    cluster.acquire(1, "queue", 1_500).await; // never renewed: free again in 1.5 s
    let out = Command::new(BIN)
        .args(["lock", "run", "queue", "--ttl", "2s", "--margin", "500ms"])
        .args(["--wait", "10s", "--", "sh", "-c", "sleep 3; echo finished"])
        .env("FENCEGATE_ENDPOINT", cluster.url(1))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "finished");
}
