//! Manifest mode, the pure part: the manifest document, how one change is committed into it,
//! and how a listing is read from it. No I/O; golden-tested.
//!
//! Layout in the protected bucket, for a rule with resource `R`:
//! - `.fencegate/manifest/R`: one JSON document `{fence, seq, keys: {logical key -> entry}}`.
//!   It is replaced only with `If-Match` on the ETag the gateway read (`If-None-Match: *` for
//!   the first commit), so the store decides every commit. `seq` grows on every commit, so the
//!   body, and with it the ETag, is never reused: an old ETag cannot match again.
//! - `.fencegate/data/R/<revision>-<uuid>`: the immutable objects the entries point at, written
//!   with `If-None-Match: *` before the commit that names them. A refused commit leaves its
//!   object unreferenced, for garbage collection; readers never see it.
//!
//! The fence is the manifest's `fence`: a commit with a token below it is refused, an equal or
//! higher one raises it to the token. New keys, overwrites, copies, multipart completions and
//! deletes are all commits, so a stale holder cannot create a key, rewrite identical bytes or
//! delete one. Limit of this first layout: every commit rewrites the whole manifest (cost
//! O(keys) per commit; one resource holding ~100k keys writes ~10 MB per commit).

use std::collections::BTreeMap;

use fencegate_core::{Rejection, Token};
use serde::{Deserialize, Serialize};

use crate::rewrite::ClientConditions;

/// Keys under this prefix are the gateway's own (manifests and physical objects): clients can
/// neither read nor write them through the gateway.
pub const RESERVED_PREFIX: &str = ".fencegate/";

/// The manifest object of `resource`.
pub fn manifest_key(resource: &str) -> String {
    format!("{RESERVED_PREFIX}manifest/{resource}")
}

/// A fresh immutable object key for a write by `revision` of `resource`.
pub fn physical_key(resource: &str, revision: u64, id: &str) -> String {
    format!("{RESERVED_PREFIX}data/{resource}/{revision:020}-{id}")
}

/// The manifest of one resource.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The highest revision that committed.
    pub fence: u64,
    /// Grows on every commit, so no two manifest bodies (and ETags) are alike.
    pub seq: u64,
    /// Logical key -> the committed object.
    pub keys: BTreeMap<String, Entry>,
}

/// One logical key's committed object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The physical key holding the bytes.
    pub physical: String,
    /// The physical object's ETag (quoted), which is also the logical key's ETag.
    pub etag: String,
    /// Size in bytes.
    pub size: u64,
    /// When it was committed (`2026-12-01T03:04:05.000Z`).
    pub modified: String,
    /// The revision of the token that committed it.
    pub revision: u64,
}

/// What one commit changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The key now names this object (new key, overwrite, copy, multipart completion).
    Put(String, Entry),
    /// The key is removed (its object is left for garbage collection).
    Delete(String),
}

impl Change {
    fn key(&self) -> &str {
        match self {
            Self::Put(key, _) | Self::Delete(key) => key,
        }
    }
}

/// The decision for one commit attempt over the manifest as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitPlan {
    /// The manifest's fence is above the token.
    Refuse(Rejection),
    /// The client's own precondition fails on the committed entry.
    PreconditionFailed,
    /// The client asked `If-Match` on a key the manifest does not name.
    NoSuchKey,
    /// Write this manifest, conditional on the ETag of the one read.
    Commit(Manifest),
}

