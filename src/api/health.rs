//! `GET /healthz` and `GET /readyz`.
//!
//! `/healthz`: 200 while this node knows a leader, every gateway it runs is listening, can
//! reach its upstream and can serve protected writes, and its audit log can be written; 503
//! with the reason otherwise. The body reports each gateway's listener and upstream, for
//! operators. A degraded gateway recovers on its own once its upstream does, the audit log once
//! its volume takes writes.
//!
//! `/readyz`: for load balancers and readiness probes: 200 once the node knows a leader and
//! its gateways are listening. An unreachable upstream does not take the node out of
//! rotation: every node shares the same upstreams, and the gateway answers clients with the
//! upstream's error, which says more than a connection refused by the balancer.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::ApiState;

/// How long `/healthz` waits for an upstream to accept a TCP connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// One gateway's health: its listener, its upstream, and its own check.
#[derive(Clone)]
pub struct GatewayHealth {
    store: fencegate_core::Store,
    /// The config section (`redis`, ...).
    pub name: &'static str,
    /// `Err` says why the gateway cannot serve protected writes.
    pub check: Arc<dyn Fn() -> Result<(), String> + Send + Sync>,
    /// The bound address, and whether its accept loop still runs.
    pub listener: Option<(SocketAddr, Arc<AtomicBool>)>,
    /// The upstream's `host:port`, probed with a TCP connection.
    pub upstream: Option<String>,
    /// Set to the last probe's result (a metric).
    pub up: Option<prometheus_client::metrics::gauge::Gauge>,
    /// Facts the gateway reports beside its health (name, value), such as where the store runs
    /// the fence check.
    pub details: Option<Details>,
}

/// A gateway's facts for `/healthz`: (name, value) pairs, read at each request.
pub type Details = Arc<dyn Fn() -> Vec<(&'static str, String)> + Send + Sync>;

impl GatewayHealth {
    pub fn new(
        store: fencegate_core::Store,
        check: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            store,
            name: store.as_str(),
            check: Arc::new(check),
            listener: None,
            upstream: None,
            up: None,
            details: None,
        }
    }

    /// Reports `details()` in the gateway's `/healthz` entry.
    pub fn details(
        mut self,
        details: impl Fn() -> Vec<(&'static str, String)> + Send + Sync + 'static,
    ) -> Self {
        self.details = Some(Arc::new(details));
        self
    }

    /// Reports the listener on `addr`, listening while `running` is set.
    pub fn listener(mut self, addr: SocketAddr, running: Arc<AtomicBool>) -> Self {
        self.listener = Some((addr, running));
        self
    }

    /// Probes `upstream` (a `host:port`, or a URL whose scheme gives the default port) and
    /// reports each probe in the store's `fencegate_gateway_upstream_up` (1 reachable, 0 not).
    pub fn upstream(
        mut self,
        upstream: &str,
        default_port: u16,
        metrics: &crate::gateway_metrics::GatewayMetrics,
    ) -> Self {
        self.upstream = Some(host_port(upstream, default_port));
        self.up = Some(metrics.upstream_up(self.store));
        self
    }

    fn listening(&self) -> bool {
        self.listener
            .as_ref()
            .is_none_or(|(_, running)| running.load(Ordering::Relaxed))
    }
}

/// `host:port` of `upstream`: a scheme (`redis://`, `https://`...) and a path are dropped, and
/// a missing port is the scheme's (`https`: 443, `http`: 80) or `default_port`.
pub fn host_port(upstream: &str, default_port: u16) -> String {
    let (scheme, rest) = upstream.split_once("://").unwrap_or(("", upstream));
    let authority = rest.split('/').next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let has_port = match authority.rsplit_once(':') {
        Some((host, port)) => !host.ends_with(':') && port.parse::<u16>().is_ok(),
        None => false,
    };
    if has_port {
        return authority.to_owned();
    }
    let port = match scheme {
        "https" => 443,
        "http" => 80,
        _ => default_port,
    };
    format!("{authority}:{port}")
}

async fn probe(addr: &str) -> Result<(), String> {
    match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("cannot connect to {addr}: {e}")),
        Err(_) => Err(format!(
            "{addr} did not accept a connection within {} ms",
            PROBE_TIMEOUT.as_millis()
        )),
    }
}

