//! The listener and what every session shares: config, token policy and audit sink.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fencegate_core::{
    Admission, AuditSink, ConnectionCap, Resource, SessionThreads, Store, TokenPolicy,
};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::classify_cache::ClassifyCache;
use crate::config::PostgresConfig;
use crate::error::PostgresError;
use crate::session;
use crate::upstream::Upstream;

/// One PostgreSQL gateway: a listener's shared state.
pub struct Gateway {
    pub(crate) config: PostgresConfig,
    pub(crate) policy: TokenPolicy,
    pub(crate) sink: Arc<dyn AuditSink>,
    pub(crate) route: Option<Resource>,
    pub(crate) tls: Option<tokio_rustls::TlsAcceptor>,
    /// The certificate `tls` presents (SIGHUP replaces it).
    server_cert: Option<Arc<fencegate_core::ServerCert>>,
    /// How sessions connect to the server (TLS or not).
    pub(crate) upstream: Upstream,
    /// Statement classifications by shape, shared by every session.
    pub(crate) classified: ClassifyCache,
    connections: AtomicU64,
    /// The sessions running now (the node waits on it while it drains).
    sessions: TaskTracker,
    /// The threads the sessions run on.
    threads: SessionThreads,
    /// `max_client_connections`, and what a client over it is told.
    cap: ConnectionCap,
    too_many: String,
}

/// Statement shapes remembered per gateway (cleared when full).
const CLASSIFY_CACHE_SHAPES: usize = 1024;

