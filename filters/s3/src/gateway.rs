//! The gateway's shared state (config, credentials, token policy, audit sink, open multipart
//! uploads, cached manifests) and its HTTP client towards the store: every write-side
//! upstream request goes through [`Shared::send`], which refuses a path the HTTP client would
//! rewrite and is bounded by `upstream_timeout_ms`.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fencegate_core::{AuditSink, TokenPolicy};

use crate::config::S3Config;
use crate::error::S3Error;
use crate::rewrite::ObjectState;
use crate::upstream::Upstream;

/// State shared by every request of one gateway.
pub struct Shared {
    pub(crate) config: S3Config,
    /// Client access keys and their secrets; SIGHUP may replace them ([`S3Clients`]).
    clients: Mutex<Arc<HashMap<String, String>>>,
    pub(crate) upstream: Upstream,
    pub(crate) policy: TokenPolicy,
    pub(crate) audit: Arc<dyn AuditSink>,
    http: reqwest::Client,
    /// Fenced multipart uploads: `(bucket, key, upload id)` -> the revision its fence
    /// metadata carries and when it was created. Forgotten by age only (a flood of new uploads
    /// is refused instead of evicting a holder's), bounded by `max_open_uploads`.
    uploads: Mutex<HashMap<UploadKey, Upload>>,
    /// Manifest mode: `(bucket, resource)` -> the manifest last read or committed, by ETag.
    /// One entry per manifest-mode rule, so bounded by the config.
    pub(crate) manifests: Mutex<HashMap<(String, String), crate::manifest_store::Loaded>>,
    /// Manifest mode: each manifest's group-commit queue (one per rule, bounded by the config).
    pub(crate) committers: Mutex<HashMap<(String, String), Arc<crate::group_commit::Committer>>>,
}

/// A fenced multipart upload the gateway created.
#[derive(Debug, Clone)]
pub(crate) struct Upload {
    /// The revision its creator's token carried.
    pub(crate) revision: u64,
    /// Manifest mode: the physical key the parts go to.
    pub(crate) physical: Option<String>,
    created: Instant,
}

impl Upload {
    /// An object-mode upload recovered from its stamp in the store (its age starts now).
    pub(crate) fn recalled(revision: u64) -> Self {
        Self {
            revision,
            physical: None,
            created: Instant::now(),
        }
    }
}

/// `(bucket, key, upload id)`: an upload is completed only through the key it was created for.
pub(crate) type UploadKey = (String, String, String);

