//! The CLI's client for the lock API: tries each endpoint in turn and retries briefly while
//! the cluster elects a leader.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use thiserror::Error;

use crate::cli::EndpointArg;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a PEM CA certificate: {message}")]
    BadCa { path: String, message: String },
    #[error("no endpoint answered within {0:?} (tried {1}); is the authority running? set --endpoint or FENCEGATE_ENDPOINT")]
    Unreachable(Duration, String),
    #[error("endpoint {0} answered with something that is not JSON: {1}")]
    NotJson(String, String),
}

/// An answer from the API: its status and JSON body.
pub struct Answer {
    pub status: StatusCode,
    pub body: serde_json::Value,
    /// When the attempt that got this answer was sent, on this process's monotonic clock.
    pub sent: tokio::time::Instant,
}

pub struct Client {
    endpoints: Vec<String>,
    http: reqwest::Client,
    patience: Duration,
    /// The bearer credential, if the user gave one.
    credential: Option<String>,
    /// The endpoint that answered last, tried first next time: a renewal does not start again
    /// at a node it already waited on in vain. Shared by `with_patience` copies.
    preferred: Arc<AtomicUsize>,
}

/// Pause between rounds over the endpoint list.
const ROUND_PAUSE: Duration = Duration::from_millis(200);

/// Tells the node how long this client waits for the answer, so a follower forwarding the
/// request gives up on an unresponsive leader (and answers 503) while the client still has time
/// to try another endpoint.
pub const TIMEOUT_HEADER: &str = "fencegate-timeout-ms";

/// The longest one attempt at one endpoint may take when time is short (`call_within`): a
/// frozen node answers nothing, and a healthy one answers a keepalive in milliseconds.
pub const MAX_ATTEMPT: Duration = Duration::from_secs(2);

/// The shortest attempt worth making.
const MIN_ATTEMPT: Duration = Duration::from_millis(100);

impl Client {
    /// A client for `arg`'s endpoints, with its credential and CA, if any.
    pub fn new(arg: &EndpointArg, patience: Duration) -> Result<Self, ClientError> {
        let read = |path: &std::path::Path| {
            std::fs::read(path).map_err(|source| ClientError::Read {
                path: path.display().to_string(),
                source,
            })
        };
        let credential = match (std::env::var("FENCEGATE_API_TOKEN"), &arg.credential_file) {
            (Ok(secret), _) if !secret.trim().is_empty() => Some(secret.trim().to_owned()),
            (_, Some(path)) => Some(String::from_utf8_lossy(&read(path)?).trim().to_owned()),
            _ => None,
        };
        let mut http = reqwest::Client::builder();
        if let Some(path) = &arg.ca_file {
            let ca =
                reqwest::Certificate::from_pem(&read(path)?).map_err(|e| ClientError::BadCa {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?;
            http = http.use_rustls_tls().add_root_certificate(ca);
        }
        let http = http.build().map_err(|e| ClientError::BadCa {
            path: "(client)".into(),
            message: e.to_string(),
        })?;
        let endpoints = arg
            .endpoint
            .iter()
            .map(|e| e.trim().trim_end_matches('/'))
            .filter(|e| !e.is_empty())
            .map(|e| {
                if e.contains("://") {
                    e.to_owned()
                } else {
                    format!("http://{e}")
                }
            })
            .collect();
        Ok(Self {
            endpoints,
            http,
            patience,
            credential,
            preferred: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The same endpoints and connection pool, trying for at most `patience`.
    pub fn with_patience(&self, patience: Duration) -> Self {
        Self {
            endpoints: self.endpoints.clone(),
            http: self.http.clone(),
            patience,
            credential: self.credential.clone(),
            preferred: self.preferred.clone(),
        }
    }

    /// Sends the request to each endpoint in turn until one answers with anything but "no
    /// leader / unavailable", for up to `patience` (plus the request's own `timeout`).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> Result<Answer, ClientError> {
        self.call_with(method, path, |_| body.cloned(), |_| timeout)
            .await
    }

    /// Like `call`, for a request that must be decided within `patience`: each attempt gets a
    /// third of the time left (at most `MAX_ATTEMPT`), so one node that does not answer leaves
    /// time for the others, and nothing runs past `patience`.
    pub async fn call_within(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<Answer, ClientError> {
        self.call_with(
            method,
            path,
            |_| body.cloned(),
            |left| (left / 3).clamp(MIN_ATTEMPT, MAX_ATTEMPT).min(left),
        )
        .await
    }

    /// The general form: `body(left)` and `timeout(left)` make each attempt from the time
    /// left of `patience` (a waiting acquire asks the node to wait only for what is left).
    pub async fn call_with(
        &self,
        method: Method,
        path: &str,
        body: impl Fn(Duration) -> Option<serde_json::Value>,
        timeout: impl Fn(Duration) -> Duration,
    ) -> Result<Answer, ClientError> {
        let deadline = Instant::now() + self.patience;
        let n = self.endpoints.len();
        loop {
            let first = self.preferred.load(Ordering::Relaxed);
            for i in (0..n).map(|k| (first + k) % n) {
                let endpoint = &self.endpoints[i];
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let timeout = timeout(left).max(MIN_ATTEMPT);
                let mut req = self
                    .http
                    .request(method.clone(), format!("{endpoint}{path}"))
                    .timeout(timeout)
                    .header(TIMEOUT_HEADER, timeout.as_millis().to_string());
                if let Some(body) = body(left) {
                    req = req.json(&body);
                }
                if let Some(credential) = &self.credential {
                    req = req.bearer_auth(credential);
                }
                let sent = tokio::time::Instant::now();
                let Ok(answer) = req.send().await else {
                    continue;
                };
                let status = answer.status();
                if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::BAD_GATEWAY {
                    continue;
                }
                let Ok(text) = answer.text().await else {
                    continue;
                };
                self.preferred.store(i, Ordering::Relaxed);
                let body = serde_json::from_str(&text)
                    .map_err(|_| ClientError::NotJson(endpoint.clone(), text))?;
                return Ok(Answer { status, body, sent });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || n == 0 {
                return Err(ClientError::Unreachable(
                    self.patience,
                    self.endpoints.join(","),
                ));
            }
            tokio::time::sleep(ROUND_PAUSE.min(left)).await;
        }
    }
}

/// A random id that makes a retried acquire idempotent.
pub fn request_id() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::thread_rng().gen();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
