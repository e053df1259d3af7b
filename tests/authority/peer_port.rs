//! DESIGN rule 10 on the Raft peer port: strangers holding it full of TLS handshakes that never
//! finish do not keep the members out. One follower of a TLS cluster restarted, the followers
//! hold no connection to each other, so when the leader dies the election needs new
//! connections to their peer ports; with both ports held full by a stranger, it still
//! succeeds, on the slots kept for members (without them it never did: checked by taking the
//! reserve away).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::support::cluster::Cluster;
use nix::sys::signal::Signal;
use tokio::io::AsyncReadExt;
use tokio::net::TcpSocket;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Connections per port the stranger keeps open: more than the port holds.
const HOLDERS: usize = 24;

/// Where the stranger connects from: the members talk from 127.0.1.<id>.
const STRANGER: [u8; 4] = [127, 0, 0, 2];

/// One of the stranger's connections, reopened whenever it is closed, until `stop` (at most
/// 90 s). A connection closed at once was refused: `refused` counts those.
async fn hold(port: SocketAddr, refused: Arc<AtomicU64>, stop: CancellationToken) {
    let until = Instant::now() + Duration::from_secs(90);
    while !stop.is_cancelled() && Instant::now() < until {
        let socket = TcpSocket::new_v4().expect("a socket");
        socket
            .bind(SocketAddr::from((STRANGER, 0)))
            .expect("bound to the stranger's address");
        let Ok(mut c) = socket.connect(port).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let began = Instant::now();
        let mut byte = [0u8; 1];
        tokio::select! {
            _ = c.read(&mut byte) => {}
            () = stop.cancelled() => return,
        }
        if began.elapsed() < Duration::from_millis(200) {
            refused.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_holding_the_peer_ports_full_do_not_stop_an_election() {
    // Each node on an address of its own, as on separate hosts: a follower knows the other
    // follower's address only from the membership, never having been called from it.
    let mut cluster = Cluster::start_tls_on_own_addresses(3, "max_api_connections = 16").await;
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let followers: Vec<u64> = cluster.ids_but(leader);
    // The nodes called each other in the first election: they may still hold those
    // connections, and know each other's addresses from them. Restarted (gracefully: no
    // election, as tests/authority/faults.rs shows), the followers hold none to each other and
    // know only the leader's address from a call, its heartbeats.
    let term = cluster.cluster_view(leader).await.unwrap()["term"]
        .as_u64()
        .unwrap();
    for follower in &followers {
        cluster.signal(*follower, Signal::SIGTERM);
        let status = cluster
            .wait_exit(*follower, Duration::from_secs(30))
            .await
            .expect("the follower stops within 30 s");
        assert!(status.success(), "node {follower} exited with {status}");
        cluster.spawn(*follower);
        assert_eq!(cluster.wait_for_leader(&cluster.ids()).await, leader);
    }
    for id in cluster.ids() {
        let view = cluster.cluster_view(id).await.unwrap();
        assert_eq!(view["term"].as_u64(), Some(term), "an election ran: {view}");
    }

    let stop = CancellationToken::new();
    let mut refused = Vec::new();
    let mut holders = tokio::task::JoinSet::new();
    for id in &followers {
        let port: SocketAddr = cluster.peer_addr(*id).parse().expect("an address");
        let count = Arc::new(AtomicU64::new(0));
        for _ in 0..HOLDERS {
            holders.spawn(hold(port, count.clone(), stop.clone()));
        }
        refused.push(count);
    }
    // The stranger holds all it may of both ports once it is refused on each.
    let deadline = Instant::now() + Duration::from_secs(20);
    while refused.iter().any(|r| r.load(Ordering::Relaxed) == 0) {
        assert!(Instant::now() < deadline, "the stranger was never refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    cluster.kill(leader);
    let started = Instant::now();
    let new_leader = cluster.wait_for_leader(&followers).await;
    let elected_in = started.elapsed();
    let grant = cluster.acquire(new_leader, "flooded", 5000).await;
    assert!(grant["revision"].as_u64().is_some(), "{grant}");
    let refusals: Vec<u64> = refused.iter().map(|r| r.load(Ordering::Relaxed)).collect();
    stop.cancel();
    while holders.join_next().await.is_some() {}
    println!(
        "new leader {new_leader} in {elected_in:?}; the stranger was refused {refusals:?} times"
    );
}