impl Gateway {
    /// A gateway for `config` that verifies tokens with `policy` (its `accept_plain` is taken
    /// from the config) and reports refusals to `sink`.
    pub fn new(
        config: PostgresConfig,
        mut policy: TokenPolicy,
        sink: Arc<dyn AuditSink>,
    ) -> Result<Arc<Self>, PostgresError> {
        config.validate()?;
        policy.accept_plain = config.accept_plain;
        let route = config.route();
        let (tls, server_cert) = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => Some(crate::tls::acceptor(cert, key)?),
            _ => None,
        }
        .unzip();
        let upstream = Upstream::new(&config)?;
        let threads = SessionThreads::start("fg-pg-session", config.session_threads)
            .map_err(PostgresError::io("starting the session threads"))?;
        let cap = ConnectionCap::new(config.max_client_connections);
        let too_many = too_many(config.max_client_connections);
        Ok(Arc::new(Self {
            upstream,
            config,
            policy,
            sink,
            route,
            tls,
            server_cert,
            classified: ClassifyCache::new(CLASSIFY_CACHE_SHAPES),
            connections: AtomicU64::new(0),
            sessions: TaskTracker::new(),
            threads,
            cap,
            too_many,
        }))
    }

    /// Installs `fence.sql` if the config asks for it at startup.
    pub async fn install_if_configured(&self) -> Result<(), PostgresError> {
        if !self.config.install_on_start {
            return Ok(());
        }
        let var = self.config.install_dsn_env.as_deref().unwrap_or_default();
        let dsn = std::env::var(var).map_err(|_| {
            PostgresError::Config(format!("install_dsn_env names {var}, which is not set"))
        })?;
        crate::install::install(&dsn).await?;
        tracing::info!("installed fence.sql upstream");
        Ok(())
    }

    /// Keeps the store's token keys in step with the node's key ring (see [`crate::key_sync`])
    /// when the config names an install DSN; a background task for the node's life.
    pub fn start_key_sync(&self) -> Result<(), PostgresError> {
        let Some(var) = self.config.install_dsn_env.as_deref() else {
            tracing::warn!("[postgres] has no install_dsn_env: the store's token keys are not kept in step; run `fencegate postgres sync-keys` after every key rotation, or direct connections are judged with old keys");
            return Ok(());
        };
        if self.policy.accept_unsigned {
            // With keys installed the store refuses unsigned tokens; the store would then
            // refuse what this development gateway accepts.
            tracing::warn!("accept_unsigned = true: the store's token keys are not written, so the guard accepts unsigned tokens too");
            return Ok(());
        }
        let dsn = std::env::var(var).map_err(|_| {
            PostgresError::Config(format!("install_dsn_env names {var}, which is not set"))
        })?;
        tokio::spawn(crate::key_sync::sync_forever(self.policy.keys.clone(), dsn));
        Ok(())
    }

    pub(crate) fn next_connection_id(&self) -> u64 {
        self.connections.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Binds the configured listen address.
    pub async fn bind(&self) -> Result<TcpListener, PostgresError> {
        let addr: SocketAddr = self.config.listen;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(PostgresError::io(format!("binding {addr}")))?;
        // The bound address: with port 0 in the config, this line is how the port is learned.
        let bound = listener.local_addr().unwrap_or(addr);
        tracing::info!(listen = %bound, upstream = %self.config.upstream, "postgres gateway listening");
        Ok(listener)
    }

    /// Accepts clients on `listener` until the task is dropped; one session (and one upstream
    /// connection) per client.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> Result<(), PostgresError> {
        self.serve_until(listener, CancellationToken::new()).await
    }

    /// Accepts clients on `listener` until `shutdown` is cancelled, then closes the listener
    /// (new clients are refused) and returns. Sessions see the same token: each finishes its
    /// transaction and ends at its next ReadyForQuery with no transaction open (the client
    /// gets SQLSTATE 57P01); [`Gateway::sessions`] says when they are all gone.
    pub async fn serve_until(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> Result<(), PostgresError> {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = shutdown.cancelled() => break,
            };
            let (socket, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) if ConnectionCap::client_gave_up(&e) => continue,
                // EMFILE, ENFILE...: one failed accept must not stop the listener for good
                // (issue 12, bypass 8). Back off briefly so a full fd table is not spun on.
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a PostgreSQL client failed; retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            match self.cap.admit(self.sessions.len()) {
                Admission::Admitted => {}
                Admission::Reopened { refused } => {
                    tracing::info!(refused, "the postgres gateway admits clients again");
                }
                Admission::Refused { first } => {
                    if first {
                        tracing::warn!(
                            max_client_connections = self.cap.max(),
                            "the postgres gateway holds max_client_connections; new clients get SQLSTATE 53300 until one leaves"
                        );
                    }
                    self.sink.connection_refused(Store::Postgres);
                    let gateway = self.clone();
                    self.cap
                        .refuse_on(&self.threads, socket, |socket| async move {
                            session::refuse_over_cap(&gateway, socket, &gateway.too_many).await;
                        });
                    continue;
                }
            }
            if let Err(e) = ConnectionCap::keep_alive(&socket) {
                tracing::debug!(error = %e, %peer, "TCP keepalive not set on a PostgreSQL client");
            }
            // The session runs on a session thread (see `fencegate_core::SessionThreads`): the socket leaves
            // this runtime's reactor and joins that thread's.
            let socket = match socket.into_std() {
                Ok(socket) => socket,
                Err(e) => {
                    tracing::warn!(error = %e, %peer, "handing a PostgreSQL client to a session thread failed");
                    continue;
                }
            };
            let gateway = self.clone();
            let shutdown = shutdown.clone();
            self.threads.spawn(&self.sessions, async move {
                match TcpStream::from_std(socket) {
                    Ok(socket) => session::run(gateway, socket, peer, shutdown).await,
                    Err(e) => tracing::warn!(error = %e, %peer, "registering a PostgreSQL client with its session thread failed"),
                }
            });
        }
        drop(listener);
        self.sessions.close();
        tracing::info!(
            sessions = self.sessions.len(),
            "postgres gateway stopped accepting; sessions finish their transactions"
        );
        Ok(())
    }

    /// The sessions running now: `len()` counts them, `wait()` (after the listener stopped)
    /// returns when the last one ended.
    pub fn sessions(&self) -> TaskTracker {
        self.sessions.clone()
    }

    /// The certificate the TLS listener presents, when `tls_cert` is set: SIGHUP reloads it.
    pub fn server_cert(&self) -> Option<Arc<fencegate_core::ServerCert>> {
        self.server_cert.clone()
    }
}

/// What a client over `max_client_connections` is told (SQLSTATE 53300).
fn too_many(max: usize) -> String {
    format!(
        "fencegate: too many client connections (max_client_connections = {max}): retry later, or raise max_client_connections in [postgres]"
    )
}
