//! How long the cluster has no usable leader after its leader is killed: 20 kills, the median
//! and the spread printed (not asserted: it measures the machine as much as the code).
//!
//! Ignored by default (about a minute); run it with
//! `cargo test --test authority failover_time -- --ignored --nocapture`. The `[authority]`
//! settings under test come from FAILOVER_CONFIG (e.g. "heartbeat_ms = 100\n..."); without it,
//! the defaults.

use std::time::{Duration, Instant};

use crate::support::cluster::Cluster;
use reqwest::StatusCode;
use serde_json::json;

const KILLS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a one-minute measurement; run with --ignored --nocapture"]
async fn time_to_a_usable_leader_after_a_leader_kill() {
    let extra = std::env::var("FAILOVER_CONFIG").unwrap_or_default();
    let mut cluster = Cluster::start(3, &extra).await;
    let started = Instant::now();
    let mut times = Vec::new();
    for round in 0..KILLS {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "bounded: 20 kills in 5 minutes"
        );
        let leader = cluster.wait_for_leader(&cluster.ids()).await;
        let survivors: Vec<u64> = cluster.ids_but(leader);
        cluster.kill(leader);
        let killed_at = Instant::now();
        // Usable: some survivor grants a lock (a committed write through a new leader).
        let took = 'usable: loop {
            assert!(killed_at.elapsed() < Duration::from_secs(30), "no leader");
            for id in &survivors {
                let answer = cluster
                    .http
                    .post(format!("{}/v1/locks/failover:{round}", cluster.url(*id)))
                    .json(&json!({ "ttl_ms": 1000 }))
                    .timeout(Duration::from_millis(500))
                    .send()
                    .await;
                if answer.is_ok_and(|a| a.status() == StatusCode::OK) {
                    break 'usable killed_at.elapsed();
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        times.push(took);
        cluster.spawn(leader);
        // A healthy cluster before the next kill: the restarted node has caught up (a node
        // behind on the log loses its campaign, and its vote can split the next one).
        let caught_up = Instant::now();
        loop {
            let mut applied = Vec::new();
            for id in cluster.ids() {
                applied.push(
                    cluster
                        .cluster_view(id)
                        .await
                        .map(|v| v["last_applied"].clone()),
                );
            }
            if applied[0].is_some() && applied.iter().all(|a| *a == applied[0]) {
                break;
            }
            assert!(caught_up.elapsed() < Duration::from_secs(30), "{applied:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    times.sort();
    let ms = |d: Duration| d.as_millis();
    println!(
        "leader kills: {KILLS}; time to a usable leader: median {} ms, min {} ms, p90 {} ms, max {} ms; config: {:?}",
        ms(times[KILLS / 2]),
        ms(times[0]),
        ms(times[KILLS * 9 / 10]),
        ms(times[KILLS - 1]),
        if extra.is_empty() { "defaults" } else { &extra },
    );
}
