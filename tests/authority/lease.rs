//! Lease lifetimes and waiting acquires.

use std::time::{Duration, Instant};

use crate::support::cluster::{Cluster, ELECTION_MAX};
use reqwest::{Method, StatusCode};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalives_hold_a_lease_for_three_ttls_and_silence_lets_it_expire() {
    let cluster = Cluster::start(3, "").await;
    let ttl = Duration::from_millis(1500);
    let grant = cluster.acquire(1, "job", ttl.as_millis() as u64).await;
    let token_a = grant["revision"].as_u64().unwrap();
    let keepalive = format!(
        "/v1/leases/{}/keepalive",
        grant["lease_id"].as_str().unwrap()
    );

    let started = Instant::now();
    let mut tick = tokio::time::interval(ttl / 3);
    let mut last_sent = Instant::now();
    let mut round = 0u64;
    while started.elapsed() < ttl * 3 {
        tick.tick().await;
        last_sent = Instant::now();
        let (status, body) = cluster
            .call(round % 3 + 1, Method::POST, &keepalive, None)
            .await;
        assert_eq!(
            status,
            StatusCode::OK,
            "keepalive {round} after {:?}: {body}",
            started.elapsed()
        );
        assert_eq!(body["ttl_ms"].as_u64(), Some(ttl.as_millis() as u64));
        round += 1;
    }
    let (status, body) = cluster
        .call(
            2,
            Method::POST,
            "/v1/locks/job",
            Some(json!({ "ttl_ms": 1500 })),
        )
        .await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "still held after 3 x ttl of keepalives: {body}"
    );
    let held_for = started.elapsed();

    // Now silence: another client polls until it gets the lock.
    let token_b = loop {
        let (status, body) = cluster
            .call(
                2,
                Method::POST,
                "/v1/locks/job",
                Some(json!({ "ttl_ms": 1500 })),
            )
            .await;
        if status == StatusCode::OK {
            break body["revision"].as_u64().unwrap();
        }
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert!(
            last_sent.elapsed() < ttl + ELECTION_MAX + Duration::from_secs(1),
            "lease outlived ttl + election timeout"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let expired_after = last_sent.elapsed();
    println!("held {held_for:?} with {round} keepalives; free again {expired_after:?} after the last keepalive was sent");
    assert!(
        expired_after >= ttl,
        "expired {expired_after:?} after the last keepalive: before the holder's stop time"
    );
    assert!(expired_after <= ttl + ELECTION_MAX + Duration::from_millis(500));
    assert!(token_b > token_a);
}

async fn waiting_now(cluster: &Cluster, id: u64) -> u64 {
    let text = cluster.metrics(id).await;
    // A gauge of whole acquires, so the cast loses nothing.
    crate::support::metrics::sample(&text, "fencegate_authority_waiting_acquires")
        .expect("waiting_acquires gauge") as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_served_one_at_a_time_in_arrival_order() {
    let cluster = std::sync::Arc::new(Cluster::start(3, "").await);
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let first = cluster.acquire(leader, "queue", 30_000).await;

    let mut waiters = Vec::new();
    for n in 0..3u64 {
        let c = cluster.clone();
        waiters.push(tokio::spawn(async move {
            let body = json!({ "ttl_ms": 30_000, "wait_ms": 20_000, "holder": format!("w{n}") });
            let (status, grant) = c
                .call(leader, Method::POST, "/v1/locks/queue", Some(body))
                .await;
            assert_eq!(status, StatusCode::OK, "waiter {n}: {grant}");
            (
                n,
                grant["revision"].as_u64().unwrap(),
                grant["lease_id"].as_str().unwrap().to_owned(),
            )
        }));
        // Event, not sleep: the next waiter arrives only once this one is queued.
        let deadline = Instant::now() + Duration::from_secs(10);
        while waiting_now(&cluster, leader).await != n + 1 {
            assert!(Instant::now() < deadline, "waiter {n} never queued");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // A non-waiting acquire does not jump the queue.
    let (status, _) = cluster
        .call(
            leader,
            Method::POST,
            "/v1/locks/queue",
            Some(json!({ "ttl_ms": 1000 })),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT);

    cluster
        .release(leader, first["lease_id"].as_str().unwrap())
        .await;
    let mut last = first["revision"].as_u64().unwrap();
    for (expected, handle) in waiters.into_iter().enumerate() {
        let (n, token, lease) = handle.await.unwrap();
        assert_eq!(n, expected as u64);
        assert!(token > last, "waiter {n} got {token} after {last}");
        // Exactly one waiter holds the lock at a time: the rest are still waiting.
        assert_eq!(waiting_now(&cluster, leader).await, 2 - n);
        last = token;
        cluster.release(leader, &lease).await;
    }
}
