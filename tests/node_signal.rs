//! Signals an operator sends to a running node.

mod support;

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use support::cluster::Cluster;

const SIGHUP_LINE: &str = "SIGHUP: config reloaded";

/// SIGHUP used to kill the node (exit 129, nothing logged). It must leave it serving, reload
/// the (unchanged) config, and SIGTERM must still stop it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_leaves_the_node_serving_and_reloads() {
    let mut cluster = Cluster::start(1, "").await;
    cluster.wait_for_leader(&[1]).await;
    cluster.signal(1, Signal::SIGHUP);

    // The log line is the event that says the signal was handled; bounded to 10 s.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = std::fs::read_to_string(cluster.log_path(1)).unwrap_or_default();
        if log.contains(SIGHUP_LINE) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no SIGHUP log line within 10 s; log:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        cluster.wait_exit(1, Duration::ZERO).await.is_none(),
        "the node exited after SIGHUP"
    );
    let grant = cluster.acquire(1, "after-hup", 5_000).await;
    assert!(grant["revision"].as_u64().is_some(), "grant: {grant}");

    cluster.signal(1, Signal::SIGTERM);
    let status = cluster
        .wait_exit(1, Duration::from_secs(15))
        .await
        .expect("the node did not exit within 15 s of SIGTERM");
    assert!(status.success(), "exit after SIGTERM: {status:?}");
}
