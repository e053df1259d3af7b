//! `fencegate serve`: assembles a node from its config and runs it until SIGINT or SIGTERM.

use std::future::IntoFuture;
use std::sync::Arc;

use fencegate_core::TokenKey;
use thiserror::Error;
use tokio::net::TcpListener;

use crate::api::{self, ApiState};
use crate::authority::{Authority, AuthorityError};
use crate::config::Config;
use crate::metrics::Metrics;

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source} (is another node or program using it?)")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("token signing key: environment variable {0} is not set; set it to a secret of 32 or more bytes, or remove authority.token_key_env")]
    KeyMissing(String),
    #[error("token signing key in {0} is shorter than 32 bytes; use a longer secret")]
    KeyShort(String),
    #[error(transparent)]
    Authority(#[from] AuthorityError),
    #[error("the API server failed: {0}")]
    Http(std::io::Error),
    #[error("audit log: {0}")]
    Audit(#[from] crate::audit::AuditError),
    #[error(transparent)]
    Redis(#[from] fencegate_redis::RedisError),
    #[error(transparent)]
    Postgres(#[from] fencegate_postgres::PostgresError),
    #[error(transparent)]
    S3(#[from] fencegate_s3::S3Error),
}

/// Reads the token signing key named by `authority.token_key_env`, if any.
pub fn token_key(config: &Config) -> Result<Option<TokenKey>, ServeError> {
    let Some(var) = &config.authority.token_key_env else {
        return Ok(None);
    };
    let secret = std::env::var(var).map_err(|_| ServeError::KeyMissing(var.clone()))?;
    TokenKey::new(secret.as_bytes())
        .map(Some)
        .ok_or_else(|| ServeError::KeyShort(var.clone()))
}

/// How long in-flight requests may finish after SIGINT or SIGTERM.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

pub async fn serve(config: Config) -> Result<(), ServeError> {
    let key = token_key(&config)?;
    let metrics = Arc::new(Metrics::default());
    let audit = crate::audit::AuditWriter::start(
        &config.audit,
        &config.node.data_dir,
        &config.node.id.to_string(),
        metrics.fences.clone(),
    )?;
    if let Some(redis) = config.redis.clone() {
        let policy = fencegate_core::TokenPolicy {
            key: key.clone(),
            accept_plain: false,
        };
        let gateway = fencegate_redis::Gateway::new(redis, policy, audit.sink())?;
        let listener = gateway.bind().await?;
        tokio::spawn(async move {
            if let Err(e) = gateway.serve(listener).await {
                tracing::error!(error = %e, "the Redis gateway stopped");
            }
        });
    }
    if let Some(postgres) = config.postgres.clone() {
        let policy = fencegate_core::TokenPolicy {
            key: key.clone(),
            accept_plain: false,
        };
        let gateway = fencegate_postgres::Gateway::new(postgres, policy, audit.sink())?;
        gateway.install_if_configured().await?;
        let listener = gateway.bind().await?;
        tokio::spawn(async move {
            if let Err(e) = gateway.serve(listener).await {
                tracing::error!(error = %e, "the PostgreSQL gateway stopped");
            }
        });
    }
    // The S3 gateway is a pingora server with its own runtime, on its own thread (see
    // filters/s3/src/proxy.rs); this runtime only starts and stops it.
    let s3 = match config.s3.clone() {
        Some(s3) => {
            let policy = fencegate_core::TokenPolicy {
                key: key.clone(),
                accept_plain: false,
            };
            Some(fencegate_s3::S3Gateway::new(s3, policy, audit.sink())?.start()?)
        }
        None => None,
    };
    let http = reqwest::Client::builder()
        .build()
        .expect("a plain HTTP client always builds");
    let addr = config.node.api;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: addr.to_string(),
            source,
        })?;
    let authority = Authority::start(&config, key, metrics.clone(), http.clone()).await?;
    let state = ApiState {
        authority: authority.clone(),
        limits: Arc::new(config.authority.clone()),
        metrics,
        http,
    };
    tracing::info!(node_id = config.node.id, api = %addr, data_dir = %config.node.data_dir.display(), "node started");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, api::router(state)).with_graceful_shutdown(async {
        let _ = stop_rx.await;
    });
    let mut server = std::pin::pin!(server.into_future());
    tokio::select! {
        result = &mut server => result.map_err(ServeError::Http)?,
        () = shutdown_signal() => {
            tracing::info!(grace = ?SHUTDOWN_GRACE, "shutting down; finishing requests in flight");
            let _ = stop_tx.send(());
            // Waiting acquires can run for minutes; they are cut off after the grace period
            // (their clients retry elsewhere).
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut server).await.is_err() {
                tracing::warn!("requests still in flight after the grace period; closing them");
            }
        }
    }
    if let Some(s3) = s3 {
        let _ = tokio::task::spawn_blocking(move || s3.shutdown()).await;
    }
    let _ = authority.raft().shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
