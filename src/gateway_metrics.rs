//! Prometheus families for the gateways' traffic and for the audit writer, fed through the
//! audit sink every gateway already holds ([`fencegate_core::Observer`]).

use std::time::Duration;

use fencegate_core::{Store, UpstreamFailure};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabel {
    store: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    store: &'static str,
    kind: &'static str,
}

/// Seconds, from 0.5 ms (a local Redis round trip) to 30 s (a large S3 upload).
const LATENCY_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0,
];
/// Seconds for one audit batch's write and fsync: 0.1 ms (a cache) to 5 s (a failing disk).
const FSYNC_BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 5.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Per-store gateway traffic, and the audit writer's queue and fsync time.
#[derive(Debug, Clone)]
pub struct GatewayMetrics {
    connections: Family<StoreLabel, Gauge>,
    connections_refused: Family<StoreLabel, Counter>,
    requests: Family<StoreLabel, Histogram, fn() -> Histogram>,
    /// `requests`' series of each store, looked up once: every request of every gateway
    /// observes one, and the family's lookup (a hash of the label and a read lock) cost as much
    /// as the observation.
    request_series: [(Store, Histogram); 3],
    upstream_failures: Family<FailureLabels, Counter>,
    upstream_up: Family<StoreLabel, Gauge>,
    audit_queue: Gauge,
    audit_fsync: Histogram,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        let requests: Family<StoreLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        let request_series =
            Store::ALL.map(|store| (store, requests.get_or_create(&label(store)).clone()));
        Self {
            connections: Family::default(),
            connections_refused: Family::default(),
            requests,
            request_series,
            upstream_failures: Family::default(),
            upstream_up: Family::default(),
            audit_queue: Gauge::default(),
            audit_fsync: Histogram::new(FSYNC_BUCKETS),
        }
    }
}

impl GatewayMetrics {
    /// Adds every family to `registry` (under its prefix), with every store's series at zero
    /// so dashboards and alerts see them before the first client.
    pub fn register(&self, registry: &mut Registry) {
        for store in Store::ALL {
            let label = StoreLabel {
                store: store.as_str(),
            };
            let _ = self.connections.get_or_create(&label);
            let _ = self.connections_refused.get_or_create(&label);
            let _ = self.requests.get_or_create(&label);
            for failure in [UpstreamFailure::Connect, UpstreamFailure::Error] {
                let _ = self.upstream_failures.get_or_create(&FailureLabels {
                    store: store.as_str(),
                    kind: failure.as_str(),
                });
            }
        }
        registry.register(
            "gateway_connections",
            "Client connections open on this node's gateways (s3: requests in flight)",
            self.connections.clone(),
        );
        registry.register(
            "gateway_connections_refused",
            "Client connections refused because the gateway held its max_client_connections (redis, postgres)",
            self.connections_refused.clone(),
        );
        registry.register(
            "gateway_request_duration_seconds",
            "Time from reading a client request to writing its answer (redis: a command; postgres: a query, Sync or function call until its ReadyForQuery; s3: an HTTP request)",
            self.requests.clone(),
        );
        registry.register(
            "gateway_upstream_failures",
            "Failures talking to the upstream store: kind=connect (could not connect) or error (an open connection failed)",
            self.upstream_failures.clone(),
        );
        registry.register(
            "gateway_upstream_up",
            "1 if the gateway's upstream accepted a TCP connection at the last scrape or /healthz (configured gateways only)",
            self.upstream_up.clone(),
        );
        registry.register(
            "audit_queue_depth",
            "Audit records waiting for the writer (the queue is bounded: a full queue slows refusals down)",
            self.audit_queue.clone(),
        );
        registry.register(
            "audit_fsync_seconds",
            "Time to write and fsync one batch of audit records",
            self.audit_fsync.clone(),
        );
    }

    pub fn connection_opened(&self, store: Store) {
        self.connections.get_or_create(&label(store)).inc();
    }

    pub fn connection_closed(&self, store: Store) {
        self.connections.get_or_create(&label(store)).dec();
    }

    pub fn connection_refused(&self, store: Store) {
        self.connections_refused.get_or_create(&label(store)).inc();
    }

    pub fn request_done(&self, store: Store, elapsed: Duration) {
        // Every store has its series (built from `Store::ALL`).
        if let Some((_, series)) = self.request_series.iter().find(|(s, _)| *s == store) {
            series.observe(elapsed.as_secs_f64());
        }
    }

    pub fn upstream_failed(&self, store: Store, failure: UpstreamFailure) {
        self.upstream_failures
            .get_or_create(&FailureLabels {
                store: store.as_str(),
                kind: failure.as_str(),
            })
            .inc();
    }

    /// The gauge that says whether `store`'s upstream is reachable.
    pub fn upstream_up(&self, store: Store) -> Gauge {
        self.upstream_up.get_or_create(&label(store)).clone()
    }

    /// Sets the audit queue's depth (records submitted, not yet taken by the writer).
    pub fn audit_queue_depth(&self, depth: usize) {
        self.audit_queue.set(depth as i64);
    }

    /// Records one audit batch's write-and-fsync time.
    pub fn audit_fsync(&self, elapsed: Duration) {
        self.audit_fsync.observe(elapsed.as_secs_f64());
    }
}

fn label(store: Store) -> StoreLabel {
    StoreLabel {
        store: store.as_str(),
    }
}
