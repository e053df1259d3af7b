//! Manifest mode, the log's I/O: load a resource's view (checkpoint, then the log entries after
//! it), keep it current (one GET of the next position: 404 when nothing was committed since),
//! append one entry (`If-None-Match: *` on its position, so the store picks one writer per
//! position) and write checkpoints. A checkpoint or entry the gateway cannot parse fails
//! closed: nothing is committed over it.
//!
//! The cached view is changed in place under the cache lock (`Arc::make_mut`), so catching up
//! and committing cost O(changes), not a copy of the view, unless a reader still holds the
//! previous `Arc` at that moment.

use std::sync::Arc;

use bytes::Bytes;
use fencegate_core::FenceReset;

use crate::error::S3Error;
use crate::gateway::Shared;
use crate::manifest::{
    checkpoint_key, legacy_manifest_key, log_key, Legacy, LogEntry, Manifest, CHECKPOINT_EVERY,
};
use crate::upstream::Upstream;

/// The user metadata carrying a checkpoint's log position, so a HEAD tells it.
const POSITION_META: &str = "x-amz-meta-fencegate-position";

/// A resource's view as this node knows it.
#[derive(Debug, Clone)]
pub(crate) struct Loaded {
    pub(crate) manifest: Arc<Manifest>,
    /// The checkpoint last read or written: its ETag and position.
    checkpoint: Option<(String, u64)>,
}

impl Shared {
    /// The view of `resource` in `bucket` (`None`: nothing committed yet). `revalidate` false
    /// may answer from the cache without I/O: fine wherever a stale view only costs a retry
    /// (an append on it loses its position) or refuses correctly (fences only grow).
    /// Revalidating costs one GET (404) when the cached view is current.
    pub(crate) async fn manifest(
        &self,
        bucket: &str,
        resource: &str,
        revalidate: bool,
    ) -> Result<Option<Loaded>, S3Error> {
        let id = (bucket.to_owned(), resource.to_owned());
        let cached = self.manifests.lock().expect("poisoned").get(&id).cloned();
        let loaded = match (cached, revalidate) {
            (Some(cached), false) => cached,
            (Some(cached), true) => {
                let position = cached.manifest.position;
                drop(cached);
                self.catch_up(bucket, resource, position).await?
            }
            (None, _) => {
                let base = self.load_base(bucket, resource).await?;
                let position = base.manifest.position;
                self.install(&id, base);
                self.catch_up(bucket, resource, position).await?
            }
        };
        Ok((loaded.manifest.position > 0 || !loaded.manifest.keys.is_empty()).then_some(loaded))
    }

    /// Stores `loaded` unless the cache already holds a view at least as new.
    fn install(&self, id: &(String, String), loaded: Loaded) {
        let mut cache = self.manifests.lock().expect("poisoned");
        match cache.get(id) {
            Some(have) if have.manifest.position >= loaded.manifest.position => {}
            _ => {
                cache.insert(id.clone(), loaded);
            }
        }
    }

    /// Applies `entries` (consecutive, from `from`) to the cached view where they follow it.
    fn absorb(&self, id: &(String, String), from: u64, entries: &[LogEntry]) -> Option<Loaded> {
        let mut cache = self.manifests.lock().expect("poisoned");
        let loaded = cache.get_mut(id)?;
        for (position, entry) in (from..).zip(entries) {
            if position == loaded.manifest.position + 1 {
                Arc::make_mut(&mut loaded.manifest).apply(position, entry);
            }
        }
        Some(loaded.clone())
    }