/// Plans committing `change` with `token` over `current` (`None`: no manifest yet).
pub fn plan_commit(
    current: Option<&Manifest>,
    token: &Token,
    target: &str,
    change: &Change,
    client: &ClientConditions,
) -> CommitPlan {
    let revision = token.revision().get();
    let fence = current.map_or(0, |m| m.fence);
    if fence > revision {
        return CommitPlan::Refuse(Rejection::stale(
            token,
            fence,
            &format!("the manifest of {target}"),
            None,
        ));
    }
    let existing = current.and_then(|m| m.keys.get(change.key()));
    match existing {
        Some(entry) => {
            if matches!(change, Change::Put(..)) && client.if_none_match_fails(&entry.etag) {
                return CommitPlan::PreconditionFailed;
            }
            if client.if_match_fails(&entry.etag) {
                return CommitPlan::PreconditionFailed;
            }
        }
        None if client.if_match.is_some() => return CommitPlan::NoSuchKey,
        None => {}
    }
    let mut next = current.cloned().unwrap_or_default();
    next.fence = revision;
    next.seq += 1;
    match change {
        Change::Put(key, entry) => {
            next.keys.insert(key.clone(), entry.clone());
        }
        Change::Delete(key) => {
            next.keys.remove(key);
        }
    }
    CommitPlan::Commit(next)
}

/// A ListObjects(V2) request's parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListRequest {
    /// `prefix`.
    pub prefix: String,
    /// `delimiter` (empty: none).
    pub delimiter: String,
    /// `max-keys` (S3 caps it at 1000).
    pub max_keys: usize,
    /// Resume strictly after this (V2 `start-after`, V1 `marker`).
    pub start_after: String,
    /// V2 `continuation-token` as issued by [`list`].
    pub continuation: Option<String>,
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListPage<'m> {
    /// Keys and their entries, in order.
    pub contents: Vec<(&'m str, &'m Entry)>,
    /// Common prefixes (with a delimiter), in order.
    pub common_prefixes: Vec<String>,
    /// Whether more follow.
    pub truncated: bool,
    /// The token (V2) or marker (V1) to resume with.
    pub next: Option<String>,
}

