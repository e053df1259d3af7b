//! Prometheus counters for fenced writes, by store and reason.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
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
    /// 1 while the audit directory is over its size budget (an alarm).
    over_budget: Gauge,
    /// Refusals counted but not written because the log was over budget.
    suppressed: Counter,
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
        registry.register(
            "audit_over_budget",
            "1 while the audit directory is over max_total_bytes: tokenless/malformed refusals are only counted",
            self.over_budget.clone(),
        );
        registry.register(
            "audit_suppressed",
            "Tokenless or malformed refusals not written because the audit log was over its size budget",
            self.suppressed.clone(),
        );
    }

    /// Sets the over-budget alarm.
    pub fn set_over_budget(&self, over: bool) {
        self.over_budget.set(i64::from(over));
    }

    /// Counts one refusal not written (over budget).
    pub fn suppressed(&self) {
        self.suppressed.inc();
    }

    /// Whether the over-budget alarm is on.
    pub fn over_budget(&self) -> bool {
        self.over_budget.get() != 0
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
