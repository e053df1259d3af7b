//! Prometheus counters for fenced writes, by store and reason.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabel {
    store: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    store: String,
    reason: String,
}

/// `fencegate_fenced_writes_applied_total{store}` and
/// `fencegate_fenced_writes_refused_total{store,reason}`. A refusal is counted only once its
/// audit record is on disk.
#[derive(Debug, Clone, Default)]
pub struct FenceCounters {
    applied: Family<StoreLabel, Counter>,
    refused: Family<RefusedLabels, Counter>,
}

impl FenceCounters {
    /// Adds both families to `registry` (under its prefix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "fenced_writes_applied",
            "Writes to protected keys or objects that the store applied under the fence",
            self.applied.clone(),
        );
        registry.register(
            "fenced_writes_refused",
            "Refused writes whose audit record is on disk, by store and reason",
            self.refused.clone(),
        );
    }

    /// Counts one applied fenced write.
    pub fn applied(&self, store: &str) {
        self.applied
            .get_or_create(&StoreLabel {
                store: store.to_owned(),
            })
            .inc();
    }

    /// Counts one logged refusal.
    pub fn refused(&self, store: &str, reason: &str) {
        self.refused
            .get_or_create(&RefusedLabels {
                store: store.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }
}
