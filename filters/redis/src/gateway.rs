//! The listener and what every session shares: config, token policy, audit sink, and what was
//! learned from the upstream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_core::{
    Admission, AuditSink, Charge, ConnectionCap, RefusalBudget, ServerCert, SessionThreads, Store,
    TokenPolicy,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::RedisConfig;
use crate::error::RedisError;
use crate::frame::Limits;
use crate::rewrite::ScriptMode;
use crate::session;
use crate::shared_upstream::{SharedConnection, SharedPool};
use crate::upstream::{ControlConnection, Upstream, UpstreamInfo};

/// What a client over `max_client_connections` gets: Redis's own answer when its `maxclients`
/// is reached, which clients and their pools already recognise.
const TOO_MANY_CLIENTS: &[u8] = b"-ERR max number of clients reached\r\n";

/// One Redis gateway: a listener's shared state.
pub struct Gateway {
    pub(crate) config: RedisConfig,
    /// The config whose protect rules are in force: `config`, or what
    /// [`Gateway::set_protect_rules`] last put in its place. Sessions read it per request.
    live: std::sync::RwLock<Arc<RedisConfig>>,
    /// Counts the changes of `live`, so a session reads it again only after one.
    live_version: AtomicU64,
    pub(crate) policy: TokenPolicy,
    pub(crate) sink: Arc<dyn AuditSink>,
    pub(crate) limits: Limits,
    /// Where the upstream is, and its TLS settings.
    pub(crate) upstream: Upstream,
    /// The client side's TLS acceptor (`tls_cert`/`tls_key`).
    pub(crate) tls: Option<TlsAcceptor>,
    /// The certificate `tls` presents (SIGHUP replaces it).
    server_cert: Option<Arc<ServerCert>>,
    /// What was learned, and when the upstream's durability was last confirmed.
    info: Mutex<Option<(Arc<UpstreamInfo>, Instant)>>,
    connections: AtomicU64,
    /// Why the gateway is not serving protected writes right now (`None`: healthy).
    degraded: std::sync::Mutex<Option<String>>,
    /// What runs the fence check upstream ([`ScriptMode::name`]): the mode learned with the
    /// command table, which every session uses (a reload does not change it).
    fence_check: std::sync::Mutex<Option<&'static str>>,
    /// Set while fence keys are at risk: sessions refuse fenced writes.
    at_risk: AtomicBool,
    /// Bytes of partial requests buffered by all sessions (see `max_buffered_bytes`).
    pub(crate) buffered: AtomicUsize,
    /// Refusals of clients without a valid token, all sessions together (`refusals_per_second`).
    refusals: std::sync::Mutex<RefusalBudget>,
    /// Sessions in the tarpit now (a refusal over the budget since their last accepted write).
    pub(crate) tarpitted: AtomicUsize,
    /// Tarpit waits so far.
    pub(crate) tarpit_waits: AtomicU64,
    /// The sessions running now (the node waits on it while it drains).
    sessions: TaskTracker,
    /// Upstream connections sessions share while they are in the plain state.
    shared: SharedPool,
    /// Where the sessions run (`session_threads`), and with them the shared connections.
    threads: SessionThreads,
    /// `max_client_connections`.
    cap: ConnectionCap,
    /// The upstream limits clients' output or memory (see
    /// [`ControlConnection::sharing_hazard`]): new sessions get a connection of their own.
    sharing_hazard: AtomicBool,
}

/// How often refusals over the budget are logged (one line per period, with a count).
const REFUSAL_REPORT: Duration = Duration::from_secs(10);

/// How often the upstream's eviction and persistence settings are checked again.
const RECHECK: Duration = Duration::from_secs(10);

