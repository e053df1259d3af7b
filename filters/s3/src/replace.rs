//! Object mode, writes that replace an object (PUT, copy, multipart creation and
//! completion): read the object's ETag and fence with a fresh HEAD (never an ETag remembered
//! from this node's own write: another node may have written identical bytes, same ETag,
//! with a higher fence since), plan the conditional request ([`crate::rewrite::plan_write`]),
//! send it; when the store answers 412/409 someone wrote in between, so re-read and try again
//! (bounded), refusing as soon as the fence is above the token.

use bytes::Bytes;
use fencegate_core::{RejectReason, Rejection, Store, Token};

use crate::body::{header, BodyReader, Payload, MAX_XML_BODY};
use crate::error::S3Error;
use crate::rewrite::{
    plan_write, ClientConditions, Operation, WriteKind, WritePlan, FENCE_RESOURCE_HEADER,
    FENCE_REVISION_HEADER,
};
use crate::session::{xml_text, SendError, WriteSession};
use crate::upload_stamp::UploadStamp;
use crate::upstream::Upstream;

impl WriteSession<'_> {
    /// The object-mode loop for PUT, copy and multipart completion.
    pub(crate) async fn fenced_replace(
        &mut self,
        bucket: &str,
        key: &str,
        token: &Token,
        upload_id: Option<String>,
    ) {
        let target = format!("{bucket}/{key}");
        if let Some(upload_id) = &upload_id {
            // From memory, or after a restart (or on another node) from the upload's stamp.
            let created = match self
                .shared
                .recall_upload(&(bucket.to_owned(), key.to_owned(), upload_id.clone()))
                .await
            {
                Ok(upload) => upload.map(|upload| upload.revision),
                Err(e) => return self.upstream_failed(e).await,
            };
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
                self.shared.policy.issued.get(),
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
                self.shared.audit.applied(Store::S3);
                if let Some(upload_id) = &upload_id {
                    self.shared
                        .unstamp_upload(&(bucket.to_owned(), key.to_owned(), upload_id.clone()))
                        .await;
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
                    self.shared.policy.issued.get(),
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
    pub(crate) async fn create_upload(&mut self, bucket: &str, key: &str, token: &Token) {
        let target = format!("{bucket}/{key}");
        match self.shared.head(bucket, key).await {
            Ok(observed) => {
                if let WritePlan::Refuse(rejection) = plan_write(
                    WriteKind::Replace,
                    token,
                    &target,
                    observed.as_ref(),
                    &ClientConditions::default(),
                    self.shared.policy.issued.get(),
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
                        let upload = (bucket.to_owned(), key.to_owned(), upload_id.clone());
                        if !self
                            .shared
                            .track_upload(upload.clone(), token.revision().get(), None)
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
                        let stamp = UploadStamp {
                            key: key.to_owned(),
                            upload_id,
                            revision: token.revision().get(),
                            resource: token.resource().to_string(),
                        };
                        if let Err(e) = self.shared.stamp_upload(bucket, &stamp).await {
                            // Without its stamp the upload could not be completed after a
                            // restart: abort it and let the client start again.
                            tracing::warn!(request_id = %self.request_id, error = %e, "upload stamp not written; aborting the upload");
                            self.shared.forget_upload(&upload);
                            self.abort_upload(bucket, key, &stamp.upload_id).await;
                            return self
                                .error(
                                    503,
                                    "ServiceUnavailable",
                                    "the gateway could not record the upload's fencing revision in the store; the upload was aborted, retry",
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

    /// Aborts an upload the gateway created but cannot stand behind (best effort).
    async fn abort_upload(&self, bucket: &str, key: &str, upload_id: &str) {
        let query = format!("uploadId={}", crate::sigv4_verify::aws_encode(upload_id));
        let path = Upstream::path_and_query(Some(bucket), Some(key), &query);
        if let Err(e) = self
            .shared
            .send("DELETE", &path, Vec::new(), Bytes::new().into(), None)
            .await
        {
            tracing::warn!(request_id = %self.request_id, error = %e, "aborting the upload failed");
        }
    }
}
