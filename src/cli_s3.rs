//! `fencegate s3 gc` and `fencegate s3 export`: manifest-mode maintenance against the store,
//! with the `[s3]` section's upstream credentials (nothing goes through a gateway).

use std::process::ExitCode;

use anyhow::Context;
use fencegate_s3::{GcReport, Maintenance, ProtectMode, S3Config};

use crate::cli::S3Command;
use crate::config::Config;

pub async fn run(command: S3Command) -> anyhow::Result<ExitCode> {
    match command {
        S3Command::Gc {
            config,
            grace,
            bucket,
            dry_run,
        } => {
            let s3 = s3_section(&config.config)?;
            let maintenance = Maintenance::new(s3)?;
            let manifests: Vec<(String, String)> = maintenance
                .manifests()
                .into_iter()
                .filter(|(b, _)| bucket.as_ref().is_none_or(|want| want == b))
                .collect();
            if manifests.is_empty() {
                anyhow::bail!(
                    "{} has no mode = \"manifest\" rule{}; gc only cleans manifest-mode buckets",
                    config.config.display(),
                    bucket
                        .map(|b| format!(" for bucket {b}"))
                        .unwrap_or_default()
                );
            }
            let grace_text = humantime::format_duration(grace).to_string();
            let removed_word = if dry_run { "to remove" } else { "removed" };
            let mut total = GcReport::default();
            for (bucket, resource) in &manifests {
                let report = maintenance
                    .gc(bucket, resource, grace, dry_run)
                    .await
                    .with_context(|| format!("gc of {bucket} (resource {resource})"))?;
                println!(
                    "gc {bucket} (resource {resource}): {} listed, {} referenced kept, {} younger than {grace_text} kept, {} {removed_word}",
                    report.listed, report.referenced, report.too_young, report.removed
                );
                total.listed += report.listed;
                total.referenced += report.referenced;
                total.too_young += report.too_young;
                total.removed += report.removed;
            }
            println!(
                "gc{}: {} manifest(s), objects kept {} (referenced {}, young {}), {removed_word} {}",
                if dry_run { " (dry run)" } else { "" },
                manifests.len(),
                total.referenced + total.too_young,
                total.referenced,
                total.too_young,
                total.removed
            );
            Ok(ExitCode::SUCCESS)
        }
        S3Command::Export {
            config,
            bucket,
            prefix,
            to_prefix,
            to_bucket,
        } => {
            let s3 = s3_section(&config.config)?;
            // The manifests that may hold keys under `prefix`: manifest rules of the bucket
            // whose prefix and `prefix` overlap.
            let mut resources: Vec<String> = Vec::new();
            for rule in &s3.protect {
                let overlaps = rule.prefix.starts_with(&prefix) || prefix.starts_with(&rule.prefix);
                if rule.bucket == bucket && rule.mode == ProtectMode::Manifest && overlaps {
                    let resource = rule.resource.clone().unwrap_or_default();
                    if !resources.contains(&resource) {
                        resources.push(resource);
                    }
                }
            }
            if resources.is_empty() {
                anyhow::bail!(
                    "no mode = \"manifest\" rule of {} covers bucket {bucket} prefix {prefix:?}; export reads manifest-mode keys only",
                    config.config.display()
                );
            }
            let to_bucket = to_bucket.unwrap_or_else(|| bucket.clone());
            let maintenance = Maintenance::new(s3)?;
            let mut exported = 0;
            for resource in &resources {
                exported += maintenance
                    .export(&bucket, resource, &prefix, &to_bucket, &to_prefix)
                    .await
                    .with_context(|| format!("export of {bucket} (resource {resource})"))?;
            }
            println!(
                "export {bucket}/{prefix} -> {to_bucket}/{to_prefix}: {exported} object(s) exported from {} manifest(s)",
                resources.len()
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The config file's `[s3]` section.
fn s3_section(path: &std::path::Path) -> anyhow::Result<S3Config> {
    let config = Config::load(path)?;
    config.s3.with_context(|| {
        format!(
            "{} has no [s3] section: s3 gc and export use its upstream and protect rules",
            path.display()
        )
    })
}
