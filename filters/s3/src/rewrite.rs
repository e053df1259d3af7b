//! The pure part of the gateway: which S3 operation a request is, which bucket and key it
//! names, and how a fenced write becomes a conditional upstream request given what the store
//! holds now. No I/O; golden-tested.
//!
//! Object mode: an object's fence is its metadata `x-amz-meta-fencegate-revision` (and
//! `-resource`). A write with token `t` over an object whose fence is `f`:
//! `f > t` is refused (stale); otherwise the write is sent with `If-Match: <the ETag read>`
//! (`If-None-Match: *` when the object does not exist) and the new fence `t` in its metadata,
//! so the store applies it only if nothing changed since the read: check and write are one
//! atomic conditional request in the store.

use fencegate_core::{Rejection, Token};

/// Metadata header holding an object's fence revision.
pub const FENCE_REVISION_HEADER: &str = "x-amz-meta-fencegate-revision";
/// Metadata header holding the resource of the token that wrote the object.
pub const FENCE_RESOURCE_HEADER: &str = "x-amz-meta-fencegate-resource";
/// The token carrier.
pub const TOKEN_HEADER: &str = "fencing-token";
/// The token carrier for clients that cannot add a header (the aws CLI): the SigV4 session
/// token, used when `Fencing-Token` is absent. Never sent upstream.
pub const SESSION_TOKEN_HEADER: &str = "x-amz-security-token";

/// What an S3 request does, as far as fencing is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Operation {
    /// `GET`/`HEAD` of anything (objects, lists, ListParts): passes through.
    Read,
    /// `PutObject`.
    PutObject,
    /// `CopyObject` onto the target (the `x-amz-copy-source` header).
    CopyObject,
    /// `CreateMultipartUpload`: records the token's revision in the upload's metadata.
    CreateMultipartUpload,
    /// `UploadPart`/`UploadPartCopy`: inert until completion.
    UploadPart,
    /// `AbortMultipartUpload`: removes parts only.
    AbortMultipartUpload,
    /// `CompleteMultipartUpload`: the fenced step of a multipart upload.
    CompleteMultipartUpload {
        /// The upload id.
        upload_id: String,
    },
    /// `DeleteObject`.
    DeleteObject,
    /// `DeleteObjects` (`POST ?delete`).
    DeleteObjects,
    /// Any other write (tagging, ACLs, lifecycle, bucket creation or deletion, ...).
    OtherWrite(String),
}

impl Operation {
    /// Classifies a request by method, query parameter names and headers.
    pub fn classify(
        method: &str,
        query: &[(String, String)],
        has_key: bool,
        copy_source: bool,
    ) -> Self {
        // `x-id=<Operation>` is a hint newer SDKs (Rust, Java, JS) add; it changes nothing.
        let query: Vec<&(String, String)> = query.iter().filter(|(k, _)| k != "x-id").collect();
        let has = |name: &str| query.iter().any(|(k, _)| k == name);
        let get = |name: &str| {
            query
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        // Sub-resources that make a PUT/POST/DELETE something other than an object write.
        const OTHER: &[&str] = &[
            "acl",
            "tagging",
            "lifecycle",
            "policy",
            "cors",
            "versioning",
            "website",
            "logging",
            "notification",
            "replication",
            "encryption",
            "retention",
            "legal-hold",
            "restore",
            "select",
            "object-lock",
            "ownershipControls",
            "publicAccessBlock",
            "accelerate",
            "requestPayment",
            "analytics",
            "inventory",
            "metrics",
            "intelligent-tiering",
            "attributes",
            "renameObject",
        ];
        match method {
            "GET" | "HEAD" => Self::Read,
            _ if OTHER.iter().any(|name| has(name)) => Self::OtherWrite(format!(
                "{method} ?{}",
                OTHER.iter().find(|n| has(n)).unwrap_or(&"")
            )),
            "PUT" if has_key && has("uploadId") && has("partNumber") => Self::UploadPart,
            "PUT" if has_key && copy_source => Self::CopyObject,
            "PUT" if has_key && query.is_empty() => Self::PutObject,
            "POST" if has_key && has("uploads") => Self::CreateMultipartUpload,
            "POST" if has_key && has("uploadId") => Self::CompleteMultipartUpload {
                upload_id: get("uploadId").unwrap_or_default(),
            },
            "POST" if !has_key && has("delete") => Self::DeleteObjects,
            "DELETE" if has_key && has("uploadId") => Self::AbortMultipartUpload,
            "DELETE" if has_key && query.is_empty() => Self::DeleteObject,
            _ if !has_key => Self::OtherWrite(format!("{method} bucket")),
            _ => Self::OtherWrite(format!(
                "{method} object with {} query parameter(s)",
                query.len()
            )),
        }
    }

    /// The operation's name for logs and audit records.
    pub fn name(&self) -> String {
        match self {
            Self::Read => "Read".into(),
            Self::PutObject => "PutObject".into(),
            Self::CopyObject => "CopyObject".into(),
            Self::CreateMultipartUpload => "CreateMultipartUpload".into(),
            Self::UploadPart => "UploadPart".into(),
            Self::AbortMultipartUpload => "AbortMultipartUpload".into(),
            Self::CompleteMultipartUpload { .. } => "CompleteMultipartUpload".into(),
            Self::DeleteObject => "DeleteObject".into(),
            Self::DeleteObjects => "DeleteObjects".into(),
            Self::OtherWrite(what) => what.clone(),
        }
    }
}

/// The bucket and key a request names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The bucket; `None` for the service (ListBuckets).
    pub bucket: Option<String>,
    /// The object key, decoded; `None` for bucket-level requests.
    pub key: Option<String>,
}

