//! The lock service stays available through faults that leave a majority healthy: a node that
//! freezes, a leader killed during a waited acquire, a follower restarted gracefully.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::cluster::{Cluster, Security, BIN};
use nix::sys::signal::Signal;
use reqwest::{Method, StatusCode};
use serde_json::json;

/// Starts `fencegate lock run` against `endpoints` (in that order), stdin/stdout/stderr piped.
fn lock_run(endpoints: &str, args: &[&str]) -> Child {
    Command::new(BIN)
        .args(["lock", "run"])
        .args(args)
        .env("FENCEGATE_ENDPOINT", endpoints)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The first line the child prints, read off the test's runtime threads.
async fn first_line(child: &mut Child) -> String {
    let out = child.stdout.take().unwrap();
    tokio::task::spawn_blocking(move || {
        let mut text = String::new();
        BufReader::new(out).read_line(&mut text).unwrap();
        text.trim().to_owned()
    })
    .await
    .unwrap()
}

/// Waits (bounded) for the child to exit; returns its code and stderr.
async fn finish(mut child: Child, within: Duration) -> (Option<i32>, String) {
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                break child.wait().unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        (status.code(), err)
    })
    .await
    .unwrap()
}

fn endpoints(cluster: &Cluster, order: &[u64]) -> String {
    order
        .iter()
        .map(|id| cluster.url(*id))
        .collect::<Vec<_>>()
        .join(",")
}

