//! Cluster status, snapshots, health and metrics.

use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::forward::{answer, Original};
use super::reply::{ok, parse_body, ApiError};
use super::ApiState;
use crate::authority::state::AuthorityState;
use crate::authority::AuthorityError;

const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);

/// A restore forwarded to the leader: its parts go through the log one after another.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(120);

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

pub async fn snapshot(State(state): State<ApiState>, original: Original) -> Response {
    let result = state.authority.snapshot().await;
    answer(&state, original, FORWARD_TIMEOUT, result, |s| {
        ok(SnapshotFile {
            format: SNAPSHOT_FORMAT.into(),
            revision: s.revision,
            state: s,
        })
    })
    .await
}

pub async fn restore(
    State(state): State<ApiState>,
    original: Original,
) -> Result<Response, ApiError> {
    let file: SnapshotFile = parse_body(&original.body)?;
    if file.format != SNAPSHOT_FORMAT {
        return Err(ApiError::bad_request(format!(
            "unknown snapshot format {:?}; expected {SNAPSHOT_FORMAT:?}",
            file.format
        )));
    }
    if file.revision != file.state.revision {
        return Err(ApiError::bad_request(
            "snapshot file is inconsistent: its revision does not match its state",
        ));
    }
    // On a task of its own: a client that gives up mid-way must not stop the restore between
    // two parts (the parts applied so far would stay staged until the next restore).
    let authority = state.authority.clone();
    let result = tokio::spawn(async move { authority.restore(file.state).await })
        .await
        .unwrap_or_else(|e| Err(AuthorityError::Unavailable(e.to_string())));
    Ok(
        answer(&state, original, RESTORE_TIMEOUT, result, |revision| {
            ok(json!({ "restored": true, "revision": revision }))
        })
        .await,
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BumpBody {
    by: u64,
}

/// Raises the revision (after stores were restored from a backup, or to get above fences a
/// wiped authority no longer knows).
pub async fn bump(State(state): State<ApiState>, original: Original) -> Result<Response, ApiError> {
    let body: BumpBody = parse_body(&original.body)?;
    if body.by == 0 {
        return Err(ApiError::bad_request("by must be positive"));
    }
    let result = state.authority.bump(body.by).await;
    Ok(
        answer(&state, original, FORWARD_TIMEOUT, result, |revision| {
            ok(json!({ "revision": revision }))
        })
        .await,
    )
}

pub async fn metrics(State(state): State<ApiState>) -> Response {
    state.authority.refresh_gauges().await;
    super::health::probe_upstreams(&state.gateways).await;
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.render(),
    )
        .into_response()
}