    /// Reads the log after `position` until the first free position, and applies it to the
    /// cached view. After [`CHECKPOINT_EVERY`] entries in a row it looks for a newer
    /// checkpoint first (a node idle for long jumps instead of replaying everything).
    async fn catch_up(
        &self,
        bucket: &str,
        resource: &str,
        position: u64,
    ) -> Result<Loaded, S3Error> {
        let id = (bucket.to_owned(), resource.to_owned());
        let mut next = position + 1;
        let mut read = Vec::new();
        loop {
            if read.len() as u64 == CHECKPOINT_EVERY {
                self.absorb(&id, next - read.len() as u64, &read);
                read.clear();
                let base = self.load_base(bucket, resource).await?;
                if base.manifest.position >= next {
                    next = base.manifest.position + 1;
                    self.install(&id, base);
                }
            }
            match self.read_entry(bucket, resource, next).await? {
                Some(entry) => {
                    read.push(entry);
                    next += 1;
                }
                None => break,
            }
        }
        let from = next - read.len() as u64;
        self.absorb(&id, from, &read).ok_or_else(|| {
            S3Error::Upstream(format!(
                "the view of {resource} in {bucket} was dropped; retry"
            ))
        })
    }

    /// The log entry at `position`, `None` when that position is free.
    async fn read_entry(
        &self,
        bucket: &str,
        resource: &str,
        position: u64,
    ) -> Result<Option<LogEntry>, S3Error> {
        let path = Upstream::path_and_query(Some(bucket), Some(&log_key(resource, position)), "");
        let response = self
            .send("GET", &path, Vec::new(), Bytes::new().into(), None)
            .await?;
        match response.status {
            200 => serde_json::from_slice(&response.body).map(Some).map_err(|e| {
                S3Error::Upstream(format!(
                    "log entry {position} of {resource} in {bucket} is unreadable ({e}); refusing to commit over it: restore it from the bucket's versions or a backup"
                ))
            }),
            404 => Ok(None),
            status => Err(S3Error::Upstream(format!(
                "GET of log entry {position} of {resource} in {bucket} answered {status}"
            ))),
        }
    }

    /// The view to replay the log from: the checkpoint, else a converted first-layout
    /// manifest, else the empty view at position 0.
    async fn load_base(&self, bucket: &str, resource: &str) -> Result<Loaded, S3Error> {
        let path = Upstream::path_and_query(Some(bucket), Some(&checkpoint_key(resource)), "");
        for _attempt in 0..3 {
            let response = self
                .send("GET", &path, Vec::new(), Bytes::new().into(), None)
                .await?;
            match response.status {
                200 => {
                    let etag = response.header("etag").map(str::to_owned).ok_or_else(|| {
                        S3Error::Upstream(format!(
                            "the checkpoint of {resource} came without an ETag"
                        ))
                    })?;
                    let manifest: Manifest =
                        serde_json::from_slice(&response.body).map_err(|e| {
                            S3Error::Upstream(format!(
                                "the checkpoint of {resource} in {bucket} is unreadable ({e}); remove it and the gateway replays the log from the start"
                            ))
                        })?;
                    return Ok(Loaded {
                        checkpoint: Some((etag, manifest.position)),
                        manifest: Arc::new(manifest),
                    });
                }
                404 => {}
                status => {
                    return Err(S3Error::Upstream(format!(
                        "GET of the checkpoint of {resource} in {bucket} answered {status}"
                    )))
                }
            }
            match self.convert_legacy(bucket, resource).await? {
                Some(view) => {
                    // The checkpoint at position 0 makes the conversion visible to every
                    // node; if another node wrote it first, read theirs (the same view).
                    if let Some(etag) = self.put_checkpoint(bucket, resource, &view, None).await? {
                        return Ok(Loaded {
                            checkpoint: Some((etag, 0)),
                            manifest: Arc::new(view),
                        });
                    }
                }
                None => {
                    return Ok(Loaded {
                        checkpoint: None,
                        manifest: Arc::new(Manifest::default()),
                    })
                }
            }
        }
        Err(S3Error::Upstream(format!(
            "the checkpoint of {resource} in {bucket} kept changing while converting the first-layout manifest; retry"
        )))
    }

