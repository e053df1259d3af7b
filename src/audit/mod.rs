//! The audit log: one JSON line per refused write, chained by SHA-256 so that an edited,
//! reordered or deleted line is detected (`fencegate audit verify`).
//!
//! One writer thread owns the files. Filters submit through [`AuditHandle`] (a
//! [`fencegate_core::AuditSink`]): the queue is bounded, so a full queue makes submitters wait
//! (backpressure) instead of dropping; records are written and fsync'd in batches, and a
//! submission resolves only after its batch is on disk. Files rotate by size; the chain goes on
//! across files, and each file after the first starts with a checkpoint (the chain's head where
//! the previous file ended), so the oldest files can be pruned (`prune`) and the rest still
//! verifies from its oldest checkpoint. A write the disk refuses fails its batch without
//! touching what is on disk; the node reports it and writing resumes once the disk takes it.
//!
//! Files in the audit directory: `audit.jsonl` (being written), `audit-<first seq>.jsonl`
//! (rotated, first seq zero-padded to 20 digits so names sort in chain order), `audit.head`
//! (the chain's head) and `audit.pruned` (where the last prune left the log starting).
//!
//! A flood of tokenless or malformed requests cannot fill the disk: such refusals are
//! aggregated per client and second (`aggregate`), and the directory has a size budget
//! (`max_total_bytes`) with an alarm metric.

mod aggregate;
mod files;
#[cfg(test)]
mod fixture;
mod metrics;
pub mod prune;
pub mod query;
pub mod verify;
mod writer;

use std::path::PathBuf;

use serde::Deserialize;

pub use files::read_records;
pub use metrics::FenceCounters;
pub use writer::AuditWriter;

/// The `[audit]` config section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    /// Directory of the log files. Default: `<node.data_dir>/audit`.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Rotate the current file once it reaches this size, in bytes.
    #[serde(default = "default_max_file_bytes")]
    pub max_file_bytes: u64,
    /// Records that may wait for the writer; submitters wait when it is full.
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// The most records written per fsync.
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// Size budget of the whole audit directory, in bytes. Over it, aggregated refusals
    /// (tokenless, malformed) are only counted (`fencegate_audit_suppressed_total`), others are
    /// still written, and `fencegate_audit_over_budget` is 1: an alarm to act on (archive
    /// rotated files). Keep the audit directory on its own volume, away from the Raft log.
    #[serde(default = "default_max_total_bytes")]
    pub max_total_bytes: u64,
}

fn default_max_file_bytes() -> u64 {
    64 * 1024 * 1024
}
fn default_queue() -> usize {
    4096
}
fn default_batch() -> usize {
    512
}
fn default_max_total_bytes() -> u64 {
    1024 * 1024 * 1024
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            dir: None,
            max_file_bytes: default_max_file_bytes(),
            queue: default_queue(),
            batch: default_batch(),
            max_total_bytes: default_max_total_bytes(),
        }
    }
}

impl AuditConfig {
    /// The log directory, given the node's data directory.
    pub fn dir(&self, data_dir: &std::path::Path) -> PathBuf {
        self.dir.clone().unwrap_or_else(|| data_dir.join("audit"))
    }
}

/// Errors of the audit log.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// File I/O failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A line is not an audit record.
    #[error("{path}:{line}: not an audit record: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parser's message.
        message: String,
    },
}

pub(crate) fn io_error(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> AuditError + '_ {
    move |source| AuditError::Io {
        path: path.to_owned(),
        source,
    }
}
