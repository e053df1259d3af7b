//! Manifest mode, writes: every change is an immutable physical object (written with
//! `If-None-Match: *` under a fresh key holding the writer's revision) plus a commit into the
//! resource's log ([`crate::manifest::Batch`], appended by [`crate::group_commit`] with
//! `If-None-Match: *` on the next position). A commit that loses its position is re-planned on
//! the caught-up view, bounded by `max_attempts`; a token below the fence is refused (412,
//! audited once) and its physical object stays unreferenced.

use bytes::Bytes;
use fencegate_core::{RejectReason, Rejection, Token};

use crate::body::{header, BodyReader, Payload, MAX_XML_BODY};
use crate::config::{ProtectMode, ProtectRule};
use crate::error::S3Error;
use crate::gateway::{query_pairs, UpstreamResponse};
use crate::group_commit::{CommitDone, Writing};
use crate::manifest::{physical_key, Change, Entry, RESERVED_PREFIX};
use crate::respond::respond;
use crate::rewrite::{ClientConditions, Operation};
use crate::session::{xml_text, SendError, WriteSession};
use crate::sigv4_verify::encode_path;
use crate::upstream::Upstream;

/// S3's timestamp form for listings (`2026-12-01T03:04:05.000Z`).
fn now_s3() -> String {
    let now = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second(),
        now.millisecond()
    )
}