impl Target {
    /// Parses path-style (`/bucket/key`) or virtual-hosted-style (`bucket.<suffix>` host,
    /// `/key`) addressing.
    pub fn parse(host: &str, raw_path: &str, virtual_host_suffix: Option<&str>) -> Self {
        let host = host.split(':').next().unwrap_or(host);
        let path = percent_encoding::percent_decode_str(raw_path.trim_start_matches('/'))
            .decode_utf8_lossy()
            .into_owned();
        let vhost_bucket = virtual_host_suffix.and_then(|suffix| {
            host.strip_suffix(suffix)
                .and_then(|b| b.strip_suffix('.'))
                .filter(|b| !b.is_empty())
        });
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        match vhost_bucket {
            Some(bucket) => Self {
                bucket: Some(bucket.to_owned()),
                key: non_empty(&path),
            },
            None => match path.split_once('/') {
                Some((bucket, key)) => Self {
                    bucket: non_empty(bucket),
                    key: non_empty(key),
                },
                None => Self {
                    bucket: non_empty(&path),
                    key: None,
                },
            },
        }
    }

    /// `bucket/key` for messages and audit records.
    pub fn display(&self) -> String {
        match (&self.bucket, &self.key) {
            (Some(b), Some(k)) => format!("{b}/{k}"),
            (Some(b), None) => b.clone(),
            _ => String::new(),
        }
    }
}

/// What the store holds for an object, as read by a HEAD (or remembered from our own write).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectState {
    /// The ETag, quoted as S3 returns it.
    pub etag: String,
    /// The fence revision in its metadata; `None` for an object no fenced write has touched.
    pub fence: Option<u64>,
}

impl ObjectState {
    /// Reads the state from HEAD response headers (names lower-case).
    pub fn from_headers<'a>(headers: impl IntoIterator<Item = (&'a str, &'a str)>) -> Option<Self> {
        let mut etag = None;
        let mut fence = None;
        for (name, value) in headers {
            if name.eq_ignore_ascii_case("etag") {
                etag = Some(value.to_owned());
            } else if name.eq_ignore_ascii_case(FENCE_REVISION_HEADER) {
                // An unparseable fence fails closed: it counts as the highest possible.
                fence = Some(value.trim().parse().unwrap_or(u64::MAX));
            }
        }
        Some(Self { etag: etag?, fence })
    }
}

/// The client's own preconditions on the target.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientConditions {
    /// `If-Match`.
    pub if_match: Option<String>,
    /// `If-None-Match`.
    pub if_none_match: Option<String>,
}

impl ClientConditions {
    /// Whether `If-None-Match` fails against an existing object with `etag`.
    pub(crate) fn if_none_match_fails(&self, etag: &str) -> bool {
        self.if_none_match
            .as_deref()
            .is_some_and(|v| v.trim() == "*" || etag_eq(v, etag))
    }

    /// Whether `If-Match` fails against an existing object with `etag`.
    pub(crate) fn if_match_fails(&self, etag: &str) -> bool {
        self.if_match
            .as_deref()
            .is_some_and(|v| v.trim() != "*" && !etag_eq(v, etag))
    }
}

/// Whether a write replaces or removes the object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    /// PUT, copy, multipart completion: the object gets the token's fence.
    Replace,
    /// DELETE.
    Delete,
}

