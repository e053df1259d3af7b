//! Writes: everything that is not a `GET`/`HEAD`, answered from pingora's `request_filter`.
//!
//! A write to an unprotected bucket (or an inert multipart step) streams through, re-signed.
//! A fenced write runs the object-mode loop: read the object's ETag and fence with a fresh
//! HEAD (never an ETag remembered from this node's own write: another node may have written
//! identical bytes, same ETag, with a higher fence since), plan the conditional request
//! ([`crate::rewrite::plan_write`]), send it; when the store answers 412/409 someone wrote in
//! between, so re-read and try again (bounded), refusing as soon as the fence is above the
//! token. The decision is always the store's: the gateway never writes unconditionally.
//!
//! Bodies are verified while they stream (payload SHA-256 or chunk signatures); the last piece
//! is held back until the check passes, so a body that fails it never reaches the store whole.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use bytes::Bytes;
use fencegate_core::{
    AuditEvent, AuditSink, OperationSummary, RejectReason, Rejection, Resource, Token, TokenPolicy,
};
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use sha2::{Digest, Sha256};

use crate::chunked::{ChunkDecoder, ChunkError};
use crate::config::{ProtectRule, S3Config};
use crate::error::S3Error;
use crate::error_xml::S3ErrorBody;
use crate::multi_delete::{self, DeleteEntry, DeleteOutcome};
use crate::rewrite::{
    plan_write, ClientConditions, ObjectState, Operation, Target, WriteKind, WritePlan,
    FENCE_RESOURCE_HEADER, FENCE_REVISION_HEADER, TOKEN_HEADER,
};
use crate::sigv4_verify::{PayloadMode, Verified};
use crate::upstream::{Upstream, DROPPED_HEADERS};

/// The largest XML body (CompleteMultipartUpload, DeleteObjects) accepted.
const MAX_XML_BODY: usize = 2 * 1024 * 1024;

