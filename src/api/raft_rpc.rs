//! The receiving side of the Raft RPCs in `authority::network`.

use axum::extract::State;
use axum::Json;
use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};

use super::ApiState;
use crate::authority::hand_over::HandOver;
use crate::authority::membership::CommittedMembership;
use crate::authority::type_config::{NodeId, TypeConfig};

pub async fn append(
    State(state): State<ApiState>,
    Json(req): Json<AppendEntriesRequest<TypeConfig>>,
) -> Json<Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>> {
    state.authority.heard_from_leader();
    Json(state.authority.raft().append_entries(req).await)
}

pub async fn vote(
    State(state): State<ApiState>,
    Json(req): Json<VoteRequest<NodeId>>,
) -> Json<Result<VoteResponse<NodeId>, RaftError<NodeId>>> {
    state.authority.vote_requested(req.vote.leader_id.term);
    Json(state.authority.raft().vote(req).await)
}

pub async fn snapshot(
    State(state): State<ApiState>,
    Json(req): Json<InstallSnapshotRequest<TypeConfig>>,
) -> Json<Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>> {
    Json(state.authority.receive_snapshot_chunk(req).await)
}

/// This node's committed membership, for a peer that stopped hearing from the leader and asks
/// whether it was removed.
pub async fn membership(State(state): State<ApiState>) -> Json<CommittedMembership> {
    Json(state.authority.committed_membership().await)
}

/// A draining leader names this node its successor; `true` when it will campaign.
pub async fn hand_over(State(state): State<ApiState>, Json(from): Json<HandOver>) -> Json<bool> {
    Json(state.authority.campaign_after_hand_over(from))
}
