//! Manifest mode, the pure part: the committed view of a resource, how a batch of changes is
//! planned over it and recorded as one log entry, and how a listing is read from it. No I/O;
//! golden-tested. The layout and its limits are described in `docs/S3_MANIFEST.md`.
//!
//! Layout in the protected bucket, for a rule with resource `R`:
//! - `.fencegate/log/R/<position>` (20 digits, from 1): one [`LogEntry`] per commit, written
//!   with `If-None-Match: *`. The store lets exactly one writer create a position, so the log
//!   is the commit order and that create is the compare-and-set: a writer plans its entry over
//!   the view at `position - 1` and loses the create if anyone else committed in between.
//!   Entries are never rewritten or deleted (a deleted position could be created again by a
//!   node that had not seen it).
//! - `.fencegate/checkpoint/R`: the whole view ([`Manifest`]) at some position, rewritten every
//!   [`CHECKPOINT_EVERY`] commits off the commit path, `If-Match` on the checkpoint it replaces.
//!   Only an optimisation: the view is the checkpoint plus the entries after it.
//! - `.fencegate/data/R/<revision>-<uuid>`: the immutable objects the entries point at, written
//!   with `If-None-Match: *` before the commit that names them. A refused commit leaves its
//!   object unreferenced, for garbage collection; readers never see it.
//! - `.fencegate/manifest/R`: the first layout's single manifest object; converted once (see
//!   [`Legacy`]).
//!
//! The fence is the view's `fence`: a commit with a token below it is refused, an equal or
//! higher one raises it to the token. New keys, overwrites, copies, multipart completions and
//! deletes are all commits, so a stale holder cannot create a key, rewrite identical bytes or
//! delete one. A commit writes one entry holding only its own changes: O(1) in the number of
//! keys. The one exception to "the fence only grows" is an operator's reset, an entry with
//! `reset_to` ([`LogEntry::reset`]), appended like any commit; so a gateway re-reads the log
//! tail before it refuses on a cached view.

use std::collections::{BTreeMap, HashMap};

use fencegate_core::{Rejection, Token};
use serde::{Deserialize, Serialize};

use crate::rewrite::ClientConditions;

/// Keys under this prefix are the gateway's own (log, checkpoint, physical objects): clients
/// can neither read nor write them through the gateway.
pub const RESERVED_PREFIX: &str = ".fencegate/";

/// A checkpoint is written once the log has grown this many entries past the last one.
pub const CHECKPOINT_EVERY: u64 = 64;

/// The log entry of `resource` at `position` (from 1).
pub fn log_key(resource: &str, position: u64) -> String {
    format!("{RESERVED_PREFIX}log/{resource}/{position:020}")
}

/// The checkpoint object of `resource`.
pub fn checkpoint_key(resource: &str) -> String {
    format!("{RESERVED_PREFIX}checkpoint/{resource}")
}

/// The single manifest object of the first layout (read only to convert it).
pub fn legacy_manifest_key(resource: &str) -> String {
    format!("{RESERVED_PREFIX}manifest/{resource}")
}

/// A fresh immutable object key for a write by `revision` of `resource`.
pub fn physical_key(resource: &str, revision: u64, id: &str) -> String {
    format!("{RESERVED_PREFIX}data/{resource}/{revision:020}-{id}")
}

/// The committed view of one resource at a log position (also the checkpoint's body).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The highest revision that committed.
    pub fence: u64,
    /// The last log entry this view includes (0: none).
    pub position: u64,
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

/// One commit: the fence after it and the keys it changes, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    /// The fence after this commit (the highest revision committed so far).
    pub fence: u64,
    /// The changes, applied in order.
    pub changes: Vec<LogChange>,
    /// An operator's fence reset (`fencegate fence reset`): the fence becomes exactly this,
    /// also when it is lower. Gateways that predate resets ignore the field and keep the higher
    /// fence, so they go on refusing (fail closed) rather than letting a lower token through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_to: Option<u64>,
}

impl LogEntry {
    /// The entry of an operator's reset of the fence to `to` (0: no fence); it changes no key.
    pub fn reset(to: u64) -> Self {
        Self {
            fence: to,
            changes: Vec::new(),
            reset_to: Some(to),
        }
    }
}

/// One key's change in a log entry: `put` names the new object, `None` removes the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogChange {
    /// The logical key.
    pub key: String,
    /// The object it now names (`None`: deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub put: Option<Entry>,
}

