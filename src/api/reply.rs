//! JSON replies and the mapping of every failure to a status code and a message.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::json;

use crate::authority::AuthorityError;

/// A failed API call: `{"error": code, "message": text}` plus any extra fields.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: serde_json::Value,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            body: json!({ "error": code, "message": message.into() }),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn held(revision: u64) -> Self {
        Self {
            status: StatusCode::CONFLICT,
            body: json!({
                "error": "held",
                "revision": revision,
                "message": "the lock is held by another lease; retry later or pass wait_ms",
            }),
        }
    }

    pub fn expired() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "expired",
            "the lease has expired or never existed; acquire the lock again",
        )
    }
}

impl From<AuthorityError> for ApiError {
    fn from(e: AuthorityError) -> Self {
        match &e {
            AuthorityError::NotLeader { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_leader",
                "this node is not the leader and knows of none yet; retry or try another endpoint",
            ),
            AuthorityError::Unavailable(_) | AuthorityError::Open { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                e.to_string(),
            ),
            AuthorityError::BadSnapshot(_) => Self::bad_request(e.to_string()),
            AuthorityError::RequestIdInUse(_) => {
                Self::new(StatusCode::CONFLICT, "request_id_in_use", e.to_string())
            }
            AuthorityError::RestoreInterrupted => {
                Self::new(StatusCode::CONFLICT, "restore_interrupted", e.to_string())
            }
            AuthorityError::KeyRefused(_) => {
                Self::new(StatusCode::CONFLICT, "key_refused", e.to_string())
            }
            AuthorityError::Membership(_) => {
                Self::new(StatusCode::CONFLICT, "membership_refused", e.to_string())
            }
            AuthorityError::TooManyLeases { .. } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_leases",
                e.to_string(),
            ),
            AuthorityError::RevisionExhausted => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "revision_exhausted",
                e.to_string(),
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

pub fn ok<T: Serialize>(value: T) -> Response {
    (StatusCode::OK, Json(value)).into_response()
}

/// Parses a JSON body strictly (unknown fields are refused), answering 400 with serde's reason.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}
