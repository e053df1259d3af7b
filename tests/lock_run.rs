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

/// CLOCK_MONOTONIC now, in nanoseconds: the clock the stop file is written on.
fn monotonic_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// `--stop-file`: the command is told where it is (FENCING_STOP_FILE); it names the lease, moves
/// with every renewal, and when renewals stop the runner stops the command at the time it last
/// said. A path in a missing directory is refused before the lock is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stop_file_holds_the_stop_time_the_runner_keeps() {
    let cluster = Cluster::start(1, "").await;
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing/stop.json");
    let out = Command::new(BIN)
        .args(["lock", "run", "stopped", "--stop-file"])
        .arg(&missing)
        .args(["--", "true"])
        .env("FENCEGATE_ENDPOINT", cluster.url(1))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("directory does not exist"),
        "{err}"
    );

    let path = dir.path().join("stop.json");
    let (mut child, out) = run(
        &cluster.url(1),
        &[
            "stopped",
            "--ttl",
            "1500ms",
            "--margin",
            "500ms",
            "--grace",
            "1s",
            "--stop-file",
            path.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            r#"echo "$FENCING_REVISION $FENCING_STOP_FILE"; exec sleep 60"#,
        ],
    );
    let (first, _out) = line(out).await;
    let read = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    };
    let stop = |v: &serde_json::Value| v["stop_monotonic_ns"].as_u64().unwrap();
    let started = read();
    assert_eq!(first, format!("{} {}", started["revision"], path.display()));
    assert!(stop(&started) > monotonic_ns(), "{started}");

    // A renewal (every ttl/3) moves the stop time on.
    let deadline = Instant::now() + Duration::from_secs(5);
    let renewed = loop {
        let now = read();
        if stop(&now) != stop(&started) {
            break now;
        }
        assert!(Instant::now() < deadline, "the stop file never moved");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(stop(&renewed) > stop(&started));
    let expires = renewed["expires_monotonic_ns"].as_u64().unwrap();
    assert_eq!(expires - stop(&renewed), 500_000_000, "{renewed}");

    // The authority freezes: the command is stopped at the last stop time the file said.
    cluster.signal(1, Signal::SIGSTOP);
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    let stopped_at = monotonic_ns();
    cluster.signal(1, Signal::SIGCONT);
    assert_eq!(status.code(), Some(124));
    let promised = stop(&read());
    // SIGTERM ends `sleep` at once; the bound is --grace (1 s) plus time to exit, under load.
    assert!(
        stopped_at >= promised && stopped_at <= promised + 1_500_000_000,
        "stopped {} ms after the promised stop time",
        (stopped_at as i64 - promised as i64) / 1_000_000
    );
}