impl Manifest {
    /// Applies the entry at `position` (the caller applies entries in order, from
    /// `self.position + 1`).
    pub fn apply(&mut self, position: u64, entry: &LogEntry) {
        self.fence = match entry.reset_to {
            Some(to) => to,
            None => self.fence.max(entry.fence),
        };
        self.position = position;
        for change in &entry.changes {
            match &change.put {
                Some(put) => {
                    self.keys.insert(change.key.clone(), put.clone());
                }
                None => {
                    self.keys.remove(&change.key);
                }
            }
        }
    }
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

/// The decision for one change of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitPlan {
    /// The fence (as committed, or as raised earlier in the batch) is above the token.
    Refuse(Rejection),
    /// The client's own precondition fails on the committed entry.
    PreconditionFailed,
    /// The client asked `If-Match` on a key the view does not name.
    NoSuchKey,
    /// The change is part of the batch's log entry.
    Commit,
}

/// The changes planned over one view, in order, to become one log entry. Planning reads the
/// view and the batch's own earlier changes, never copies the view: O(changes).
#[derive(Debug)]
pub struct Batch<'m> {
    base: &'m Manifest,
    fence: u64,
    changes: Vec<LogChange>,
    /// Key -> index of its latest change in `changes`.
    index: HashMap<String, usize>,
    /// The highest revision the node's authority has issued, if known (words a refusal whose
    /// fence is above it as an authority reset, not the client's lost lock).
    issued: Option<u64>,
}

impl<'m> Batch<'m> {
    /// An empty batch over `base`.
    pub fn new(base: &'m Manifest) -> Self {
        Self {
            base,
            fence: base.fence,
            changes: Vec::new(),
            index: HashMap::new(),
            issued: None,
        }
    }

    /// The same batch, wording stale refusals with what the authority has `issued`.
    pub fn issued(mut self, issued: Option<u64>) -> Self {
        self.issued = issued;
        self
    }

    /// The entry `key` names after the changes planned so far.
    fn current(&self, key: &str) -> Option<&Entry> {
        match self.index.get(key) {
            Some(&at) => self.changes[at].put.as_ref(),
            None => self.base.keys.get(key),
        }
    }

    /// Plans `change` with `token` after the changes already planned.
    pub fn plan(
        &mut self,
        token: &Token,
        target: &str,
        change: &Change,
        client: &ClientConditions,
    ) -> CommitPlan {
        let revision = token.revision().get();
        let fence = self.fence;
        if fence > revision {
            return CommitPlan::Refuse(Rejection::stale(
                token,
                fence,
                &format!("the manifest of {target}"),
                self.issued,
            ));
        }
        match self.current(change.key()) {
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
        self.fence = revision;
        let (key, put) = match change {
            Change::Put(key, entry) => (key.clone(), Some(entry.clone())),
            Change::Delete(key) => (key.clone(), None),
        };
        self.index.insert(key.clone(), self.changes.len());
        self.changes.push(LogChange { key, put });
        CommitPlan::Commit
    }

    /// The log entry to write, `None` when nothing was planned.
    pub fn into_entry(self) -> Option<LogEntry> {
        (!self.changes.is_empty()).then_some(LogEntry {
            fence: self.fence,
            changes: self.changes,
            reset_to: None,
        })
    }
}

/// The first layout's manifest object, as found at [`legacy_manifest_key`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Legacy {
    /// Not converted yet: its view (becomes the checkpoint at position 0).
    Unconverted(Manifest),
    /// Already replaced by the conversion marker, which carries the same view.
    Converted(Manifest),
}

/// The first layout's document.
#[derive(Deserialize)]
struct LegacyDocument {
    fence: u64,
    #[allow(dead_code)]
    seq: u64,
    keys: BTreeMap<String, Entry>,
}

/// What replaces a converted first-layout manifest. It has no top-level `fence`, so a gateway
/// of the first layout fails closed on it ("unreadable; refusing to commit over it") instead of
/// committing where this layout no longer looks.
#[derive(Serialize, Deserialize)]
struct ConversionMarker {
    converted_to_log: Manifest,
    note: String,
}

