//! `GET /v1/locks`: every held lock (client role).

use std::time::Duration;

use axum::extract::State;
use axum::response::Response;
use serde_json::json;

use super::forward::{answer, Original};
use super::reply::{ok, ApiError};
use super::ApiState;

const FORWARD_SLACK: Duration = Duration::from_secs(10);

pub async fn list(State(state): State<ApiState>, original: Original) -> Result<Response, ApiError> {
    let result = state.authority.locks().await;
    Ok(answer(&state, original, FORWARD_SLACK, result, |locks| {
        ok(json!({ "locks": locks }))
    })
    .await)
}
