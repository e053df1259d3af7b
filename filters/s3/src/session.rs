//! One write request (anything that is not a plain read), answered from pingora's
//! `request_filter`: which rule protects it, the token check, refusals and their audit record,
//! and the pass-through of unprotected writes. Object-mode writes are in [`crate::replace`] and
//! [`crate::delete`], manifest-mode ones in [`crate::manifest_write`]. The decision is always
//! the store's: the gateway never writes a protected key unconditionally.

use bytes::Bytes;
use fencegate_core::{
    Attempt, AuditEvent, OperationSummary, RejectReason, Rejection, Resource, Store, Token,
};
use pingora_proxy::Session;

use crate::body::{header, BodyError, BodyReader};
use crate::config::ProtectRule;
use crate::error::S3Error;
use crate::error_xml::S3ErrorBody;
use crate::gateway::{Shared, UpstreamResponse};
use crate::respond::{respond, respond_body, respond_error};
use crate::rewrite::{Operation, Target, SESSION_TOKEN_HEADER, TOKEN_HEADER};
use crate::sigv4_verify::Verified;
use crate::upstream::{Upstream, DROPPED_HEADERS};

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
            && self.shared.config.bucket_protected(&bucket)
        {
            // Manifests, physical objects and upload stamps: the gateway's word.
            let detail = format!(
                "{} is the gateway's own storage; clients cannot write it",
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
            Operation::AbortMultipartUpload => {
                if self.relay_through(&bucket, Some(&key)).await {
                    // The upload is gone: so is its stamp.
                    let upload_id = crate::gateway::query_pairs(&self.raw_query)
                        .into_iter()
                        .find(|(k, _)| k == "uploadId")
                        .map(|(_, v)| v)
                        .unwrap_or_default();
                    self.shared.unstamp_upload(&(bucket, key, upload_id)).await;
                }
            }
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

    /// The token the client presented: the `Fencing-Token` header, else the SigV4 session
    /// token (`x-amz-security-token`, which `AWS_SESSION_TOKEN` sets), for clients such as the
    /// aws CLI that cannot add a header. Both are covered by the client's signature.
    pub(crate) fn presented_token(&self) -> Option<&str> {
        header(&self.headers, TOKEN_HEADER).or_else(|| header(&self.headers, SESSION_TOKEN_HEADER))
    }

    pub(crate) fn token(&self, rule: &ProtectRule) -> Result<Token, Rejection> {
        let Some(presented) = self.presented_token() else {
            return Err(Rejection::new(
                RejectReason::Missing,
                format!(
                    "a write to protected {} needs a Fencing-Token header (or the token as the session token, AWS_SESSION_TOKEN)",
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
        let object = match key {
            Some(key) => format!("{}/{key}", self.target.bucket.as_deref().unwrap_or("")),
            None => self.target.display(),
        };
        let attempt = Attempt {
            store: Store::S3,
            client_addr: self
                .session
                .client_addr()
                .map(|a| a.to_string())
                .unwrap_or_default(),
            client_identity: Some(self.verified.access_key.clone()),
            token: self.presented_token().and_then(|t| Token::parse(t).ok()),
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
        };
        attempt.refused(rejection)
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
        self.relay_through(bucket, key).await;
    }

    /// [`WriteSession::pass_through`], telling whether the store answered 2xx.
    pub(crate) async fn relay_through(&mut self, bucket: &str, key: Option<&str>) -> bool {
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
                let applied = response.succeeded();
                self.relay(response).await;
                applied
            }
            Err(SendError::Body(e)) => {
                self.body_failed(e).await;
                false
            }
            Err(SendError::Upstream(e)) => {
                self.upstream_failed(e).await;
                false
            }
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
        // Pieces handed to the store: the upstream timeout counts from the last one.
        let progress = std::sync::atomic::AtomicU64::new(0);
        let pumped_pieces = &progress;
        let pump = async move {
            loop {
                match reader.next(session).await {
                    Ok(Some(piece)) => {
                        if tx.send(Ok(piece)).await.is_err() {
                            return Ok(());
                        }
                        pumped_pieces.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        let send = self.shared.send_streaming(
            &self.method,
            path,
            headers,
            body,
            Some(len),
            Some(&progress),
        );
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
}

pub(crate) fn normalized_path_rejection(target: &str) -> Rejection {
    Rejection::new(
        RejectReason::Unsupported,
        format!(
            "the key of {target} has `.` or `..` path segments, which HTTP clients and stores resolve to another key; refused"
        ),
    )
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
