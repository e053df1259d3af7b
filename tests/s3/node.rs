//! The S3 gateway inside a real `fencegate serve` node: configured from `[s3]`, refusals in
//! the node's hash-chained audit log, stopped with the node by SIGINT.

use std::fs::File;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::free_port;
use crate::support::s3_server::{run_client, wait_for_port, MotoServer};
use serde_json::json;

#[test]
fn node_serves_s3_and_audits_refusals() {
    let moto = MotoServer::start();
    let created = moto.direct(json!([{"op": "create_bucket", "bucket": "billing"}]));
    assert_eq!(created[0]["ok"], true, "{created}");
    let dir = tempfile::tempdir().unwrap();
    let (api, s3) = (free_port(), free_port());
    let audit_dir = dir.path().join("audit");
    let config = dir.path().join("fencegate.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nid = 1\napi = \"127.0.0.1:{api}\"\ndata_dir = \"{data}\"\n\n[audit]\ndir = \"{audit}\"\n\n\
             [authority]\naccept_unsigned = true\n\n[security]\ninsecure = true\n\n\
             [s3]\nlisten = \"127.0.0.1:{s3}\"\nupstream = \"{upstream}\"\nupstream_access_key = \"gateway\"\n\
             upstream_secret_env = \"S3_UPSTREAM_SECRET\"\nclients_env = \"S3_CLIENTS\"\n\n\
             [[s3.protect]]\nbucket = \"billing\"\nprefix = \"out/\"\nresource = \"billing\"\n",
            data = dir.path().join("data").display(),
            audit = audit_dir.display(),
            upstream = moto.endpoint,
        ),
    )
    .unwrap();
    let log = dir.path().join("fencegate.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("FENCEGATE_LOG", "info,openraft=warn")
        .env("S3_UPSTREAM_SECRET", "gateway-secret")
        .env("S3_CLIENTS", "AKIDNODE:node-client-secret")
        .stdout(Stdio::null())
        .stderr(File::create(&log).unwrap())
        .spawn()
        .expect("start fencegate serve");
    wait_for_port(s3, Duration::from_secs(30));
    let endpoint = format!("http://127.0.0.1:{s3}");
    let results = run_client(
        &endpoint,
        "AKIDNODE",
        "node-client-secret",
        json!([
            {"op": "put", "bucket": "billing", "key": "out/2026-09-28.csv", "body": "chunk 1", "token": "fg1~12~billing"},
            {"op": "put", "bucket": "billing", "key": "out/2026-09-28.csv", "body": "zombie", "token": "fg1~7~billing"},
            {"op": "put", "bucket": "billing", "key": "out/2026-09-28.csv", "body": "other lock", "token": "fg1~99~payroll"},
            {"op": "put", "bucket": "billing", "key": "scratch/tmp", "body": "unprotected prefix"},
            {"op": "get", "bucket": "billing", "key": "out/2026-09-28.csv"},
        ]),
    );
    println!("{results}");
    assert_eq!(results[0]["ok"], true);
    assert_eq!(
        (results[1]["status"].clone(), results[1]["code"].clone()),
        (json!(412), json!("FencingTokenStale"))
    );
    assert_eq!(
        (results[2]["status"].clone(), results[2]["code"].clone()),
        (json!(403), json!("FencingTokenOutOfScope"))
    );
    assert_eq!(results[3]["ok"], true);
    assert_eq!(results[4]["body"], "chunk 1");
    // SIGINT stops the node, pingora's runtime included, promptly.
    let stop = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    println!(
        "node exited with {status} {:?} after SIGINT",
        stop.elapsed()
    );
    assert!(
        stop.elapsed() < Duration::from_secs(15),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    // Refusal records only (the audit writer may keep other lines, e.g. a seal, next to them).
    let mut records = crate::support::audit::records(&audit_dir);
    records.retain(|r| r.get("store").is_some());
    for r in &records {
        println!("audit: {r}");
    }
    assert_eq!(records.len(), 2);
    assert_eq!(
        (records[0]["store"].as_str(), records[0]["reason"].as_str()),
        (Some("s3"), Some("stale"))
    );
    assert_eq!(
        (
            records[0]["revision"].as_u64(),
            records[0]["fence"].as_u64()
        ),
        (Some(7), Some(12))
    );
    assert_eq!(records[1]["reason"], "out_of_scope");
    assert_eq!(records[1]["prev"], records[0]["hash"]);
}
