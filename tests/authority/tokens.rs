//! Tokens only grow: over many cycles, across a full restart, and across a restore.

use std::collections::BTreeSet;

use crate::support::cluster::Cluster;
use reqwest::{Method, StatusCode};
use serde_json::Value;

fn token_of(grant: &Value) -> u64 {
    let revision = grant["revision"].as_u64().expect("revision");
    let token = grant["token"].as_str().expect("token");
    // Signed by default, with the cluster's own key.
    let parsed = fencegate_core::Token::parse(token).expect("a well-formed token");
    assert_eq!(
        parsed.unsigned_form(),
        format!("fg1~{revision}~{}", grant["resource"].as_str().unwrap())
    );
    assert!(parsed.key_id().is_some(), "unsigned token {token}");
    revision
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_strictly_increase_over_1000_acquire_release_cycles() {
    let cluster = Cluster::start(3, "").await;
    let mut last = 0;
    for cycle in 0..1000u64 {
        // Spread the calls over every node: followers forward to the leader.
        let via = cycle % 3 + 1;
        let grant = cluster.acquire(via, "billing:2026-09-28", 10_000).await;
        let token = token_of(&grant);
        assert!(token > last, "cycle {cycle}: token {token} after {last}");
        last = token;
        cluster
            .release((cycle + 1) % 3 + 1, grant["lease_id"].as_str().unwrap())
            .await;
    }
    println!("1000 cycles: last token {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_restart_keeps_locks_leases_and_the_revision() {
    let mut cluster = Cluster::start(3, "").await;
    let held = cluster.acquire(1, "held", 60_000).await;
    let mut issued = BTreeSet::from([token_of(&held)]);
    for _ in 0..20 {
        let grant = cluster.acquire(2, "churn", 60_000).await;
        issued.insert(token_of(&grant));
        cluster
            .release(3, grant["lease_id"].as_str().unwrap())
            .await;
    }
    // A linearizable read (forwarded to the leader); a follower's local view may lag.
    let (_, before) = cluster.get(1, "/v1/snapshot").await.unwrap();
    let revision_before = before["revision"].as_u64().unwrap();

    // kill -9 every node: nothing gets a chance to flush anything it has not already.
    for id in cluster.ids() {
        cluster.kill(id);
    }
    for id in cluster.ids() {
        cluster.spawn(id);
    }
    let leader = cluster.wait_for_leader(&cluster.ids()).await;

    let (status, lock) = cluster.get(leader, "/v1/locks/held").await.unwrap();
    assert_eq!(status, StatusCode::OK, "{lock}");
    assert_eq!(lock["revision"], held["revision"]);
    assert_eq!(
        Some(lock["lease"].to_string().as_str()),
        held["lease_id"].as_str().unwrap().split('.').next()
    );
    // The lease survived with its id: its holder can still renew it.
    let path = format!(
        "/v1/leases/{}/keepalive",
        held["lease_id"].as_str().unwrap()
    );
    let (status, body) = cluster.call(leader, Method::POST, &path, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let (_, after) = cluster.get(leader, "/v1/snapshot").await.unwrap();
    assert_eq!(
        after["revision"].as_u64().unwrap(),
        revision_before,
        "the revision survives a restart"
    );
    let next = token_of(&cluster.acquire(1, "fresh", 10_000).await);
    assert!(
        next > *issued.last().unwrap() && next > revision_before,
        "token {next} reissued? issued {issued:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_snapshot_bumps_the_revision_above_everything_issued() {
    let mut cluster = Cluster::start(3, "").await;
    let endpoints = cluster.endpoints();
    let snapshot_file = cluster.path().join("backup.json");
    let held = cluster.acquire(1, "held", 60_000).await;
    let (code, out) = cluster.cli(&[
        "snapshot",
        "save",
        snapshot_file.to_str().unwrap(),
        "--endpoint",
        &endpoints,
    ]);
    assert_eq!(code, 0, "{out}");
    let saved: Value = serde_json::from_str(&out).unwrap();
    let snapshot_revision = saved["revision"].as_u64().unwrap();
    assert!(snapshot_revision >= token_of(&held));

    // Tokens keep being issued after the backup was taken...
    let mut highest = 0;
    for _ in 0..10 {
        let grant = cluster.acquire(2, "after-backup", 10_000).await;
        highest = highest.max(token_of(&grant));
        cluster
            .release(2, grant["lease_id"].as_str().unwrap())
            .await;
    }
    assert!(highest > snapshot_revision);

    // ...then the whole cluster is lost and rebuilt from empty data directories.
    for id in cluster.ids() {
        cluster.kill(id);
        std::fs::remove_dir_all(cluster.data_dir(id)).unwrap();
    }
    for id in cluster.ids() {
        cluster.spawn(id);
    }
    cluster.wait_for_leader(&cluster.ids()).await;
    let (_, fresh) = cluster.get(1, "/v1/cluster").await.unwrap();
    assert_eq!(fresh["revision"], 0, "the new cluster starts from nothing");

    let (code, out) = cluster.cli(&[
        "snapshot",
        "restore",
        snapshot_file.to_str().unwrap(),
        "--endpoint",
        &endpoints,
    ]);
    assert_eq!(code, 0, "{out}");
    let restored: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        restored["revision"].as_u64().unwrap(),
        snapshot_revision + 1_000_000
    );

    // The restored lock is back, and the next token clears every token ever issued.
    let (status, lock) = cluster.get(3, "/v1/locks/held").await.unwrap();
    assert!(
        status == StatusCode::OK || status == StatusCode::SERVICE_UNAVAILABLE,
        "{lock}"
    );
    let next = token_of(&cluster.acquire(3, "after-restore", 10_000).await);
    assert_eq!(next, snapshot_revision + 1_000_000 + 1);
    assert!(next > highest);
    println!("snapshot revision {snapshot_revision}, highest issued {highest}, first token after restore {next}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_node_catches_up_from_a_snapshot() {
    // Snapshot often and keep no log behind it, so a node that was away can only catch up
    // through a snapshot transfer.
    let mut cluster = Cluster::start(3, "snapshot_every_logs = 20\nsnapshot_keep_logs = 0").await;
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let away = cluster.ids().into_iter().find(|id| *id != leader).unwrap();
    let other = cluster
        .ids()
        .into_iter()
        .find(|id| *id != leader && *id != away)
        .unwrap();
    cluster.kill(away);
    for _ in 0..60 {
        let grant = cluster.acquire(leader, "churn", 10_000).await;
        cluster
            .release(leader, grant["lease_id"].as_str().unwrap())
            .await;
    }
    let held = cluster.acquire(leader, "held", 60_000).await;
    let (_, view) = cluster.get(leader, "/v1/cluster").await.unwrap();
    let revision = view["revision"].as_u64().unwrap();

    returns_from_a_snapshot(&mut cluster, away, revision, leader, 30).await;
    // With the other follower gone, the returning node is part of every majority: the
    // cluster still works and still knows the held lock.
    cluster.kill(other);
    let (status, lock) = cluster.get(away, "/v1/locks/held").await.unwrap();
    assert_eq!(status, StatusCode::OK, "{lock}");
    assert_eq!(lock["revision"], held["revision"]);
    let next = token_of(&cluster.acquire(away, "after", 10_000).await);
    assert!(next > revision);
}

/// Live leases a cluster may realistically hold: the state a lagging node then catches up
/// from is several MiB, sent in chunks.
const MANY_LEASES: u64 = 20_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_node_catches_up_from_a_snapshot_of_many_leases() {
    let mut cluster = Cluster::start(3, "snapshot_every_logs = 20\nsnapshot_keep_logs = 0").await;
    let leader = cluster.wait_for_leader(&cluster.ids()).await;
    let away = cluster.ids().into_iter().find(|id| *id != leader).unwrap();
    cluster.kill(away);

    // The cluster's own state (its token keys) with MANY_LEASES held locks added, restored:
    // the quickest way to a state of that size.
    let (_, saved) = cluster.get(leader, "/v1/snapshot").await.unwrap();
    let mut file = saved.clone();
    let base = saved["state"]["last_lease_id"].as_u64().unwrap();
    let mut revision = saved["revision"].as_u64().unwrap();
    for i in 1..=MANY_LEASES {
        let id = base + i;
        revision += 1;
        let resource = format!("job:{i:08}");
        file["state"]["locks"][&resource] = serde_json::json!({ "lease_id": id, "token": revision, "holder": format!("worker-{i}") });
        file["state"]["leases"][id.to_string()] = serde_json::json!({
            "ttl_ms": 300_000, "resources": [resource], "request_id": null,
            "secret": format!("{:032x}", u128::from(id) * 0x9e37_79b9_7f4a_7c15),
        });
    }
    file["state"]["last_lease_id"] = (base + MANY_LEASES).into();
    file["state"]["revision"] = revision.into();
    file["revision"] = revision.into();
    let size = file["state"].to_string().len();
    let restoring = std::time::Instant::now();
    let (status, body) = cluster
        .call(leader, Method::POST, "/v1/snapshot/restore", Some(file))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    println!(
        "restored a state of {size} bytes ({MANY_LEASES} leases) in {:?}",
        restoring.elapsed()
    );
    // Enough entries after it for a snapshot that holds it.
    for _ in 0..30 {
        let grant = cluster.acquire(leader, "churn", 10_000).await;
        cluster
            .release(leader, grant["lease_id"].as_str().unwrap())
            .await;
    }
    let (_, view) = cluster.get(leader, "/v1/cluster").await.unwrap();
    let revision = view["revision"].as_u64().unwrap();

    let took = returns_from_a_snapshot(&mut cluster, away, revision, leader, 60).await;
    println!(
        "node {away} caught up from a state of {size} bytes ({MANY_LEASES} leases) in {took:?}"
    );
    // The returning node knows a restored lock.
    let (status, lock) = cluster.get(away, "/v1/locks/job:00000001").await.unwrap();
    assert_eq!(status, StatusCode::OK, "{lock}");
    assert_eq!(
        lock["revision"].as_u64(),
        Some(saved["revision"].as_u64().unwrap() + 1)
    );
}

/// The last 40 lines of node `id`'s log.
fn tail(cluster: &Cluster, id: u64) -> String {
    let text = log_text(cluster, id);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Starts node `away` again and waits (at most `within_s` seconds) until it has applied
/// `revision`; checks it got there from a snapshot, without ever campaigning, and returns how
/// long it took. On failure shows the end of `leader`'s log and of its own.
///
/// A returning node that campaigns mid-transfer deposes the leader, and the next one starts
/// the transfer over: under CPU load a node once never caught up that way. The leader sees such
/// a campaign in its replication to the node ("seen a higher vote" from it), so the nodes'
/// logs since the restart must show none.
async fn returns_from_a_snapshot(
    cluster: &mut Cluster,
    away: u64,
    revision: u64,
    leader: u64,
    within_s: u64,
) -> std::time::Duration {
    let logged_before: Vec<(u64, usize)> = cluster
        .ids()
        .into_iter()
        .map(|id| (id, log_text(cluster, id).len()))
        .collect();
    cluster.spawn(away);
    let began = std::time::Instant::now();
    let deadline = began + std::time::Duration::from_secs(within_s);
    loop {
        if let Some((StatusCode::OK, v)) = cluster.get(away, "/v1/cluster").await {
            if v["revision"].as_u64() == Some(revision) {
                assert!(
                    v["snapshot"].as_u64().is_some(),
                    "caught up without a snapshot? {v}"
                );
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node {away} never caught up to revision {revision}:\nleader {leader}'s log:\n{}\nnode {away}'s log:\n{}",
            tail(cluster, leader),
            tail(cluster, away)
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let took = began.elapsed();
    let its_vote = format!("-N{away}:");
    let campaigns: Vec<String> = logged_before
        .into_iter()
        .flat_map(|(id, from)| {
            let text = log_text(cluster, id);
            text.get(from..)
                .unwrap_or_default()
                .lines()
                .filter(|line| line.contains("seen a higher vote: T") && line.contains(&its_vote))
                .map(|line| format!("node {id}: {line}"))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        campaigns.is_empty(),
        "node {away} campaigned while it caught up:\n{}",
        campaigns.join("\n")
    );
    took
}

/// Node `id`'s log so far.
fn log_text(cluster: &Cluster, id: u64) -> String {
    std::fs::read_to_string(cluster.log_path(id)).unwrap_or_default()
}
