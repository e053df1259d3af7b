//! The node's HTTP API: the lock service for clients, Raft RPCs for peers, health and metrics
//! for operators. One port serves all of it.

mod forward;
mod lock;
mod ops;
mod raft_rpc;
mod reply;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post};
use axum::Router;

use crate::authority::network::{APPEND_PATH, SNAPSHOT_PATH, VOTE_PATH};
use crate::authority::Authority;
use crate::config::AuthorityConfig;
use crate::metrics::Metrics;

/// Marks a request a follower already forwarded, so it is never forwarded twice.
pub const FORWARDED_HEADER: &str = "fencegate-forwarded";

#[derive(Clone)]
pub struct ApiState {
    pub authority: Arc<Authority>,
    pub limits: Arc<AuthorityConfig>,
    pub metrics: Arc<Metrics>,
    pub http: reqwest::Client,
}

/// Raft RPCs carry batches of entries and snapshot chunks, and a restore carries a whole
/// state: all can be far above axum's 2 MiB default body limit.
const LARGE_BODY: usize = 256 * 1024 * 1024;

pub fn router(state: ApiState) -> Router {
    let peer = Router::new()
        .route(APPEND_PATH, post(raft_rpc::append))
        .route(VOTE_PATH, post(raft_rpc::vote))
        .route(SNAPSHOT_PATH, post(raft_rpc::snapshot))
        .route("/v1/snapshot/restore", post(ops::restore))
        .layer(DefaultBodyLimit::max(LARGE_BODY));
    Router::new()
        .route(
            "/v1/locks/{*resource}",
            post(lock::acquire).get(lock::status),
        )
        .route("/v1/leases/{lease_id}/keepalive", post(lock::keepalive))
        .route("/v1/leases/{lease_id}", delete(lock::release))
        .route("/v1/cluster", get(ops::cluster))
        .route("/v1/snapshot", get(ops::snapshot))
        .route("/healthz", get(ops::healthz))
        .route("/metrics", get(ops::metrics))
        .merge(peer)
        .with_state(state)
}
