//! The authority suite: fencegate's lease service against etcd 3.4 doing the same work, both
//! 3-node clusters on loopback with fsync on, both driven over HTTP/JSON by the same client.
//!
//! The same work: an acquire is "grant a lease and create the lock key under it only if it
//! does not exist". fencegate does that in one request (`POST /v1/locks/{r}`, one log entry);
//! etcd needs two (`/v3/lease/grant`, then a `/v3/kv/txn` comparing create_revision = 0), as an
//! etcd lock client does. A keepalive is one request on both. Requests go to the leader on both.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};
use tempfile::TempDir;

use crate::load::{closed_loop, median};
use crate::machine;
use crate::process::{fencegate_binary, free_port, wait_for, Server};
use crate::report::{Row, Section};

struct Cluster {
    leader: String,
    _servers: Vec<Server>,
}

async fn start_fencegate(dir: &TempDir, http: &reqwest::Client) -> anyhow::Result<Cluster> {
    let bin = fencegate_binary()?;
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let members: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{{ id = {}, api = \"127.0.0.1:{p}\" }}", i + 1))
        .collect();
    let mut servers = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        let id = i + 1;
        let config = dir.path().join(format!("fg{id}.toml"));
        std::fs::write(
            &config,
            format!(
                "[node]\nid = {id}\napi = \"127.0.0.1:{port}\"\ndata_dir = \"{}\"\n[authority]\nmembers = [{}]\nmax_ttl_ms = 600000\n[log]\nlevel = \"warn\"\n[security]\ninsecure = true\n",
                dir.path().join(format!("fg{id}")).display(),
                members.join(", ")
            ),
        )?;
        let mut command = std::process::Command::new(&bin);
        command.args(["serve", "--config"]).arg(&config);
        servers.push(Server::start(
            &format!("fencegate{id}"),
            &mut command,
            dir.path().join(format!("fg{id}.log")),
        )?);
    }
    let first = format!("http://127.0.0.1:{}", ports[0]);
    let leader_id = wait_for("the fencegate cluster", || {
        let (http, first) = (http.clone(), first.clone());
        async move {
            let view: Value = http
                .get(format!("{first}/v1/cluster"))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            view["leader_id"].as_u64()
        }
    })
    .await?;
    let leader = ports[leader_id as usize - 1];
    Ok(Cluster {
        leader: format!("http://127.0.0.1:{leader}"),
        _servers: servers,
    })
}

async fn start_etcd(dir: &TempDir, http: &reqwest::Client) -> anyhow::Result<Cluster> {
    let client: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peer: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let initial: Vec<String> = peer
        .iter()
        .enumerate()
        .map(|(i, p)| format!("e{i}=http://127.0.0.1:{p}"))
        .collect();
    let mut servers = Vec::new();
    for i in 0..3 {
        let mut command = std::process::Command::new("etcd");
        command
            .args(["--name", &format!("e{i}")])
            .arg("--data-dir")
            .arg(dir.path().join(format!("etcd{i}")))
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{}", client[i]),
            ])
            .args([
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", client[i]),
            ])
            .args([
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", peer[i]),
            ])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", peer[i]),
            ])
            .args(["--initial-cluster", &initial.join(",")])
            .args([
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "fencegate-bench",
            ])
            .args(["--log-level", "warn"]);
        servers.push(
            Server::start(
                &format!("etcd{i}"),
                &mut command,
                dir.path().join(format!("etcd{i}.log")),
            )
            .context("etcd 3.4 is needed: apt-get install etcd-server")?,
        );
    }
    // The member whose status names itself as leader.
    let leader = wait_for("the etcd cluster", || {
        let (http, client) = (http.clone(), client.clone());
        async move {
            for port in &client {
                let url = format!("http://127.0.0.1:{port}");
                let answer = http
                    .post(format!("{url}/v3/maintenance/status"))
                    .json(&json!({}))
                    .send()
                    .await
                    .ok()?;
                let status: Value = answer.json().await.ok()?;
                if status["leader"].is_string() && status["leader"] == status["header"]["member_id"]
                {
                    return Some(url);
                }
            }
            None
        }
    })
    .await?;
    Ok(Cluster {
        leader,
        _servers: servers,
    })
}

