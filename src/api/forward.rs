//! Followers pass client requests to the leader and relay its answer unchanged.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use super::reply::ApiError;
use super::{ApiState, FORWARDED_HEADER};
use crate::authority::AuthorityError;
use crate::client::TIMEOUT_HEADER;

/// The request as received, kept so it can be sent on to the leader. An extractor: it takes
/// the body, so it comes last in a handler's arguments.
pub struct Original {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl<S: Send + Sync> FromRequest<S> for Original {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let (parts, body) = req.into_parts();
        let body = Bytes::from_request(Request::from_parts(parts.clone(), body), state)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self {
            method: parts.method,
            uri: parts.uri,
            headers: parts.headers,
            body,
        })
    }
}

/// Renders a successful result with `render`; on a "not the leader" error forwards the
/// request to the leader; otherwise answers the error.
pub async fn answer<T>(
    state: &ApiState,
    original: Original,
    timeout: Duration,
    result: Result<T, AuthorityError>,
    render: impl FnOnce(T) -> Response,
) -> Response {
    match result {
        Ok(value) => render(value),
        Err(e) => or_forward(state, e, original, timeout).await,
    }
}

/// Answers `err`, or, when it says another node leads, forwards `original` there once.
pub async fn or_forward(
    state: &ApiState,
    err: AuthorityError,
    original: Original,
    timeout: Duration,
) -> Response {
    let AuthorityError::NotLeader {
        leader: Some(leader),
    } = &err
    else {
        return ApiError::from(err).into_response();
    };
    if original.headers.contains_key(FORWARDED_HEADER) {
        // The node that sent us this believed we lead; we do not. Let the client retry rather
        // than bounce the request around while an election settles.
        return ApiError::from(AuthorityError::NotLeader { leader: None }).into_response();
    }
    let timeout = forward_timeout(&original.headers, timeout);
    let path = original.uri.path_and_query().map_or("/", |p| p.as_str());
    let url = format!("{}://{leader}{path}", state.scheme);
    let mut request = state.http.request(original.method, url);
    // The leader checks the client's credential again (every node has the same ones).
    if let Some(authorization) = original.headers.get(axum::http::header::AUTHORIZATION) {
        request = request.header(axum::http::header::AUTHORIZATION, authorization);
    }
    let sent = request
        .header(FORWARDED_HEADER, state.authority_id().to_string())
        .header("content-type", "application/json")
        .body(original.body)
        .timeout(timeout)
        .send()
        .await;
    match sent {
        Ok(answer) => {
            let status =
                StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            match answer.bytes().await {
                Ok(body) => (status, [("content-type", "application/json")], body).into_response(),
                Err(e) => ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "forward_failed",
                    format!("leader's answer was cut off: {e}"),
                )
                .into_response(),
            }
        }
        Err(e) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "forward_failed",
            format!("cannot reach the leader at {leader}: {e}; retry or try another endpoint"),
        )
        .into_response(),
    }
}

/// How long to wait for the leader: `timeout`, but no longer than two thirds of what the
/// client said it waits (`TIMEOUT_HEADER`). A leader that does not answer (frozen, cut off)
/// then costs the client part of its attempt, and the 503 it gets leaves it time to try
/// another endpoint, where an elected successor may answer.
fn forward_timeout(headers: &HeaderMap, timeout: Duration) -> Duration {
    headers
        .get(TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(timeout, |ms| {
            timeout.min(Duration::from_millis(ms.saturating_mul(2) / 3))
        })
}

impl ApiState {
    fn authority_id(&self) -> u64 {
        self.authority.id()
    }
}