    /// A first-layout manifest of `resource`, replaced by the conversion marker (which first
    /// stops gateways of that layout from committing into it): its view, `None` if there is
    /// none.
    async fn convert_legacy(
        &self,
        bucket: &str,
        resource: &str,
    ) -> Result<Option<Manifest>, S3Error> {
        let path = Upstream::path_and_query(Some(bucket), Some(&legacy_manifest_key(resource)), "");
        for _attempt in 0..3 {
            let response = self
                .send("GET", &path, Vec::new(), Bytes::new().into(), None)
                .await?;
            match response.status {
                404 => return Ok(None),
                200 => {}
                status => {
                    return Err(S3Error::Upstream(format!(
                    "GET of the first-layout manifest of {resource} in {bucket} answered {status}"
                )))
                }
            }
            let legacy = Legacy::parse(&response.body).map_err(|e| {
                S3Error::Upstream(format!(
                    "the first-layout manifest of {resource} in {bucket} is unreadable ({e}); refusing to convert it: restore it from the bucket's versions or a backup"
                ))
            })?;
            let view = match legacy {
                Legacy::Converted(view) => return Ok(Some(view)),
                Legacy::Unconverted(view) => view,
            };
            let etag = response.header("etag").unwrap_or_default().to_owned();
            let body = Bytes::from(Legacy::marker(&view));
            let len = body.len() as u64;
            let headers = vec![
                ("if-match".to_owned(), etag),
                ("content-type".to_owned(), "application/json".to_owned()),
            ];
            let put = self
                .send("PUT", &path, headers, body.into(), Some(len))
                .await?;
            match put.status {
                200..=299 => {
                    tracing::info!(bucket, resource, fence = view.fence, keys = view.keys.len(), "s3: first-layout manifest converted to the commit log");
                    return Ok(Some(view));
                }
                // A first-layout gateway committed meanwhile, or another node converted it.
                404 | 409 | 412 => {}
                status => {
                    return Err(S3Error::Upstream(format!(
                        "converting the first-layout manifest of {resource} in {bucket} answered {status}"
                    )))
                }
            }
        }
        Err(S3Error::Upstream(format!(
            "the first-layout manifest of {resource} in {bucket} kept changing while converting it; stop the gateways of the older version and retry"
        )))
    }

    /// Writes `view` as the checkpoint, replacing the one with `replaces` (ETag; `None`: there
    /// is none). `Ok(None)` when the condition failed (another node wrote one).
    async fn put_checkpoint(
        &self,
        bucket: &str,
        resource: &str,
        view: &Manifest,
        replaces: Option<&str>,
    ) -> Result<Option<String>, S3Error> {
        let path = Upstream::path_and_query(Some(bucket), Some(&checkpoint_key(resource)), "");
        let body = Bytes::from(serde_json::to_vec(view).expect("a view serializes"));
        let len = body.len() as u64;
        let condition = match replaces {
            Some(etag) => ("if-match".to_owned(), etag.to_owned()),
            None => ("if-none-match".to_owned(), "*".to_owned()),
        };
        let headers = vec![
            condition,
            ("content-type".to_owned(), "application/json".to_owned()),
            (POSITION_META.to_owned(), view.position.to_string()),
        ];
        let response = self
            .send("PUT", &path, headers, body.into(), Some(len))
            .await?;
        match response.status {
            200..=299 => Ok(Some(response.header("etag").unwrap_or_default().to_owned())),
            404 | 409 | 412 => Ok(None),
            status => Err(S3Error::Upstream(format!(
                "the checkpoint of {resource} in {bucket} answered {status}"
            ))),
        }
    }

