//! The lock service: acquire, keepalive, release, status.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use fencegate_core::Resource;
use serde::Deserialize;
use serde_json::json;

use super::forward::{or_forward, Original};
use super::reply::{ok, parse_body, ApiError};
use super::ApiState;
use crate::authority::{AcquireOutcome, AcquireRequest};

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

fn lease_id(text: &str) -> Result<u64, ApiError> {
    text.parse()
        .map_err(|_| ApiError::bad_request(format!("lease id {text:?} is not a number")))
}

pub async fn acquire(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let parsed = (|| {
        let resource = resource(name)?;
        let req: AcquireBody = parse_body(&body)?;
        if req.ttl_ms == 0 || req.ttl_ms > state.limits.max_ttl_ms {
            return Err(ApiError::bad_request(format!(
                "ttl_ms must be from 1 to {} (authority.max_ttl_ms); got {}",
                state.limits.max_ttl_ms, req.ttl_ms
            )));
        }
        if req.wait_ms > state.limits.max_wait_ms {
            return Err(ApiError::bad_request(format!(
                "wait_ms must be at most {} (authority.max_wait_ms); got {}",
                state.limits.max_wait_ms, req.wait_ms
            )));
        }
        check_label("request_id", &req.request_id)?;
        check_label("holder", &req.holder)?;
        Ok((resource, req))
    })();
    let (resource, req) = match parsed {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let wait = Duration::from_millis(req.wait_ms);
    let request = AcquireRequest {
        resource,
        ttl: Duration::from_millis(req.ttl_ms),
        wait,
        request_id: req.request_id,
        holder: req.holder,
    };
    match state.authority.acquire(request).await {
        Ok(AcquireOutcome::Granted(grant)) => ok(grant),
        Ok(AcquireOutcome::Held { revision }) => ApiError::held(revision).into_response(),
        Err(e) => {
            or_forward(
                &state,
                e,
                Original {
                    method,
                    uri,
                    headers,
                    body,
                },
                wait + FORWARD_SLACK,
            )
            .await
        }
    }
}

pub async fn keepalive(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let id = match lease_id(&id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    match state.authority.keepalive(id).await {
        Ok(Some(ttl_ms)) => ok(json!({ "lease_id": id, "ttl_ms": ttl_ms })),
        Ok(None) => ApiError::expired().into_response(),
        Err(e) => {
            or_forward(
                &state,
                e,
                Original {
                    method,
                    uri,
                    headers,
                    body,
                },
                FORWARD_SLACK,
            )
            .await
        }
    }
}

pub async fn release(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let id = match lease_id(&id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    match state.authority.release(id).await {
        Ok(true) => ok(json!({ "lease_id": id, "released": true })),
        Ok(false) => ApiError::expired().into_response(),
        Err(e) => {
            or_forward(
                &state,
                e,
                Original {
                    method,
                    uri,
                    headers,
                    body,
                },
                FORWARD_SLACK,
            )
            .await
        }
    }
}

pub async fn status(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let resource = match resource(name) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match state.authority.status(&resource).await {
        Ok(Some(status)) => ok(status),
        Ok(None) => ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            "not_held",
            format!("nobody holds {resource}"),
        )
        .into_response(),
        Err(e) => {
            or_forward(
                &state,
                e,
                Original {
                    method,
                    uri,
                    headers,
                    body,
                },
                FORWARD_SLACK,
            )
            .await
        }
    }
}
