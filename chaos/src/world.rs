//! What a chaos run stands on: a real redis-server, and a 3-node cluster of real `fencegate
//! serve` processes, each running a Redis gateway in front of that server.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use fencegate_testkit::cluster::Cluster;
use fencegate_testkit::free_port;
use fencegate_testkit::redis_server::RedisServer;
use fencegate_testkit::s3_server::wait_for_port;

/// The resource every worker locks; the gateways protect the records under it.
pub const RESOURCE: &str = "job";

pub struct World {
    pub cluster: Cluster,
    pub redis: RedisServer,
    /// Each node's Redis gateway port.
    pub redis_gateways: BTreeMap<u64, u16>,
}

impl World {
    pub async fn start(nodes: usize) -> Self {
        let redis = RedisServer::start();
        let redis_gateways: BTreeMap<u64, u16> =
            (1..=nodes as u64).map(|id| (id, free_port())).collect();
        let sections = |id: u64| {
            format!(
                "\n[redis]\nlisten = \"127.0.0.1:{port}\"\nupstream = \"{upstream}\"\n\n\
                 [[redis.protect]]\npattern = \"chaos:*\"\nmode = \"enforce\"\nresource = \"{RESOURCE}\"\n",
                port = redis_gateways[&id],
                upstream = redis.addr,
            )
        };
        let cluster = Cluster::start_configured(nodes, "", sections, &[]).await;
        for port in redis_gateways.values() {
            wait_for_port(*port, Duration::from_secs(30));
        }
        Self {
            cluster,
            redis,
            redis_gateways,
        }
    }

    /// `id=127.0.0.1:port` of every Redis gateway, as the worker takes them.
    pub fn redis_targets(&self, bypass: bool) -> Vec<String> {
        if bypass {
            return vec![format!("0={}", self.redis.addr)];
        }
        self.redis_gateways
            .iter()
            .map(|(id, port)| format!("{id}=127.0.0.1:{port}"))
            .collect()
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
