//! Online membership changes with real processes: a fourth node joins a running cluster and
//! the first one leaves while clients acquire and release, as when a node is replaced.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::cluster::{Cluster, Security};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::watch;

/// The lock both clients take in turn.
const RESOURCE: &str = "/v1/locks/replaced";
/// Bounds of the client loops.
const MAX_ACQUIRES: u64 = 2_000;
const MAX_RUN: Duration = Duration::from_secs(120);
/// Attempts (each at the next endpoint) before one acquire or release counts as failed.
const MAX_ATTEMPTS: u32 = 200;

/// What the clients saw, shared with the test.
#[derive(Default)]
struct Tally {
    /// Revisions in grant order: the lock is exclusive, and each client records its grant
    /// before it releases.
    revisions: Vec<u64>,
    retries: u64,
}

/// Sends one call to `endpoints[*preferred]`, moving on to the next endpoint (and staying
/// there) after each failure; counts the failed attempts in `tally.retries`.
async fn call(
    http: &reqwest::Client,
    endpoints: &[String],
    preferred: &mut usize,
    tally: &Mutex<Tally>,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> Value {
    for attempt in 0..MAX_ATTEMPTS {
        let url = format!("{}{path}", endpoints[*preferred]);
        // Longer than the acquire's wait_ms.
        let mut req = http
            .request(method.clone(), url)
            .timeout(Duration::from_secs(8));
        if let Some(body) = &body {
            req = req.json(body);
        }
        if let Ok(answer) = req.send().await {
            let status = answer.status();
            let body: Value = answer.json().await.unwrap_or(Value::Null);
            // A release retried after its first attempt went through finds the lease gone.
            if status == StatusCode::OK || (attempt > 0 && status == StatusCode::NOT_FOUND) {
                return body;
            }
        }
        tally.lock().unwrap().retries += 1;
        *preferred = (*preferred + 1) % endpoints.len();
        // Not a synchronisation: a pause between attempts while an election runs.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{method} {path} failed {MAX_ATTEMPTS} times");
}

/// One client: acquire (waiting for the other's release), record, release; an acquire is
/// retried with the same request id. Stops at `stop` or at the bounds.
async fn client(
    http: reqwest::Client,
    name: &'static str,
    endpoints: Vec<String>,
    tally: Arc<Mutex<Tally>>,
    count: watch::Sender<u64>,
    stop: watch::Receiver<bool>,
) {
    let started = Instant::now();
    let mut preferred = 0;
    let mut n = 0u64;
    while !*stop.borrow() && n < MAX_ACQUIRES && started.elapsed() < MAX_RUN {
        let body =
            json!({ "ttl_ms": 10_000, "wait_ms": 5_000, "request_id": format!("{name}-{n}") });
        let grant = call(
            &http,
            &endpoints,
            &mut preferred,
            &tally,
            reqwest::Method::POST,
            RESOURCE,
            Some(body),
        )
        .await;
        let revision = grant["revision"].as_u64().expect("a grant has a revision");
        tally.lock().unwrap().revisions.push(revision);
        let lease = grant["lease_id"].as_str().expect("a grant has a lease id");
        call(
            &http,
            &endpoints,
            &mut preferred,
            &tally,
            reqwest::Method::DELETE,
            &format!("/v1/leases/{lease}"),
            None,
        )
        .await;
        n += 1;
        count.send_modify(|c| *c += 1);
    }
}

/// Waits (bounded) until the clients have done `more` acquires since now.
async fn wait_more(count: &mut watch::Receiver<u64>, more: u64) {
    let target = *count.borrow() + more;
    tokio::time::timeout(Duration::from_secs(60), count.wait_for(|c| *c >= target))
        .await
        .expect("the clients made no progress for 60 s")
        .unwrap();
}

/// The CLI as admin, run off the runtime's worker so the clients keep going meanwhile.
fn cli(cluster: &Cluster, args: &[&str]) -> (i32, String) {
    tokio::task::block_in_place(|| cluster.cli(args))
}

/// Member ids and whether each votes, from a `/v1/cluster` answer.
fn members(view: &Value) -> Vec<(u64, bool)> {
    view["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| (m["id"].as_u64().unwrap(), m["voter"].as_bool().unwrap()))
        .collect()
}

/// 3 -> 4 -> 3 nodes with the secure default (mutual TLS peers, credentials): node 4 starts in
/// join mode with a certificate from `certs add-node`, is added, then node 1 is removed; two
/// clients acquire and release throughout. No call fails beyond retries, revisions rise in
/// grant order, node 1 exits 0 by itself (and again when restarted), and every remaining node
/// shows members 2, 3 and 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_replaced_while_clients_acquire() {
    replace(Security::Tls, |_leader| 1).await;
}

/// The same, removing whichever node leads (insecure, Raft on the API port): the leader
/// commits its own removal, steps down and exits; the others elect a successor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_is_replaced_while_clients_acquire() {
    replace(Security::Insecure, |leader| leader).await;
}

/// Adds node 4 to a 3-node cluster, then removes `pick(leader)`, while two clients run.
async fn replace(security: Security, pick: impl Fn(u64) -> u64) {
    let mut cluster = Cluster::start_secured(security, 3, "", |_| String::new(), &[]).await;
    let first_leader = cluster.wait_for_leader(&[1, 2, 3]).await;
    let new = cluster.spawn_joining();
    assert_eq!(new, 4);
    let config = cluster.nodes[3].config.display().to_string();
    let (code, out) = cli(&cluster, &["check-config", "--config", &config]);
    assert!(
        code == 0 && out.contains("join mode"),
        "check-config: {out}"
    );

    let tally = Arc::new(Mutex::new(Tally::default()));
    let (count_tx, mut count) = watch::channel(0u64);
    let (stop_tx, stop) = watch::channel(false);
    let clients: Vec<_> = [("a", vec![1, 2, 3, 4]), ("b", vec![4, 3, 2, 1])]
        .into_iter()
        .map(|(name, order)| {
            let endpoints = order.iter().map(|id| cluster.url(*id)).collect();
            tokio::spawn(client(
                cluster.http.clone(),
                name,
                endpoints,
                tally.clone(),
                count_tx.clone(),
                stop.clone(),
            ))
        })
        .collect();
    let started = Instant::now();
    wait_more(&mut count, 20).await;

    let added_at = Instant::now();
    let (code, out) = cli(
        &cluster,
        &[
            "cluster",
            "add-node",
            "--id",
            "4",
            "--api",
            &cluster.api_addr(4),
            "--peer",
            &cluster.peer_addr(4),
            "--endpoint",
            &cluster.endpoints_of(&[2, 3, 1]),
        ],
    );
    assert_eq!(code, 0, "add-node: {out}");
    let added_in = added_at.elapsed();
    let answer: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        members(&answer),
        vec![(1, true), (2, true), (3, true), (4, true)],
        "{out}"
    );
    wait_more(&mut count, 20).await;

    let leader = cluster.wait_for_leader(&[1, 2, 3, 4]).await;
    let gone = pick(leader);
    let staying: Vec<u64> = (1..=4).filter(|id| *id != gone).collect();
    let removed_at = Instant::now();
    let (code, out) = cli(
        &cluster,
        &[
            "cluster",
            "remove-node",
            &gone.to_string(),
            "--endpoint",
            &cluster.endpoints_of(&staying),
        ],
    );
    assert_eq!(code, 0, "remove-node: {out}");
    let answer: Value = serde_json::from_str(&out).unwrap();
    let expected: Vec<(u64, bool)> = staying.iter().map(|id| (*id, true)).collect();
    assert_eq!(members(&answer), expected, "{out}");
    let status = cluster
        .wait_exit(gone, Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("node {gone} still runs 30 s after its removal"));
    assert!(status.success(), "node {gone} exited with {status}");
    let exited_in = removed_at.elapsed();
    wait_more(&mut count, 20).await;
    let _ = stop_tx.send(true);
    for client in clients {
        client.await.unwrap();
    }
    let run = started.elapsed();

    let log = std::fs::read_to_string(cluster.log_path(gone)).unwrap();
    assert!(log.contains("no longer a member of the cluster"), "{log}");

    let new_leader = cluster.wait_for_leader(&staying).await;
    for id in &staying {
        let (code, out) = cli(
            &cluster,
            &["cluster", "status", "--endpoint", &cluster.url(*id)],
        );
        assert_eq!(code, 0, "status of node {id}: {out}");
        let view: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(members(&view), expected, "node {id}: {out}");
        assert_eq!(
            view["leader_id"].as_u64(),
            Some(new_leader),
            "node {id}: {out}"
        );
    }

    // Restarted with its old data, the removed node finds out again from its peers and stops.
    let restarted_at = Instant::now();
    cluster.spawn(gone);
    let status = cluster
        .wait_exit(gone, Duration::from_secs(30))
        .await
        .unwrap_or_else(|| {
            panic!(
                "the restarted node {gone} still runs after 30 s; its log:\n{}",
                std::fs::read_to_string(cluster.log_path(gone)).unwrap()
            )
        });
    assert!(
        status.success(),
        "restarted node {gone} exited with {status}"
    );
    let restarted_exit = restarted_at.elapsed();

    let tally = tally.lock().unwrap();
    assert!(
        tally.revisions.windows(2).all(|w| w[0] < w[1]),
        "revisions not strictly increasing: {:?}",
        tally.revisions
    );
    println!(
        "{security:?}: {} acquires and releases by 2 clients in {run:.1?}, {} retries; leader \
         {first_leader} at start, {leader} before the removal, {new_leader} after; add-node took \
         {added_in:.1?}; removed node {gone} exited {exited_in:.1?} after remove-node was sent, \
         and {restarted_exit:.1?} after a restart; revisions {}..{}",
        tally.revisions.len(),
        tally.retries,
        tally.revisions.first().unwrap(),
        tally.revisions.last().unwrap(),
    );
}
