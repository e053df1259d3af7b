//! The CLI's client for the lock API: tries each endpoint in turn and retries briefly while
//! the cluster elects a leader.

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
}

pub struct Client {
    endpoints: Vec<String>,
    http: reqwest::Client,
    patience: Duration,
    /// The bearer credential, if the user gave one.
    credential: Option<String>,
}

/// Pause between rounds over the endpoint list.
const ROUND_PAUSE: Duration = Duration::from_millis(200);

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
        })
    }

    /// The same endpoints and connection pool, trying for at most `patience`.
    pub fn with_patience(&self, patience: Duration) -> Self {
        Self {
            endpoints: self.endpoints.clone(),
            http: self.http.clone(),
            patience,
            credential: self.credential.clone(),
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
                if let Some(credential) = &self.credential {
                    req = req.bearer_auth(credential);
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