    /// Appends `entry` at `position` (one past the view it was planned over): the new view
    /// when this node created the position, `Ok(None)` when another writer had.
    pub(crate) async fn append(
        &self,
        bucket: &str,
        resource: &str,
        position: u64,
        entry: &LogEntry,
    ) -> Result<Option<Loaded>, S3Error> {
        let path = Upstream::path_and_query(Some(bucket), Some(&log_key(resource, position)), "");
        let body = Bytes::from(serde_json::to_vec(entry).expect("an entry serializes"));
        let len = body.len() as u64;
        let headers = vec![
            ("if-none-match".to_owned(), "*".to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
        ];
        let response = self
            .send("PUT", &path, headers, body.into(), Some(len))
            .await?;
        match response.status {
            200..=299 => {
                let id = (bucket.to_owned(), resource.to_owned());
                Ok(Some(
                    self.absorb(&id, position, std::slice::from_ref(entry))
                        .ok_or_else(|| {
                            S3Error::Upstream(format!(
                                "the view of {resource} in {bucket} was dropped"
                            ))
                        })?,
                ))
            }
            409 | 412 => Ok(None),
            status => Err(S3Error::Upstream(format!(
                "log entry {position} of {resource} in {bucket} answered {status}"
            ))),
        }
    }

    /// An operator's reset of `resource`'s fence in `bucket` to `to` (0: none), only if the
    /// log's fence is `current` now: the reset entry goes to the position after the view it
    /// was judged on, `If-None-Match: *`, so a commit that lands in between makes the append
    /// fail and the reset is judged again on the new view.
    pub(crate) async fn reset_fence(
        &self,
        bucket: &str,
        resource: &str,
        current: u64,
        to: u64,
    ) -> Result<FenceReset, S3Error> {
        for _attempt in 0..self.config.max_attempts {
            let view = self.manifest(bucket, resource, true).await?;
            let (fence, position) =
                view.map_or((0, 0), |l| (l.manifest.fence, l.manifest.position));
            if fence != current {
                return Ok(FenceReset::Mismatch { actual: fence });
            }
            if self
                .append(bucket, resource, position + 1, &LogEntry::reset(to))
                .await?
                .is_some()
            {
                tracing::info!(
                    bucket,
                    resource,
                    from = fence,
                    to,
                    position = position + 1,
                    "s3: manifest fence reset"
                );
                return Ok(FenceReset::Done { from: fence, to });
            }
        }
        Err(S3Error::Upstream(format!(
            "the log of {resource} in {bucket} kept changing during the reset; nothing was reset: retry"
        )))
    }

    /// Writes a checkpoint of the cached view if the log has grown [`CHECKPOINT_EVERY`]
    /// entries past the last one. Called after a commit was answered; a failure only leaves
    /// a longer log for cold readers to replay, so it is logged, not returned.
    pub(crate) async fn checkpoint_if_due(&self, bucket: &str, resource: &str) {
        let id = (bucket.to_owned(), resource.to_owned());
        let Some(loaded) = self.manifests.lock().expect("poisoned").get(&id).cloned() else {
            return;
        };
        let (etag, at) = match &loaded.checkpoint {
            Some((etag, at)) => (Some(etag.clone()), *at),
            None => (None, 0),
        };
        if loaded.manifest.position < at + CHECKPOINT_EVERY {
            return;
        }
        let view = loaded.manifest.clone();
        drop(loaded);
        let written = self
            .put_checkpoint(bucket, resource, &view, etag.as_deref())
            .await;
        let mark = match written {
            Ok(Some(etag)) => Some((etag, view.position)),
            // Someone else wrote one: learn its ETag and position from a HEAD.
            Ok(None) => match self.checkpoint_mark(bucket, resource).await {
                Ok(mark) => mark,
                Err(e) => {
                    tracing::warn!(bucket, resource, error = %e, "s3: checkpoint not read back");
                    None
                }
            },
            Err(e) => {
                tracing::warn!(bucket, resource, error = %e, "s3: checkpoint not written");
                None
            }
        };
        if let Some(mark) = mark {
            let mut cache = self.manifests.lock().expect("poisoned");
            if let Some(loaded) = cache.get_mut(&id) {
                if loaded
                    .checkpoint
                    .as_ref()
                    .is_none_or(|(_, at)| *at <= mark.1)
                {
                    loaded.checkpoint = Some(mark);
                }
            }
        }
    }

    /// The stored checkpoint's ETag and position (HEAD).
    async fn checkpoint_mark(
        &self,
        bucket: &str,
        resource: &str,
    ) -> Result<Option<(String, u64)>, S3Error> {
        let headers = self
            .head_headers(bucket, &checkpoint_key(resource), "")
            .await?;
        Ok(headers.and_then(|headers| {
            let get = |name: &str| {
                headers
                    .iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case(name))
                    .map(|(_, v)| v.clone())
            };
            Some((get("etag")?, get(POSITION_META)?.parse().ok()?))
        }))
    }
}
