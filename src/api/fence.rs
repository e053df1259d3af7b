//! `POST /v1/fences/reset` (admin): an operator's compare-and-set of one resource's fence in one
//! store (see [`crate::fence_reset`]). Runs on the node that receives it, against that node's
//! gateway upstreams; not forwarded to the leader.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use fencegate_core::FenceReset;
use serde_json::json;

use super::auth::Caller;
use super::reply::{ok, parse_body, ApiError};
use super::ApiState;
use crate::fence_reset::{ResetError, ResetRequest};

pub async fn reset(
    State(state): State<ApiState>,
    caller: Option<Extension<Caller>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: ResetRequest = parse_body(&body)?;
    let caller = caller.map_or_else(|| "anonymous".to_owned(), |Extension(c)| c.0);
    match state
        .fences
        .reset(&state.authority, &request, &caller)
        .await
    {
        Ok(FenceReset::Done { from, to }) => Ok(ok(json!({ "reset": true, "from": from, "to": to }))),
        Ok(FenceReset::Mismatch { actual }) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "fence_mismatch",
            format!(
                "the store holds fence {actual}, not {}; nothing changed. Check the value and send --current {actual} to reset it",
                request.current
            ),
        )),
        Err(e @ ResetError::BadRequest(_)) => Err(ApiError::bad_request(e.to_string())),
        Err(e @ ResetError::NoGateway(_)) => {
            Err(ApiError::new(StatusCode::NOT_FOUND, "no_gateway", e.to_string()))
        }
        Err(e @ ResetError::Store { .. }) => {
            Err(ApiError::new(StatusCode::BAD_GATEWAY, "store_failed", e.to_string()))
        }
    }
}
