//! Manifest mode, maintenance run by an operator against the store (not through the listener):
//! [`Maintenance::gc`] removes physical objects no manifest names once they are older than a
//! grace period, [`Maintenance::export`] copies a resource's committed view to plain keys
//! for readers that cannot use the gateway, and [`Maintenance::reset_fence`] is an operator's
//! reset of a manifest's fence. The `fencegate s3 gc` / `s3 export` CLI and `fencegate fence
//! reset` call these.
//!
//! GC lists the physical objects first and reads the manifest after, so a commit that lands
//! in between is seen and its object kept. An object is removed only when older than the grace
//! period: it must exceed the longest time a writer may spend between writing its physical
//! object and committing it (a commit naming an object GC removed would leave a dangling key).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fencegate_core::{FenceReset, MemoryAuditSink, TokenPolicy};

use crate::config::{ProtectMode, S3Config};
use crate::error::S3Error;
use crate::gateway::Shared;
use crate::manifest::RESERVED_PREFIX;
use crate::session::xml_text;
use crate::sigv4_verify::{aws_encode, encode_path};
use crate::upstream::Upstream;

/// What one GC run found and did, per manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Physical objects listed.
    pub listed: usize,
    /// Named by the manifest (kept).
    pub referenced: usize,
    /// Unreferenced but younger than the grace period (kept).
    pub too_young: usize,
    /// Unreferenced and removed (or that would be, in a dry run).
    pub removed: usize,
}

/// Store-side maintenance of manifest-mode rules, with the gateway's upstream credentials.
pub struct Maintenance {
    shared: Shared,
}

impl Maintenance {
    /// Connects with `config`'s upstream settings (the secret from `upstream_secret_env`).
    pub fn new(config: S3Config) -> Result<Self, S3Error> {
        let secret = std::env::var(&config.upstream_secret_env).map_err(|_| {
            S3Error::Config(format!(
                "the environment variable {} (upstream_secret_env) is not set",
                config.upstream_secret_env
            ))
        })?;
        let upstream = Upstream::new(
            &config.upstream,
            &config.region,
            &config.upstream_access_key,
            &secret,
        )?;
        let shared = Shared::new(
            config,
            Default::default(),
            upstream,
            // Maintenance judges no token: a policy with no key accepts none.
            TokenPolicy::signed(fencegate_core::SharedKeyRing::default()),
            Arc::new(MemoryAuditSink::default()),
        )?;
        Ok(Self { shared })
    }

    /// `(bucket, resource)` of every manifest-mode rule, without repeats.
    pub fn manifests(&self) -> Vec<(String, String)> {
        let mut seen = Vec::new();
        for rule in &self.shared.config.protect {
            if rule.mode == ProtectMode::Manifest {
                let id = (
                    rule.bucket.clone(),
                    rule.resource.clone().unwrap_or_default(),
                );
                if !seen.contains(&id) {
                    seen.push(id);
                }
            }
        }
        seen
    }

    /// Resets the fence of `resource`'s manifest-mode log in `bucket` to `to` (0: none) if it is
    /// `current` now (a compare-and-set against concurrent commits; see
    /// `docs/S3_MANIFEST.md`). Gateways that cached the old fence re-read the log before they
    /// refuse a write, so they follow without a restart.
    pub async fn reset_fence(
        &self,
        bucket: &str,
        resource: &str,
        current: u64,
        to: u64,
    ) -> Result<FenceReset, S3Error> {
        self.shared.reset_fence(bucket, resource, current, to).await
    }

    /// Removes the physical objects of `resource` in `bucket` that its manifest does not name
    /// and that are older than `grace` (`dry_run`: only counts them).
    pub async fn gc(
        &self,
        bucket: &str,
        resource: &str,
        grace: Duration,
        dry_run: bool,
    ) -> Result<GcReport, S3Error> {
        let prefix = format!("{RESERVED_PREFIX}data/{resource}/");
        let listed = self.list(bucket, &prefix).await?;
        // Read after listing: a commit that landed meanwhile is seen, its object kept.
        let manifest = self.shared.manifest(bucket, resource, true).await?;
        let referenced: HashSet<String> = manifest
            .map(|l| {
                l.manifest
                    .keys
                    .values()
                    .map(|e| e.physical.clone())
                    .collect()
            })
            .unwrap_or_default();
        let now = time::OffsetDateTime::now_utc();
        let mut report = GcReport {
            listed: listed.len(),
            ..GcReport::default()
        };
        for (key, modified) in listed {
            if referenced.contains(&key) {
                report.referenced += 1;
                continue;
            }
            let age = modified.map(|m| now - m);
            if age.is_none_or(|age| age < grace) {
                report.too_young += 1;
                continue;
            }
            report.removed += 1;
            if !dry_run {
                let path = Upstream::path_and_query(Some(bucket), Some(&key), "");
                let response = self
                    .shared
                    .send("DELETE", &path, Vec::new(), Bytes::new().into(), None)
                    .await?;
                if !(200..300).contains(&response.status) && response.status != 404 {
                    return Err(S3Error::Upstream(format!(
                        "DELETE {bucket}/{key} answered {}",
                        response.status
                    )));
                }
            }
        }
        tracing::info!(bucket, resource, ?report, dry_run, "s3 gc");
        Ok(report)
    }

