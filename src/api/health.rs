//! `GET /healthz`: 200 while this node knows a leader, every gateway it runs can serve
//! protected writes and its audit log can be written; 503 with the reason otherwise (a
//! readiness probe, not a liveness one: a degraded gateway recovers on its own once its
//! upstream does, the audit log once its volume takes writes).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::ApiState;

/// One gateway's health check: `Err` says why it cannot serve protected writes.
#[derive(Clone)]
pub struct GatewayHealth {
    /// The config section (`redis`, ...).
    pub name: &'static str,
    pub check: Arc<dyn Fn() -> Result<(), String> + Send + Sync>,
}

impl GatewayHealth {
    pub fn new(
        name: &'static str,
        check: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            check: Arc::new(check),
        }
    }
}

pub async fn healthz(State(state): State<ApiState>) -> Response {
    let status = state.authority.cluster().await;
    let mut problems = Vec::new();
    if status.leader_id.is_none() {
        problems.push("no leader known yet".to_owned());
    }
    let mut gateways = Map::new();
    for gateway in state.gateways.iter() {
        let entry = match (gateway.check)() {
            Ok(()) => json!({ "ok": true }),
            Err(reason) => {
                problems.push(format!("{} gateway degraded: {reason}", gateway.name));
                json!({ "ok": false, "reason": reason })
            }
        };
        gateways.insert(gateway.name.to_owned(), entry);
    }
    // Refusals still refuse while the audit log cannot be written, but leave no record.
    let audit = match state.metrics.fences.write_failure() {
        None => json!({ "ok": true }),
        Some(reason) => {
            problems.push(format!("audit log cannot be written: {reason}"));
            json!({ "ok": false, "reason": reason })
        }
    };
    let mut body = json!({
        "ok": problems.is_empty(),
        "node_id": status.node_id,
        "leader_id": status.leader_id,
        "gateways": Value::Object(gateways),
        "audit": audit,
    });
    if problems.is_empty() {
        return (StatusCode::OK, axum::Json(body)).into_response();
    }
    body["message"] = problems.join("; ").into();
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
}
