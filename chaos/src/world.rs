//! What a chaos run stands on: a real redis-server and PostgreSQL, and a 3-node cluster of real
//! `fencegate serve` processes, each running a Redis and a PostgreSQL gateway in front of them,
//! whose Raft links go through the testkit's fault proxies.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use fencegate_testkit::cluster::Cluster;
use fencegate_testkit::free_port;
use fencegate_testkit::postgres_server::PgServer;
use fencegate_testkit::redis_server::RedisServer;
use fencegate_testkit::s3_server::wait_for_port;

use crate::worker::PG_TABLE;

/// The resource every worker locks; the gateways protect the records under it.
pub const RESOURCE: &str = "job";

pub struct World {
    pub cluster: Cluster,
    pub redis: Option<RedisServer>,
    pub pg: Option<PgServer>,
    /// Each node's gateway ports: Redis, PostgreSQL.
    pub gateways: BTreeMap<u64, [u16; 2]>,
}

impl World {
    /// Starts the stores asked for and the cluster. With `bypass`, the PostgreSQL table is left
    /// unprotected (its triggers would refuse the bypassing writes: the store's own fence).
    pub async fn start(nodes: usize, redis: bool, postgres: bool, bypass: bool) -> Self {
        let redis = redis.then(RedisServer::start);
        let pg = postgres.then(|| {
            let pg = PgServer::start();
            let dsn = pg.dsn("postgres");
            fencegate(&["postgres", "install", "--dsn", &dsn]);
            pg.psql_as(
                "postgres",
                &format!(
                    "CREATE SCHEMA chaos; CREATE TABLE {PG_TABLE} (id bigserial PRIMARY KEY, record text NOT NULL)"
                ),
            );
            if !bypass {
                fencegate(&[
                    "postgres", "protect", "--dsn", &dsn, "--table", PG_TABLE, "--resource",
                    RESOURCE,
                ]);
            }
            pg
        });
        let gateways: BTreeMap<u64, [u16; 2]> = (1..=nodes as u64)
            .map(|id| (id, [free_port(), free_port()]))
            .collect();
        let sections = |id: u64| {
            let [redis_port, pg_port] = gateways[&id];
            let mut text = String::new();
            if let Some(redis) = &redis {
                text.push_str(&format!(
                    "\n[redis]\nlisten = \"127.0.0.1:{redis_port}\"\nupstream = \"{}\"\n\n\
                     [[redis.protect]]\npattern = \"chaos:*\"\nmode = \"enforce\"\nresource = \"{RESOURCE}\"\n",
                    redis.addr
                ));
            }
            if let Some(pg) = &pg {
                text.push_str(&format!(
                    "\n[postgres]\nlisten = \"127.0.0.1:{pg_port}\"\nupstream = \"{}\"\nresource = \"{RESOURCE}\"\n",
                    pg.addr()
                ));
            }
            text
        };
        // Every Raft link through a fault proxy, for the nemesis's network faults.
        let cluster = Cluster::start_with_faulty_links(nodes, "", sections, &[]).await;
        for [redis_port, pg_port] in gateways.values() {
            if redis.is_some() {
                wait_for_port(*redis_port, Duration::from_secs(30));
            }
            if pg.is_some() {
                wait_for_port(*pg_port, Duration::from_secs(30));
            }
        }
        Self {
            cluster,
            redis,
            pg,
            gateways,
        }
    }

    /// The worker's target options: every gateway, or with `bypass` the stores themselves.
    pub fn worker_targets(&self, bypass: bool) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(redis) = &self.redis {
            if bypass {
                args.extend(["--redis".to_owned(), format!("0={}", redis.addr)]);
            }
            for (id, [port, _]) in self.gateways.iter().filter(|_| !bypass) {
                args.extend(["--redis".to_owned(), format!("{id}=127.0.0.1:{port}")]);
            }
        }
        if let Some(pg) = &self.pg {
            if bypass {
                args.extend(["--postgres".to_owned(), format!("0={}", pg.addr())]);
            }
            for (id, [_, port]) in self.gateways.iter().filter(|_| !bypass) {
                args.extend(["--postgres".to_owned(), format!("{id}=127.0.0.1:{port}")]);
            }
        }
        args
    }

    /// Node `id`'s audit directory.
    pub fn audit_dir(&self, id: u64) -> PathBuf {
        self.cluster.data_dir(id).join("audit")
    }

    /// The node every live node names as leader, if they agree within `within`.
    pub async fn leader(&self, live: &[u64], within: Duration) -> Option<u64> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let mut seen = Vec::new();
            for id in live {
                let view = self.cluster.cluster_view(*id).await;
                seen.push(view.and_then(|v| v["leader_id"].as_u64()));
            }
            if let Some(Some(leader)) = seen.first() {
                if seen.iter().all(|s| *s == Some(*leader)) && live.contains(leader) {
                    return Some(*leader);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Runs the `fencegate` CLI for a setup step; panics with its output when it fails (nothing
/// can be checked on a store that was not set up).
fn fencegate(args: &[&str]) {
    let out = Command::new(fencegate_testkit::fencegate_bin())
        .args(args)
        .output()
        .expect("run fencegate");
    assert!(
        out.status.success(),
        "fencegate {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
