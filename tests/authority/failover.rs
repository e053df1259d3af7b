//! The authority's leader dies or freezes while a lease is held.

use std::time::{Duration, Instant};

use crate::support::cluster::{Cluster, ELECTION_MAX};
use nix::sys::signal::Signal;
use reqwest::{Method, StatusCode};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_never_shortens_a_lease() {
    let mut cluster = Cluster::start(3, "").await;
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let follower = cluster.ids().into_iter().find(|id| *id != leader).unwrap();
    let ttl = Duration::from_millis(4000);

    // The holder's own stop time, read on its monotonic clock before the request is sent
    // (margin 0: the strictest reading).
    let sent_at = Instant::now();
    let grant = cluster
        .acquire(follower, "billing:2026-09-28", ttl.as_millis() as u64)
        .await;
    let stop_time = sent_at + ttl;
    let token_a = grant["revision"].as_u64().unwrap();

    cluster.kill(leader);
    let survivors: Vec<u64> = cluster.ids_but(leader);

    // Until the holder's stop time, nobody else gets the lock, whoever leads.
    let mut refused_after_failover = 0;
    let mut new_leader_seen = false;
    while Instant::now() < stop_time {
        for id in &survivors {
            let (status, body) = cluster
                .call(
                    *id,
                    Method::POST,
                    "/v1/locks/billing:2026-09-28",
                    Some(json!({ "ttl_ms": 4000 })),
                )
                .await;
            let answered_at = Instant::now();
            if status == StatusCode::SERVICE_UNAVAILABLE {
                continue; // election in progress
            }
            if answered_at < stop_time {
                assert_eq!(
                    status,
                    StatusCode::CONFLICT,
                    "lock granted before the holder's stop time: {body}"
                );
                assert_eq!(body["revision"].as_u64(), Some(token_a));
                if !new_leader_seen {
                    if let Some((_, c)) = cluster.get(*id, "/v1/cluster").await {
                        new_leader_seen = c["leader_id"].as_u64().is_some_and(|l| l != leader);
                    }
                }
                if new_leader_seen {
                    refused_after_failover += 1;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        refused_after_failover > 0,
        "the new leader never answered before the stop time"
    );
    let new_leader = cluster.wait_for_leader(&survivors).await;
    assert_ne!(new_leader, leader);

    // Nobody renews it, so it expires, and the next holder's token is above every earlier one.
    let deadline = Instant::now() + ttl + ELECTION_MAX + Duration::from_secs(10);
    let token_b = loop {
        let (status, body) = cluster
            .call(
                new_leader,
                Method::POST,
                "/v1/locks/billing:2026-09-28",
                Some(json!({ "ttl_ms": 4000 })),
            )
            .await;
        if status == StatusCode::OK {
            break body["revision"].as_u64().unwrap();
        }
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert!(
            Instant::now() < deadline,
            "the orphaned lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("token A {token_a}, token B {token_b}, {refused_after_failover} refusals by the new leader before A's stop time");
    assert!(token_b > token_a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_answers_no_keepalive_after_it_is_deposed() {
    let cluster = Cluster::start(3, "").await;
    let old = cluster.wait_for_leader(&cluster.ids()).await;
    let grant = cluster.acquire(old, "job", 30_000).await;
    let keepalive = format!(
        "/v1/leases/{}/keepalive",
        grant["lease_id"].as_str().unwrap()
    );
    let (status, _) = cluster.call(old, Method::POST, &keepalive, None).await;
    assert_eq!(status, StatusCode::OK);

    cluster.signal(old, Signal::SIGSTOP);
    let others: Vec<u64> = cluster.ids_but(old);
    let new = cluster.wait_for_leader(&others).await;
    cluster.signal(old, Signal::SIGCONT);

    // Straight after waking, the old leader still believes it leads. Ask it directly, marked as
    // already forwarded so it cannot hand the request on: it must not renew anything itself.
    for attempt in 0..20 {
        let answer = cluster
            .http
            .post(format!("{}{keepalive}", cluster.url(old)))
            .header("fencegate-forwarded", "test")
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .expect("the resumed node answers");
        let status = answer.status();
        let body = answer.text().await.unwrap();
        assert_eq!(
            status,
            StatusCode::SERVICE_UNAVAILABLE,
            "attempt {attempt}: the deposed leader answered {body}"
        );
    }
    // The lease itself is alive under the new leader, which restarted it at full length.
    let (status, body) = cluster.call(new, Method::POST, &keepalive, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // And through the old node, now a follower, the keepalive is forwarded to the new leader.
    let (status, body) = cluster.call(old, Method::POST, &keepalive, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (_, view) = cluster.get(old, "/v1/cluster").await.unwrap();
    assert_eq!(view["leader_id"].as_u64(), Some(new));
}