    /// Copies every key under `prefix` that the manifest of `resource` names to
    /// `dest_bucket`/`dest_prefix<key without prefix>` as a plain object; returns how many.
    /// The destination must not be under a fencing rule (these copies bypass the gateway):
    /// every destination key is checked before the first copy.
    pub async fn export(
        &self,
        bucket: &str,
        resource: &str,
        prefix: &str,
        dest_bucket: &str,
        dest_prefix: &str,
    ) -> Result<usize, S3Error> {
        let manifest = self.shared.manifest(bucket, resource, true).await?;
        let Some(manifest) = manifest else {
            return Ok(0);
        };
        let mut copies = Vec::new();
        for (key, entry) in &manifest.manifest.keys {
            let Some(rest) = key.strip_prefix(prefix) else {
                continue;
            };
            let dest_key = format!("{dest_prefix}{rest}");
            if dest_key.starts_with(RESERVED_PREFIX)
                || self
                    .shared
                    .config
                    .rule_for(dest_bucket, Some(&dest_key))
                    .is_some_and(|r| r.mode.fenced())
            {
                return Err(S3Error::Config(format!(
                    "export destination {dest_bucket}/{dest_key} is protected by a fencing rule (or is the gateway's own storage); nothing was copied: export to an unprotected bucket or prefix"
                )));
            }
            copies.push((key, &entry.physical, dest_key));
        }
        for (key, physical, dest_key) in &copies {
            let path = Upstream::path_and_query(Some(dest_bucket), Some(dest_key), "");
            let headers = vec![(
                "x-amz-copy-source".to_owned(),
                format!("/{}/{}", encode_path(bucket), encode_path(physical)),
            )];
            let response = self
                .shared
                .send("PUT", &path, headers, Bytes::new().into(), Some(0))
                .await?;
            if !response.succeeded() {
                return Err(S3Error::Upstream(format!(
                    "copying {bucket}/{key} to {dest_bucket}/{dest_key} answered {}",
                    response.status
                )));
            }
        }
        Ok(copies.len())
    }

    /// Every key under `prefix` with its LastModified (ListObjectsV2, all pages).
    async fn list(
        &self,
        bucket: &str,
        prefix: &str,
    ) -> Result<Vec<(String, Option<time::OffsetDateTime>)>, S3Error> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut query = format!("list-type=2&prefix={}", aws_encode(prefix));
            if let Some(token) = &token {
                query.push_str(&format!("&continuation-token={}", aws_encode(token)));
            }
            let path = Upstream::path_and_query(Some(bucket), None, &query);
            let response = self
                .shared
                .send("GET", &path, Vec::new(), Bytes::new().into(), None)
                .await?;
            if response.status != 200 {
                return Err(S3Error::Upstream(format!(
                    "listing {bucket}/{prefix} answered {}",
                    response.status
                )));
            }
            let text = String::from_utf8_lossy(&response.body).into_owned();
            for block in text.split("<Contents>").skip(1) {
                let block = block.split("</Contents>").next().unwrap_or("");
                if let Some(key) = xml_text(block.as_bytes(), "Key") {
                    let modified = xml_text(block.as_bytes(), "LastModified").and_then(|m| {
                        time::OffsetDateTime::parse(
                            &m,
                            &time::format_description::well_known::Rfc3339,
                        )
                        .ok()
                    });
                    out.push((key, modified));
                }
            }
            token = xml_text(&response.body, "NextContinuationToken");
            if token.is_none() {
                return Ok(out);
            }
        }
    }
}
