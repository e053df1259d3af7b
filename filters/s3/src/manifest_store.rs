//! Manifest mode, the manifest's I/O: read it (a conditional GET revalidates the cached copy
//! cheaply: 304 when unchanged) and commit it (a PUT conditional on the ETag read, so the store
//! decides). A manifest the gateway cannot parse fails closed: nothing is committed over it.

use std::sync::Arc;

use bytes::Bytes;

use crate::error::S3Error;
use crate::gateway::Shared;
use crate::manifest::{manifest_key, Manifest};
use crate::upstream::Upstream;

/// A manifest as read or committed, with the ETag the store gave it.
#[derive(Debug, Clone)]
pub(crate) struct Loaded {
    pub(crate) etag: String,
    pub(crate) manifest: Arc<Manifest>,
}

impl Shared {
    /// The manifest of `resource` in `bucket` (`None`: none committed yet). `revalidate`
    /// false may answer from the cache without I/O: fine wherever a stale copy only costs a
    /// retry (a commit on it fails its `If-Match`), or refuses correctly (fences only grow).
    pub(crate) async fn manifest(
        &self,
        bucket: &str,
        resource: &str,
        revalidate: bool,
    ) -> Result<Option<Loaded>, S3Error> {
        let id = (bucket.to_owned(), resource.to_owned());
        let cached = self.manifests.lock().expect("poisoned").get(&id).cloned();
        if let (Some(cached), false) = (&cached, revalidate) {
            return Ok(Some(cached.clone()));
        }
        let path = Upstream::path_and_query(Some(bucket), Some(&manifest_key(resource)), "");
        let headers = cached
            .iter()
            .map(|c| ("if-none-match".to_owned(), c.etag.clone()))
            .collect();
        let response = self
            .send("GET", &path, headers, Bytes::new().into(), None)
            .await?;
        match response.status {
            304 => cached.map(Some).ok_or_else(|| {
                S3Error::Upstream(format!(
                    "the manifest of {resource} answered 304 to a plain GET"
                ))
            }),
            200 => {
                let etag = response.header("etag").map(str::to_owned).ok_or_else(|| {
                    S3Error::Upstream(format!("the manifest of {resource} came without an ETag"))
                })?;
                let manifest: Manifest = serde_json::from_slice(&response.body).map_err(|e| {
                    S3Error::Upstream(format!(
                        "the manifest of {resource} in {bucket} is unreadable ({e}); refusing to commit over it: restore it from the bucket's versions or a backup"
                    ))
                })?;
                let loaded = Loaded {
                    etag,
                    manifest: Arc::new(manifest),
                };
                self.manifests
                    .lock()
                    .expect("poisoned")
                    .insert(id, loaded.clone());
                Ok(Some(loaded))
            }
            404 => {
                self.manifests.lock().expect("poisoned").remove(&id);
                Ok(None)
            }
            status => Err(S3Error::Upstream(format!(
                "GET of the manifest of {resource} in {bucket} answered {status}"
            ))),
        }
    }

    /// Writes `next` over `base` (`None`: the first manifest): `Ok(None)` when someone
    /// committed in between (the store refused the condition).
    pub(crate) async fn commit_manifest(
        &self,
        bucket: &str,
        resource: &str,
        base: Option<&Loaded>,
        next: Manifest,
    ) -> Result<Option<Loaded>, S3Error> {
        let path = Upstream::path_and_query(Some(bucket), Some(&manifest_key(resource)), "");
        let body = Bytes::from(serde_json::to_vec(&next).expect("a manifest serializes"));
        let condition = match base {
            Some(base) => ("if-match".to_owned(), base.etag.clone()),
            None => ("if-none-match".to_owned(), "*".to_owned()),
        };
        let headers = vec![
            condition,
            ("content-type".to_owned(), "application/json".to_owned()),
        ];
        let len = body.len() as u64;
        let response = self
            .send("PUT", &path, headers, body.into(), Some(len))
            .await?;
        match response.status {
            200..=299 => {
                let etag = response.header("etag").map(str::to_owned).ok_or_else(|| {
                    S3Error::Upstream(format!(
                        "the manifest commit of {resource} came without an ETag"
                    ))
                })?;
                let loaded = Loaded {
                    etag,
                    manifest: Arc::new(next),
                };
                self.manifests
                    .lock()
                    .expect("poisoned")
                    .insert((bucket.to_owned(), resource.to_owned()), loaded.clone());
                Ok(Some(loaded))
            }
            // 404: If-Match on a manifest that was removed behind the gateway's back.
            404 | 409 | 412 => Ok(None),
            status => Err(S3Error::Upstream(format!(
                "the manifest commit of {resource} in {bucket} answered {status}"
            ))),
        }
    }
}