impl Legacy {
    /// Parses the object at [`legacy_manifest_key`].
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        if let Ok(marker) = serde_json::from_slice::<ConversionMarker>(body) {
            return Ok(Self::Converted(marker.converted_to_log));
        }
        let old: LegacyDocument = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        Ok(Self::Unconverted(Manifest {
            fence: old.fence,
            position: 0,
            keys: old.keys,
        }))
    }

    /// The marker body that replaces a first-layout manifest holding `view`.
    pub fn marker(view: &Manifest) -> Vec<u8> {
        serde_json::to_vec(&ConversionMarker {
            converted_to_log: view.clone(),
            note: "converted to the commit-log layout (.fencegate/log/, .fencegate/checkpoint/); gateways older than the conversion must not serve this bucket".into(),
        })
        .expect("a marker serializes")
    }
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
            position: 9,
            keys: keys.iter().map(|k| ((*k).into(), entry(k))).collect(),
        }
    }

    fn none() -> ClientConditions {
        ClientConditions::default()
    }

    #[test]
    fn golden_first_commit_raises_the_fence_in_one_entry() {
        let empty = Manifest::default();
        let mut batch = Batch::new(&empty);
        let plan = batch.plan(
            &token(7),
            "b/k",
            &Change::Put("k".into(), entry("p")),
            &none(),
        );
        assert_eq!(plan, CommitPlan::Commit);
        let plan = batch.plan(&token(7), "b/gone", &Change::Delete("gone".into()), &none());
        assert_eq!(plan, CommitPlan::Commit);
        let log = batch.into_entry().unwrap();
        assert_eq!(
            serde_json::to_string(&log).unwrap(),
            r#"{"fence":7,"changes":[{"key":"k","put":{"physical":"p","etag":"\"p\"","size":1,"modified":"2026-12-01T00:00:00.000Z","revision":1}},{"key":"gone"}]}"#
        );
        let mut view = empty.clone();
        view.apply(1, &log);
        assert_eq!((view.fence, view.position), (7, 1));
        assert_eq!(view.keys.keys().collect::<Vec<_>>(), ["k"]);
    }

    #[test]
    fn lower_is_refused_equal_commits() {
        let current = manifest(&["k"]);
        let mut batch = Batch::new(&current);
        let CommitPlan::Refuse(rejection) =
            batch.plan(&token(4), "b/k", &Change::Delete("k".into()), &none())
        else {
            panic!()
        };
        assert_eq!(rejection.reason, RejectReason::Stale { fence: 5 });
        assert!(
            rejection.detail.contains("acquire it again"),
            "{rejection:?}"
        );
        // Above every revision the authority issued: the refusal does not blame the client.
        let CommitPlan::Refuse(reset) = Batch::new(&current).issued(Some(4)).plan(
            &token(4),
            "b/k",
            &Change::Delete("k".into()),
            &none(),
        ) else {
            panic!()
        };
        assert!(reset.detail.contains("snapshot bump 5"), "{reset:?}");
        // A stale write to a key the view has never named is refused just the same.
        assert!(matches!(
            batch.plan(
                &token(4),
                "b/new",
                &Change::Put("new".into(), entry("x")),
                &none()
            ),
            CommitPlan::Refuse(_)
        ));
        assert_eq!(
            batch.plan(&token(5), "b/k", &Change::Delete("k".into()), &none()),
            CommitPlan::Commit
        );
        let log = batch.into_entry().unwrap();
        let mut next = current.clone();
        next.apply(10, &log);
        assert_eq!((next.fence, next.position), (5, 10));
        assert!(next.keys.is_empty());
    }

    #[test]
    fn a_raise_earlier_in_the_batch_refuses_a_later_lower_token() {
        let current = manifest(&[]);
        let mut batch = Batch::new(&current);
        let put = |k: &str| Change::Put(k.into(), entry(k));
        assert_eq!(
            batch.plan(&token(9), "b/a", &put("a"), &none()),
            CommitPlan::Commit
        );
        assert!(matches!(
            batch.plan(&token(6), "b/b", &put("b"), &none()),
            CommitPlan::Refuse(_)
        ));
        assert_eq!(batch.into_entry().unwrap().fence, 9);
        assert!(Batch::new(&current).into_entry().is_none());
    }

    #[test]
    fn client_conditions_apply_to_the_committed_entry_and_earlier_changes() {
        let current = manifest(&["k"]);
        let put = Change::Put("k".into(), entry("p2"));
        let none_match = ClientConditions {
            if_none_match: Some("*".into()),
            if_match: None,
        };
        let mut batch = Batch::new(&current);
        assert_eq!(
            batch.plan(&token(6), "b/k", &put, &none_match),
            CommitPlan::PreconditionFailed
        );
        let wrong = ClientConditions {
            if_match: Some("\"other\"".into()),
            if_none_match: None,
        };
        assert_eq!(
            batch.plan(&token(6), "b/k", &put, &wrong),
            CommitPlan::PreconditionFailed
        );
        assert_eq!(
            batch.plan(
                &token(6),
                "b/x",
                &Change::Put("x".into(), entry("p")),
                &wrong
            ),
            CommitPlan::NoSuchKey
        );
        // A key created earlier in the same batch exists for the next change.
        assert_eq!(
            batch.plan(
                &token(6),
                "b/x",
                &Change::Put("x".into(), entry("p")),
                &none()
            ),
            CommitPlan::Commit
        );
        assert_eq!(
            batch.plan(
                &token(6),
                "b/x",
                &Change::Put("x".into(), entry("q")),
                &none_match
            ),
            CommitPlan::PreconditionFailed
        );
        let deleted = ClientConditions {
            if_match: Some("\"k\"".into()),
            if_none_match: None,
        };
        assert_eq!(
            batch.plan(&token(6), "b/k", &Change::Delete("k".into()), &none()),
            CommitPlan::Commit
        );
        assert_eq!(
            batch.plan(&token(6), "b/k", &Change::Delete("k".into()), &deleted),
            CommitPlan::NoSuchKey
        );
    }

    #[test]
    fn golden_reset_lowers_the_fence_and_keeps_the_keys() {
        let reset = LogEntry::reset(3);
        assert_eq!(
            serde_json::to_string(&reset).unwrap(),
            r#"{"fence":3,"changes":[],"reset_to":3}"#
        );
        let mut view = manifest(&["k"]);
        view.fence = 999;
        view.apply(10, &reset);
        assert_eq!((view.fence, view.position), (3, 10));
        assert_eq!(view.keys.keys().collect::<Vec<_>>(), ["k"]);
        // After the reset a token at the new fence commits and raises it as before...
        let mut batch = Batch::new(&view);
        assert_eq!(
            batch.plan(&token(3), "b/k", &Change::Delete("k".into()), &none()),
            CommitPlan::Commit
        );
        let next = batch.into_entry().unwrap();
        assert_eq!(next.reset_to, None);
        view.apply(11, &next);
        assert_eq!(view.fence, 3);
        // ...and an entry written before resets existed (no field) still only raises it.
        let old: LogEntry = serde_json::from_str(r#"{"fence":2,"changes":[]}"#).unwrap();
        view.apply(12, &old);
        assert_eq!(view.fence, 3);
        // Reset to 0: no fence at all.
        view.apply(13, &LogEntry::reset(0));
        assert_eq!(view.fence, 0);
    }

    #[test]
    fn legacy_manifests_convert_and_the_marker_fails_closed_for_old_gateways() {
        let old = br#"{"fence":4,"seq":12,"keys":{"k":{"physical":"p","etag":"\"p\"","size":1,"modified":"2026-12-01T00:00:00.000Z","revision":1}}}"#;
        let Legacy::Unconverted(view) = Legacy::parse(old).unwrap() else {
            panic!()
        };
        assert_eq!((view.fence, view.position, view.keys.len()), (4, 0, 1));
        let marker = Legacy::marker(&view);
        assert_eq!(Legacy::parse(&marker).unwrap(), Legacy::Converted(view));
        // What a gateway of the first layout parses the marker as: it has no fence.
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct FirstLayout {
            fence: u64,
            seq: u64,
            keys: BTreeMap<String, Entry>,
        }
        assert!(serde_json::from_slice::<FirstLayout>(&marker).is_err());
        assert!(Legacy::parse(b"{}").is_err());
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
    fn golden_keys() {
        assert_eq!(
            physical_key("job", 42, "u1"),
            ".fencegate/data/job/00000000000000000042-u1"
        );
        assert_eq!(log_key("job", 3), ".fencegate/log/job/00000000000000000003");
        assert_eq!(checkpoint_key("job"), ".fencegate/checkpoint/job");
        assert_eq!(legacy_manifest_key("job"), ".fencegate/manifest/job");
    }
}