impl Shared {
    pub(crate) fn new(
        config: S3Config,
        clients: HashMap<String, String>,
        upstream: Upstream,
        policy: TokenPolicy,
        audit: Arc<dyn AuditSink>,
    ) -> Result<Self, S3Error> {
        // Connecting is bounded here; waiting for an answer is bounded per request in `send`
        // (reqwest's read timeout also runs while a large body is still being sent).
        let mut http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .connect_timeout(Duration::from_millis(config.upstream_timeout_ms));
        if let Some(path) = &config.upstream_ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                S3Error::Config(format!("upstream_ca_file {}: {e}", path.display()))
            })?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| S3Error::Config(format!("upstream_ca_file {}: {e}", path.display())))?
            {
                http = http.add_root_certificate(cert);
            }
        }
        let http = http.build().map_err(|e| S3Error::Upstream(e.to_string()))?;
        Ok(Self {
            config,
            clients: Mutex::new(Arc::new(clients)),
            upstream,
            policy,
            audit,
            http,
            uploads: Mutex::new(HashMap::new()),
            manifests: Mutex::new(HashMap::new()),
            committers: Mutex::new(HashMap::new()),
        })
    }

    /// The client credentials in force now.
    pub(crate) fn clients(&self) -> Arc<HashMap<String, String>> {
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records a fenced upload; `false` when `max_open_uploads` younger uploads are open.
    pub(crate) fn track_upload(
        &self,
        key: UploadKey,
        revision: u64,
        physical: Option<String>,
    ) -> bool {
        let max_age = Duration::from_secs(self.config.upload_max_age_s);
        let mut uploads = self.uploads.lock().expect("poisoned");
        if uploads.len() >= self.config.max_open_uploads {
            uploads.retain(|_, upload| upload.created.elapsed() < max_age);
            if uploads.len() >= self.config.max_open_uploads {
                return false;
            }
        }
        uploads.insert(
            key,
            Upload {
                revision,
                physical,
                created: Instant::now(),
            },
        );
        true
    }

    /// An open upload, if it is known and not too old.
    pub(crate) fn upload(&self, key: &UploadKey) -> Option<Upload> {
        let max_age = Duration::from_secs(self.config.upload_max_age_s);
        let uploads = self.uploads.lock().expect("poisoned");
        uploads
            .get(key)
            .filter(|upload| upload.created.elapsed() < max_age)
            .cloned()
    }

    /// Forgets an upload (completed or aborted).
    pub(crate) fn forget_upload(&self, key: &UploadKey) {
        self.uploads.lock().expect("poisoned").remove(key);
    }

    /// Sends one signed upstream request; the response body is read whole (write responses
    /// are small XML documents).
    pub(crate) async fn send(
        &self,
        method: &str,
        path: &str,
        headers: Vec<(String, String)>,
        body: reqwest::Body,
        content_length: Option<u64>,
    ) -> Result<UpstreamResponse, S3Error> {
        self.send_streaming(method, path, headers, body, content_length, None)
            .await
    }

    /// [`Shared::send`] for a body that streams from the client: `progress` counts pieces
    /// sent, and the store is given up on only after `upstream_timeout_ms` without progress
    /// or answer (an idle timeout, so a long upload is not cut off).
    pub(crate) async fn send_streaming(
        &self,
        method: &str,
        path: &str,
        headers: Vec<(String, String)>,
        body: reqwest::Body,
        content_length: Option<u64>,
        progress: Option<&AtomicU64>,
    ) -> Result<UpstreamResponse, S3Error> {
        if !self.upstream.sent_as_judged(path) {
            // Backstop: the request was judged for another path than the one the HTTP client
            // would send; nothing goes out.
            return Err(S3Error::Upstream(format!(
                "refusing to send {method} {path}: the HTTP client would normalize the path"
            )));
        }
        let mut headers = headers;
        headers.push(("host".to_owned(), self.upstream.host_header()));
        let signature = self.upstream.sign(method, path, &headers)?;
        let method = reqwest::Method::from_bytes(method.as_bytes())
            .map_err(|e| S3Error::Upstream(e.to_string()))?;
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.upstream.base));
        for (name, value) in headers.iter().chain(signature.iter()) {
            request = request.header(name.as_str(), value.as_str());
        }
        if let Some(len) = content_length {
            request = request.header("content-length", len.to_string());
        }
        let timeout = Duration::from_millis(self.config.upstream_timeout_ms);
        let silent = || {
            S3Error::Upstream(format!(
                "the store did not answer within upstream_timeout_ms ({} ms)",
                timeout.as_millis()
            ))
        };
        let sending = request.body(body).send();
        tokio::pin!(sending);
        let read = |p: Option<&AtomicU64>| p.map_or(0, |p| p.load(Ordering::Relaxed));
        let mut seen = read(progress);
        let response = loop {
            tokio::select! {
                response = &mut sending => {
                    break response.map_err(|e| S3Error::Upstream(e.to_string()))?;
                }
                () = tokio::time::sleep(timeout) => {
                    let now = read(progress);
                    if now == seen {
                        return Err(silent());
                    }
                    seen = now;
                }
            }
        };
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .filter_map(|(n, v)| {
                v.to_str()
                    .ok()
                    .map(|v| (n.as_str().to_owned(), v.to_owned()))
            })
            .collect();
        let body = tokio::time::timeout(timeout, response.bytes())
            .await
            .map_err(|_| silent())?
            .map_err(|e| S3Error::Upstream(e.to_string()))?;
        Ok(UpstreamResponse {
            status,
            headers,
            body,
        })
    }

    /// HEADs an object: its state, or `None` when it does not exist.
    pub(crate) async fn head(
        &self,
        bucket: &str,
        key: &str,
    ) -> Result<Option<ObjectState>, S3Error> {
        let headers = self.head_headers(bucket, key, "").await?;
        Ok(headers.and_then(|headers| {
            ObjectState::from_headers(headers.iter().map(|(n, v)| (n.as_str(), v.as_str())))
        }))
    }

    pub(crate) async fn head_headers(
        &self,
        bucket: &str,
        key: &str,
        query: &str,
    ) -> Result<Option<Vec<(String, String)>>, S3Error> {
        let path = Upstream::path_and_query(Some(bucket), Some(key), query);
        let response = self
            .send(
                "HEAD",
                &path,
                Vec::new(),
                reqwest::Body::from(Bytes::new()),
                None,
            )
            .await?;
        match response.status {
            200 => Ok(Some(response.headers)),
            404 => Ok(None),
            status => Err(S3Error::Upstream(format!(
                "HEAD {bucket}/{key} answered {status}"
            ))),
        }
    }
}

pub(crate) struct UpstreamResponse {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Bytes,
}

impl UpstreamResponse {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// A 2xx answer without an `<Error>` document (S3 may answer CompleteMultipartUpload and
    /// CopyObject with 200 and an error body).
    pub(crate) fn succeeded(&self) -> bool {
        (200..300).contains(&self.status)
            && !(self.body.starts_with(b"<?xml") && contains(&self.body, b"<Error>"))
    }
}

impl UpstreamResponse {
    /// Whether the store refused the write's precondition (someone wrote in between).
    /// S3 may answer CompleteMultipartUpload with 200 and an `<Error>` body.
    pub(crate) fn lost_race(&self) -> bool {
        matches!(self.status, 409 | 412)
            || (self.status == 200
                && self.body.starts_with(b"<?xml")
                && contains(&self.body, b"<Error>")
                && contains(&self.body, b"PreconditionFailed"))
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The query string's parameters, decoded.
pub fn query_pairs(raw_query: &str) -> Vec<(String, String)> {
    raw_query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            let d = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8_lossy()
                    .into_owned()
            };
            (d(k), d(v))
        })
        .collect()
}

/// A running gateway's client credentials, for a reload: [`S3Clients::reload`] reads
/// `clients_env` and `clients_file` again; requests verified after it use the new ones.
#[derive(Clone)]
pub struct S3Clients {
    pub(crate) shared: Arc<Shared>,
}

impl S3Clients {
    /// Reads the client credentials `config` names (its other settings are ignored) and puts
    /// them in force; returns how many there are. On an error the credentials in force stay.
    pub fn reload(&self, config: &S3Config) -> Result<usize, S3Error> {
        let clients = crate::proxy::load_clients(config)?;
        let n = clients.len();
        *self
            .shared
            .clients
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Arc::new(clients);
        Ok(n)
    }
}
