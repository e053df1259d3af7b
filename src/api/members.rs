//! Membership changes (admin): add a node, remove a node. Both run on the leader; a follower
//! forwards them.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::response::Response;
use serde::Deserialize;
use serde_json::json;

use super::forward::{answer, Original};
use super::reply::{ok, parse_body, ApiError};
use super::ApiState;
use crate::authority::Node;

/// Adding waits for the new node to catch up (up to a minute, see `authority::membership`).
const ADD_TIMEOUT: Duration = Duration::from_secs(90);
const REMOVE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddNodeBody {
    id: u64,
    /// `host:port` of the new node's API.
    api: String,
    /// `host:port` of its peer (Raft) port; with TLS the host must be in its certificate.
    peer: String,
}

/// Checks a `host:port` address from the body.
fn address(field: &str, value: &str) -> Result<(), ApiError> {
    let ok = value
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "{field} {value:?}: expected host:port"
        )))
    }
}

/// `POST /v1/cluster/nodes {"id", "api", "peer"}`: adds the node as a learner, waits until it
/// has caught up, then makes it a voter. Answers the new membership.
pub async fn add(State(state): State<ApiState>, original: Original) -> Result<Response, ApiError> {
    let body: AddNodeBody = parse_body(&original.body)?;
    if body.id == 0 {
        return Err(ApiError::bad_request("node ids start at 1"));
    }
    address("api", &body.api)?;
    address("peer", &body.peer)?;
    let result = state
        .authority
        .add_node(
            body.id,
            Node {
                peer: body.peer,
                api: body.api,
            },
        )
        .await;
    Ok(answer(&state, original, ADD_TIMEOUT, result, |members| {
        ok(json!({ "members": members }))
    })
    .await)
}

/// `DELETE /v1/cluster/nodes/{id}`: removes the node; it notices and stops by itself.
pub async fn remove(
    State(state): State<ApiState>,
    Path(id): Path<u64>,
    original: Original,
) -> Response {
    let result = state.authority.remove_node(id).await;
    answer(&state, original, REMOVE_TIMEOUT, result, |members| {
        ok(json!({ "members": members }))
    })
    .await
}
