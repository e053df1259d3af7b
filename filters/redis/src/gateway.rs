//! The listener and what every session shares: config, token policy, audit sink, and what was
//! learned from the upstream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fencegate_core::{AuditSink, TokenPolicy};
use tokio::net::TcpListener;
use tokio::sync::Mutex;

use crate::config::RedisConfig;
use crate::error::RedisError;
use crate::frame::Limits;
use crate::rewrite::ScriptMode;
use crate::session;
use crate::upstream::{ControlConnection, UpstreamInfo};

/// One Redis gateway: a listener's shared state.
pub struct Gateway {
    pub(crate) config: RedisConfig,
    pub(crate) policy: TokenPolicy,
    pub(crate) sink: Arc<dyn AuditSink>,
    pub(crate) limits: Limits,
    info: Mutex<Option<Arc<UpstreamInfo>>>,
    connections: AtomicU64,
}

impl Gateway {
    /// A gateway for `config` that verifies tokens with `policy` and reports to `sink`.
    pub fn new(
        config: RedisConfig,
        policy: TokenPolicy,
        sink: Arc<dyn AuditSink>,
    ) -> Result<Arc<Self>, RedisError> {
        config.validate()?;
        let limits = Limits {
            max_frame_bytes: config.max_request_bytes,
            ..Limits::default()
        };
        Ok(Arc::new(Self {
            config,
            policy,
            sink,
            limits,
            info: Mutex::new(None),
            connections: AtomicU64::new(0),
        }))
    }

    /// The command table and script mode, learned from the upstream on first use (and retried
    /// on the next connection if the upstream was down).
    pub async fn info(&self) -> Result<Arc<UpstreamInfo>, RedisError> {
        let mut guard = self.info.lock().await;
        if let Some(info) = &*guard {
            return Ok(info.clone());
        }
        let mut control = ControlConnection::open(&self.config).await?;
        let info = Arc::new(control.learn().await?);
        tracing::info!(commands = info.table.len(), mode = ?info.mode, upstream = %self.config.upstream, "learned the upstream's commands and loaded the fence script");
        *guard = Some(info.clone());
        Ok(info)
    }

    /// Loads the fence script again (after `FUNCTION FLUSH`, `SCRIPT FLUSH` or an upstream
    /// restart).
    pub async fn reload_fence(&self) -> Result<ScriptMode, RedisError> {
        let mut control = ControlConnection::open(&self.config).await?;
        let mode = control.load_fence().await?;
        tracing::warn!(mode = ?mode, "the fence script was missing upstream; reloaded it");
        Ok(mode)
    }

    pub(crate) fn next_connection_id(&self) -> u64 {
        self.connections.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Accepts clients on `listener` until the task is dropped; one session per client.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> Result<(), RedisError> {
        if let Err(e) = self.info().await {
            tracing::warn!(error = %e, "upstream not ready; will retry when a client connects");
        }
        loop {
            let (socket, peer) = listener
                .accept()
                .await
                .map_err(RedisError::io("accepting a Redis client"))?;
            let gateway = self.clone();
            tokio::spawn(async move { session::run(gateway, socket, peer).await });
        }
    }

    /// Binds `config.listen` and serves.
    pub async fn bind_and_serve(self: Arc<Self>) -> Result<(), RedisError> {
        let listener = self.bind().await?;
        self.serve(listener).await
    }

    /// Binds the configured listen address.
    pub async fn bind(&self) -> Result<TcpListener, RedisError> {
        let addr: SocketAddr = self.config.listen;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(RedisError::io(format!("binding {addr}")))?;
        // The bound address: with port 0 in the config, this line is how the port is learned.
        let bound = listener.local_addr().unwrap_or(addr);
        tracing::info!(listen = %bound, upstream = %self.config.upstream, "redis gateway listening");
        Ok(listener)
    }
}
