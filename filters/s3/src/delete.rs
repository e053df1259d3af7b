//! Object mode, deletes (DeleteObject, and DeleteObjects judged key by key, each by its own
//! rule; manifest-mode keys there are tombstone commits): conditional on the ETag whose fence
//! was checked.

use bytes::Bytes;
use fencegate_core::{RejectReason, Rejection, Store, Token};

use crate::body::{header, BodyReader, MAX_XML_BODY};
use crate::error::S3Error;
use crate::multi_delete::{self, DeleteEntry, DeleteOutcome};
use crate::respond::respond;
use crate::rewrite::{plan_write, ClientConditions, WriteKind, WritePlan};
use crate::session::{normalized_path_rejection, WriteSession};
use crate::upstream::Upstream;

impl WriteSession<'_> {
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
                self.shared.policy.issued.get(),
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
                        self.shared.audit.applied(Store::S3);
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

    pub(crate) async fn fenced_delete(&mut self, bucket: &str, key: &str, token: &Token) {
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
    pub(crate) async fn delete_objects(&mut self, bucket: &str) {
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
                && self.shared.config.bucket_protected(bucket);
            if reserved || !self.shared.upstream.sent_as_judged(&path) {
                let rejection = if reserved {
                    Rejection::new(
                        RejectReason::Unsupported,
                        format!(
                            "{bucket}/{} is the gateway's own storage; clients cannot delete it",
                            entry.key
                        ),
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
                                Ok(crate::group_commit::CommitDone::Committed) => Ok(DeleteOutcome::Deleted),
                                Ok(crate::group_commit::CommitDone::Refused(rejection)) => Err(rejection),
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

enum DeleteDone {
    Deleted,
    PreconditionFailed,
    NoSuchKey,
    Busy,
}