impl WriteSession<'_> {
    /// A write to a key under a manifest-mode rule, with a verified token.
    pub(crate) async fn manifest_write(
        &mut self,
        bucket: &str,
        key: &str,
        rule: &ProtectRule,
        token: &Token,
    ) {
        let resource = rule.resource.clone().unwrap_or_default();
        match self.operation.clone() {
            Operation::PutObject => self.manifest_put(bucket, key, &resource, token).await,
            Operation::CopyObject => self.manifest_copy(bucket, key, &resource, token).await,
            Operation::CreateMultipartUpload => {
                self.manifest_create_upload(bucket, key, &resource, token)
                    .await
            }
            Operation::UploadPart | Operation::AbortMultipartUpload => {
                self.manifest_upload_step(bucket, key).await
            }
            Operation::CompleteMultipartUpload { upload_id } => {
                self.manifest_complete(bucket, key, &resource, token, &upload_id)
                    .await
            }
            Operation::DeleteObject => {
                let conditions = ClientConditions {
                    if_match: header(&self.headers, "if-match").map(str::to_owned),
                    if_none_match: None,
                };
                let change = Change::Delete(key.to_owned());
                match self
                    .commit(bucket, &resource, token, key, change, &conditions)
                    .await
                {
                    Ok(CommitDone::Committed) => {
                        respond(
                            self.session,
                            204,
                            Vec::new(),
                            Bytes::new(),
                            &self.request_id,
                        )
                        .await
                    }
                    Ok(done) => self.answer_uncommitted(done).await,
                    Err(e) => self.upstream_failed(e).await,
                }
            }
            _ => {
                let detail = format!(
                    "{} on manifest-mode {} is not supported; refused (fail closed)",
                    self.operation.name(),
                    self.target.display()
                );
                self.refuse(Rejection::new(RejectReason::Unsupported, detail), None)
                    .await
            }
        }
    }

    /// Commits `change` into the manifest of `resource` (group commit: shares one
    /// conditional manifest write with the other changes queued for it on this node).
    pub(crate) async fn commit(
        &self,
        bucket: &str,
        resource: &str,
        token: &Token,
        key: &str,
        change: Change,
        conditions: &ClientConditions,
    ) -> Result<CommitDone, S3Error> {
        self.shared
            .commit_grouped(
                bucket,
                resource,
                token,
                format!("{bucket}/{key}"),
                change,
                conditions.clone(),
                None,
            )
            .await
    }

    /// Refuses early, before any physical write, when the manifest's fence is above the
    /// token. The cached fence answers without I/O when it lets the write on; before refusing,
    /// the log tail is re-read (one GET when nothing changed), because an operator's reset
    /// through another node may have lowered the fence since.
    async fn stale_before_write(
        &mut self,
        bucket: &str,
        resource: &str,
        token: &Token,
    ) -> Result<bool, S3Error> {
        let revision = token.revision().get();
        let fence_of =
            |view: Option<crate::manifest_store::Loaded>| view.map_or(0, |l| l.manifest.fence);
        let mut fence = fence_of(self.shared.manifest(bucket, resource, false).await?);
        if fence > revision {
            fence = fence_of(self.shared.manifest(bucket, resource, true).await?);
        }
        if fence > revision {
            let target = format!("the manifest of {}", self.target.display());
            let rejection = self.shared.policy.stale(token, fence, &target);
            self.refuse(rejection, None).await;
            return Ok(true);
        }
        Ok(false)
    }

    async fn answer_uncommitted(&mut self, done: CommitDone) {
        match done {
            CommitDone::Committed => {}
            CommitDone::Refused(rejection) => self.refuse(rejection, None).await,
            CommitDone::PreconditionFailed => {
                self.error(
                    412,
                    "PreconditionFailed",
                    "At least one of the pre-conditions you specified did not hold",
                )
                .await
            }
            CommitDone::NoSuchKey => {
                self.error(404, "NoSuchKey", "The specified key does not exist.")
                    .await
            }
            CommitDone::Busy => {
                self.error(
                    503,
                    "SlowDown",
                    "the manifest kept changing under this commit; retry",
                )
                .await
            }
        }
    }

    /// Commits `key -> physical` and answers with `response` (the physical write's answer),
    /// or answers the refusal.
    #[allow(clippy::too_many_arguments)]
    async fn commit_and_answer(
        &mut self,
        bucket: &str,
        key: &str,
        resource: &str,
        token: &Token,
        entry: Entry,
        response: UpstreamResponse,
        writing: Option<Writing>,
    ) {
        let conditions = ClientConditions {
            if_match: header(&self.headers, "if-match").map(str::to_owned),
            if_none_match: header(&self.headers, "if-none-match").map(str::to_owned),
        };
        let physical = entry.physical.clone();
        let change = Change::Put(key.to_owned(), entry);
        let committed = self
            .shared
            .commit_grouped(
                bucket,
                resource,
                token,
                format!("{bucket}/{key}"),
                change,
                conditions,
                writing,
            )
            .await;
        match committed {
            Ok(CommitDone::Committed) => {
                let response = with_logical_key(response, &physical, key);
                self.relay(response).await
            }
            Ok(done) => self.answer_uncommitted(done).await,
            Err(e) => self.upstream_failed(e).await,
        }
    }

    /// The physical object's ETag and size, read back after a copy or a completion.
    async fn physical_entry(
        &self,
        bucket: &str,
        physical: &str,
        revision: u64,
    ) -> Result<Entry, S3Error> {
        let headers = self
            .shared
            .head_headers(bucket, physical, "")
            .await?
            .ok_or_else(|| {
                S3Error::Upstream(format!(
                    "{bucket}/{physical} vanished right after it was written"
                ))
            })?;
        let get = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        Ok(Entry {
            physical: physical.to_owned(),
            etag: get("etag").unwrap_or_default(),
            size: get("content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            modified: now_s3(),
            revision,
        })
    }

    async fn manifest_put(&mut self, bucket: &str, key: &str, resource: &str, token: &Token) {
        match self.stale_before_write(bucket, resource, token).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => return self.upstream_failed(e).await,
        }
        let revision = token.revision().get();
        let physical = fresh_physical_key(resource, revision);
        let path = Upstream::path_and_query(Some(bucket), Some(&physical), "");
        let mut reader = BodyReader::new(&self.verified, &self.headers);
        let len = self.body_length();
        // The physical key is fresh: the write goes once, so large bodies stream.
        let payload = match len {
            Some(len) if len > self.shared.config.retry_buffer_bytes as u64 => Payload::Stream(len),
            _ => match reader
                .read_all(self.session, self.shared.config.retry_buffer_bytes)
                .await
            {
                Ok(body) => Payload::Buffered(body),
                Err(e) => return self.body_failed(e).await,
            },
        };
        let mut headers = self.upstream_headers(false);
        let checksums = reader.trailer_checksums();
        headers.retain(|(n, _)| !checksums.iter().any(|(c, _)| c == n));
        headers.extend(checksums);
        headers.push(("if-none-match".into(), "*".into()));
        let mut writing = None;
        let (result, size) = match payload {
            Payload::Buffered(body) => {
                let len = body.len() as u64;
                // Whole body in hand: only the store's latency is left before the commit, so
                // a concurrent batch may wait for it.
                writing = Some(self.shared.writing(bucket, resource));
                let sent = self
                    .shared
                    .send("PUT", &path, headers, body.into(), Some(len))
                    .await
                    .map_err(SendError::Upstream);
                (sent, len)
            }
            Payload::Stream(len) => (self.stream(&mut reader, &path, headers, len).await, len),
        };
        let response = match result {
            Ok(response) if response.succeeded() => response,
            failed => {
                // Nothing to commit: stop any batch waiting for this write.
                drop(writing);
                return match failed {
                    Ok(response) => self.relay(response).await,
                    Err(SendError::Body(e)) => self.body_failed(e).await,
                    Err(SendError::Upstream(e)) => self.upstream_failed(e).await,
                };
            }
        };
        let entry = Entry {
            physical,
            etag: response.header("etag").unwrap_or_default().to_owned(),
            size,
            modified: now_s3(),
            revision,
        };
        self.commit_and_answer(bucket, key, resource, token, entry, response, writing)
            .await
    }

    /// The physical `(bucket, key)` a copy source names: a manifest-mode key resolves
    /// through its manifest; `Ok(None)` when it does not exist.
    async fn resolve_source(&self, source: &str) -> Result<Option<(String, String)>, S3Error> {
        let source = source.split_once("?versionId=").map_or(source, |(s, _)| s);
        let decoded = percent_encoding::percent_decode_str(source.trim_start_matches('/'))
            .decode_utf8_lossy()
            .into_owned();
        let Some((src_bucket, src_key)) = decoded.split_once('/') else {
            return Ok(None);
        };
        if !self.shared.config.bucket_has_manifest(src_bucket) {
            return Ok(Some((src_bucket.to_owned(), src_key.to_owned())));
        }
        if src_key.starts_with(RESERVED_PREFIX) {
            return Ok(None);
        }
        match self.shared.config.rule_for(src_bucket, Some(src_key)) {
            Some(rule) if rule.mode == ProtectMode::Manifest => {
                let resource = rule.resource.clone().unwrap_or_default();
                let manifest = self.shared.manifest(src_bucket, &resource, true).await?;
                Ok(manifest
                    .and_then(|l| l.manifest.keys.get(src_key).map(|e| e.physical.clone()))
                    .map(|physical| (src_bucket.to_owned(), physical)))
            }
            _ => Ok(Some((src_bucket.to_owned(), src_key.to_owned()))),
        }
    }

    async fn manifest_copy(&mut self, bucket: &str, key: &str, resource: &str, token: &Token) {
        match self.stale_before_write(bucket, resource, token).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => return self.upstream_failed(e).await,
        }
        let source = header(&self.headers, "x-amz-copy-source")
            .unwrap_or("")
            .to_owned();
        let (src_bucket, src_physical) = match self.resolve_source(&source).await {
            Ok(Some(found)) => found,
            Ok(None) => {
                return self
                    .error(404, "NoSuchKey", "The copy source does not exist.")
                    .await
            }
            Err(e) => return self.upstream_failed(e).await,
        };
        let revision = token.revision().get();
        let physical = fresh_physical_key(resource, revision);
        let path = Upstream::path_and_query(Some(bucket), Some(&physical), "");
        let mut headers = self.upstream_headers(false);
        headers.retain(|(n, _)| n != "x-amz-copy-source");
        headers.push((
            "x-amz-copy-source".into(),
            format!(
                "/{}/{}",
                encode_path(&src_bucket),
                encode_path(&src_physical)
            ),
        ));
        let response = match self
            .shared
            .send("PUT", &path, headers, Bytes::new().into(), Some(0))
            .await
        {
            Ok(response) => response,
            Err(e) => return self.upstream_failed(e).await,
        };
        if !response.succeeded() {
            return self.relay(response).await;
        }
        let entry = match self.physical_entry(bucket, &physical, revision).await {
            Ok(entry) => entry,
            Err(e) => return self.upstream_failed(e).await,
        };
        self.commit_and_answer(bucket, key, resource, token, entry, response, None)
            .await
    }

    async fn manifest_create_upload(
        &mut self,
        bucket: &str,
        key: &str,
        resource: &str,
        token: &Token,
    ) {
        match self.stale_before_write(bucket, resource, token).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => return self.upstream_failed(e).await,
        }
        let revision = token.revision().get();
        let physical = fresh_physical_key(resource, revision);
        let path = Upstream::path_and_query(Some(bucket), Some(&physical), &self.raw_query);
        let headers = self.upstream_headers(false);
        let response = match self
            .shared
            .send("POST", &path, headers, Bytes::new().into(), Some(0))
            .await
        {
            Ok(response) => response,
            Err(e) => return self.upstream_failed(e).await,
        };
        if response.succeeded() {
            if let Some(upload_id) = xml_text(&response.body, "UploadId") {
                let upload = (bucket.to_owned(), key.to_owned(), upload_id);
                if !self
                    .shared
                    .track_upload(upload, revision, Some(physical.clone()))
                {
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
        let response = with_logical_key(response, &physical, key);
        self.relay(response).await
    }

    /// UploadPart(Copy) and AbortMultipartUpload: sent to the upload's physical key.
    async fn manifest_upload_step(&mut self, bucket: &str, key: &str) {
        let upload_id = query_pairs(&self.raw_query)
            .into_iter()
            .find(|(k, _)| k == "uploadId")
            .map(|(_, v)| v)
            .unwrap_or_default();
        let id = (bucket.to_owned(), key.to_owned(), upload_id.clone());
        let Some(physical) = self.shared.upload(&id).and_then(|u| u.physical) else {
            let detail = format!(
                "upload {upload_id} was not created for {} through this gateway; start it with CreateMultipartUpload on this key",
                self.target.display()
            );
            return self
                .refuse(Rejection::new(RejectReason::Unsupported, detail), None)
                .await;
        };
        if let Some(source) = header(&self.headers, "x-amz-copy-source").map(str::to_owned) {
            match self.resolve_source(&source).await {
                Ok(Some((src_bucket, src_key))) => {
                    self.headers.retain(|(n, _)| n != "x-amz-copy-source");
                    self.headers.push((
                        "x-amz-copy-source".into(),
                        format!("/{}/{}", encode_path(&src_bucket), encode_path(&src_key)),
                    ));
                }
                Ok(None) => {
                    return self
                        .error(404, "NoSuchKey", "The copy source does not exist.")
                        .await
                }
                Err(e) => return self.upstream_failed(e).await,
            }
        }
        if self.operation == Operation::AbortMultipartUpload {
            self.shared.forget_upload(&id);
        }
        self.pass_through(bucket, Some(&physical)).await
    }

    async fn manifest_complete(
        &mut self,
        bucket: &str,
        key: &str,
        resource: &str,
        token: &Token,
        upload_id: &str,
    ) {
        let id = (bucket.to_owned(), key.to_owned(), upload_id.to_owned());
        let target = self.target.display();
        let revision = token.revision().get();
        let upload = self.shared.upload(&id);
        let rejection = match &upload {
            None | Some(crate::gateway::Upload { physical: None, .. }) => Some(Rejection::new(
                RejectReason::Unsupported,
                format!("upload {upload_id} was not created for {target} through this gateway with a fencing token (or is too old); restart it with CreateMultipartUpload on this key"),
            )),
            Some(u) if u.revision > revision => Some(Rejection::new(
                RejectReason::Stale { fence: u.revision },
                format!("fencing token revision {revision} is below the revision {} the upload of {target} was created with", u.revision),
            )),
            Some(u) if u.revision < revision => Some(Rejection::new(
                RejectReason::OutOfScope,
                format!("the upload of {target} was created with revision {}; complete it with that token or restart it", u.revision),
            )),
            Some(_) => None,
        };
        if let Some(rejection) = rejection {
            let rejection = rejection.with_token(token.resource().clone(), token.revision());
            return self.refuse(rejection, None).await;
        }
        let physical = upload.and_then(|u| u.physical).unwrap_or_default();
        match self.stale_before_write(bucket, resource, token).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => return self.upstream_failed(e).await,
        }
        let mut reader = BodyReader::new(&self.verified, &self.headers);
        let body = match reader.read_all(self.session, MAX_XML_BODY).await {
            Ok(body) => body,
            Err(e) => return self.body_failed(e).await,
        };
        let path = Upstream::path_and_query(Some(bucket), Some(&physical), &self.raw_query);
        let headers = self.upstream_headers(false);
        let len = body.len() as u64;
        let response = match self
            .shared
            .send("POST", &path, headers, body.into(), Some(len))
            .await
        {
            Ok(response) => response,
            Err(e) => return self.upstream_failed(e).await,
        };
        if !response.succeeded() {
            return self.relay(response).await;
        }
        // Completed: the upload is gone whatever the commit decides.
        self.shared.forget_upload(&id);
        let entry = match self.physical_entry(bucket, &physical, revision).await {
            Ok(entry) => entry,
            Err(e) => return self.upstream_failed(e).await,
        };
        self.commit_and_answer(bucket, key, resource, token, entry, response, None)
            .await
    }
}

/// The store's answer with the physical key replaced by the logical one (`<Key>` of
/// CreateMultipartUpload/CompleteMultipartUpload results, `Location`).
fn with_logical_key(mut response: UpstreamResponse, physical: &str, key: &str) -> UpstreamResponse {
    if response.body.is_empty() {
        return response;
    }
    let escape = |s: &str| quick_xml::escape::escape(s).into_owned();
    if let Ok(text) = std::str::from_utf8(&response.body) {
        let text = text
            .replace(&escape(physical), &escape(key))
            .replace(&encode_path(physical), &encode_path(key));
        response.body = Bytes::from(text);
    }
    response
}

/// A physical key no other write uses: the writer's revision and a random id, so a write with
/// `If-None-Match: *` never meets an object it did not make.
fn fresh_physical_key(resource: &str, revision: u64) -> String {
    physical_key(
        resource,
        revision,
        &uuid::Uuid::new_v4().simple().to_string(),
    )
}
