//! Who may call the API: bearer credentials with a role.
//!
//! `client` may acquire, renew and release (its own leases: a lease handle is a 128-bit secret
//! only its acquirer knows) and read status; `admin` may also save and restore snapshots, bump
//! the revision, rotate token keys and add or remove nodes. Health and metrics stay open for
//! probes and scrapers.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use thiserror::Error;

use super::reply::ApiError;
use crate::config::SecurityConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    Client,
    Admin,
}

#[derive(Debug, Error)]
pub enum CredentialError {
    #[error("cannot read credentials file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("credentials: environment variable {0} is not set")]
    EnvMissing(String),
    #[error("{origin}: entry {entry}: {message}")]
    Invalid {
        origin: String,
        entry: usize,
        message: String,
    },
}

/// The shortest credential secret accepted, in bytes.
const MIN_SECRET: usize = 16;

/// The configured credentials, looked up by the SHA-256 of the presented secret (so the lookup
/// reveals nothing through timing about secrets that are not presented).
#[derive(Debug, Default)]
pub struct Credentials {
    by_digest: HashMap<[u8; 32], (String, Role)>,
}

impl Credentials {
    /// Loads `credentials_file` and `credentials_env`; `None` when neither is set.
    pub fn load(security: &SecurityConfig) -> Result<Option<Self>, CredentialError> {
        let mut credentials = Self::default();
        let mut any = false;
        if let Some(path) = &security.credentials_file {
            let text = std::fs::read_to_string(path).map_err(|source| CredentialError::Read {
                path: path.display().to_string(),
                source,
            })?;
            let entries = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(|l| l.split_whitespace().collect::<Vec<_>>());
            credentials.add_all(&path.display().to_string(), entries)?;
            any = true;
        }
        if let Some(var) = &security.credentials_env {
            let text = std::env::var(var).map_err(|_| CredentialError::EnvMissing(var.clone()))?;
            let entries = text
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(|e| e.splitn(3, ':').collect::<Vec<_>>());
            credentials.add_all(&format!("${var}"), entries)?;
            any = true;
        }
        Ok(any.then_some(credentials))
    }

    fn add_all<'a>(
        &mut self,
        origin: &str,
        entries: impl Iterator<Item = Vec<&'a str>>,
    ) -> Result<(), CredentialError> {
        for (i, fields) in entries.enumerate() {
            let invalid = |message: String| CredentialError::Invalid {
                origin: origin.to_owned(),
                entry: i + 1,
                message,
            };
            let [name, role, secret] = fields[..] else {
                return Err(invalid(
                    "expected three fields: name, role (client or admin), secret".into(),
                ));
            };
            let role = match role {
                "client" => Role::Client,
                "admin" => Role::Admin,
                other => return Err(invalid(format!("role {other:?} is not client or admin"))),
            };
            if secret.len() < MIN_SECRET {
                return Err(invalid(format!(
                    "the secret of {name:?} is shorter than {MIN_SECRET} characters"
                )));
            }
            if self
                .by_digest
                .insert(digest(secret), (name.to_owned(), role))
                .is_some()
            {
                return Err(invalid(format!("the secret of {name:?} is used twice")));
            }
        }
        Ok(())
    }

    /// The name and role of the credential in an `Authorization: Bearer` header value.
    pub fn check(&self, authorization: Option<&str>) -> Option<(&str, Role)> {
        let secret = authorization?.strip_prefix("Bearer ")?.trim();
        self.by_digest
            .get(&digest(secret))
            .map(|(name, role)| (name.as_str(), *role))
    }

    pub fn len(&self) -> usize {
        self.by_digest.len()
    }
}

fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// The credentials in force (`None`: insecure mode without any); SIGHUP replaces them.
#[derive(Default)]
pub struct LiveCredentials(std::sync::RwLock<Option<Arc<Credentials>>>);

impl LiveCredentials {
    pub fn new(credentials: Option<Arc<Credentials>>) -> Self {
        Self(std::sync::RwLock::new(credentials))
    }

    /// The credentials in force now.
    pub fn current(&self) -> Option<Arc<Credentials>> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Puts `credentials` in force for the next request.
    pub fn replace(&self, credentials: Arc<Credentials>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(credentials);
    }
}

/// What a route group needs, with the node's credentials.
#[derive(Clone)]
pub struct Gate {
    pub credentials: Arc<LiveCredentials>,
    pub needs: Role,
}

/// Middleware: answers 401 without a known credential and 403 with one whose role is too low.
pub async fn require(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    let Some(credentials) = gate.credentials.current() else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match credentials.check(presented) {
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this API needs a credential: send Authorization: Bearer <secret> (the CLI reads FENCEGATE_API_TOKEN or --credential-file)",
        )
        .into_response(),
        Some((name, role)) if role < gate.needs => ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("credential {name:?} has the client role; this call needs admin"),
        )
        .into_response(),
        Some((name, _)) => {
            let mut request = request;
            request.extensions_mut().insert(Caller(name.to_owned()));
            next.run(request).await
        }
    }
}

/// The name of the credential that made a request, for audit records of admin actions.
#[derive(Debug, Clone)]
pub struct Caller(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    fn load(env_value: &str) -> Result<Option<Credentials>, CredentialError> {
        let var = format!("FG_TEST_CREDS_{}", env_value.len());
        std::env::set_var(&var, env_value);
        Credentials::load(&SecurityConfig {
            credentials_env: Some(var),
            ..SecurityConfig::default()
        })
    }

    #[test]
    fn credentials_have_roles() {
        let c = load("app:client:0123456789abcdef,ops:admin:fedcba9876543210")
            .unwrap()
            .unwrap();
        assert_eq!(
            c.check(Some("Bearer 0123456789abcdef")),
            Some(("app", Role::Client))
        );
        assert_eq!(
            c.check(Some("Bearer fedcba9876543210")),
            Some(("ops", Role::Admin))
        );
        assert_eq!(c.check(Some("Bearer nope")), None);
        assert_eq!(c.check(Some("0123456789abcdef")), None);
        assert_eq!(c.check(None), None);
    }

    #[test]
    fn bad_entries_are_named() {
        let err = load("app:root:0123456789abcdef").unwrap_err().to_string();
        assert!(err.contains("entry 1") && err.contains("root"), "{err}");
        let err = load("app:client:short").unwrap_err().to_string();
        assert!(err.contains("shorter than 16"), "{err}");
        let err = load("a:client:0123456789abcdef,b:admin:0123456789abcdef")
            .unwrap_err()
            .to_string();
        assert!(err.contains("entry 2") && err.contains("twice"), "{err}");
    }
}