impl Gateway {
    /// A gateway for `config` that verifies tokens with `policy` and reports to `sink`.
    pub fn new(
        config: RedisConfig,
        policy: TokenPolicy,
        sink: Arc<dyn AuditSink>,
    ) -> Result<Arc<Self>, RedisError> {
        config.validate()?;
        if config.rules().is_empty() {
            tracing::warn!(listen = %config.listen, "[redis] protect = []: this gateway is a pass-through and fences nothing");
        }
        let limits = Limits {
            max_frame_bytes: config.max_request_bytes,
            ..Limits::default()
        };
        let upstream = Upstream::load(&config)?;
        let config_shared = config.shared_upstream_connections;
        let cap = ConnectionCap::new(config.max_client_connections);
        let threads = SessionThreads::start("fg-redis-session", config.session_threads)
            .map_err(RedisError::io("starting the session threads"))?;
        let (tls, server_cert) = crate::tls::acceptor(&config)?.unzip();
        let refusals = RefusalBudget::new(
            config.refusals_per_second,
            config.refusal_burst,
            REFUSAL_REPORT,
            Instant::now(),
        );
        Ok(Arc::new(Self {
            live: std::sync::RwLock::new(Arc::new(config.clone())),
            live_version: AtomicU64::new(0),
            config,
            policy,
            sink,
            limits,
            upstream,
            tls,
            server_cert,
            info: Mutex::new(None),
            connections: AtomicU64::new(0),
            degraded: std::sync::Mutex::new(None),
            fence_check: std::sync::Mutex::new(None),
            at_risk: AtomicBool::new(false),
            buffered: AtomicUsize::new(0),
            refusals: std::sync::Mutex::new(refusals),
            tarpitted: AtomicUsize::new(0),
            tarpit_waits: AtomicU64::new(0),
            sessions: TaskTracker::new(),
            cap,
            shared: SharedPool::new(config_shared),
            threads,
            sharing_hazard: AtomicBool::new(false),
        }))
    }

    /// The command table and script mode, learned from the upstream on first use (and retried
    /// on the next connection if the upstream was down). The upstream's eviction and
    /// persistence settings are checked then and again every [`RECHECK`]: while fence keys are
    /// at risk, sessions refuse protected writes (reads and unprotected writes still pass) and
    /// [`Gateway::health`] says why.
    pub async fn info(&self) -> Result<Arc<UpstreamInfo>, RedisError> {
        let mut guard = self.info.lock().await;
        if let Some((info, checked)) = &*guard {
            if checked.elapsed() < RECHECK {
                return Ok(info.clone());
            }
        }
        let known = guard.as_ref().map(|(info, _)| info.clone());
        let mut control = match ControlConnection::open(&self.upstream, &self.config).await {
            Ok(control) => control,
            Err(e) => {
                self.set_degraded(Some(e.to_string()));
                return Err(e);
            }
        };
        let info = match known {
            Some(info) => info,
            None => {
                let info = match control.learn(&self.config).await {
                    Ok(info) => Arc::new(info),
                    Err(e) => {
                        self.set_degraded(Some(e.to_string()));
                        return Err(e);
                    }
                };
                tracing::info!(commands = info.table.len(), mode = ?info.mode, upstream = %self.config.upstream, "learned the upstream's commands and loaded the fence script");
                self.set_fence_check(&info.mode);
                info
            }
        };
        match control.check_durability(&self.config).await {
            Ok(()) => self.set_degraded(None),
            Err(e) => self.set_degraded(Some(e.to_string())),
        }
        if self.shared.enabled() {
            let hazard = control.sharing_hazard().await.unwrap_or(None);
            let was = self
                .sharing_hazard
                .swap(hazard.is_some(), Ordering::Relaxed);
            match &hazard {
                Some(why) if !was => {
                    tracing::warn!(hazard = %why, "new Redis sessions get an upstream connection of their own instead of a shared one: with this setting Redis may close a connection for what one client did, which on a shared connection would end every session on it")
                }
                None if was => {
                    tracing::info!("new Redis sessions share upstream connections again")
                }
                _ => {}
            }
        }
        *guard = Some((info.clone(), Instant::now()));
        Ok(info)
    }

