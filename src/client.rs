//! The CLI's client for the lock API: tries each endpoint in turn and retries briefly while
//! the cluster elects a leader.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("no endpoint answered within {0:?} (tried {1}); is the authority running? set --endpoint or FENCEGATE_ENDPOINT")]
    Unreachable(Duration, String),
    #[error("endpoint {0} answered with something that is not JSON: {1}")]
    NotJson(String, String),
}

/// An answer from the API: its status and JSON body.
pub struct Answer {
    pub status: StatusCode,
    pub body: serde_json::Value,
}

pub struct Client {
    endpoints: Vec<String>,
    http: reqwest::Client,
    patience: Duration,
}

/// Pause between rounds over the endpoint list.
const ROUND_PAUSE: Duration = Duration::from_millis(200);

impl Client {
    pub fn new(endpoints: &[String], patience: Duration) -> Self {
        let endpoints = endpoints
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
        Self {
            endpoints,
            http: reqwest::Client::new(),
            patience,
        }
    }

    /// The same endpoints and connection pool, trying for at most `patience`.
    pub fn with_patience(&self, patience: Duration) -> Self {
        Self {
            endpoints: self.endpoints.clone(),
            http: self.http.clone(),
            patience,
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
        let started = Instant::now();
        loop {
            for endpoint in &self.endpoints {
                let mut req = self
                    .http
                    .request(method.clone(), format!("{endpoint}{path}"))
                    .timeout(timeout);
                if let Some(body) = body {
                    req = req.json(body);
                }
                let Ok(answer) = req.send().await else {
                    continue;
                };
                let status = answer.status();
                if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::BAD_GATEWAY {
                    continue;
                }
                let text = answer.text().await.unwrap_or_default();
                let body = serde_json::from_str(&text)
                    .map_err(|_| ClientError::NotJson(endpoint.clone(), text))?;
                return Ok(Answer { status, body });
            }
            if started.elapsed() >= self.patience {
                return Err(ClientError::Unreachable(
                    self.patience,
                    self.endpoints.join(","),
                ));
            }
            tokio::time::sleep(ROUND_PAUSE).await;
        }
    }
}

/// A random id that makes a retried acquire idempotent.
pub fn request_id() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::thread_rng().gen();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
