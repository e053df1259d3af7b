//! Prometheus metrics of a node, served on `GET /metrics` in the classic text format.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabel {
    peer: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

/// Every metric family of the node; handles are cheap clones of shared atomics.
pub struct Metrics {
    registry: Registry,
    pub acquires: Counter,
    /// Acquires refused because the cluster holds `[authority] max_leases`.
    pub leases_refused: Counter,
    pub keepalives: Counter,
    pub expiries: Counter,
    pub releases: Counter,
    pub term: Gauge,
    pub is_leader: Gauge,
    pub commit_index: Gauge,
    pub active_leases: Gauge,
    pub revision: Gauge,
    pub waiting_acquires: Gauge,
    /// Fenced writes applied and refused, by store and reason (every filter).
    pub fences: crate::audit::FenceCounters,
    /// Connections of the Redis gateway in its tarpit now (read from the gateway on scrape).
    pub redis_tarpitted: crate::sampled_gauge::SampledGauge,
    /// Leader changes this node saw (a new leader known; see [`crate::raft_watch`]).
    pub leader_changes: Counter,
    pub has_leader: Gauge,
    pub last_log_index: Gauge,
    replication_lag: Family<PeerLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("fencegate");
        let metrics = Self {
            acquires: Counter::default(),
            leases_refused: Counter::default(),
            keepalives: Counter::default(),
            expiries: Counter::default(),
            releases: Counter::default(),
            term: Gauge::default(),
            is_leader: Gauge::default(),
            commit_index: Gauge::default(),
            active_leases: Gauge::default(),
            revision: Gauge::default(),
            waiting_acquires: Gauge::default(),
            fences: crate::audit::FenceCounters::default(),
            redis_tarpitted: Default::default(),
            leader_changes: Counter::default(),
            has_leader: Gauge::default(),
            last_log_index: Gauge::default(),
            replication_lag: Family::default(),
            registry: Registry::default(),
        };
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register(
            "build_info",
            "Always 1; the version label says which fencegate this node runs",
            build_info,
        );
        registry.register(
            "raft_leader_changes",
            "Times this node learned of a new Raft leader (elections and failovers)",
            metrics.leader_changes.clone(),
        );
        registry.register(
            "raft_has_leader",
            "1 while this node knows a Raft leader",
            metrics.has_leader.clone(),
        );
        registry.register(
            "raft_last_log_index",
            "Index of the last entry in this node's Raft log",
            metrics.last_log_index.clone(),
        );
        registry.register(
            "raft_replication_lag",
            "On the leader: log entries each peer has yet to confirm",
            metrics.replication_lag.clone(),
        );
        metrics.fences.register(&mut registry);
        registry.register_collector(metrics.redis_tarpitted.collector(
            "redis_tarpitted_connections",
            "Redis gateway connections slowed down now because their refusals went over the refusal budget ([redis] refusals_per_second)",
        ));
        registry.register(
            "authority_acquires",
            "Locks granted by this node as leader",
            metrics.acquires.clone(),
        );
        registry.register(
            "authority_leases_refused",
            "Acquires refused by this node as leader because the cluster holds [authority] max_leases live leases",
            metrics.leases_refused.clone(),
        );
        registry.register(
            "authority_keepalives",
            "Keepalives answered by this node as leader",
            metrics.keepalives.clone(),
        );
        registry.register(
            "authority_expiries",
            "Leases expired by this node as leader",
            metrics.expiries.clone(),
        );
        registry.register(
            "authority_releases",
            "Leases released through this node as leader",
            metrics.releases.clone(),
        );
        registry.register("raft_term", "Current Raft term", metrics.term.clone());
        registry.register(
            "raft_is_leader",
            "1 if this node is the Raft leader",
            metrics.is_leader.clone(),
        );
        registry.register(
            "raft_commit_index",
            "Index of the last log entry applied on this node",
            metrics.commit_index.clone(),
        );
        registry.register(
            "authority_active_leases",
            "Leases alive in this node's state",
            metrics.active_leases.clone(),
        );
        registry.register(
            "authority_revision",
            "The authority's revision on this node",
            metrics.revision.clone(),
        );
        registry.register(
            "authority_waiting_acquires",
            "Acquires on this node waiting for a held lock",
            metrics.waiting_acquires.clone(),
        );
        Self {
            registry,
            ..metrics
        }
    }
}

impl Metrics {
    /// The classic Prometheus text exposition of every family, with the process metrics.
    pub fn render(&self) -> String {
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        let mut text = crate::exposition::classic(&text);
        text.push_str(&crate::process_metrics::render());
        text
    }

    /// The replication lag gauge of `peer`.
    pub fn replication_lag(&self, peer: u64) -> Gauge {
        self.replication_lag
            .get_or_create(&PeerLabel {
                peer: peer.to_string(),
            })
            .clone()
    }

    /// Drops every peer's lag series (this node is not the leader).
    pub fn clear_replication_lag(&self) {
        self.replication_lag.clear();
    }
}
