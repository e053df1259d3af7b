//! A paused holder: the old holder (token 7) is stopped with SIGSTOP in the middle of a large
//! streamed upload, after the gateway has read the object's ETag and started the conditional
//! PUT; the new holder (token 8) writes; the old holder resumes and finishes its body. The
//! store refuses the old holder's `If-Match` (the ETag changed), the gateway re-reads the fence,
//! and the client gets 412 FencingTokenStale, audited once. The new holder's data survives.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::harness::s3_server::{repo_root, venv_python};
use crate::harness::{token, Harness, ACCESS_KEY, SECRET};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::json;

#[test]
fn a_holder_paused_mid_upload_is_refused_when_it_resumes() {
    let h = Harness::start();
    let setup = h.run(json!([{"op": "put", "bucket": "fenced", "key": "report.bin", "body": "v0", "token": token(7)}]));
    assert_eq!(setup[0]["ok"], true);
    // 48 MiB (above the 16 MiB retry buffer: streamed once), sent slowly.
    let marker = tempfile::tempdir().unwrap();
    let sending = marker.path().join("sending");
    let steps = json!([{"op": "put", "bucket": "fenced", "key": "report.bin", "size": 48 << 20,
                        "slow": 0.002, "marker": sending, "token": token(7)}]);
    let zombie = Command::new(venv_python())
        .arg(repo_root().join("tests/s3/client.py"))
        .args([h.endpoint.as_str(), ACCESS_KEY, SECRET, &steps.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = Pid::from_raw(zombie.id() as i32);
    // Let it hash its body and start sending, then freeze it mid-body.
    let start = std::time::Instant::now();
    while !sending.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the paused holder never started sending"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    kill(pid, Signal::SIGSTOP).unwrap();
    let new_holder = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "report.bin", "body": "new holder's report", "token": token(8)},
    ]));
    println!("new holder: {}", new_holder[0]);
    assert_eq!(new_holder[0]["ok"], true);
    kill(pid, Signal::SIGCONT).unwrap();
    let out = zombie.wait_with_output().unwrap();
    let zombie_result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("paused holder after resuming: {zombie_result}");
    assert_eq!(zombie_result[0]["status"], 412, "{zombie_result}");
    assert_eq!(zombie_result[0]["code"], "FencingTokenStale");
    let after = h.run(json!([{"op": "get", "bucket": "fenced", "key": "report.bin"}]));
    assert_eq!(after[0]["body"], "new holder's report");
    assert_eq!(after[0]["metadata"]["fencegate-revision"], "8");
    let events = h.audit.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0].revision, events[0].fence), (Some(7), Some(8)));
}
