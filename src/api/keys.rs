//! Token keys: list (ids and states, never secrets), rotate, retire.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::response::Response;
use serde_json::json;

use super::forward::{answer, Original};
use super::reply::{ok, ApiError};
use super::ApiState;

const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// This node's view of the keys (they replicate like any entry).
pub async fn list(State(state): State<ApiState>) -> Response {
    ok(json!({ "keys": state.authority.key_list() }))
}

/// Adds a new key; it signs from now on, older keys still verify until retired.
pub async fn rotate(State(state): State<ApiState>, original: Original) -> Response {
    let result = state.authority.rotate_key().await;
    answer(&state, original, FORWARD_TIMEOUT, result, |kid| {
        ok(json!({ "kid": kid, "signing": true }))
    })
    .await
}

/// Retires a key: tokens it signed are refused by every gateway from now on.
pub async fn retire(
    State(state): State<ApiState>,
    Path(kid): Path<String>,
    original: Original,
) -> Result<Response, ApiError> {
    let kid: u32 = kid
        .parse()
        .map_err(|_| ApiError::bad_request(format!("key id {kid:?} is not a number")))?;
    let result = state.authority.retire_key(kid).await;
    Ok(answer(&state, original, FORWARD_TIMEOUT, result, |()| {
        ok(json!({ "kid": kid, "retired": true }))
    })
    .await)
}
