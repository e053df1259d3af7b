//! The lock service: acquire, keepalive, release, status.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use fencegate_core::Resource;
use serde::Deserialize;
use serde_json::json;

use super::forward::{answer, Original};
use super::reply::{ok, parse_body, ApiError};
use super::ApiState;
use crate::authority::{AcquireOutcome, AcquireRequest, LeaseHandle};

/// How long a forwarded call may take beyond any wait the client asked for.
const FORWARD_SLACK: Duration = Duration::from_secs(10);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AcquireBody {
    ttl_ms: u64,
    #[serde(default)]
    wait_ms: u64,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    holder: Option<String>,
}

const MAX_LABEL: usize = 256;

fn check_label(name: &str, value: &Option<String>) -> Result<(), ApiError> {
    match value {
        Some(v)
            if v.is_empty() || v.len() > MAX_LABEL || !v.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Err(ApiError::bad_request(format!(
                "{name} must be 1 to {MAX_LABEL} printable ASCII characters without spaces"
            )))
        }
        _ => Ok(()),
    }
}

fn resource(name: String) -> Result<Resource, ApiError> {
    Resource::new(name).map_err(|e| ApiError::bad_request(e.to_string()))
}

fn lease_id(text: &str) -> Result<LeaseHandle, ApiError> {
    LeaseHandle::parse(text).ok_or_else(|| {
        ApiError::bad_request(
            "the lease id is not a lease handle (<number>.<32 hex digits>, as acquire returned it)",
        )
    })
}

fn acquire_request(
    state: &ApiState,
    name: String,
    body: &[u8],
) -> Result<AcquireRequest, ApiError> {
    let resource = resource(name)?;
    let req: AcquireBody = parse_body(body)?;
    let limits = &state.limits;
    if req.ttl_ms == 0 || req.ttl_ms > limits.max_ttl_ms {
        return Err(ApiError::bad_request(format!(
            "ttl_ms must be from 1 to {} (authority.max_ttl_ms); got {}",
            limits.max_ttl_ms, req.ttl_ms
        )));
    }
    if req.wait_ms > limits.max_wait_ms {
        return Err(ApiError::bad_request(format!(
            "wait_ms must be at most {} (authority.max_wait_ms); got {}",
            limits.max_wait_ms, req.wait_ms
        )));
    }
    check_label("request_id", &req.request_id)?;
    check_label("holder", &req.holder)?;
    Ok(AcquireRequest {
        resource,
        ttl: Duration::from_millis(req.ttl_ms),
        wait: Duration::from_millis(req.wait_ms),
        request_id: req.request_id,
        holder: req.holder,
    })
}

pub async fn acquire(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    original: Original,
) -> Result<Response, ApiError> {
    let request = acquire_request(&state, name, &original.body)?;
    let timeout = request.wait + FORWARD_SLACK;
    let result = state.authority.acquire(request).await;
    Ok(
        answer(&state, original, timeout, result, |outcome| match outcome {
            AcquireOutcome::Granted(grant) => ok(grant),
            AcquireOutcome::Held { revision } => ApiError::held(revision).into_response(),
        })
        .await,
    )
}

pub async fn keepalive(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    original: Original,
) -> Result<Response, ApiError> {
    let handle = lease_id(&id)?;
    let result = state.authority.keepalive(&handle).await;
    Ok(
        answer(&state, original, FORWARD_SLACK, result, |ttl| match ttl {
            Some(ttl_ms) => ok(json!({ "lease_id": id, "ttl_ms": ttl_ms })),
            None => ApiError::expired().into_response(),
        })
        .await,
    )
}

pub async fn release(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    original: Original,
) -> Result<Response, ApiError> {
    let handle = lease_id(&id)?;
    let result = state.authority.release(&handle).await;
    Ok(answer(
        &state,
        original,
        FORWARD_SLACK,
        result,
        |released| match released {
            true => ok(json!({ "lease_id": id, "released": true })),
            false => ApiError::expired().into_response(),
        },
    )
    .await)
}

pub async fn status(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    original: Original,
) -> Result<Response, ApiError> {
    let resource = resource(name)?;
    let result = state.authority.status(&resource).await;
    Ok(answer(
        &state,
        original,
        FORWARD_SLACK,
        result,
        |status| match status {
            Some(status) => ok(status),
            None => ApiError::new(
                StatusCode::NOT_FOUND,
                "not_held",
                format!("nobody holds {resource}"),
            )
            .into_response(),
        },
    )
    .await)
}
