//! Object mode: the revision a fenced multipart upload was created with, kept in the store so
//! that a restarted gateway (or another node) can still judge the upload's completion.
//!
//! S3 keeps an upload's metadata (where the fence to be applied at completion already is) but
//! no API returns it before completion: neither ListMultipartUploads nor ListParts carries
//! user metadata, on AWS or on moto. So the gateway writes a small stamp object per upload,
//! `.fencegate/uploads/<sha256(key, upload id)>`, with `If-None-Match: *` right after the
//! store created the upload, and deletes it when the upload is completed or aborted through
//! it. Clients can neither write nor delete keys under `.fencegate/` in a bucket with a
//! fencing rule, so a stamp is the gateway's word. An upload whose stamp could not be written
//! is aborted and the client told to retry: it could not be completed after a restart.
//!
//! Stamps of uploads abandoned without an abort stay behind (as the uploads' parts do); a
//! lifecycle rule that expires `.fencegate/uploads/` after `upload_max_age_s` removes them.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::S3Error;
use crate::gateway::{Shared, Upload, UploadKey};
use crate::manifest::RESERVED_PREFIX;
use crate::upstream::Upstream;

/// The stamp object's body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadStamp {
    /// The key the upload was created for.
    pub key: String,
    /// The store's upload id.
    pub upload_id: String,
    /// The revision of the token that created the upload.
    pub revision: u64,
    /// The resource of that token.
    pub resource: String,
}

/// The stamp object's key for the upload `upload_id` of `key` (hashed: keys and upload ids
/// may hold any character, the stamp's key must stay plain).
pub fn stamp_key(key: &str, upload_id: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(key.as_bytes());
    hash.update([0]);
    hash.update(upload_id.as_bytes());
    format!("{RESERVED_PREFIX}uploads/{}", hex::encode(hash.finalize()))
}

impl UploadStamp {
    /// Parses a stamp read back, accepting it only for the upload it was asked for.
    pub fn parse_for(body: &[u8], key: &str, upload_id: &str) -> Option<Self> {
        let stamp: Self = serde_json::from_slice(body).ok()?;
        (stamp.key == key && stamp.upload_id == upload_id).then_some(stamp)
    }
}

impl Shared {
    /// Writes the stamp of a just-created upload (`If-None-Match: *`: never replaces one).
    pub(crate) async fn stamp_upload(
        &self,
        bucket: &str,
        stamp: &UploadStamp,
    ) -> Result<(), S3Error> {
        let path = Upstream::path_and_query(
            Some(bucket),
            Some(&stamp_key(&stamp.key, &stamp.upload_id)),
            "",
        );
        let body = serde_json::to_vec(stamp).map_err(|e| S3Error::Upstream(e.to_string()))?;
        let len = body.len() as u64;
        let headers = vec![
            ("if-none-match".to_owned(), "*".to_owned()),
            ("content-type".to_owned(), "application/json".to_owned()),
        ];
        let response = self
            .send("PUT", &path, headers, Bytes::from(body).into(), Some(len))
            .await?;
        if !response.succeeded() {
            return Err(S3Error::Upstream(format!(
                "writing the stamp of upload {} of {bucket}/{} answered {}",
                stamp.upload_id, stamp.key, response.status
            )));
        }
        Ok(())
    }

    /// The upload `id`, from memory or else from its stamp in the store (then remembered);
    /// `None` when neither knows it.
    pub(crate) async fn recall_upload(&self, id: &UploadKey) -> Result<Option<Upload>, S3Error> {
        if let Some(upload) = self.upload(id) {
            return Ok(Some(upload));
        }
        let (bucket, key, upload_id) = id;
        let path = Upstream::path_and_query(Some(bucket), Some(&stamp_key(key, upload_id)), "");
        let response = self
            .send("GET", &path, Vec::new(), Bytes::new().into(), None)
            .await?;
        match response.status {
            200 => {}
            404 => return Ok(None),
            status => {
                return Err(S3Error::Upstream(format!(
                    "reading the stamp of upload {upload_id} of {bucket}/{key} answered {status}"
                )))
            }
        }
        let Some(stamp) = UploadStamp::parse_for(&response.body, key, upload_id) else {
            tracing::warn!(
                bucket,
                upload_id,
                "an upload stamp names another upload; ignored"
            );
            return Ok(None);
        };
        tracing::info!(
            bucket,
            upload_id,
            revision = stamp.revision,
            "upload recovered from its stamp"
        );
        // Remembered if there is room; judged from the stamp either way.
        self.track_upload(id.clone(), stamp.revision, None);
        Ok(Some(Upload::recalled(stamp.revision)))
    }

    /// Forgets the upload `id`, in memory and in the store (best effort: a stamp left behind
    /// only names an upload that no longer exists).
    pub(crate) async fn unstamp_upload(&self, id: &UploadKey) {
        self.forget_upload(id);
        let (bucket, key, upload_id) = id;
        let path = Upstream::path_and_query(Some(bucket), Some(&stamp_key(key, upload_id)), "");
        match self
            .send("DELETE", &path, Vec::new(), Bytes::new().into(), None)
            .await
        {
            Ok(response) if response.succeeded() || response.status == 404 => {}
            Ok(response) => {
                tracing::warn!(
                    bucket,
                    upload_id,
                    status = response.status,
                    "the upload's stamp was not deleted"
                )
            }
            Err(e) => {
                tracing::warn!(bucket, upload_id, error = %e, "the upload's stamp was not deleted")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_keys_are_plain_and_distinct() {
        let a = stamp_key("billing/2026.csv", "upload-1");
        assert_eq!(a.len(), ".fencegate/uploads/".len() + 64);
        assert!(a.starts_with(".fencegate/uploads/"));
        assert!(a[".fencegate/uploads/".len()..]
            .chars()
            .all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, stamp_key("billing/2026.csv", "upload-2"));
        // The separator keeps (key, id) pairs that concatenate alike apart.
        assert_ne!(stamp_key("ab", "c"), stamp_key("a", "bc"));
        assert_eq!(a, stamp_key("billing/2026.csv", "upload-1"));
    }

    #[test]
    fn a_stamp_is_accepted_only_for_its_own_upload() {
        let stamp = UploadStamp {
            key: "k".into(),
            upload_id: "u".into(),
            revision: 7,
            resource: "job".into(),
        };
        let body = serde_json::to_vec(&stamp).unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"key":"k","upload_id":"u","revision":7,"resource":"job"}"#
        );
        assert_eq!(UploadStamp::parse_for(&body, "k", "u"), Some(stamp));
        assert_eq!(UploadStamp::parse_for(&body, "other", "u"), None);
        assert_eq!(UploadStamp::parse_for(&body, "k", "v"), None);
        assert_eq!(UploadStamp::parse_for(b"not json", "k", "u"), None);
    }
}