/// A holder renews with ttl 10 s / margin 2 s (renewals every 3.3 s, stop time 8 s after the
/// last one was sent) while `frozen` is stopped for 7 s: every renewal in that window meets the
/// frozen node first in `order`. The holder must keep its lease.
async fn holder_survives_a_freeze(pick: impl Fn(u64, &[u64]) -> (u64, Vec<u64>)) {
    let cluster = Cluster::start(3, "").await;
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let followers: Vec<u64> = cluster.ids_but(leader);
    let (frozen, order) = pick(leader, &followers);
    let mut child = lock_run(
        &endpoints(&cluster, &order),
        &[
            "freeze:job",
            "--ttl",
            "10s",
            "--margin",
            "2s",
            "--",
            "sh",
            "-c",
            r#"echo "$FENCING_REVISION"; read _ || true"#,
        ],
    );
    let revision: u64 = first_line(&mut child).await.parse().unwrap();
    let started = Instant::now();

    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.signal(frozen, Signal::SIGSTOP);
    let frozen_at = Instant::now();
    while frozen_at.elapsed() < Duration::from_secs(7) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the runner stopped {:?} into the freeze of node {frozen}",
            frozen_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.signal(frozen, Signal::SIGCONT);

    // Past the stop time any renewal lost in the freeze would have set, and a renewal later.
    while started.elapsed() < Duration::from_secs(12) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the runner stopped {:?} after it started",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Any leader will do: a thawed follower may even win an election.
    let now_leader = cluster.wait_for_leader(&cluster.ids()).await;
    let (status, lock) = cluster
        .get(now_leader, "/v1/locks/freeze:job")
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK, "{lock}");
    assert_eq!(lock["revision"].as_u64(), Some(revision), "{lock}");

    drop(child.stdin.take()); // the command's `read` returns; it exits 0
    let (code, stderr) = finish(child, Duration::from_secs(20)).await;
    println!(
        "froze node {frozen} (leader was {leader}), endpoints {order:?}; runner said:\n{stderr}"
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("stopping the command"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_first_in_the_list_costs_no_lease() {
    holder_survives_a_freeze(|leader, f| (leader, vec![leader, f[0], f[1]])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_behind_a_forwarding_follower_costs_no_lease() {
    holder_survives_a_freeze(|leader, f| (leader, vec![f[0], leader, f[1]])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_follower_first_in_the_list_costs_no_lease() {
    holder_survives_a_freeze(|leader, f| (f[0], vec![f[0], leader, f[1]])).await;
}

/// `lock run --wait 30s` is queued on the leader, which is killed 12 s into the wait: the
/// runner retries the same acquire (same request id) with the new leader and runs the command
/// once the lock is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waited_acquire_survives_the_death_of_the_leader_queuing_it() {
    let mut cluster = Cluster::start(3, "").await;
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let followers: Vec<u64> = cluster.ids_but(leader);
    let held = cluster.acquire(leader, "queued:job", 60_000).await;
    let held_revision = held["revision"].as_u64().unwrap();
    let started = Instant::now();
    let mut child = lock_run(
        &endpoints(&cluster, &[leader, followers[0], followers[1]]),
        &[
            "queued:job",
            "--wait",
            "30s",
            "--ttl",
            "5s",
            "--margin",
            "1s",
            "--",
            "sh",
            "-c",
            r#"echo "$FENCING_REVISION""#,
        ],
    );
    // The acquire is queued on the leader.
    loop {
        let metrics = cluster.metrics(leader).await;
        if metrics.lines().any(|l| {
            !l.starts_with('#') && l.contains("authority_waiting_acquires") && l.ends_with(" 1")
        }) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never queued");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(12).saturating_sub(started.elapsed())).await;
    cluster.kill(leader);
    let new_leader = cluster.wait_for_leader(&followers).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "the runner gave up during the failover"
    );
    cluster
        .release(new_leader, held["lease_id"].as_str().unwrap())
        .await;

    let line = first_line(&mut child).await;
    let (code, stderr) = finish(child, Duration::from_secs(30)).await;
    println!(
        "leader {leader} killed 12 s into the wait; the command ran {:?} after the runner started",
        started.elapsed()
    );
    assert_eq!(code, Some(0), "{stderr}");
    let revision: u64 = line.parse().unwrap_or_else(|_| panic!("{line:?} {stderr}"));
    assert!(revision > held_revision, "{revision} <= {held_revision}");
}

/// One acquire and release of `steady` through each of `via`; the revision must rise.
async fn steady_round(cluster: &Cluster, via: &[u64], last: &mut u64, count: &mut u32) {
    for via in via {
        let (status, grant) = cluster
            .call(
                *via,
                Method::POST,
                "/v1/locks/steady",
                Some(json!({ "ttl_ms": 5000 })),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "acquire {count} via {via}: {grant}");
        let revision = grant["revision"].as_u64().unwrap();
        assert!(revision > *last, "{revision} after {last}");
        *last = revision;
        cluster
            .release(*via, grant["lease_id"].as_str().unwrap())
            .await;
        *count += 1;
    }
}

/// A graceful restart of a follower while clients acquire steadily: it stops campaigning
/// before it stops serving, so it comes back with the cluster's term, nobody elects anything
/// and no acquire fails. A waiting acquire forwarded through the follower keeps it in its grace
/// period for seconds, with Raft still running and no heartbeats reaching it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_restarted_gracefully_causes_no_election() {
    follower_restart(Security::Insecure).await;
}

/// The same with Raft on its own mutual-TLS peer port, which the draining node keeps serving
/// until Raft has stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_restarted_gracefully_causes_no_election_with_a_peer_port() {
    follower_restart(Security::Tls).await;
}

async fn follower_restart(security: Security) {
    let mut cluster = Cluster::start_secured(security, 3, "", |_| String::new(), &[]).await;
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let followers: Vec<u64> = cluster.ids_but(leader);
    let (going, staying) = (followers[0], followers[1]);
    let term = cluster.cluster_view(leader).await.unwrap()["term"]
        .as_u64()
        .unwrap();

    cluster.acquire(leader, "held", 60_000).await;
    let in_flight = {
        let http = cluster.http.clone();
        let url = format!("{}/v1/locks/held", cluster.url(going));
        tokio::spawn(async move {
            let _ = http
                .post(url)
                .json(&json!({ "ttl_ms": 5000, "wait_ms": 20_000 }))
                .timeout(Duration::from_secs(30))
                .send()
                .await;
        })
    };

    let (mut acquires, mut last) = (0u32, 0u64);
    let mut signalled_at = None;
    let mut restarted_at: Option<Instant> = None;
    let started = Instant::now();
    // Steady acquires through the leader and the other follower, until 4 s after the node is
    // back (longer than any election timeout), bounded at 40 s.
    while restarted_at.is_none_or(|at| at.elapsed() < Duration::from_secs(4)) {
        assert!(started.elapsed() < Duration::from_secs(40));
        steady_round(&cluster, &[leader, staying], &mut last, &mut acquires).await;
        if acquires == 10 {
            cluster.signal(going, Signal::SIGTERM);
            signalled_at = Some(Instant::now());
        }
        if let (Some(at), None) = (signalled_at, restarted_at) {
            if let Some(status) = cluster.wait_exit(going, Duration::ZERO).await {
                assert!(status.success(), "node {going} exited with {status}");
                println!("node {going} exited {:?} after SIGTERM", at.elapsed());
                cluster.spawn(going);
                restarted_at = Some(Instant::now());
            }
        }
    }
    in_flight.abort();
    assert_eq!(cluster.wait_for_leader(&cluster.ids()).await, leader);
    for id in cluster.ids() {
        let view = cluster.cluster_view(id).await.unwrap();
        assert_eq!(view["term"].as_u64(), Some(term), "node {id}: {view}");
    }
    println!("{acquires} acquires, none failed; term still {term}, leader still {leader}");
}

/// A leader cut off from both followers, both ways, through the fault proxies: the followers
/// elect one of themselves, and once the links heal the old leader follows the new one. The
/// followers can only notice if the proxies tell the old leader's traffic apart, so this also
/// proves `[node] peer_source` and the advertised peer address (`[authority] members` peer,
/// not the bound `[node] peer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leader_is_replaced_and_follows_once_healed() {
    use fencegate_testkit::fault_proxy::LinkFault;
    let cluster = Cluster::start_with_faulty_links(3, "", |_| String::new(), &[]).await;
    let old = cluster.wait_for_leader(&cluster.ids()).await;
    let others: Vec<u64> = cluster.ids_but(old);
    cluster.set_links_of(old, LinkFault::Partition);
    let new = cluster.wait_for_leader(&others).await;
    assert_ne!(new, old);
    // The majority serves grants while the old leader is cut off.
    let grant = cluster.acquire(new, "partition:job", 5_000).await;
    assert!(grant["revision"].as_u64().unwrap() > 0, "{grant}");
    cluster.heal_links();
    assert_eq!(cluster.wait_for_leader(&cluster.ids()).await, new);
}