async fn fg_acquire(http: &reqwest::Client, base: &str, resource: &str) -> Option<String> {
    let answer = http
        .post(format!("{base}/v1/locks/{resource}"))
        .json(&json!({ "ttl_ms": 300_000 }))
        .send()
        .await
        .ok()?;
    if !answer.status().is_success() {
        eprintln!(
            "fencegate acquire {resource}: {} {}",
            answer.status(),
            answer.text().await.unwrap_or_default()
        );
        return None;
    }
    answer.json::<Value>().await.ok()?["lease_id"]
        .as_str()
        .map(str::to_owned)
}

async fn etcd_grant(http: &reqwest::Client, base: &str) -> Option<String> {
    let sent = http
        .post(format!("{base}/v3/lease/grant"))
        .json(&json!({ "TTL": 300 }))
        .send()
        .await;
    let v: Value = match sent {
        Ok(answer) => answer.json().await.unwrap_or_default(),
        Err(e) => {
            eprintln!("etcd grant: {e}");
            return None;
        }
    };
    if v["ID"].is_null() {
        eprintln!("etcd grant: {v}");
    }
    v["ID"].as_str().map(str::to_owned)
}

async fn etcd_acquire(http: &reqwest::Client, base: &str, resource: &str) -> bool {
    let Some(lease) = etcd_grant(http, base).await else {
        return false;
    };
    let key = B64.encode(format!("/locks/{resource}"));
    let txn = json!({
        "compare": [{ "key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
        "success": [{ "request_put": { "key": key, "value": B64.encode("held"), "lease": lease } }],
    });
    let answer = match http
        .post(format!("{base}/v3/kv/txn"))
        .json(&txn)
        .send()
        .await
    {
        Ok(answer) => answer,
        Err(e) => {
            eprintln!("etcd txn: {e:?}");
            return false;
        }
    };
    answer
        .json::<Value>()
        .await
        .is_ok_and(|v| v["succeeded"] == true)
}

#[derive(Clone, Copy, PartialEq)]
enum System {
    Etcd,
    Fencegate,
}

#[derive(Clone, Copy)]
enum Work {
    Acquire,
    Keepalive,
}

async fn measure(
    system: System,
    work: Work,
    workers: usize,
    run: Duration,
    base: &str,
    http: &reqwest::Client,
    round: usize,
) -> anyhow::Result<(f64, u64)> {
    let http = http.clone();
    let base: Arc<str> = base.into();
    let outcome = match work {
        Work::Acquire => {
            closed_loop(workers, run, move |w, i| {
                let (http, base) = (http.clone(), base.clone());
                async move {
                    let resource = format!("bench-{round}-{workers}-{w}-{i}");
                    match system {
                        System::Fencegate => fg_acquire(&http, &base, &resource).await.is_some(),
                        System::Etcd => etcd_acquire(&http, &base, &resource).await,
                    }
                }
            })
            .await
        }
        Work::Keepalive => {
            let mut leases = Vec::new();
            for w in 0..workers {
                let id = match system {
                    System::Fencegate => {
                        fg_acquire(&http, &base, &format!("keep-{round}-{workers}-{w}"))
                            .await
                            .map(|id| id.to_string())
                    }
                    System::Etcd => etcd_grant(&http, &base).await,
                };
                leases.push(id.context("could not create the leases to keep alive")?);
            }
            let leases = Arc::new(leases);
            closed_loop(workers, run, move |w, _| {
                let (http, base, leases) = (http.clone(), base.clone(), leases.clone());
                async move {
                    let id = &leases[w];
                    let answer = match system {
                        System::Fencegate => {
                            http.post(format!("{base}/v1/leases/{id}/keepalive"))
                                .send()
                                .await
                        }
                        System::Etcd => {
                            http.post(format!("{base}/v3/lease/keepalive"))
                                .json(&json!({ "ID": id }))
                                .send()
                                .await
                        }
                    };
                    match answer {
                        Ok(a) if a.status().is_success() => match system {
                            System::Fencegate => true,
                            System::Etcd => a
                                .json::<Value>()
                                .await
                                .is_ok_and(|v| v["result"]["TTL"].is_string()),
                        },
                        _ => false,
                    }
                }
            })
            .await
        }
    };
    if outcome.errors > 0 {
        bail!(
            "{} errors during a run; see the server logs",
            outcome.errors
        );
    }
    Ok((outcome.ops_per_sec, outcome.p50_us))
}

/// fdatasync'd 8 KiB writes per second in `dir`: the physical ceiling of any durable log here.
fn fsync_rate(dir: &std::path::Path) -> anyhow::Result<f64> {
    let path = dir.join("fsync-probe");
    let mut file = std::fs::File::create(&path)?;
    let block = [0u8; 8192];
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(2) {
        file.write_all(&block)?;
        file.sync_data()?;
        n += 1;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

pub async fn run(run: Duration, reps: usize) -> anyhow::Result<Section> {
    let dir = tempfile::Builder::new()
        .prefix("fencegate-bench")
        .tempdir()?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()?;
    let fsync = fsync_rate(dir.path())?;
    let fg = start_fencegate(&dir, &http).await?;
    let etcd = start_etcd(&dir, &http).await?;

    let cases: Vec<(Work, usize, &str, &str)> = vec![
        (Work::Acquire, 1, "acquires/s, 1 client", ">= 1.5x"),
        (Work::Acquire, 32, "acquires/s, 32 clients", ">= 1.5x"),
        (Work::Keepalive, 1, "keepalives/s, 1 client", ">= 3x"),
        (Work::Keepalive, 32, "keepalives/s, 32 clients", ">= 3x"),
    ];
    let mut figures = vec![(Vec::new(), Vec::new()); cases.len()];
    let mut latency = vec![(Vec::new(), Vec::new()); cases.len()];
    for rep in 0..reps {
        for (c, (work, workers, what, _)) in cases.iter().enumerate() {
            // Interleaved: etcd, then fencegate, for every case in every repetition.
            let (e, e_p50) =
                measure(System::Etcd, *work, *workers, run, &etcd.leader, &http, rep).await?;
            let (f, f_p50) = measure(
                System::Fencegate,
                *work,
                *workers,
                run,
                &fg.leader,
                &http,
                rep,
            )
            .await?;
            eprintln!("rep {rep}: {what}: etcd {e:.0}, fencegate {f:.0}");
            figures[c].0.push(e);
            figures[c].1.push(f);
            latency[c].0.push(e_p50 as f64);
            latency[c].1.push(f_p50 as f64);
        }
    }
    let rows = cases
        .iter()
        .zip(figures.iter_mut())
        .map(|((_, _, what, target), (e, f))| Row::ratio(*what, median(e), median(f), target))
        .collect();
    Ok(Section {
        name: "authority".into(),
        title: "Authority: fencegate against etcd".into(),
        setup: vec![
            format!("Machine: {}", machine::describe()),
            format!("etcd: {}; fencegate {}", machine::version(&["etcd", "--version"]), env!("CARGO_PKG_VERSION")),
            format!("Both: 3 nodes on loopback, data in {} (fsync on; etcd's WAL, fencegate's redb log)", std::env::temp_dir().display()),
            format!("Raw disk: {fsync:.0} fdatasync'd 8 KiB writes/s (the ceiling of any one durable log here)"),
            format!("{reps} repetitions of {:.0} s per case, etcd and fencegate interleaved; medians", run.as_secs_f64()),
            "Acquire = lease grant + create-if-absent: one request for fencegate, two for etcd (grant, then txn)".into(),
        ],
        headers: ["etcd 3.4".into(), "fencegate".into()],
        rows,
        tables: Vec::new(),
        notes: cases
            .iter()
            .zip(latency.iter_mut())
            .filter(|((_, workers, _, _), _)| *workers == 1)
            .map(|((_, _, what, _), (e, f))| {
                format!("p50 latency, {what}: etcd {:.0} µs, fencegate {:.0} µs.  ", median(e), median(f))
            })
            .collect(),
    })
}
