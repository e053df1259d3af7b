//! What a chaos run stands on: a real redis-server, PostgreSQL and moto (S3), and a 3-node
//! cluster of real `fencegate serve` processes, each running a Redis, a PostgreSQL and an S3
//! gateway in front of them, whose Raft links go through the testkit's fault proxies.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use fencegate_testkit::cluster::Cluster;
use fencegate_testkit::free_port;
use fencegate_testkit::postgres_server::PgServer;
use fencegate_testkit::redis_server::RedisServer;
use fencegate_testkit::s3_server::{wait_for_port, MotoServer};

use crate::s3_store;
use crate::worker::PG_TABLE;

/// The resource every worker locks; the gateways protect the records under it.
pub const RESOURCE: &str = "job";

pub struct World {
    pub cluster: Cluster,
    pub redis: Option<RedisServer>,
    pub pg: Option<PgServer>,
    /// Each node's gateway ports: Redis, PostgreSQL.
    pub gateways: BTreeMap<u64, [u16; 2]>,
    /// moto keeps its objects in memory: it is never restarted (no `restart-store`).
    pub s3: Option<MotoServer>,
    /// Each node's S3 gateway port.
    pub s3_gateways: BTreeMap<u64, u16>,
}

impl World {
    /// Starts the stores asked for and the cluster. With `bypass`, the PostgreSQL table is left
    /// unprotected (its triggers would refuse the bypassing writes: the store's own fence).
    pub async fn start(nodes: usize, redis: bool, postgres: bool, s3: bool, bypass: bool) -> Self {
        // appendfsync always: under everysec Redis may answer a write whose AOF write() is still
        // postponed behind a slow fsync, and restart-store SIGKILLs it, so "no acknowledged write
        // lost" would test the setting, not the fence (a seed found one such loss).
        let redis = redis.then(|| RedisServer::start_with(&["--appendfsync", "always"]));
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
        let s3 = s3.then(|| {
            let moto = MotoServer::start();
            let created = moto.direct(serde_json::json!([
                {"op": "create_bucket", "bucket": s3_store::BUCKET}
            ]));
            assert_eq!(created[0]["ok"], true, "create bucket: {created}");
            moto
        });
        let gateways: BTreeMap<u64, [u16; 2]> = (1..=nodes as u64)
            .map(|id| (id, [free_port(), free_port()]))
            .collect();
        let s3_gateways: BTreeMap<u64, u16> =
            (1..=nodes as u64).map(|id| (id, free_port())).collect();
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
            if let Some(moto) = &s3 {
                text.push_str(&s3_section(s3_gateways[&id], &moto.endpoint));
            }
            text
        };
        let clients = format!("{}:{}", s3_store::ACCESS_KEY, s3_store::SECRET);
        let env = [(S3_SECRET_ENV, "moto"), (S3_CLIENTS_ENV, clients.as_str())];
        // Every Raft link through a fault proxy, for the nemesis's network faults.
        let cluster = Cluster::start_with_faulty_links(nodes, "", sections, &env).await;
        for [redis_port, pg_port] in gateways.values() {
            if redis.is_some() {
                wait_for_port(*redis_port, Duration::from_secs(30));
            }
            if pg.is_some() {
                wait_for_port(*pg_port, Duration::from_secs(30));
            }
        }
        for port in s3_gateways.values().filter(|_| s3.is_some()) {
            wait_for_port(*port, Duration::from_secs(30));
        }
        Self {
            cluster,
            redis,
            pg,
            gateways,
            s3,
            s3_gateways,
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
        if let Some(moto) = &self.s3 {
            if bypass {
                let addr = moto.endpoint.trim_start_matches("http://");
                args.extend(["--s3".to_owned(), format!("0={addr}")]);
            }
            for (id, port) in self.s3_gateways.iter().filter(|_| !bypass) {
                args.extend(["--s3".to_owned(), format!("{id}=127.0.0.1:{port}")]);
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

/// The environment variables the nodes' `[s3]` sections read their secrets from.
const S3_SECRET_ENV: &str = "CHAOS_S3_UPSTREAM_SECRET";
const S3_CLIENTS_ENV: &str = "CHAOS_S3_CLIENTS";

/// A node's `[s3]` section: a gateway on `port` in front of moto at `upstream`, the records'
/// prefix in manifest mode (the mode whose commit log orders every applied write).
fn s3_section(port: u16, upstream: &str) -> String {
    format!(
        "\n[s3]\nlisten = \"127.0.0.1:{port}\"\nupstream = \"{upstream}\"\n\
         upstream_access_key = \"moto\"\nupstream_secret_env = \"{S3_SECRET_ENV}\"\n\
         clients_env = \"{S3_CLIENTS_ENV}\"\n\n[[s3.protect]]\nbucket = \"{}\"\n\
         prefix = \"{}\"\nmode = \"manifest\"\nresource = \"{RESOURCE}\"\n",
        s3_store::BUCKET,
        s3_store::PREFIX
    )
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