/// Lists `manifest` like S3: keys in byte order, rolled up at the delimiter, `max_keys` items
/// (keys plus common prefixes) per page.
pub fn list<'m>(manifest: &'m Manifest, request: &ListRequest) -> ListPage<'m> {
    // The continuation token is the hex of the last item returned: after a common prefix,
    // everything under it is skipped.
    let resume = request
        .continuation
        .as_deref()
        .and_then(|t| hex::decode(t).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .unwrap_or_default();
    let after = std::cmp::max(resume.as_str(), request.start_after.as_str()).to_owned();
    let mut page = ListPage {
        contents: Vec::new(),
        common_prefixes: Vec::new(),
        truncated: false,
        next: None,
    };
    let mut last = String::new();
    let mut count = 0;
    for (key, entry) in manifest.keys.range::<str, _>((
        std::ops::Bound::Excluded(after.as_str()),
        std::ops::Bound::Unbounded,
    )) {
        if !key.starts_with(&request.prefix) {
            if key.as_str() > request.prefix.as_str() && !request.prefix.is_empty() {
                break;
            }
            continue;
        }
        let rolled = (!request.delimiter.is_empty())
            .then(|| {
                key[request.prefix.len()..]
                    .find(&request.delimiter)
                    .map(|at| key[..request.prefix.len() + at + request.delimiter.len()].to_owned())
            })
            .flatten();
        if let Some(common) = &rolled {
            if page.common_prefixes.last() == Some(common) || after.starts_with(common.as_str()) {
                continue;
            }
        }
        if count == request.max_keys {
            page.truncated = true;
            page.next = Some(hex::encode(&last));
            break;
        }
        count += 1;
        match rolled {
            Some(common) => {
                last = common.clone();
                page.common_prefixes.push(common);
            }
            None => {
                last = key.clone();
                page.contents.push((key.as_str(), entry));
            }
        }
    }
    page
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

    fn entry(physical: &str) -> Entry {
        Entry {
            physical: physical.into(),
            etag: format!("\"{physical}\""),
            size: 1,
            modified: "2026-12-01T00:00:00.000Z".into(),
            revision: 1,
        }
    }

    fn manifest(keys: &[&str]) -> Manifest {
        Manifest {
            fence: 5,
            seq: 9,
            keys: keys.iter().map(|k| ((*k).into(), entry(k))).collect(),
        }
    }

    #[test]
    fn golden_first_commit_raises_the_fence() {
        let plan = plan_commit(
            None,
            &token(7),
            "b/k",
            &Change::Put("k".into(), entry("p")),
            &ClientConditions::default(),
        );
        let CommitPlan::Commit(next) = plan else {
            panic!("{plan:?}")
        };
        assert_eq!(
            serde_json::to_string(&next).unwrap(),
            r#"{"fence":7,"seq":1,"keys":{"k":{"physical":"p","etag":"\"p\"","size":1,"modified":"2026-12-01T00:00:00.000Z","revision":1}}}"#
        );
    }

    #[test]
    fn lower_is_refused_equal_commits_and_seq_always_grows() {
        let current = manifest(&["k"]);
        let plan = plan_commit(
            Some(&current),
            &token(4),
            "b/k",
            &Change::Delete("k".into()),
            &ClientConditions::default(),
        );
        let CommitPlan::Refuse(rejection) = plan else {
            panic!("{plan:?}")
        };
        assert_eq!(rejection.reason, RejectReason::Stale { fence: 5 });
        // A stale write to a key the manifest has never named is refused just the same.
        assert!(matches!(
            plan_commit(
                Some(&current),
                &token(4),
                "b/new",
                &Change::Put("new".into(), entry("x")),
                &ClientConditions::default()
            ),
            CommitPlan::Refuse(_)
        ));
        let CommitPlan::Commit(next) = plan_commit(
            Some(&current),
            &token(5),
            "b/k",
            &Change::Delete("k".into()),
            &ClientConditions::default(),
        ) else {
            panic!()
        };
        assert_eq!((next.fence, next.seq), (5, 10));
        assert!(next.keys.is_empty());
    }

    #[test]
    fn client_conditions_apply_to_the_committed_entry() {
        let current = manifest(&["k"]);
        let put = Change::Put("k".into(), entry("p2"));
        let none_match = ClientConditions {
            if_none_match: Some("*".into()),
            if_match: None,
        };
        assert_eq!(
            plan_commit(Some(&current), &token(6), "b/k", &put, &none_match),
            CommitPlan::PreconditionFailed
        );
        let wrong = ClientConditions {
            if_match: Some("\"other\"".into()),
            if_none_match: None,
        };
        assert_eq!(
            plan_commit(Some(&current), &token(6), "b/k", &put, &wrong),
            CommitPlan::PreconditionFailed
        );
        assert_eq!(
            plan_commit(
                Some(&current),
                &token(6),
                "b/x",
                &Change::Put("x".into(), entry("p")),
                &wrong
            ),
            CommitPlan::NoSuchKey
        );
    }

    #[test]
    fn listing_with_delimiter_and_pagination() {
        let m = manifest(&["a/1", "a/2", "b", "c/x/1", "c/y", "d"]);
        let mut request = ListRequest {
            delimiter: "/".into(),
            max_keys: 2,
            ..ListRequest::default()
        };
        let mut seen = Vec::new();
        loop {
            let page = list(&m, &request);
            seen.extend(page.common_prefixes.iter().cloned());
            seen.extend(page.contents.iter().map(|(k, _)| (*k).to_owned()));
            if !page.truncated {
                break;
            }
            request.continuation = page.next;
        }
        seen.sort();
        assert_eq!(seen, ["a/", "b", "c/", "d"]);
        let page = list(
            &m,
            &ListRequest {
                prefix: "c/".into(),
                delimiter: "/".into(),
                max_keys: 1000,
                ..ListRequest::default()
            },
        );
        assert_eq!(page.common_prefixes, ["c/x/"]);
        assert_eq!(
            page.contents.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            ["c/y"]
        );
        let page = list(
            &m,
            &ListRequest {
                max_keys: 1000,
                start_after: "b".into(),
                ..ListRequest::default()
            },
        );
        assert_eq!(
            page.contents.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            ["c/x/1", "c/y", "d"]
        );
    }

    #[test]
    fn physical_keys_sort_by_revision() {
        assert_eq!(
            physical_key("job", 42, "u1"),
            ".fencegate/data/job/00000000000000000042-u1"
        );
        assert_eq!(manifest_key("job"), ".fencegate/manifest/job");
    }
}
