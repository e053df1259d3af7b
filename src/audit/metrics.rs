//! Prometheus counters for fenced writes, by store and reason.

use prometheus_client::encoding::EncodeLabelSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fencegate_core::Store;

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
#[derive(Debug, Clone)]
pub struct FenceCounters {
    applied: Family<StoreLabel, Counter>,
    /// `applied`'s series of each store, looked up once: every fenced write counts one, and
    /// the family's lookup cost a label `String` and a hash per write.
    applied_series: [(Store, Counter); 3],
    refused: Family<RefusedLabels, Counter>,
    /// The highest fence a store reported in a refusal on this node.
    highest_fence: Arc<AtomicU64>,
    /// 1 while that fence is above every revision the authority has issued.
    above_authority: Gauge,
    /// 1 while the audit directory is over its size budget (an alarm).
    over_budget: Gauge,
    /// Refusals counted but not written because the log was over budget.
    suppressed: Counter,
    /// 1 while the audit log cannot be written (disk full, read-only, I/O errors).
    write_failing: Gauge,
    /// Why, for `/healthz` (an I/O error and the file; never a record's content).
    write_failure: Arc<std::sync::Mutex<Option<String>>>,
    /// Batches whose write or fsync failed.
    write_errors: Counter,
    /// Refusals that stood but whose record could not be written.
    unrecorded: Counter,
    /// Gateway traffic and the audit writer's queue and fsync time (they reach the node
    /// through the same sink).
    pub gateway: crate::gateway_metrics::GatewayMetrics,
}

impl Default for FenceCounters {
    fn default() -> Self {
        let applied: Family<StoreLabel, Counter> = Family::default();
        let applied_series = Store::ALL.map(|store| {
            let label = StoreLabel {
                store: store.as_str().to_owned(),
            };
            (store, applied.get_or_create(&label).clone())
        });
        Self {
            applied,
            applied_series,
            refused: Family::default(),
            highest_fence: Arc::default(),
            above_authority: Gauge::default(),
            over_budget: Gauge::default(),
            suppressed: Counter::default(),
            write_failing: Gauge::default(),
            write_failure: Arc::default(),
            write_errors: Counter::default(),
            unrecorded: Counter::default(),
            gateway: crate::gateway_metrics::GatewayMetrics::default(),
        }
    }
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
            "fence_above_authority",
            "1 when a store reported a fence above every revision the authority has issued (the authority was reset: set authority.initial_revision or run `fencegate snapshot bump`)",
            self.above_authority.clone(),
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
        self.gateway.register(registry);
        self.register_write_failure(registry);
    }

    /// Registers the audit log's write-failure metrics (see [`FenceCounters::set_write_failure`]).
    fn register_write_failure(&self, registry: &mut Registry) {
        registry.register(
            "audit_write_failing",
            "1 while the audit log cannot be written (disk full, read-only, I/O error): refusals still refuse but leave no record; /healthz names the reason",
            self.write_failing.clone(),
        );
        registry.register(
            "audit_write_errors",
            "Audit log batches whose write or fsync failed",
            self.write_errors.clone(),
        );
        registry.register(
            "audit_unrecorded_refusals",
            "Refusals that stood but whose audit record could not be written",
            self.unrecorded.clone(),
        );
    }

    /// Sets why the audit log cannot be written (`None`: it can).
    pub fn set_write_failure(&self, failure: Option<String>) {
        self.write_failing.set(i64::from(failure.is_some()));
        *self.write_failure.lock().unwrap_or_else(|p| p.into_inner()) = failure;
    }

    /// Why the audit log cannot be written, if it cannot.
    pub fn write_failure(&self) -> Option<String> {
        self.write_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Counts one failed batch and the refusals it held.
    pub fn write_error(&self, refusals: u64) {
        self.write_errors.inc();
        self.unrecorded.inc_by(refusals);
    }

    /// Notes the fence a store reported in a refusal.
    pub fn saw_fence(&self, fence: Option<u64>) {
        if let Some(fence) = fence {
            self.highest_fence.fetch_max(fence, Ordering::Relaxed);
        }
    }

    /// Forgets the highest fence seen (an operator reset it); the next refusal reports anew.
    pub fn forget(&self) {
        self.highest_fence.store(0, Ordering::Relaxed);
        self.above_authority.set(0);
    }

    /// Compares the highest fence seen with the authority's `revision`; logs the first time a
    /// fence is above it. Returns the fence when it is.
    pub fn check_floor(&self, revision: u64) -> Option<u64> {
        let fence = self.highest_fence.load(Ordering::Relaxed);
        let above = fence > revision;
        if above && self.above_authority.set(1) == 0 {
            tracing::error!(fence, revision, "a store holds a fence above every revision this authority has issued: every write to that resource will be refused as stale. The authority's data was lost or re-created; set authority.initial_revision above the fence (or run `fencegate snapshot bump`) so new tokens pass");
        } else if !above {
            self.above_authority.set(0);
        }
        above.then_some(fence)
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
    pub fn applied(&self, store: Store) {
        // Every store has its series (built from `Store::ALL`).
        if let Some((_, series)) = self.applied_series.iter().find(|(s, _)| *s == store) {
            series.inc();
        }
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
