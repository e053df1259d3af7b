//! The node's HTTP API: the lock service for clients, Raft RPCs for peers, health and metrics
//! for operators. One port serves all of it.

pub mod auth;
mod fence;
mod forward;
pub mod health;
mod keys;
mod lock;
mod lock_list;
mod members;
mod ops;
mod raft_rpc;
mod reply;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post};
use axum::Router;

use crate::authority::network::{
    APPEND_PATH, HAND_OVER_PATH, MEMBERSHIP_PATH, SNAPSHOT_PATH, VOTE_PATH,
};
use crate::authority::Authority;
use crate::config::AuthorityConfig;
use crate::metrics::Metrics;
use auth::{Gate, Role};

/// Marks a request a follower already forwarded, so it is never forwarded twice.
pub const FORWARDED_HEADER: &str = "fencegate-forwarded";

#[derive(Clone)]
pub struct ApiState {
    pub authority: Arc<Authority>,
    pub limits: Arc<AuthorityConfig>,
    pub metrics: Arc<Metrics>,
    /// For forwarding to the leader's API (trusts the cluster CA when TLS is on).
    pub http: reqwest::Client,
    /// `https` when the APIs serve TLS.
    pub scheme: &'static str,
    /// Operators' fence resets against this node's gateway upstreams.
    pub fences: Arc<crate::fence_reset::FenceResets>,
    /// The gateways this node runs, for `/healthz`.
    pub gateways: Arc<Vec<health::GatewayHealth>>,
}

/// Raft RPCs carry batches of entries and snapshot chunks, and a restore carries a whole
/// state: all can be far above axum's 2 MiB default body limit.
const LARGE_BODY: usize = 256 * 1024 * 1024;

/// The client API: lock calls for the `client` role, operations for `admin`, health and
/// metrics open. `credentials` hold `None` only in insecure mode without any configured.
pub fn router(state: ApiState, credentials: Arc<auth::LiveCredentials>) -> Router {
    let gate = |needs| Gate {
        credentials: credentials.clone(),
        needs,
    };
    let client = Router::new()
        .route("/v1/locks", get(lock_list::list))
        .route(
            "/v1/locks/{*resource}",
            post(lock::acquire).get(lock::status),
        )
        .route("/v1/leases/{lease_id}/keepalive", post(lock::keepalive))
        .route("/v1/leases/{lease_id}", delete(lock::release))
        .route("/v1/cluster", get(ops::cluster))
        .route("/v1/token-keys", get(keys::list))
        .route_layer(axum::middleware::from_fn_with_state(
            gate(Role::Client),
            auth::require,
        ));
    let admin = Router::new()
        .route("/v1/snapshot", get(ops::snapshot))
        .route("/v1/snapshot/restore", post(ops::restore))
        .route("/v1/revision/bump", post(ops::bump))
        .route("/v1/token-keys", post(keys::rotate))
        .route("/v1/token-keys/{kid}/retire", post(keys::retire))
        .route("/v1/cluster/nodes", post(members::add))
        .route("/v1/cluster/nodes/{id}", delete(members::remove))
        .route("/v1/fences/reset", post(fence::reset))
        .route_layer(axum::middleware::from_fn_with_state(
            gate(Role::Admin),
            auth::require,
        ))
        .layer(DefaultBodyLimit::max(LARGE_BODY));
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(ops::metrics))
        .merge(client)
        .merge(admin)
        .with_state(state)
}

/// The Raft RPCs, for the peer port (or merged into the API in insecure mode without one).
pub fn peer_router(state: ApiState) -> Router {
    Router::new()
        .route(APPEND_PATH, post(raft_rpc::append))
        .route(VOTE_PATH, post(raft_rpc::vote))
        .route(SNAPSHOT_PATH, post(raft_rpc::snapshot))
        .route(MEMBERSHIP_PATH, get(raft_rpc::membership))
        .route(HAND_OVER_PATH, post(raft_rpc::hand_over))
        .layer(DefaultBodyLimit::max(LARGE_BODY))
        .with_state(state)
}