/// How one fenced write goes upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WritePlan {
    /// The fence is above the token.
    Refuse(Rejection),
    /// The client's own precondition fails on what the store holds (S3 `412 PreconditionFailed`).
    PreconditionFailed,
    /// The client asked `If-Match` on a missing object (S3 `404 NoSuchKey`).
    NoSuchKey,
    /// A delete of an object that does not exist: nothing to write, answer 204.
    NothingToDelete,
    /// Send the write with these condition and fence headers (replacing any the client sent).
    Send {
        /// Headers to set on the upstream request.
        headers: Vec<(&'static str, String)>,
    },
}

/// Plans one attempt of a fenced write: the pure core of object mode. `issued` is the highest
/// revision the node's authority has applied (it words a stale refusal).
pub fn plan_write(
    kind: WriteKind,
    token: &Token,
    target: &str,
    observed: Option<&ObjectState>,
    client: &ClientConditions,
    issued: Option<u64>,
) -> WritePlan {
    let revision = token.revision().get();
    if let Some(fence) = observed.and_then(|o| o.fence) {
        if fence > revision {
            return WritePlan::Refuse(Rejection::stale(token, fence, target, issued));
        }
    }
    let mut headers: Vec<(&'static str, String)> = Vec::new();
    match observed {
        Some(state) => {
            if client.if_none_match_fails(&state.etag) || client.if_match_fails(&state.etag) {
                return WritePlan::PreconditionFailed;
            }
            headers.push(("if-match", state.etag.clone()));
        }
        None => {
            if client.if_match.is_some() {
                return WritePlan::NoSuchKey;
            }
            if kind == WriteKind::Delete {
                return WritePlan::NothingToDelete;
            }
            headers.push(("if-none-match", "*".to_owned()));
        }
    }
    if kind == WriteKind::Replace {
        headers.push((FENCE_REVISION_HEADER, revision.to_string()));
        headers.push((FENCE_RESOURCE_HEADER, token.resource().to_string()));
    }
    WritePlan::Send { headers }
}

fn etag_eq(a: &str, b: &str) -> bool {
    let strip = |s: &str| {
        s.trim()
            .trim_start_matches("W/")
            .trim_matches('"')
            .to_owned()
    };
    strip(a) == strip(b)
}

#[cfg(test)]
mod tests {
    use fencegate_core::RejectReason;
    use fencegate_core::{Resource, Revision};

    use super::*;

    fn token(revision: u64) -> Token {
        Token::new(
            Resource::new("job").unwrap(),
            Revision::new(revision).unwrap(),
        )
    }

    fn state(etag: &str, fence: Option<u64>) -> ObjectState {
        ObjectState {
            etag: etag.into(),
            fence,
        }
    }

    fn q(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect()
    }

    #[test]
    fn golden_put_over_existing_object() {
        let plan = plan_write(
            WriteKind::Replace,
            &token(7),
            "b/k",
            Some(&state("\"e1\"", Some(5))),
            &ClientConditions::default(),
            None,
        );
        assert_eq!(
            plan,
            WritePlan::Send {
                headers: vec![
                    ("if-match", "\"e1\"".into()),
                    (FENCE_REVISION_HEADER, "7".into()),
                    (FENCE_RESOURCE_HEADER, "job".into()),
                ]
            }
        );
    }

    #[test]
    fn golden_put_of_new_object() {
        let plan = plan_write(
            WriteKind::Replace,
            &token(7),
            "b/k",
            None,
            &ClientConditions::default(),
            None,
        );
        assert_eq!(
            plan,
            WritePlan::Send {
                headers: vec![
                    ("if-none-match", "*".into()),
                    (FENCE_REVISION_HEADER, "7".into()),
                    (FENCE_RESOURCE_HEADER, "job".into()),
                ]
            }
        );
    }

    #[test]
    fn lower_is_refused_equal_is_accepted() {
        let plan = plan_write(
            WriteKind::Replace,
            &token(7),
            "b/k",
            Some(&state("\"e\"", Some(12))),
            &ClientConditions::default(),
            None,
        );
        let WritePlan::Refuse(rejection) = plan else {
            panic!("{plan:?}")
        };
        assert_eq!(rejection.reason, RejectReason::Stale { fence: 12 });
        assert_eq!(
            rejection.detail,
            "fencing token revision 7 is below the fence 12 of b/k: a newer holder has taken the lock; stop writing and acquire it again"
        );
        assert!(matches!(
            plan_write(WriteKind::Delete, &token(12), "b/k", Some(&state("\"e\"", Some(12))), &ClientConditions::default(), None),
            WritePlan::Send { headers } if headers == vec![("if-match", "\"e\"".to_owned())]
        ));
        assert_eq!(
            plan_write(
                WriteKind::Delete,
                &token(3),
                "b/k",
                None,
                &ClientConditions::default(),
                None
            ),
            WritePlan::NothingToDelete
        );
    }

    #[test]
    fn client_conditions_are_honoured() {
        let s = state("\"e1\"", None);
        let none_match = ClientConditions {
            if_none_match: Some("*".into()),
            if_match: None,
        };
        assert_eq!(
            plan_write(
                WriteKind::Replace,
                &token(1),
                "b/k",
                Some(&s),
                &none_match,
                None
            ),
            WritePlan::PreconditionFailed
        );
        let wrong = ClientConditions {
            if_match: Some("\"e2\"".into()),
            if_none_match: None,
        };
        assert_eq!(
            plan_write(WriteKind::Replace, &token(1), "b/k", Some(&s), &wrong, None),
            WritePlan::PreconditionFailed
        );
        assert_eq!(
            plan_write(WriteKind::Replace, &token(1), "b/k", None, &wrong, None),
            WritePlan::NoSuchKey
        );
        let right = ClientConditions {
            if_match: Some("e1".into()),
            if_none_match: None,
        };
        assert!(matches!(
            plan_write(WriteKind::Replace, &token(1), "b/k", Some(&s), &right, None),
            WritePlan::Send { .. }
        ));
    }

    #[test]
    fn unparseable_fence_fails_closed() {
        let s = ObjectState::from_headers([("etag", "\"e\""), (FENCE_REVISION_HEADER, "junk")])
            .unwrap();
        assert_eq!(s.fence, Some(u64::MAX));
        assert!(matches!(
            plan_write(
                WriteKind::Replace,
                &token(9),
                "b/k",
                Some(&s),
                &ClientConditions::default(),
                None
            ),
            WritePlan::Refuse(_)
        ));
    }

    #[test]
    fn classification() {
        assert_eq!(
            Operation::classify("PUT", &q(&[("x-id", "PutObject")]), true, false),
            Operation::PutObject
        );
        assert_eq!(
            Operation::classify("DELETE", &q(&[("x-id", "DeleteObject")]), true, false),
            Operation::DeleteObject
        );
        assert_eq!(
            Operation::classify("GET", &q(&[("list-type", "2")]), false, false),
            Operation::Read
        );
        assert_eq!(
            Operation::classify("PUT", &[], true, false),
            Operation::PutObject
        );
        assert_eq!(
            Operation::classify("PUT", &[], true, true),
            Operation::CopyObject
        );
        assert_eq!(
            Operation::classify(
                "PUT",
                &q(&[("partNumber", "1"), ("uploadId", "u")]),
                true,
                false
            ),
            Operation::UploadPart
        );
        assert_eq!(
            Operation::classify("POST", &q(&[("uploads", "")]), true, false),
            Operation::CreateMultipartUpload
        );
        assert_eq!(
            Operation::classify("POST", &q(&[("uploadId", "u")]), true, false),
            Operation::CompleteMultipartUpload {
                upload_id: "u".into()
            }
        );
        assert_eq!(
            Operation::classify("DELETE", &[], true, false),
            Operation::DeleteObject
        );
        assert_eq!(
            Operation::classify("DELETE", &q(&[("uploadId", "u")]), true, false),
            Operation::AbortMultipartUpload
        );
        assert_eq!(
            Operation::classify("POST", &q(&[("delete", "")]), false, false),
            Operation::DeleteObjects
        );
        assert!(matches!(
            Operation::classify("PUT", &q(&[("tagging", "")]), true, false),
            Operation::OtherWrite(_)
        ));
        assert!(matches!(
            Operation::classify("DELETE", &[], false, false),
            Operation::OtherWrite(_)
        ));
        assert!(matches!(
            Operation::classify("DELETE", &q(&[("versionId", "v")]), true, false),
            Operation::OtherWrite(_)
        ));
    }

    #[test]
    fn addressing_styles() {
        assert_eq!(
            Target::parse("127.0.0.1:9080", "/b/dir/a%20b", None),
            Target {
                bucket: Some("b".into()),
                key: Some("dir/a b".into())
            }
        );
        assert_eq!(
            Target::parse("b.s3.local:9080", "/k", Some("s3.local")),
            Target {
                bucket: Some("b".into()),
                key: Some("k".into())
            }
        );
        assert_eq!(
            Target::parse("h", "/b", None),
            Target {
                bucket: Some("b".into()),
                key: None
            }
        );
        assert_eq!(
            Target::parse("h", "/", None),
            Target {
                bucket: None,
                key: None
            }
        );
    }
}
