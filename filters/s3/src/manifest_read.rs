//! Manifest mode, reads: a GET/HEAD of a logical key is proxied (streaming, ranges and
//! conditional GETs handled by the store) to the physical object the resource's view names,
//! after a cheap revalidation of the cached view (one GET of the next log position: 404 when
//! nothing was committed since); a key the view does not name is `404 NoSuchKey` even if a
//! stale holder's physical object exists. ListObjects(V2) under a manifest-mode prefix is
//! answered from the view.

use bytes::Bytes;
use quick_xml::escape::escape;

use crate::config::ProtectMode;
use crate::gateway::query_pairs;
use crate::manifest::{list, ListPage, ListRequest, RESERVED_PREFIX};
use crate::respond::respond;
use crate::rewrite::Target;
use crate::session::WriteSession;

/// Query parameters a listing may carry; any other makes a bucket GET something else
/// (`?location`, `?versioning`, `?uploads`, ...), which is proxied.
const LIST_PARAMS: &[&str] = &[
    "list-type",
    "prefix",
    "delimiter",
    "max-keys",
    "continuation-token",
    "start-after",
    "fetch-owner",
    "encoding-type",
    "marker",
    "x-id",
];

impl WriteSession<'_> {
    /// A read on a bucket with manifest-mode rules: `Some(target)` to proxy to (the physical
    /// object, or the request unchanged outside manifest prefixes); `None` when answered here.
    pub(crate) async fn manifest_read(&mut self) -> Option<Target> {
        let Some(bucket) = self.target.bucket.clone() else {
            return Some(self.target.clone());
        };
        let query = query_pairs(&self.raw_query);
        let Some(key) = self.target.key.clone() else {
            let listing = query.iter().all(|(k, _)| LIST_PARAMS.contains(&k.as_str()))
                && self.method == "GET";
            if !listing {
                return Some(self.target.clone());
            }
            return self.manifest_list(&bucket, &query).await;
        };
        if key.starts_with(RESERVED_PREFIX) {
            self.error(404, "NoSuchKey", "The specified key does not exist.")
                .await;
            return None;
        }
        let rule = self.shared.config.rule_for(&bucket, Some(&key)).cloned();
        let Some(rule) = rule.filter(|r| r.mode == ProtectMode::Manifest) else {
            return Some(self.target.clone());
        };
        if let Some((_, upload_id)) = query.iter().find(|(k, _)| k == "uploadId") {
            // ListParts of an upload in progress: its parts live on the physical key.
            let id = (bucket.clone(), key.clone(), upload_id.clone());
            return match self.shared.upload(&id).and_then(|u| u.physical) {
                Some(physical) => Some(Target {
                    bucket: Some(bucket),
                    key: Some(physical),
                }),
                None => {
                    self.error(404, "NoSuchUpload", "The specified upload does not exist.")
                        .await;
                    None
                }
            };
        }
        let resource = rule.resource.clone().unwrap_or_default();
        match self.shared.manifest(&bucket, &resource, true).await {
            Ok(manifest) => {
                match manifest.and_then(|l| l.manifest.keys.get(&key).map(|e| e.physical.clone())) {
                    Some(physical) => Some(Target {
                        bucket: Some(bucket),
                        key: Some(physical),
                    }),
                    None => {
                        self.error(404, "NoSuchKey", "The specified key does not exist.")
                            .await;
                        None
                    }
                }
            }
            Err(e) => {
                self.upstream_failed(e).await;
                None
            }
        }
    }

    async fn manifest_list(&mut self, bucket: &str, query: &[(String, String)]) -> Option<Target> {
        let get = |name: &str| {
            query
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        let prefix = get("prefix").unwrap_or_default();
        let rule = self
            .shared
            .config
            .protect
            .iter()
            .find(|r| {
                r.bucket == bucket
                    && r.mode == ProtectMode::Manifest
                    && prefix.starts_with(&r.prefix)
            })
            .cloned();
        let Some(rule) = rule else {
            let overlaps = self.shared.config.protect.iter().any(|r| {
                r.bucket == bucket
                    && r.mode == ProtectMode::Manifest
                    && r.prefix.starts_with(&prefix)
            }) || RESERVED_PREFIX.starts_with(&prefix);
            if overlaps {
                let message = "this listing would mix manifest-mode keys with plain ones, which is not supported: list with a prefix inside one manifest-mode rule's prefix";
                self.error(501, "NotImplemented", message).await;
                return None;
            }
            return Some(self.target.clone());
        };
        let v2 = get("list-type").as_deref() == Some("2");
        let request = ListRequest {
            prefix,
            delimiter: get("delimiter").unwrap_or_default(),
            max_keys: get("max-keys")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1000)
                .min(1000),
            start_after: get(if v2 { "start-after" } else { "marker" }).unwrap_or_default(),
            continuation: get("continuation-token").filter(|_| v2),
        };
        let resource = rule.resource.clone().unwrap_or_default();
        let manifest = match self.shared.manifest(bucket, &resource, true).await {
            Ok(manifest) => manifest,
            Err(e) => {
                self.upstream_failed(e).await;
                return None;
            }
        };
        let empty = crate::manifest::Manifest::default();
        let manifest = manifest.as_ref().map_or(&empty, |l| &*l.manifest);
        let page = list(manifest, &request);
        let xml = list_xml(bucket, &request, &page, v2);
        respond(
            self.session,
            200,
            vec![("content-type".into(), "application/xml".into())],
            Bytes::from(xml),
            &self.request_id,
        )
        .await;
        None
    }
}