/// State shared by every request of one gateway.
pub struct Shared {
    pub(crate) config: S3Config,
    pub(crate) clients: HashMap<String, String>,
    pub(crate) upstream: Upstream,
    policy: TokenPolicy,
    pub(crate) audit: Arc<dyn AuditSink>,
    http: reqwest::Client,
    /// Fenced multipart uploads: `(bucket, key, upload id)` -> the revision its fence
    /// metadata carries and when it was created. Forgotten by age only (a flood of new uploads
    /// is refused instead of evicting a holder's), bounded by `max_open_uploads`.
    uploads: Mutex<HashMap<UploadKey, Upload>>,
    /// Manifest mode: `(bucket, resource)` -> the manifest last read or committed, by ETag.
    /// One entry per manifest-mode rule, so bounded by the config.
    pub(crate) manifests: Mutex<HashMap<(String, String), crate::manifest_store::Loaded>>,
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
        let timeout = Duration::from_millis(config.upstream_timeout_ms);
        // connect and read timeouts (not a total one): a large body may take long to send,
        // but a store that stops answering is given up on after `timeout`.
        let mut http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .connect_timeout(timeout)
            .read_timeout(timeout);
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
            clients,
            upstream,
            policy,
            audit,
            http,
            uploads: Mutex::new(HashMap::new()),
            manifests: Mutex::new(HashMap::new()),
        })
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
        let response = request
            .body(body)
            .send()
            .await
            .map_err(|e| S3Error::Upstream(e.to_string()))?;
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
        let body = response
            .bytes()
            .await
            .map_err(|e| S3Error::Upstream(e.to_string()))?;
        Ok(UpstreamResponse {
            status,
            headers,
            body,
        })
    }

    /// HEADs an object: its state, or `None` when it does not exist.
    async fn head(&self, bucket: &str, key: &str) -> Result<Option<ObjectState>, S3Error> {
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
    fn lost_race(&self) -> bool {
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

/// Answers the client with an S3 XML error.
pub async fn respond_error(
    session: &mut Session,
    status: u16,
    code: &'static str,
    message: &str,
    resource: &str,
    request_id: &str,
) {
    let body = S3ErrorBody::new(status, code, message, resource, request_id);
    respond_body(session, &body).await;
}

async fn respond_body(session: &mut Session, error: &S3ErrorBody) {
    let xml = Bytes::from(error.to_xml());
    respond(
        session,
        error.status,
        vec![("content-type".into(), "application/xml".into())],
        xml,
        &error.request_id,
    )
    .await;
}

pub(crate) async fn respond(
    session: &mut Session,
    status: u16,
    headers: Vec<(String, String)>,
    body: Bytes,
    request_id: &str,
) {
    let Ok(mut response) = ResponseHeader::build(status, Some(headers.len() + 3)) else {
        return;
    };
    for (name, value) in headers {
        if [
            "content-length",
            "transfer-encoding",
            "connection",
            "keep-alive",
        ]
        .contains(&name.to_ascii_lowercase().as_str())
        {
            continue;
        }
        let _ = response.append_header(name, value);
    }
    let _ = response.insert_header("content-length", body.len().to_string());
    let _ = response.insert_header("x-amz-request-id", request_id.to_owned());
    let head_only = session.req_header().method == http::Method::HEAD;
    let end = body.is_empty() || head_only;
    if let Err(e) = session.write_response_header(Box::new(response), end).await {
        tracing::debug!(error = %e, "writing a response header to the client failed");
        return;
    }
    if !end {
        if let Err(e) = session.write_response_body(Some(body), true).await {
            tracing::debug!(error = %e, "writing a response body to the client failed");
        }
    }
}

/// A failure reading the client's body.
pub(crate) enum BodyError {
    /// The client sent something wrong: answer with this.
    Client(u16, &'static str, String),
    /// The connection failed.
    Io,
}

impl From<ChunkError> for BodyError {
    fn from(e: ChunkError) -> Self {
        match e {
            ChunkError::BadSignature => {
                BodyError::Client(403, "SignatureDoesNotMatch", e.to_string())
            }
            ChunkError::Truncated => BodyError::Client(400, "IncompleteBody", e.to_string()),
            ChunkError::LengthMismatch => BodyError::Client(400, "IncompleteBody", e.to_string()),
            ChunkError::Framing(_) => BodyError::Client(400, "InvalidRequest", e.to_string()),
        }
    }
}

/// Reads the client's body, checking it as it streams; holds back the last piece until the
/// whole body has been checked.
pub(crate) struct BodyReader {
    hash: Option<(Sha256, String)>,
    decoder: Option<ChunkDecoder>,
    queue: VecDeque<Bytes>,
    held: Option<Bytes>,
    eof: bool,
    expect_continue: bool,
    /// CRC32 of the decoded body when the client announced an `x-amz-checksum-crc32` trailer.
    crc32: Option<crc32fast::Hasher>,
}

impl BodyReader {
    pub(crate) fn new(verified: &Verified, headers: &[(String, String)]) -> Self {
        let decoded_len =
            header(headers, "x-amz-decoded-content-length").and_then(|v| v.parse().ok());
        let (hash, decoder) = match &verified.payload {
            PayloadMode::Unsigned => (None, None),
            PayloadMode::Sha256(hex) => (Some((Sha256::new(), hex.clone())), None),
            PayloadMode::SignedChunks { trailer } => (
                None,
                Some(ChunkDecoder::new(
                    Some(verified.chunk_context.clone()),
                    *trailer,
                    decoded_len,
                )),
            ),
            PayloadMode::UnsignedChunksTrailer => {
                (None, Some(ChunkDecoder::new(None, false, decoded_len)))
            }
        };
        let decoder_present = decoder.is_some();
        let expect_continue =
            header(headers, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        Self {
            hash,
            decoder,
            queue: VecDeque::new(),
            held: None,
            eof: false,
            expect_continue,
            crc32: (decoder_present
                && header(headers, "x-amz-trailer")
                    .is_some_and(|t| t.eq_ignore_ascii_case("x-amz-checksum-crc32")))
            .then(crc32fast::Hasher::new),
        }
    }

    async fn next(&mut self, session: &mut Session) -> Result<Option<Bytes>, BodyError> {
        if self.expect_continue {
            self.expect_continue = false;
            session
                .as_downstream_mut()
                .write_continue_response()
                .await
                .map_err(|_| BodyError::Io)?;
        }
        loop {
            if let Some(piece) = self.queue.pop_front() {
                if let Some(previous) = self.held.replace(piece) {
                    return Ok(Some(previous));
                }
                continue;
            }
            if self.eof {
                return Ok(self.held.take());
            }
            match session.read_request_body().await {
                Ok(Some(data)) => {
                    if let Some(decoder) = &mut self.decoder {
                        let mut out = Vec::new();
                        decoder.feed(&data, &mut out)?;
                        if let Some(crc) = &mut self.crc32 {
                            out.iter().for_each(|piece| crc.update(piece));
                        }
                        self.queue.extend(out.into_iter().filter(|b| !b.is_empty()));
                    } else {
                        if let Some((hasher, _)) = &mut self.hash {
                            hasher.update(&data);
                        }
                        if !data.is_empty() {
                            self.queue.push_back(data);
                        }
                    }
                }
                Ok(None) => {
                    self.eof = true;
                    if let Some(decoder) = &self.decoder {
                        decoder.finish()?;
                        if let Some(crc) = self.crc32.take() {
                            let want = STANDARD.encode(crc.finalize().to_be_bytes());
                            let got = decoder
                                .trailers()
                                .iter()
                                .find(|(n, _)| n == "x-amz-checksum-crc32")
                                .map(|(_, v)| v.as_str());
                            if got != Some(want.as_str()) {
                                return Err(BodyError::Client(
                                    400,
                                    "BadDigest",
                                    "The CRC32 you specified did not match the calculated checksum."
                                        .into(),
                                ));
                            }
                        }
                    }
                    if let Some((hasher, want)) = self.hash.take() {
                        if hex::encode(hasher.finalize()) != *want {
                            return Err(BodyError::Client(
                                400,
                                "XAmzContentSHA256Mismatch",
                                "The provided 'x-amz-content-sha256' header does not match what was computed.".into(),
                            ));
                        }
                    }
                }
                Err(_) => return Err(BodyError::Io),
            }
        }
    }

    /// Reads the whole body, refusing it past `limit` bytes.
    pub(crate) async fn read_all(
        &mut self,
        session: &mut Session,
        limit: usize,
    ) -> Result<Bytes, BodyError> {
        let mut pieces = Vec::new();
        let mut len = 0;
        while let Some(piece) = self.next(session).await? {
            len += piece.len();
            if len > limit {
                return Err(BodyError::Client(
                    413,
                    "EntityTooLarge",
                    format!("the body is larger than {limit} bytes"),
                ));
            }
            pieces.push(piece);
        }
        Ok(Bytes::from(pieces.concat()))
    }

    /// Trailer checksums (`x-amz-checksum-*`) of an aws-chunked body, to forward as headers.
    pub(crate) fn trailer_checksums(&self) -> Vec<(String, String)> {
        self.decoder
            .as_ref()
            .map(|d| {
                d.trailers()
                    .iter()
                    .filter(|(n, _)| n.starts_with("x-amz-checksum-"))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}

pub(crate) fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Where a write's body comes from on each attempt.
pub(crate) enum Payload {
    /// Held whole: can be resent.
    Buffered(Bytes),
    /// Streams once from the client.
    Stream(u64),
}

/// One write request being answered.
pub(crate) struct WriteSession<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) session: &'a mut Session,
    pub(crate) request_id: String,
    pub(crate) method: String,
    pub(crate) raw_query: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) verified: Verified,
    pub(crate) target: Target,
    pub(crate) operation: Operation,
}

impl WriteSession<'_> {
    pub(crate) async fn run(&mut self) {
        let Some(bucket) = self.target.bucket.clone() else {
            self.error(
                405,
                "MethodNotAllowed",
                "this method is not allowed on the service",
            )
            .await;
            return;
        };
        if self.operation == Operation::DeleteObjects {
            self.delete_objects(&bucket).await;
            return;
        }
        let key = self.target.key.clone();
        if key.is_none() && self.shared.config.bucket_protected(&bucket) {
            // A bucket-level write (lifecycle, policy, versioning, deletion, ...) can change
            // every key of the bucket, whatever rule its keys fall under: fail closed.
            let detail = format!(
                "{} on bucket {bucket}, which has protected keys, cannot be fenced; refused (fail closed): change bucket settings directly on the store with an admin credential",
                self.operation.name()
            );
            self.refuse(Rejection::new(RejectReason::Unsupported, detail), None)
                .await;
            return;
        }
        if key
            .as_deref()
            .is_some_and(|k| k.starts_with(crate::manifest::RESERVED_PREFIX))
            && self.shared.config.bucket_has_manifest(&bucket)
        {
            let detail = format!(
                "{} is the gateway's own manifest-mode storage; clients cannot write it",
                self.target.display()
            );
            self.refuse(Rejection::new(RejectReason::Unsupported, detail), None)
                .await;
            return;
        }
        let rule = self
            .shared
            .config
            .rule_for(&bucket, key.as_deref())
            .cloned();
        let Some(rule) = rule.filter(|r| r.mode.fenced()) else {
            self.pass_through(&bucket, key.as_deref()).await;
            return;
        };
        if let Operation::OtherWrite(what) = &self.operation {
            let detail = format!(
                "{what} on protected {} cannot be fenced in object mode; refused (fail closed)",
                self.target.display()
            );
            self.refuse(Rejection::new(RejectReason::Unsupported, detail), None)
                .await;
            return;
        }
        let token = match self.token(&rule) {
            Ok(token) => token,
            Err(rejection) => {
                self.refuse(rejection, None).await;
                return;
            }
        };
        let key = key.expect("object operations name a key");
        if rule.mode == crate::config::ProtectMode::Manifest {
            return self.manifest_write(&bucket, &key, &rule, &token).await;
        }
        match self.operation.clone() {
            Operation::PutObject | Operation::CopyObject => {
                self.fenced_replace(&bucket, &key, &token, None).await
            }
            Operation::CompleteMultipartUpload { upload_id } => {
                self.fenced_replace(&bucket, &key, &token, Some(upload_id))
                    .await
            }
            Operation::CreateMultipartUpload => self.create_upload(&bucket, &key, &token).await,
            Operation::DeleteObject => self.fenced_delete(&bucket, &key, &token).await,
            // UploadPart(Copy) and AbortMultipartUpload are inert until completion, but still
            // need a valid token for the rule's resource: a tokenless client must not be able
            // to abort the holder's upload or swap its parts.
            _ => self.pass_through(&bucket, Some(&key)).await,
        }
    }

    /// Refuses (and audits) a request whose key an HTTP client would rewrite on the way to
    /// the store (`.`/`..` segments): what is judged must be what the store executes.
    pub(crate) async fn refuse_normalized_path(&mut self) {
        let rejection = normalized_path_rejection(&self.target.display());
        self.refuse(rejection, None).await;
    }

    pub(crate) fn token(&self, rule: &ProtectRule) -> Result<Token, Rejection> {
        let Some(presented) = header(&self.headers, TOKEN_HEADER) else {
            return Err(Rejection::new(
                RejectReason::Missing,
                format!(
                    "a write to protected {} needs a Fencing-Token header",
                    self.target.display()
                ),
            ));
        };
        let route = rule.resource.as_deref().and_then(|r| Resource::new(r).ok());
        self.shared
            .policy
            .check(presented, route.as_ref())
            .map_err(|e| {
                let mut rejection =
                    Rejection::new(RejectReason::from_token_error(&e), e.to_string());
                if let Ok(parsed) = Token::parse(presented) {
                    rejection = rejection.with_token(parsed.resource().clone(), parsed.revision());
                }
                rejection
            })
    }

    pub(crate) async fn error(&mut self, status: u16, code: &'static str, message: &str) {
        let resource = format!("/{}", self.target.display());
        respond_error(
            self.session,
            status,
            code,
            message,
            &resource,
            &self.request_id,
        )
        .await;
    }

    pub(crate) async fn upstream_failed(&mut self, e: S3Error) {
        tracing::warn!(request_id = %self.request_id, error = %e, "upstream request failed");
        self.error(
            503,
            "ServiceUnavailable",
            "the gateway could not reach the store; nothing was written by this request",
        )
        .await;
    }

    pub(crate) async fn body_failed(&mut self, e: BodyError) {
        match e {
            BodyError::Client(status, code, message) => self.error(status, code, &message).await,
            BodyError::Io => {
                tracing::debug!(request_id = %self.request_id, "the client's body could not be read")
            }
        }
    }

    /// Audits a refusal (once), then answers it.
    pub(crate) async fn refuse(&mut self, rejection: Rejection, key: Option<&str>) {
        let event = self.audit_event(&rejection, key);
        tracing::info!(request_id = %self.request_id, reason = rejection.reason.label(), target = %self.target.display(), "write refused");
        if let Err(e) = self.shared.audit.refused(event).await {
            tracing::error!(request_id = %self.request_id, error = %e, "the refusal could not be audited");
        }
        let resource = format!("/{}", self.target.display());
        let body = S3ErrorBody::from_rejection(&rejection, &resource, &self.request_id);
        respond_body(self.session, &body).await;
    }

    pub(crate) fn audit_event(&self, rejection: &Rejection, key: Option<&str>) -> AuditEvent {
        let presented = header(&self.headers, TOKEN_HEADER).and_then(|t| Token::parse(t).ok());
        let object = match key {
            Some(key) => format!("{}/{key}", self.target.bucket.as_deref().unwrap_or("")),
            None => self.target.display(),
        };
        AuditEvent {
            store: "s3".into(),
            client_addr: self
                .session
                .client_addr()
                .map(|a| a.to_string())
                .unwrap_or_default(),
            client_identity: Some(self.verified.access_key.clone()),
            resource: rejection.resource.as_ref().map(ToString::to_string),
            token: presented.as_ref().map(Token::unsigned_form),
            token_signed: presented.as_ref().is_some_and(Token::is_signed),
            revision: rejection.revision.map(|r| r.get()),
            fence: match rejection.reason {
                RejectReason::Stale { fence } => Some(fence),
                _ => None,
            },
            reason: rejection.reason.label().into(),
            detail: rejection.detail.clone(),
            operation: OperationSummary {
                command: self.operation.name(),
                objects: vec![object.chars().take(200).collect()],
                args: 0,
                bytes: header(&self.headers, "x-amz-decoded-content-length")
                    .or_else(|| header(&self.headers, "content-length"))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0),
            },
            request_id: self.request_id.clone(),
        }
    }

    /// The client's headers that go upstream: without its signature, framing, the token, and
    /// any fence metadata it tried to set itself; `conditions` false also drops its
    /// `If-Match`/`If-None-Match` (the plan sets them).
    pub(crate) fn upstream_headers(&self, conditions: bool) -> Vec<(String, String)> {
        self.headers
            .iter()
            .filter(|(n, _)| {
                !DROPPED_HEADERS.contains(&n.as_str())
                    && !n.starts_with("x-amz-meta-fencegate-")
                    && (conditions || (n != "if-match" && n != "if-none-match"))
            })
            .map(|(n, v)| {
                if n == "content-encoding" {
                    // aws-chunked is this hop's framing only.
                    let rest: Vec<&str> = v
                        .split(',')
                        .map(str::trim)
                        .filter(|e| !e.eq_ignore_ascii_case("aws-chunked"))
                        .collect();
                    (n.clone(), rest.join(","))
                } else {
                    (n.clone(), v.clone())
                }
            })
            .filter(|(n, v)| !(n == "content-encoding" && v.is_empty()))
            .collect()
    }

    pub(crate) fn body_length(&self) -> Option<u64> {
        let name = if self.verified.payload.is_chunked() {
            "x-amz-decoded-content-length"
        } else {
            "content-length"
        };
        header(&self.headers, name).and_then(|v| v.parse().ok())
    }

    /// Streams a request through, re-signed, without fencing.
    pub(crate) async fn pass_through(&mut self, bucket: &str, key: Option<&str>) {
        let path = Upstream::path_and_query(Some(bucket), key, &self.raw_query);
        let headers = self.upstream_headers(true);
        let len = self.body_length();
        let mut reader = BodyReader::new(&self.verified, &self.headers);
        let result = match len {
            Some(len) => self.stream(&mut reader, &path, headers, len).await,
            None => match reader
                .read_all(self.session, self.shared.config.retry_buffer_bytes)
                .await
            {
                Ok(body) => {
                    let len = body.len() as u64;
                    self.shared
                        .send(&self.method, &path, headers, body.into(), Some(len))
                        .await
                        .map_err(SendError::Upstream)
                }
                Err(e) => Err(SendError::Body(e)),
            },
        };
        match result {
            Ok(response) => {
                if self.operation == Operation::CreateMultipartUpload
                    || matches!(self.operation, Operation::CompleteMultipartUpload { .. })
                {
                    // Unprotected: nothing to remember.
                }
                self.relay(response).await;
            }
            Err(SendError::Body(e)) => self.body_failed(e).await,
            Err(SendError::Upstream(e)) => self.upstream_failed(e).await,
        }
    }

    /// Streams the client's body into one upstream request.
    pub(crate) async fn stream(
        &mut self,
        reader: &mut BodyReader,
        path: &str,
        headers: Vec<(String, String)>,
        len: u64,
    ) -> Result<UpstreamResponse, SendError> {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        let body = reqwest::Body::wrap_stream(stream);
        let session = &mut *self.session;
        let pump = async move {
            loop {
                match reader.next(session).await {
                    Ok(Some(piece)) => {
                        if tx.send(Ok(piece)).await.is_err() {
                            return Ok(());
                        }
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        // Abort the upstream request: the store never sees the whole body.
                        let _ = tx
                            .send(Err(std::io::Error::other("the client's body was refused")))
                            .await;
                        return Err(e);
                    }
                }
            }
        };
        let send = self
            .shared
            .send(&self.method, path, headers, body, Some(len));
        let (pumped, sent) = tokio::join!(pump, send);
        pumped.map_err(SendError::Body)?;
        sent.map_err(SendError::Upstream)
    }

    pub(crate) async fn relay(&mut self, response: UpstreamResponse) {
        let headers = response
            .headers
            .into_iter()
            .filter(|(n, _)| !matches!(n.as_str(), "date" | "server" | "x-amz-request-id"))
            .collect();
        respond(
            self.session,
            response.status,
            headers,
            response.body,
            &self.request_id,
        )
        .await;
    }

    /// The object-mode loop for PUT, copy and multipart completion.
    async fn fenced_replace(
        &mut self,
        bucket: &str,
        key: &str,
        token: &Token,
        upload_id: Option<String>,
    ) {
        let target = format!("{bucket}/{key}");
        if let Some(upload_id) = &upload_id {
            let created = self
                .shared
                .upload(&(bucket.to_owned(), key.to_owned(), upload_id.clone()))
                .map(|upload| upload.revision);
            let revision = token.revision().get();
            let rejection = match created {
                None => Some(Rejection::new(
                    RejectReason::Unsupported,
                    format!("upload {upload_id} was not created for {target} through this gateway with a fencing token (or is too old); restart it with CreateMultipartUpload on this key"),
                )),
                Some(created) if created > revision => Some(Rejection::new(
                    RejectReason::Stale { fence: created },
                    format!("fencing token revision {revision} is below the revision {created} the upload of {target} was created with"),
                )),
                Some(created) if created < revision => Some(Rejection::new(
                    RejectReason::OutOfScope,
                    format!("the upload of {target} was created with revision {created}; complete it with that token or restart it"),
                )),
                Some(_) => None,
            };
            if let Some(rejection) = rejection {
                self.refuse(
                    rejection.with_token(token.resource().clone(), token.revision()),
                    None,
                )
                .await;
                return;
            }
        }
        let conditions = ClientConditions {
            if_match: header(&self.headers, "if-match").map(str::to_owned),
            if_none_match: header(&self.headers, "if-none-match").map(str::to_owned),
        };
        let mut extra: Vec<(String, String)> = Vec::new();
        if self.operation == Operation::CopyObject {
            match self.copy_metadata().await {
                Ok(Some(headers)) => extra = headers,
                Ok(None) => {
                    self.error(404, "NoSuchKey", "The copy source does not exist.")
                        .await;
                    return;
                }
                Err(e) => return self.upstream_failed(e).await,
            }
        }
        let path = Upstream::path_and_query(Some(bucket), Some(key), &self.raw_query);
        let mut reader = BodyReader::new(&self.verified, &self.headers);
        let len = self.body_length();
        let xml = upload_id.is_some();
        let payload = match len {
            Some(len) if !xml && len > self.shared.config.retry_buffer_bytes as u64 => {
                Payload::Stream(len)
            }
            _ => {
                let limit = if xml {
                    MAX_XML_BODY
                } else {
                    self.shared.config.retry_buffer_bytes
                };
                match reader.read_all(self.session, limit).await {
                    Ok(body) => Payload::Buffered(body),
                    Err(e) => return self.body_failed(e).await,
                }
            }
        };
        extra.extend(reader.trailer_checksums());
        for _attempt in 0..self.shared.config.max_attempts {
            let observed = match self.shared.head(bucket, key).await {
                Ok(state) => state,
                Err(e) => return self.upstream_failed(e).await,
            };
            let plan = plan_write(
                WriteKind::Replace,
                token,
                &target,
                observed.as_ref(),
                &conditions,
            );
            let plan_headers = match plan {
                WritePlan::Refuse(rejection) => return self.refuse(rejection, None).await,
                WritePlan::PreconditionFailed => {
                    return self
                        .error(
                            412,
                            "PreconditionFailed",
                            "At least one of the pre-conditions you specified did not hold",
                        )
                        .await
                }
                WritePlan::NoSuchKey | WritePlan::NothingToDelete => {
                    return self
                        .error(404, "NoSuchKey", "The specified key does not exist.")
                        .await
                }
                WritePlan::Send { headers } => headers,
            };
            let mut headers = self.upstream_headers(false);
            headers.retain(|(n, _)| !extra.iter().any(|(e, _)| e == n));
            headers.extend(extra.iter().cloned());
            headers.extend(plan_headers.into_iter().map(|(n, v)| (n.to_owned(), v)));
            if self.operation == Operation::CopyObject {
                headers.retain(|(n, _)| n != "x-amz-metadata-directive");
                headers.push(("x-amz-metadata-directive".into(), "REPLACE".into()));
            }
            let result = match &payload {
                Payload::Buffered(body) => {
                    let len = body.len() as u64;
                    self.shared
                        .send(&self.method, &path, headers, body.clone().into(), Some(len))
                        .await
                        .map_err(SendError::Upstream)
                }
                Payload::Stream(len) => self.stream(&mut reader, &path, headers, *len).await,
            };
            let response = match result {
                Ok(response) => response,
                Err(SendError::Body(e)) => return self.body_failed(e).await,
                Err(SendError::Upstream(e)) => return self.upstream_failed(e).await,
            };
            if response.lost_race() || (response.status == 404 && observed.is_some() && !xml) {
                // Someone wrote (or deleted) in between: nothing of ours was applied.
                if let Payload::Stream(_) = payload {
                    return self.after_lost_stream(bucket, key, token, &target).await;
                }
                continue;
            }
            if (200..300).contains(&response.status) {
                self.shared.audit.applied("s3");
                if let Some(upload_id) = &upload_id {
                    self.shared.forget_upload(&(
                        bucket.to_owned(),
                        key.to_owned(),
                        upload_id.clone(),
                    ));
                }
            }
            return self.relay(response).await;
        }
        self.error(
            503,
            "SlowDown",
            "the object kept changing under this conditional write; retry",
        )
        .await;
    }

    /// A streamed write lost a race and cannot be resent: refuse if a newer holder wrote,
    /// else ask the client to retry.
    async fn after_lost_stream(&mut self, bucket: &str, key: &str, token: &Token, target: &str) {
        match self.shared.head(bucket, key).await {
            Ok(observed) => {
                if let WritePlan::Refuse(rejection) = plan_write(
                    WriteKind::Replace,
                    token,
                    target,
                    observed.as_ref(),
                    &ClientConditions::default(),
                ) {
                    return self.refuse(rejection, None).await;
                }
                self.error(
                    503,
                    "SlowDown",
                    "another write changed the object during this upload; retry",
                )
                .await;
            }
            Err(e) => self.upstream_failed(e).await,
        }
    }

    /// For a copy with the COPY metadata directive: the source's user metadata and content
    /// headers, to send with REPLACE (so the destination can carry the new fence).
    async fn copy_metadata(&self) -> Result<Option<Vec<(String, String)>>, S3Error> {
        if header(&self.headers, "x-amz-metadata-directive")
            .is_some_and(|d| d.eq_ignore_ascii_case("REPLACE"))
        {
            return Ok(Some(Vec::new()));
        }
        let source = header(&self.headers, "x-amz-copy-source").unwrap_or("");
        let (source, version) = source
            .split_once("?versionId=")
            .map_or((source, None), |(s, v)| (s, Some(v)));
        let decoded = percent_encoding::percent_decode_str(source.trim_start_matches('/'))
            .decode_utf8_lossy()
            .into_owned();
        let Some((src_bucket, src_key)) = decoded.split_once('/') else {
            return Ok(None);
        };
        let query = version
            .map(|v| format!("versionId={v}"))
            .unwrap_or_default();
        let Some(headers) = self
            .shared
            .head_headers(src_bucket, src_key, &query)
            .await?
        else {
            return Ok(None);
        };
        const CONTENT: &[&str] = &[
            "content-type",
            "cache-control",
            "content-disposition",
            "content-encoding",
            "content-language",
            "expires",
        ];
        Ok(Some(
            headers
                .into_iter()
                .filter(|(n, _)| {
                    let n = n.to_ascii_lowercase();
                    (n.starts_with("x-amz-meta-") && !n.starts_with("x-amz-meta-fencegate-"))
                        || CONTENT.contains(&n.as_str())
                })
                .map(|(n, v)| (n.to_ascii_lowercase(), v))
                .collect(),
        ))
    }

    /// CreateMultipartUpload on a protected object: refused if the fence is already above the
    /// token; otherwise created with the token's fence in its metadata (applied at completion).
    async fn create_upload(&mut self, bucket: &str, key: &str, token: &Token) {
        let target = format!("{bucket}/{key}");
        match self.shared.head(bucket, key).await {
            Ok(observed) => {
                if let WritePlan::Refuse(rejection) = plan_write(
                    WriteKind::Replace,
                    token,
                    &target,
                    observed.as_ref(),
                    &ClientConditions::default(),
                ) {
                    return self.refuse(rejection, None).await;
                }
            }
            Err(e) => return self.upstream_failed(e).await,
        }
        let path = Upstream::path_and_query(Some(bucket), Some(key), &self.raw_query);
        let mut headers = self.upstream_headers(true);
        headers.push((
            FENCE_REVISION_HEADER.into(),
            token.revision().get().to_string(),
        ));
        headers.push((FENCE_RESOURCE_HEADER.into(), token.resource().to_string()));
        match self
            .shared
            .send(&self.method, &path, headers, Bytes::new().into(), Some(0))
            .await
        {
            Ok(response) => {
                if response.status == 200 {
                    if let Some(upload_id) = xml_text(&response.body, "UploadId") {
                        let upload = (bucket.to_owned(), key.to_owned(), upload_id);
                        if !self
                            .shared
                            .track_upload(upload, token.revision().get(), None)
                        {
                            // Not tracked means its completion would be refused: say so now.
                            return self
                                .error(
                                    503,
                                    "SlowDown",
                                    "too many fenced multipart uploads are open; complete or abort some, then retry",
                                )
                                .await;
                        }
                    }
                }
                self.relay(response).await;
            }
            Err(e) => self.upstream_failed(e).await,
        }
    }

    /// One fenced delete of `key`: `Ok(status)` when done, `Err(rejection)` when refused.
    async fn delete_one(
        &self,
        bucket: &str,
        key: &str,
        token: &Token,
        conditions: &ClientConditions,
    ) -> Result<Result<DeleteDone, Rejection>, S3Error> {
        let target = format!("{bucket}/{key}");
        let path = Upstream::path_and_query(Some(bucket), Some(key), "");
        for _attempt in 0..self.shared.config.max_attempts {
            let observed = self.shared.head(bucket, key).await?;
            match plan_write(
                WriteKind::Delete,
                token,
                &target,
                observed.as_ref(),
                conditions,
            ) {
                WritePlan::Refuse(rejection) => return Ok(Err(rejection)),
                WritePlan::PreconditionFailed => return Ok(Ok(DeleteDone::PreconditionFailed)),
                WritePlan::NoSuchKey => return Ok(Ok(DeleteDone::NoSuchKey)),
                WritePlan::NothingToDelete => return Ok(Ok(DeleteDone::Deleted)),
                WritePlan::Send { headers } => {
                    let headers = headers
                        .into_iter()
                        .map(|(n, v)| (n.to_owned(), v))
                        .collect();
                    let response = self
                        .shared
                        .send("DELETE", &path, headers, Bytes::new().into(), None)
                        .await?;
                    if response.lost_race() || response.status == 404 {
                        continue;
                    }
                    if (200..300).contains(&response.status) {
                        self.shared.audit.applied("s3");
                        return Ok(Ok(DeleteDone::Deleted));
                    }
                    return Err(S3Error::Upstream(format!(
                        "DELETE {target} answered {}",
                        response.status
                    )));
                }
            }
        }
        Ok(Ok(DeleteDone::Busy))
    }

    async fn fenced_delete(&mut self, bucket: &str, key: &str, token: &Token) {
        let conditions = ClientConditions {
            if_match: header(&self.headers, "if-match").map(str::to_owned),
            if_none_match: None,
        };
        match self.delete_one(bucket, key, token, &conditions).await {
            Ok(Ok(DeleteDone::Deleted)) => {
                respond(
                    self.session,
                    204,
                    Vec::new(),
                    Bytes::new(),
                    &self.request_id,
                )
                .await
            }
            Ok(Ok(DeleteDone::PreconditionFailed)) => {
                self.error(
                    412,
                    "PreconditionFailed",
                    "At least one of the pre-conditions you specified did not hold",
                )
                .await
            }
            Ok(Ok(DeleteDone::NoSuchKey)) => {
                self.error(404, "NoSuchKey", "The specified key does not exist.")
                    .await
            }
            Ok(Ok(DeleteDone::Busy)) => {
                self.error(
                    503,
                    "SlowDown",
                    "the object kept changing under this conditional delete; retry",
                )
                .await
            }
            Ok(Err(rejection)) => self.refuse(rejection, None).await,
            Err(e) => self.upstream_failed(e).await,
        }
    }

    /// DeleteObjects: each key under a protected rule is a fenced, conditional delete; each
    /// refused key is audited and reported in the result document.
    async fn delete_objects(&mut self, bucket: &str) {
        let mut reader = BodyReader::new(&self.verified, &self.headers);
        let body = match reader.read_all(self.session, MAX_XML_BODY).await {
            Ok(body) => body,
            Err(e) => return self.body_failed(e).await,
        };
        let Some(request) = multi_delete::parse(&body) else {
            return self
                .error(400, "MalformedXML", "The XML you provided was not well-formed or did not validate against our published schema.")
                .await;
        };
        let mut outcomes = Vec::new();
        for entry in request.entries {
            let path = Upstream::path_and_query(Some(bucket), Some(&entry.key), "");
            let reserved = entry.key.starts_with(crate::manifest::RESERVED_PREFIX)
                && self.shared.config.bucket_has_manifest(bucket);
            if reserved || !self.shared.upstream.sent_as_judged(&path) {
                let rejection = if reserved {
                    Rejection::new(
                        RejectReason::Unsupported,
                        format!("{bucket}/{} is the gateway's own manifest-mode storage; clients cannot delete it", entry.key),
                    )
                } else {
                    normalized_path_rejection(&format!("{bucket}/{}", entry.key))
                };
                let event = self.audit_event(&rejection, Some(&entry.key));
                if let Err(e) = self.shared.audit.refused(event).await {
                    tracing::error!(request_id = %self.request_id, error = %e, "the refusal could not be audited");
                }
                let (_, code) = crate::error_xml::status_and_code(&rejection.reason);
                outcomes.push((
                    entry,
                    DeleteOutcome::Error {
                        code: code.into(),
                        message: rejection.detail,
                    },
                ));
                continue;
            }
            let rule = self
                .shared
                .config
                .rule_for(bucket, Some(&entry.key))
                .cloned();
            let outcome = match rule.filter(|r| r.mode.fenced()) {
                None => self.plain_delete(bucket, &entry).await,
                Some(rule) => {
                    // Each key is judged by its own rule: a token valid for one prefix's
                    // resource says nothing about another's.
                    let result = match (self.token(&rule), &entry.version_id) {
                        (Err(rejection), _) => Err(rejection),
                        (Ok(_), Some(_)) => Err(Rejection::new(
                            RejectReason::Unsupported,
                            format!("deleting a version of protected {bucket}/{} cannot be fenced; refused", entry.key),
                        )),
                        (Ok(token), None) if rule.mode == crate::config::ProtectMode::Manifest => {
                            let resource = rule.resource.clone().unwrap_or_default();
                            let change = crate::manifest::Change::Delete(entry.key.clone());
                            match self.commit(bucket, &resource, &token, &entry.key, change, &ClientConditions::default()).await {
                                Ok(crate::manifest_write::CommitDone::Committed) => Ok(DeleteOutcome::Deleted),
                                Ok(crate::manifest_write::CommitDone::Refused(rejection)) => Err(rejection),
                                Ok(_) => Ok(DeleteOutcome::Error { code: "SlowDown".into(), message: "retry".into() }),
                                Err(e) => Ok(DeleteOutcome::Error { code: "ServiceUnavailable".into(), message: e.to_string() }),
                            }
                        }
                        (Ok(token), None) => match self.delete_one(bucket, &entry.key, &token, &ClientConditions::default()).await {
                            Ok(Ok(DeleteDone::Deleted)) => Ok(DeleteOutcome::Deleted),
                            Ok(Ok(_)) => Ok(DeleteOutcome::Error { code: "SlowDown".into(), message: "retry".into() }),
                            Ok(Err(rejection)) => Err(rejection),
                            Err(e) => Ok(DeleteOutcome::Error { code: "ServiceUnavailable".into(), message: e.to_string() }),
                        },
                    };
                    match result {
                        Ok(outcome) => outcome,
                        Err(rejection) => {
                            let event = self.audit_event(&rejection, Some(&entry.key));
                            if let Err(e) = self.shared.audit.refused(event).await {
                                tracing::error!(request_id = %self.request_id, error = %e, "the refusal could not be audited");
                            }
                            let (_, code) = crate::error_xml::status_and_code(&rejection.reason);
                            DeleteOutcome::Error {
                                code: code.into(),
                                message: rejection.detail,
                            }
                        }
                    }
                }
            };
            outcomes.push((entry, outcome));
        }
        let xml = multi_delete::result_xml(request.quiet, &outcomes);
        respond(
            self.session,
            200,
            vec![("content-type".into(), "application/xml".into())],
            Bytes::from(xml),
            &self.request_id,
        )
        .await;
    }

    async fn plain_delete(&self, bucket: &str, entry: &DeleteEntry) -> DeleteOutcome {
        let query = entry
            .version_id
            .as_ref()
            .map(|v| format!("versionId={}", crate::sigv4_verify::aws_encode(v)))
            .unwrap_or_default();
        let path = Upstream::path_and_query(Some(bucket), Some(&entry.key), &query);
        match self
            .shared
            .send("DELETE", &path, Vec::new(), Bytes::new().into(), None)
            .await
        {
            Ok(r) if (200..300).contains(&r.status) => DeleteOutcome::Deleted,
            Ok(r) => DeleteOutcome::Error {
                code: "InternalError".into(),
                message: format!("the store answered {}", r.status),
            },
            Err(e) => DeleteOutcome::Error {
                code: "ServiceUnavailable".into(),
                message: e.to_string(),
            },
        }
    }
}

fn normalized_path_rejection(target: &str) -> Rejection {
    Rejection::new(
        RejectReason::Unsupported,
        format!(
            "the key of {target} has `.` or `..` path segments, which HTTP clients and stores resolve to another key; refused"
        ),
    )
}

enum DeleteDone {
    Deleted,
    PreconditionFailed,
    NoSuchKey,
    Busy,
}

pub(crate) enum SendError {
    Body(BodyError),
    Upstream(S3Error),
}

pub(crate) fn xml_text(xml: &[u8], element: &str) -> Option<String> {
    let text = std::str::from_utf8(xml).ok()?;
    let open = format!("<{element}>");
    let start = text.find(&open)? + open.len();
    let end = text[start..].find(&format!("</{element}>"))? + start;
    Some(
        quick_xml::escape::unescape(&text[start..end])
            .ok()?
            .into_owned(),
    )
}
