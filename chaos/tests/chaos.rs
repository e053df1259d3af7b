//! `fencegate-chaos` end to end: one seed with every fault finds no violation, and the same
//! workload with fencing bypassed is caught (the checker can fail).
//!
//! Needs redis-server, PostgreSQL and moto (the repository's `.venv`); makes sure the `fencegate` binary the run starts is built
//! (see `fencegate()`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

/// One chaos run at a time: each starts a 3-node cluster and workers.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The `fencegate` binary the run starts, fresh. Cargo builds only this package's own binary for
/// its tests, so the test asks cargo for the rest, as `cargo test --workspace --no-run`: under the
/// README's `cargo test --workspace` that is the very build just made (nothing to do), where a
/// `cargo build -p fencegate` would resolve other features and compile the dependencies again.
/// Run alone (`cargo test -p fencegate-chaos`), it builds the workspace's tests once.
fn fencegate() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["test", "--workspace", "--no-run", "--quiet"])
        .status()
        .expect("run cargo test --no-run");
    assert!(status.success(), "cargo test --workspace --no-run failed");
    let me = std::env::current_exe().unwrap();
    let bin = me.parent().unwrap().parent().unwrap().join("fencegate");
    assert!(bin.is_file(), "{} was not built", bin.display());
    bin
}

/// Runs `fencegate-chaos args`; returns its exit code and its JSON report.
fn chaos(args: &[&str], dir: &Path) -> (i32, Value) {
    let report = dir.join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate-chaos"))
        .args(args)
        .arg("--report")
        .arg(&report)
        .env("FENCEGATE_BIN", fencegate())
        .output()
        .expect("run fencegate-chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    let report = std::fs::read(&report).unwrap_or_else(|e| {
        panic!(
            "no report ({e}); stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (
        out.status.code().unwrap_or(-1),
        serde_json::from_slice(&report).unwrap(),
    )
}

#[test]
fn one_seed_with_every_fault_has_no_violation() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // S3 costs this run about 12 s more (moto, its gateways, the log read back): measured
    // 52 s -> 64 s for 45 s of faults on a loaded 2-core machine.
    let (code, report) = chaos(
        &[
            "--seed",
            "7",
            "--duration",
            "45s",
            "--stores",
            "redis,postgres,s3",
        ],
        dir.path(),
    );
    let seed = &report["seeds"][0];
    assert_eq!(report["violations"], 0, "{:#}", seed["violations"]);
    assert_eq!(code, 0);
    // The run did something worth checking: writes applied, faults of several kinds.
    for store in ["redis", "postgres", "s3"] {
        let writes = &seed["writes"][store];
        assert!(
            writes["acknowledged"].as_u64().unwrap_or(0) > 50,
            "{store}: {writes}"
        );
    }
    let faults = seed["faults"].as_object().unwrap();
    assert!(faults.len() >= 3, "{faults:?}");
}

#[test]
fn with_fencing_bypassed_the_checker_reports_violations() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let (code, report) = chaos(
        &[
            "--seed",
            "1",
            "--duration",
            "15s",
            "--bypass-fencing",
            "--faults",
            "pause-worker",
        ],
        dir.path(),
    );
    let seed = &report["seeds"][0];
    assert!(
        seed["faults"]["pause-worker"].as_u64().unwrap_or(0) >= 1,
        "no pause was injected: {seed:#}"
    );
    // A paused holder wakes up and its writes land after the next holder's.
    assert!(
        seed["violations_by_kind"]["revision-decreased"]
            .as_u64()
            .unwrap_or(0)
            > 0,
        "{seed:#}"
    );
    assert_eq!(code, 1);
}
