//! The crate's error type: failures to start or to talk to the upstream. Refusals are
//! [`fencegate_core::Verdict`]s, never errors.

use thiserror::Error;

/// What can go wrong in the S3 gateway.
#[derive(Debug, Error)]
pub enum S3Error {
    /// The `[s3]` section is inconsistent.
    #[error("[s3] config: {0}")]
    Config(String),
    /// The listener could not start.
    #[error("S3 gateway listener: {0}")]
    Listen(String),
    /// The upstream could not be reached or answered something unusable.
    #[error("S3 upstream: {0}")]
    Upstream(String),
    /// Signing an upstream request failed.
    #[error("signing the upstream request: {0}")]
    Sign(String),
}
