//! `fencegate serve`: assembles a node from its config and runs it until SIGINT or SIGTERM.

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

pub async fn serve(config: Config) -> Result<(), ServeError> {
    let key = token_key(&config)?;
    let metrics = Arc::new(Metrics::default());
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
    axum::serve(listener, api::router(state))
        .with_graceful_shutdown(shutdown_signal())
        .await
        .map_err(ServeError::Http)?;
    tracing::info!("shutting down");
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
