//! Cluster status, snapshots, health and metrics.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::forward::{or_forward, Original};
use super::reply::{ok, parse_body, ApiError};
use super::ApiState;
use crate::authority::state::AuthorityState;

const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);

/// The version tag of a saved snapshot file.
pub const SNAPSHOT_FORMAT: &str = "fencegate-snapshot/1";

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotFile {
    pub format: String,
    pub revision: u64,
    pub state: AuthorityState,
}

pub async fn cluster(State(state): State<ApiState>) -> Response {
    ok(state.authority.cluster().await)
}

pub async fn snapshot(
    State(state): State<ApiState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    match state.authority.snapshot().await {
        Ok(s) => ok(SnapshotFile {
            format: SNAPSHOT_FORMAT.into(),
            revision: s.revision,
            state: s,
        }),
        Err(e) => {
            or_forward(
                &state,
                e,
                Original {
                    method,
                    uri,
                    headers,
                    body: Bytes::new(),
                },
                FORWARD_TIMEOUT,
            )
            .await
        }
    }
}

pub async fn restore(
    State(state): State<ApiState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let file: SnapshotFile = match parse_body(&body) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    if file.format != SNAPSHOT_FORMAT {
        return ApiError::bad_request(format!(
            "unknown snapshot format {:?}; expected {SNAPSHOT_FORMAT:?}",
            file.format
        ))
        .into_response();
    }
    if file.revision != file.state.revision {
        return ApiError::bad_request(
            "snapshot file is inconsistent: its revision does not match its state",
        )
        .into_response();
    }
    match state.authority.restore(file.state).await {
        Ok(revision) => ok(json!({ "restored": true, "revision": revision })),
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
                FORWARD_TIMEOUT,
            )
            .await
        }
    }
}

pub async fn healthz(State(state): State<ApiState>) -> Response {
    let status = state.authority.cluster().await;
    match status.leader_id {
        Some(leader) => ok(json!({ "ok": true, "node_id": status.node_id, "leader_id": leader })),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(
                json!({ "ok": false, "node_id": status.node_id, "message": "no leader known yet" }),
            ),
        )
            .into_response(),
    }
}

pub async fn metrics(State(state): State<ApiState>) -> Response {
    state.authority.refresh_gauges().await;
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.render(),
    )
        .into_response()
}