/// The `ListBucketResult` document of one page (V2, or V1 with `v2` false).
pub(crate) fn list_xml(bucket: &str, request: &ListRequest, page: &ListPage, v2: bool) -> String {
    let mut xml = String::from(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">",
    );
    let mut element = |name: &str, value: &str| {
        xml.push_str(&format!("<{name}>{}</{name}>", escape(value)));
    };
    element("Name", bucket);
    element("Prefix", &request.prefix);
    if !request.delimiter.is_empty() {
        element("Delimiter", &request.delimiter);
    }
    element("MaxKeys", &request.max_keys.to_string());
    element("IsTruncated", if page.truncated { "true" } else { "false" });
    if v2 {
        element(
            "KeyCount",
            &(page.contents.len() + page.common_prefixes.len()).to_string(),
        );
        if let Some(token) = &request.continuation {
            element("ContinuationToken", token);
        }
        if let Some(next) = &page.next {
            element("NextContinuationToken", next);
        }
        if !request.start_after.is_empty() {
            element("StartAfter", &request.start_after);
        }
    } else {
        element("Marker", &request.start_after);
        if let Some(next) = page.next.as_deref().and_then(|t| hex::decode(t).ok()) {
            element("NextMarker", &String::from_utf8_lossy(&next));
        }
    }
    for (key, entry) in &page.contents {
        xml.push_str("<Contents>");
        let mut element = |name: &str, value: &str| {
            xml.push_str(&format!("<{name}>{}</{name}>", escape(value)));
        };
        element("Key", key);
        element("LastModified", &entry.modified);
        element("ETag", &entry.etag);
        element("Size", &entry.size.to_string());
        element("StorageClass", "STANDARD");
        xml.push_str("</Contents>");
    }
    for common in &page.common_prefixes {
        xml.push_str(&format!(
            "<CommonPrefixes><Prefix>{}</Prefix></CommonPrefixes>",
            escape(common.as_str())
        ));
    }
    xml.push_str("</ListBucketResult>");
    xml
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Entry, Manifest};

    #[test]
    fn golden_list_v2() {
        let mut manifest = Manifest::default();
        manifest.keys.insert(
            "a&b".into(),
            Entry {
                physical: "p".into(),
                etag: "\"e\"".into(),
                size: 3,
                modified: "2026-12-01T00:00:00.000Z".into(),
                revision: 1,
            },
        );
        let request = ListRequest {
            max_keys: 1000,
            ..ListRequest::default()
        };
        let page = list(&manifest, &request);
        assert_eq!(
            list_xml("b", &request, &page, true),
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>b</Name><Prefix></Prefix><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated><KeyCount>1</KeyCount><Contents><Key>a&amp;b</Key><LastModified>2026-12-01T00:00:00.000Z</LastModified><ETag>&quot;e&quot;</ETag><Size>3</Size><StorageClass>STANDARD</StorageClass></Contents></ListBucketResult>"
        );
    }
}