    /// The config whose protect rules are in force now.
    pub(crate) fn live(&self) -> Arc<RedisConfig> {
        self.live.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many times the config in force changed: a session that saw this version holds
    /// the rules in force.
    pub(crate) fn live_version(&self) -> u64 {
        // Acquire: a version read here was stored after its config (see `set_protect_rules`).
        self.live_version.load(Ordering::Acquire)
    }

    /// The config in force with its version (the version read first: a change in between
    /// only makes the session read it again).
    pub(crate) fn live_versioned(&self) -> (u64, Arc<RedisConfig>) {
        (self.live_version(), self.live())
    }

    /// Puts `new`'s protect rules in force (SIGHUP): open sessions apply them from their next
    /// request on. Everything else in `new` is ignored (it needs a restart). `new` is checked
    /// first; when it is refused, the rules in force stay.
    pub fn set_protect_rules(&self, new: &RedisConfig) -> Result<(), RedisError> {
        let mut next = (*self.live()).clone();
        next.protect = new.protect.clone();
        next.validate()?;
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        *live = Arc::new(next);
        self.live_version.fetch_add(1, Ordering::Release);
        Ok(())
    }

    fn set_degraded(&self, reason: Option<String>) {
        let at_risk = reason.is_some();
        let mut degraded = self.degraded.lock().unwrap_or_else(|p| p.into_inner());
        if *degraded != reason {
            match &reason {
                Some(r) => {
                    tracing::error!(reason = %r, "redis gateway degraded: protected writes are refused")
                }
                None => tracing::info!("redis gateway healthy again"),
            }
        }
        *degraded = reason;
        self.at_risk.store(at_risk, Ordering::Relaxed);
    }

    /// What runs the fence check upstream (`module`, `function`, `script`), once the gateway
    /// learned it (at start, or at the first client when the upstream was down then): the
    /// sessions' mode, so `/healthz` never names one they do not use.
    pub fn fence_check(&self) -> Option<&'static str> {
        *self.fence_check.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_fence_check(&self, mode: &ScriptMode) {
        *self.fence_check.lock().unwrap_or_else(|p| p.into_inner()) = Some(mode.name());
    }

    /// `Ok` when the gateway can serve protected writes; otherwise why not (for a health
    /// endpoint: fence keys at risk of eviction or loss, upstream unreachable).
    pub fn health(&self) -> Result<(), String> {
        match &*self.degraded.lock().unwrap_or_else(|p| p.into_inner()) {
            None => Ok(()),
            Some(reason) => Err(reason.clone()),
        }
    }

    /// Bytes of partial requests all sessions buffer now (bounded by `max_buffered_bytes`).
    pub fn buffered_bytes(&self) -> usize {
        self.buffered.load(Ordering::Relaxed)
    }

    /// Sessions in the tarpit now: they caused a refusal over the gateway's refusal budget
    /// since their last accepted write, so each further refusal makes them wait.
    pub fn tarpitted_connections(&self) -> usize {
        self.tarpitted.load(Ordering::Relaxed)
    }

    /// How many times a session waited in the tarpit since the gateway started.
    pub fn tarpit_waits(&self) -> u64 {
        self.tarpit_waits.load(Ordering::Relaxed)
    }

    /// Charges one refusal of a client without a valid token to the shared budget.
    pub(crate) fn charge_refusal(&self) -> Charge {
        let now = Instant::now();
        self.refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(now)
    }

    /// Whether sessions must refuse fenced writes now.
    pub(crate) fn fences_at_risk(&self) -> bool {
        self.at_risk.load(Ordering::Relaxed)
    }

    /// Loads the fence script again (after `FUNCTION FLUSH`, `SCRIPT FLUSH` or an upstream
    /// restart).
    pub async fn reload_fence(&self) -> Result<ScriptMode, RedisError> {
        let mut control = ControlConnection::open(&self.upstream, &self.config).await?;
        let mode = control.load_fence(&self.config).await?;
        tracing::warn!(mode = ?mode, "the fence script was missing upstream; reloaded it");
        Ok(mode)
    }

    /// The next shared upstream connection in turn (see [`SharedPool::get`]).
    pub(crate) async fn shared_connection(&self) -> Result<Arc<SharedConnection>, RedisError> {
        self.shared.get(&self.upstream, &self.config).await
    }

    /// Whether a new session starts on a shared upstream connection.
    pub(crate) fn shares(&self) -> bool {
        self.shared.enabled() && !self.sharing_hazard.load(Ordering::Relaxed)
    }

    pub(crate) fn next_connection_id(&self) -> u64 {
        self.connections.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Accepts clients on `listener` until the task is dropped; one session per client.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> Result<(), RedisError> {
        self.serve_until(listener, CancellationToken::new()).await
    }

    /// Accepts clients on `listener` until `shutdown` is cancelled, then closes the listener
    /// (new clients are refused) and returns. Sessions see the same token: each finishes its
    /// open transaction and the replies in flight, then closes; [`Gateway::sessions`] says
    /// when they are all gone.
    pub async fn serve_until(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> Result<(), RedisError> {
        if let Err(e) = self.info().await {
            tracing::warn!(error = %e, "upstream not ready; will retry when a client connects");
        }
        // Long-lived connections never call info(): keep checking the upstream for them.
        let weak = Arc::downgrade(&self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(RECHECK).await;
                let Some(gateway) = weak.upgrade() else {
                    return;
                };
                let _ = gateway.info().await;
            }
        });
        let mut backoff = Duration::from_millis(10);
        let too_many: Arc<[u8]> = Arc::from(TOO_MANY_CLIENTS);
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = shutdown.cancelled() => break,
            };
            let (socket, peer) = match accepted {
                Ok(pair) => pair,
                Err(e) if ConnectionCap::client_gave_up(&e) => continue,
                Err(e) => {
                    // EMFILE, ENFILE, ENOBUFS: transient.
                    // Ending here would stop the gateway for good while its process lives.
                    tracing::error!(error = %e, retry_in = ?backoff, "accepting a Redis client failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            backoff = Duration::from_millis(10);
            match self.cap.admit(self.sessions.len()) {
                Admission::Admitted => {}
                Admission::Reopened { refused } => {
                    tracing::info!(refused, "the redis gateway admits clients again");
                }
                Admission::Refused { first } => {
                    if first {
                        tracing::warn!(
                            max_client_connections = self.cap.max(),
                            "the redis gateway holds max_client_connections; new clients are refused until one leaves"
                        );
                    }
                    self.sink.connection_refused(Store::Redis);
                    // A TLS client gets nothing written in clear (a record error is all it
                    // would read), as from redis-server over its maxclients: it is closed.
                    if self.tls.is_none() {
                        let answer = too_many.clone();
                        self.cap.refuse_on(&self.threads, socket, |socket| {
                            ConnectionCap::answer_and_close(socket, answer)
                        });
                    }
                    continue;
                }
            }
            if let Err(e) = ConnectionCap::keep_alive(&socket) {
                tracing::debug!(error = %e, %peer, "TCP keepalive not set on a Redis client");
            }
            // The session runs on a session thread (see `fencegate_core::SessionThreads`): the
            // socket leaves this runtime's reactor and joins that thread's.
            let socket = match socket.into_std() {
                Ok(socket) => socket,
                Err(e) => {
                    tracing::warn!(error = %e, %peer, "handing a Redis client to a session thread failed");
                    continue;
                }
            };
            let gateway = self.clone();
            let shutdown = shutdown.clone();
            self.threads.spawn(&self.sessions, async move {
                match TcpStream::from_std(socket) {
                    Ok(socket) => session::run(gateway, socket, peer, shutdown).await,
                    Err(e) => tracing::warn!(error = %e, %peer, "registering a Redis client with its session thread failed"),
                }
            });
        }
        drop(listener);
        self.sessions.close();
        tracing::info!(sessions = self.sessions.len(), "redis gateway stopped accepting; sessions finish their transactions and replies in flight");
        Ok(())
    }

    /// The certificate the TLS listener presents, when `tls_cert` is set: SIGHUP reloads it.
    pub fn server_cert(&self) -> Option<Arc<ServerCert>> {
        self.server_cert.clone()
    }

    /// The sessions running now: `len()` counts them, `wait()` (after the listener stopped)
    /// returns when the last one ended.
    pub fn sessions(&self) -> TaskTracker {
        self.sessions.clone()
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
        tracing::info!(listen = %bound, upstream = %self.config.upstream, tls = self.tls.is_some(), "redis gateway listening");
        Ok(listener)
    }
}
