//! The node's HTTP API: the lock service for clients, Raft RPCs for peers, health and metrics
//! for operators. One port serves all of it.

mod forward;
mod lock;
mod ops;
mod raft_rpc;
mod reply;

use std::sync::Arc;

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

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route(
            "/v1/locks/{*resource}",
            post(lock::acquire).get(lock::status),
        )
        .route("/v1/leases/{lease_id}/keepalive", post(lock::keepalive))
        .route("/v1/leases/{lease_id}", delete(lock::release))
        .route("/v1/cluster", get(ops::cluster))
        .route("/v1/snapshot", get(ops::snapshot))
        .route("/v1/snapshot/restore", post(ops::restore))
        .route("/healthz", get(ops::healthz))
        .route("/metrics", get(ops::metrics))
        .route(APPEND_PATH, post(raft_rpc::append))
        .route(VOTE_PATH, post(raft_rpc::vote))
        .route(SNAPSHOT_PATH, post(raft_rpc::snapshot))
        .with_state(state)
}