/// Probes every gateway's upstream, concurrently (one slow upstream must not add up with the
/// others); `None` for a gateway without one. Sets `fencegate_gateway_upstream_up` on the way.
pub async fn probe_upstreams(gateways: &[GatewayHealth]) -> Vec<Option<Result<(), String>>> {
    let probes: Vec<_> = gateways
        .iter()
        .map(|g| {
            g.upstream
                .clone()
                .map(|addr| tokio::spawn(async move { probe(&addr).await }))
        })
        .collect();
    let mut probed = Vec::with_capacity(probes.len());
    for (gateway, handle) in gateways.iter().zip(probes) {
        let result = match handle {
            Some(handle) => Some(handle.await.unwrap_or_else(|e| Err(e.to_string()))),
            None => None,
        };
        if let (Some(up), Some(result)) = (&gateway.up, &result) {
            up.set(i64::from(result.is_ok()));
        }
        probed.push(result);
    }
    probed
}

pub async fn healthz(State(state): State<ApiState>) -> Response {
    let status = state.authority.cluster().await;
    let mut problems = Vec::new();
    if status.leader_id.is_none() {
        problems.push("no leader known yet".to_owned());
    }
    let probed = probe_upstreams(&state.gateways).await;
    let mut gateways = Map::new();
    for (gateway, upstream) in state.gateways.iter().zip(probed) {
        let mut entry = json!({ "ok": true });
        if let Some((addr, _)) = &gateway.listener {
            entry["listen"] = addr.to_string().into();
            entry["listening"] = gateway.listening().into();
        }
        if !gateway.listening() {
            problems.push(format!("{} gateway is not listening", gateway.name));
            entry["ok"] = false.into();
        }
        if let (Some(addr), Some(result)) = (&gateway.upstream, upstream) {
            entry["upstream"] = json!({ "addr": addr, "reachable": result.is_ok() });
            if let Err(reason) = result {
                problems.push(format!("{} upstream unreachable: {reason}", gateway.name));
                entry["upstream"]["reason"] = reason.into();
                entry["ok"] = false.into();
            }
        }
        if let Some(details) = &gateway.details {
            for (name, value) in details() {
                entry[name] = value.into();
            }
        }
        if let Err(reason) = (gateway.check)() {
            problems.push(format!("{} gateway degraded: {reason}", gateway.name));
            entry["reason"] = reason.into();
            entry["ok"] = false.into();
        }
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

pub async fn readyz(State(state): State<ApiState>) -> Response {
    let status = state.authority.cluster().await;
    let mut problems = Vec::new();
    if status.leader_id.is_none() {
        problems.push("no leader known yet".to_owned());
    }
    for gateway in state.gateways.iter().filter(|g| !g.listening()) {
        problems.push(format!("{} gateway is not listening", gateway.name));
    }
    let body = json!({
        "ready": problems.is_empty(),
        "node_id": status.node_id,
        "leader_id": status.leader_id,
        "message": problems.join("; "),
    });
    let code = if problems.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn upstreams_become_host_and_port() {
        assert_eq!(host_port("127.0.0.1:6379", 6379), "127.0.0.1:6379");
        assert_eq!(
            host_port("rediss://cache.internal:6380", 6379),
            "cache.internal:6380"
        );
        assert_eq!(
            host_port("redis://cache.internal", 6379),
            "cache.internal:6379"
        );
        assert_eq!(host_port("http://minio:9000", 80), "minio:9000");
        assert_eq!(
            host_port("https://s3.example.com/", 80),
            "s3.example.com:443"
        );
        assert_eq!(host_port("http://user:pw@minio", 80), "minio:80");
        assert_eq!(host_port("[::1]:5432", 5432), "[::1]:5432");
    }
}
