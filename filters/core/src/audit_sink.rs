use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

use thiserror::Error;

use crate::{AuditEvent, Observer, Store};

/// Why a refusal could not be logged. The refusal itself still stands: a filter answers the
/// client with the refusal either way and logs this error.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AuditSinkError {
    /// The audit writer has stopped (shutdown, or a fatal I/O error it already reported).
    #[error("the audit writer has stopped")]
    Closed,
    /// Writing or syncing the log failed.
    #[error("audit log I/O failed: {0}")]
    Io(String),
}

/// A future returned by [`AuditSink::refused`].
pub type SinkFuture<'a> = Pin<Box<dyn Future<Output = Result<(), AuditSinkError>> + Send + 'a>>;

/// Where filters report what they did, so they need not depend on the node binary.
///
/// `refused` resolves only once the record is durable (written and fsync'd); it waits when the
/// writer's queue is full (backpressure) rather than dropping a record. The same sink observes
/// the gateways' traffic for metrics ([`Observer`]).
pub trait AuditSink: Observer + Send + Sync + 'static {
    /// Logs one refused write; resolves when it is on disk.
    fn refused(&self, event: AuditEvent) -> SinkFuture<'_>;
    /// Counts one fenced write that the store applied.
    fn applied(&self, store: Store);
}

/// An in-memory sink for tests: keeps every event, the applied count and the count of client
/// connections refused.
#[derive(Debug, Default)]
pub struct MemoryAuditSink {
    events: Mutex<Vec<AuditEvent>>,
    applied: Mutex<u64>,
    connections_refused: Mutex<u64>,
}

impl MemoryAuditSink {
    /// The events received so far.
    pub fn events(&self) -> Vec<AuditEvent> {
        self.events.lock().expect("poisoned").clone()
    }

    /// How many applied writes were counted.
    pub fn applied_count(&self) -> u64 {
        *self.applied.lock().expect("poisoned")
    }

    /// How many client connections were refused ([`Observer::connection_refused`]).
    pub fn connections_refused(&self) -> u64 {
        *self.connections_refused.lock().expect("poisoned")
    }
}

impl Observer for MemoryAuditSink {
    fn connection_refused(&self, _store: Store) {
        *self.connections_refused.lock().expect("poisoned") += 1;
    }
}

impl AuditSink for MemoryAuditSink {
    fn refused(&self, event: AuditEvent) -> SinkFuture<'_> {
        self.events.lock().expect("poisoned").push(event);
        Box::pin(async { Ok(()) })
    }

    fn applied(&self, _store: Store) {
        *self.applied.lock().expect("poisoned") += 1;
    }
}
