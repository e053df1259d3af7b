//! `fencegate serve`: assembles a node from its config and runs it until SIGINT or SIGTERM, or
//! until it is removed from the cluster.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fencegate_core::{IssuedRevision, KeyRing, SharedKeyRing, TokenKey};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::auth::{CredentialError, Credentials};
use crate::api::health::GatewayHealth;
use crate::api::{self, ApiState};
use crate::authority::network::Network;
use crate::authority::{Authority, AuthorityError};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::tls::{NodeTls, TlsError};

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source} (is another node or program using it?)")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("token signing key: environment variable {0} is not set; set it to a secret of 32 or more bytes, or remove authority.token_key_env (the cluster then makes its own key)")]
    KeyMissing(String),
    #[error("token signing key in {0} is shorter than 32 bytes; use a longer secret")]
    KeyShort(String),
    #[error("token signing key file {path}: {source}")]
    KeyFile {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Authority(#[from] AuthorityError),
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Credentials(#[from] CredentialError),
    #[error(transparent)]
    Disk(#[from] crate::disk::DiskError),
    #[error("audit log: {0}")]
    Audit(#[from] crate::audit::AuditError),
    #[error(transparent)]
    Redis(#[from] fencegate_redis::RedisError),
    #[error(transparent)]
    Postgres(#[from] fencegate_postgres::PostgresError),
    #[error(transparent)]
    S3(#[from] fencegate_s3::S3Error),
    #[error("cannot set up the client for Raft RPCs to peers (node.peer_source?): {0}")]
    PeerClient(reqwest::Error),
}

/// The id of an operator-supplied key. Replicated keys start at 1, so the two never collide.
pub const OPERATOR_KEY_ID: u32 = 0;

/// Reads the operator-supplied token signing key (`authority.token_key_env` or
/// `token_key_file`), if any.
pub fn operator_key(config: &Config) -> Result<Option<TokenKey>, ServeError> {
    let a = &config.authority;
    let (secret, origin) = match (&a.token_key_env, &a.token_key_file) {
        (Some(var), _) => (
            std::env::var(var).map_err(|_| ServeError::KeyMissing(var.clone()))?,
            var.clone(),
        ),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|source| ServeError::KeyFile {
                path: path.display().to_string(),
                source,
            })?;
            (
                text.trim_end_matches(['\n', '\r']).to_owned(),
                path.display().to_string(),
            )
        }
        (None, None) => return Ok(None),
    };
    TokenKey::new(OPERATOR_KEY_ID, secret.as_bytes())
        .map(Some)
        .ok_or(ServeError::KeyShort(origin))
}

/// What a node needs from outside its config file, read and checked: `check-config` and
/// `serve` build it the same way.
pub struct Secrets {
    pub operator_key: Option<TokenKey>,
    pub tls: Option<NodeTls>,
    pub credentials: Option<Arc<Credentials>>,
}

impl Secrets {
    pub fn load(config: &Config) -> Result<Self, ServeError> {
        Ok(Self {
            operator_key: operator_key(config)?,
            tls: NodeTls::load(&config.security)?,
            credentials: Credentials::load(&config.security)?.map(Arc::new),
        })
    }
}

/// How long in-flight API requests may finish after SIGINT or SIGTERM (at most
/// `shutdown_grace_ms`, which bounds the gateways' drain).
const API_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
/// The same for a leader: while it drains, nobody can reach the cluster's leader, so it cuts
/// in-flight requests short (their clients retry elsewhere) and lets a successor be elected.
const LEADER_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The address a listener is bound to (the configured one if the OS cannot say).
fn local_addr(listener: &TcpListener, configured: std::net::SocketAddr) -> std::net::SocketAddr {
    listener.local_addr().unwrap_or(configured)
}

async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: addr.to_string(),
            source,
        })
}

pub async fn serve(
    config: Config,
    path: std::path::PathBuf,
    set_log_level: crate::reload::SetLogLevel,
) -> Result<(), ServeError> {
    let secrets = Secrets::load(&config)?;
    crate::open_file_limit::raise_to(crate::open_file_limit::needed(&config));
    if config.security.insecure {
        tracing::warn!("[security] insecure = true: the API and Raft are plain HTTP and need no credentials unless some are configured; use only for local development");
        if config.node.peer.is_none() {
            // Without a peer port the Raft routes share the API port with no credentials: one
            // reachable request can vote, append or hand over leadership.
            tracing::warn!("[node] peer is not set: the Raft routes (/raft/append, /raft/vote, /raft/hand-over) are served on the API port to anyone who can reach it, with no authentication; bind api to 127.0.0.1 or set [node] peer with TLS before any other host can connect");
        }
    }
    if config.authority.accept_unsigned {
        tracing::warn!("[authority] accept_unsigned = true: the gateways accept unsigned tokens, which any client can type; use only for local development");
    }
    let keys = SharedKeyRing::default();
    if let Some(key) = &secrets.operator_key {
        let mut ring = KeyRing::default();
        ring.pin(key.clone());
        keys.replace(ring);
    }
    let policy = fencegate_core::TokenPolicy {
        keys: keys.clone(),
        accept_unsigned: config.authority.accept_unsigned,
        accept_plain: false,
        issued: IssuedRevision::default(),
    };
    crate::disk::check(&config)?;
    let metrics = Arc::new(Metrics::default());
    let audit = crate::audit::AuditWriter::start(
        &config.audit,
        &config.node.data_dir,
        &config.node.id.to_string(),
        metrics.fences.clone(),
        config.node.min_free_bytes,
    )?;
    let (peer_http, api_http) = match &secrets.tls {
        Some(tls) => (tls.peer_client(config.node.peer_source)?, tls.api_client()?),
        None => (
            reqwest::Client::builder()
                .local_address(config.node.peer_source)
                .build()
                .map_err(ServeError::PeerClient)?,
            reqwest::Client::new(),
        ),
    };
    let api_listener = bind(config.node.api).await?;
    let peer_listener = match config.node.peer {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    let authority = Authority::start(
        &config,
        keys,
        policy.issued.clone(),
        secrets.operator_key.clone(),
        metrics.clone(),
        Network::new(peer_http, secrets.tls.is_some()),
    )
    .await?;
    tokio::spawn(crate::raft_watch::run(
        authority.raft().clone(),
        metrics.clone(),
    ));
    // The gateways start once the authority has opened its state, so the key ring already
    // holds the keys from its last snapshot (and the operator's key) when the first client
    // presents a token.
    let mut gateways = Vec::new();
    // Cancelled on SIGTERM: the gateway listeners close and their sessions drain.
    let drain = CancellationToken::new();
    let mut listeners = tokio::task::JoinSet::new();
    let mut sessions = Vec::new();
    let mut redis_gateway = None;
    // Every TLS listener's certificate, for SIGHUP to reload.
    let mut certs = Vec::new();
    if let Some(tls) = &secrets.tls {
        certs.push(("api and peer", tls.server_cert()));
    }
    if let Some(redis) = config.redis.clone() {
        let gateway = fencegate_redis::Gateway::new(redis.clone(), policy.clone(), audit.sink())?;
        let observed = gateway.clone();
        metrics
            .redis_tarpitted
            .set_source(move || observed.tarpitted_connections() as i64);
        let checked = gateway.clone();
        let described = gateway.clone();
        let listener = gateway.bind().await?;
        // Set while the accept loop runs (`/healthz`, `/readyz`).
        let running = Arc::new(AtomicBool::new(true));
        gateways.push(
            GatewayHealth::new(fencegate_core::Store::Redis, move || checked.health())
                .listener(local_addr(&listener, redis.listen), running.clone())
                .upstream(&redis.upstream, 6379, &metrics.fences.gateway)
                .details(move || {
                    described
                        .fence_check()
                        .map(|check| vec![("fence_check", check.to_owned())])
                        .unwrap_or_default()
                }),
        );
        sessions.push(("redis", gateway.sessions()));
        redis_gateway = Some(gateway.clone());
        certs.extend(gateway.server_cert().map(|c| ("redis", c)));
        listeners.spawn(log_end(
            "Redis",
            gateway.serve_until(listener, drain.clone()),
            running,
        ));
    }
    if let Some(postgres) = config.postgres.clone() {
        let gateway =
            fencegate_postgres::Gateway::new(postgres.clone(), policy.clone(), audit.sink())?;
        gateway.install_if_configured().await?;
        gateway.start_key_sync()?;
        let listener = gateway.bind().await?;
        // Set while the accept loop runs (`/healthz`, `/readyz`).
        let running = Arc::new(AtomicBool::new(true));
        gateways.push(
            GatewayHealth::new(fencegate_core::Store::Postgres, || Ok(()))
                .listener(local_addr(&listener, postgres.listen), running.clone())
                .upstream(&postgres.upstream, 5432, &metrics.fences.gateway),
        );
        sessions.push(("postgres", gateway.sessions()));
        certs.extend(gateway.server_cert().map(|c| ("postgres", c)));
        listeners.spawn(log_end(
            "PostgreSQL",
            gateway.serve_until(listener, drain.clone()),
            running,
        ));
    }
    // The S3 gateway is a pingora server with its own runtime, on its own thread (see
    // filters/s3/src/proxy.rs); this runtime only starts and stops it.
    let s3 = match config.s3.clone() {
        Some(s3) => {
            let handle = fencegate_s3::S3Gateway::new(s3.clone(), policy.clone(), audit.sink())?
                .with_grace(config.node.shutdown_grace())
                .start()?;
            certs.extend(handle.server_cert().map(|c| ("s3", c)));
            gateways.push(
                GatewayHealth::new(fencegate_core::Store::S3, || Ok(()))
                    .listener(s3.listen, handle.running())
                    .upstream(&s3.upstream, 80, &metrics.fences.gateway),
            );
            Some(handle)
        }
        None => None,
    };
    let state = ApiState {
        authority: authority.clone(),
        limits: Arc::new(config.authority.clone()),
        metrics,
        http: api_http,
        scheme: if secrets.tls.is_some() {
            "https"
        } else {
            "http"
        },
        fences: Arc::new(crate::fence_reset::FenceResets {
            redis: config.redis.clone(),
            s3: config.s3.clone(),
            audit: audit.sink(),
        }),
        gateways: Arc::new(gateways),
    };
    let credentials = Arc::new(crate::api::auth::LiveCredentials::new(
        secrets.credentials.clone(),
    ));
    let mut app = api::router(state.clone(), credentials.clone());
    let peer_app = api::peer_router(state);
    if peer_listener.is_none() {
        app = app.merge(peer_app.clone());
    }
    tracing::info!(
        node_id = config.node.id,
        api = %config.node.api,
        peer = ?config.node.peer,
        tls = secrets.tls.is_some(),
        credentials = secrets.credentials.as_ref().map_or(0, |c| c.len()),
        data_dir = %config.node.data_dir.display(),
        raft_dir = %config.node.raft_dir().display(),
        "node started"
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    // The peer port stops only after Raft has: a draining node keeps answering its peers.
    let (peer_stop_tx, peer_stop_rx) = watch::channel(false);
    let mut servers = tokio::task::JoinSet::new();
    let mut peer_server = tokio::task::JoinSet::new();
    let max_api = config.node.max_api_connections;
    let (api_tls, peer_tls) = match &secrets.tls {
        Some(tls) => (Some(tls.api_acceptor()?), Some(tls.peer_acceptor()?)),
        None => (None, None),
    };
    servers.spawn(crate::api_listener::serve(
        "api",
        api_listener,
        api_tls,
        None,
        app,
        max_api,
        stop_rx.clone(),
    ));
    if let Some(listener) = peer_listener {
        // With TLS the handshake requires a member's certificate: the members are known, and
        // the port keeps slots for them (without TLS anyone may drive Raft anyway).
        let reserve = peer_tls
            .is_some()
            .then(|| Arc::new(crate::peer_reserve::PeerReserve::new(max_api)));
        if let Some(reserve) = &reserve {
            tokio::spawn(crate::peer_reserve::follow_members(
                authority.raft().clone(),
                reserve.clone(),
            ));
        }
        peer_server.spawn(crate::api_listener::serve(
            "raft peer",
            listener,
            peer_tls,
            reserve,
            peer_app,
            max_api,
            peer_stop_rx,
        ));
    }
    // A node removed from the cluster stops as on SIGTERM, and exits 0: it did what the
    // operator asked.
    let mut removed = authority.removed();
    let reloader = crate::reload::Reloader::new(
        path,
        set_log_level,
        crate::reload::Live {
            credentials,
            redis: redis_gateway,
            s3: s3.as_ref().map(|s3| s3.clients()),
            certs,
            node_tls: secrets.tls.clone(),
        },
    );
    tokio::select! {
        _ = signals(&reloader) => {}
        _ = removed.wait_for(|removed| *removed) => {}
    }
    let started = tokio::time::Instant::now();
    let deadline = started + config.node.shutdown_grace();
    // A node on its way out must not campaign (it could win and then vanish: an election for
    // nothing). A leader leads for as short a time as it can, then names a successor that
    // campaigns as soon as the leader lease allows (see `authority::hand_over`).
    let leading = authority.drain();
    // A removed node cannot complete what is in flight either (it has no leader to reach).
    let api_grace = if leading || *removed.borrow() {
        LEADER_GRACE
    } else {
        API_GRACE
    }
    .min(config.node.shutdown_grace());
    // Every listener stops accepting now; what is in flight finishes.
    let _ = stop_tx.send(true);
    drain.cancel();
    let s3_begun = s3.as_ref().map(|s3| {
        s3.stop_accepting();
        sessions.push(("s3", s3.requests()));
        s3.requests_begun()
    });
    while listeners.join_next().await.is_some() {}
    let in_flight: usize = sessions.iter().map(|(_, t)| t.len()).sum();
    tracing::info!(
        grace_ms = config.node.shutdown_grace_ms,
        ?api_grace,
        leading,
        sessions = in_flight,
        "draining: listeners closed; sessions finish their transaction, pipeline or request"
    );
    // Waiting acquires can run for minutes; they are cut off after the API's grace (their
    // clients retry elsewhere, with the same request id). The gateways do not need Raft, so
    // Raft stops then, and the peers elect a successor while the gateways still drain.
    let api_drained = tokio::time::timeout(api_grace, async {
        while servers.join_next().await.is_some() {}
    })
    .await;
    if api_drained.is_err() {
        tracing::warn!("API requests still in flight after their grace period; closing them");
    }
    // Chosen while still leading (the replication metrics say who is furthest along), told
    // only once Raft has stopped here: no heartbeat or answer of this node's can follow.
    let successor = leading.then(|| authority.successor()).flatten();
    let term = authority.raft().metrics().borrow().current_term;
    let _ = authority.raft().shutdown().await;
    if let Some(successor) = &successor {
        authority.hand_over(successor, term).await;
    }
    let _ = peer_stop_tx.send(true);
    let _ = tokio::time::timeout(API_GRACE, async {
        while peer_server.join_next().await.is_some() {}
    })
    .await;
    let _ = tokio::time::timeout_at(deadline, async {
        for (_, tracker) in &sessions {
            tracker.wait().await;
        }
    })
    .await;
    let cut: usize = sessions.iter().map(|(_, t)| t.len()).sum();
    let by_store: Vec<String> = sessions
        .iter()
        .map(|(store, t)| format!("{store}={}", t.len()))
        .collect();
    // S3 requests on connections accepted before the listener closed, begun after.
    let late = match (&s3, s3_begun) {
        (Some(s3), Some(begun)) => (s3.requests_begun() - begun) as usize,
        _ => 0,
    };
    let summary = DrainSummary::of(in_flight + late, cut);
    if cut == 0 {
        tracing::info!(drained = summary.drained, cut = 0, elapsed = ?started.elapsed(), "drained every gateway session");
    } else {
        tracing::warn!(drained = summary.drained, cut = summary.cut, still_open = %by_store.join(","), elapsed = ?started.elapsed(), "gateway sessions still open after shutdown_grace_ms; cutting them");
    }
    if let Some(s3) = s3 {
        s3.detach();
    }
    Ok(())
}

/// How a drain ended: sessions that finished on their own, and those cut at the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DrainSummary {
    drained: usize,
    cut: usize,
}

impl DrainSummary {
    /// From the sessions open when the listeners closed and those still open at the deadline.
    fn of(open_at_start: usize, open_at_deadline: usize) -> Self {
        Self {
            drained: open_at_start.saturating_sub(open_at_deadline),
            cut: open_at_deadline,
        }
    }
}

/// Runs a gateway's accept loop (it ends only when the node drains) and logs a failure.
async fn log_end<E: std::fmt::Display>(
    store: &'static str,
    serving: impl std::future::Future<Output = Result<(), E>>,
    running: Arc<AtomicBool>,
) {
    if let Err(e) = serving.await {
        tracing::error!(error = %e, "the {store} gateway stopped");
    }
    running.store(false, Ordering::Relaxed);
}

/// Waits for SIGINT or SIGTERM; on SIGHUP reloads the config (its default action, exit 129,
/// would kill the node).
async fn signals(reloader: &crate::reload::Reloader) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut hup = signal(SignalKind::hangup()).expect("installing a SIGHUP handler");
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return,
            _ = term.recv() => return,
            _ = hup.recv() => reloader.reload(),
        }
    }
}
