//! Prometheus metrics of a node, served on `GET /metrics`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Every metric family of the node; handles are cheap clones of shared atomics.
pub struct Metrics {
    registry: Registry,
    pub acquires: Counter,
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
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("fencegate");
        let metrics = Self {
            acquires: Counter::default(),
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
            registry: Registry::default(),
        };
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
    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> String {
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}
