use std::sync::Arc;
use std::time::Duration;

use crate::{AuditSink, Store};

/// What went wrong between a gateway and its upstream store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpstreamFailure {
    /// The gateway could not open a connection (refused, unreachable, TLS or login failed).
    Connect,
    /// An open connection failed mid-session (reset, closed, timed out, protocol error).
    Error,
}

impl UpstreamFailure {
    /// The `kind` label of metrics: `connect` or `error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Error => "error",
        }
    }
}

/// What gateways report about their traffic, for the node's metrics. Every method does
/// nothing by default, so a sink that keeps no metrics (a test's) need not implement any.
pub trait Observer: Send + Sync {
    /// A client connection was accepted (for S3: a request began).
    fn connection_opened(&self, _store: Store) {}
    /// A client connection ended (for S3: a request ended).
    fn connection_closed(&self, _store: Store) {}
    /// A client connection was refused: the gateway already held its `max_client_connections`.
    fn connection_refused(&self, _store: Store) {}
    /// One client request was answered `elapsed` after it was read (Redis: a command; PostgreSQL:
    /// a simple query or an extended-protocol Sync, until ReadyForQuery; S3: an HTTP request).
    fn request_done(&self, _store: Store, _elapsed: Duration) {}
    /// The upstream failed as `failure` says.
    fn upstream_failed(&self, _store: Store, _failure: UpstreamFailure) {}
}

/// One open client connection: counted as opened when made, as closed when dropped, so every
/// exit path of a session (errors and panics included) closes it.
pub struct OpenConnection {
    sink: Arc<dyn AuditSink>,
    store: Store,
}

impl OpenConnection {
    /// Counts a connection to `store` as opened on `sink`.
    pub fn new(sink: Arc<dyn AuditSink>, store: Store) -> Self {
        sink.connection_opened(store);
        Self { sink, store }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.sink.connection_closed(self.store);
    }
}
