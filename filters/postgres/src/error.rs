//! The crate's error type. A refusal is never an error: it is a [`fencegate_core::Verdict`].

use std::borrow::Cow;

use thiserror::Error;

/// What can go wrong in the PostgreSQL filter (not refusals: those are verdicts).
#[derive(Debug, Error)]
pub enum PostgresError {
    /// A config value serde could not check.
    #[error("[postgres] config: {0}")]
    Config(String),
    /// Network I/O failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: Cow<'static, str>,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A peer sent bytes that are not the PostgreSQL v3 protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// TLS to the upstream server could not be set up (`upstream_tls`).
    #[error("TLS to the upstream server {upstream} failed ({settings}): {what}")]
    UpstreamTls {
        /// The upstream address.
        upstream: String,
        /// The settings in force, named as in the config.
        settings: String,
        /// What went wrong.
        what: String,
    },
    /// `install --enforce c` could not create the C `fencegate.enforce()` (what to do is in the
    /// text).
    #[error("installing the C fencegate.enforce() (--enforce c): {0}")]
    EnforceC(String),
    /// Installing `fence.sql` failed.
    #[error("installing the fence schema: {0}")]
    Install(#[from] tokio_postgres::Error),
}

impl PostgresError {
    /// A closure that wraps an I/O error with `context`, for `map_err`. A `&'static str` is
    /// kept as it is: the closure is built before every read and write of a session, error or
    /// not (issue 18's callgrind profile: a `String` per call was 13 of the 22 allocations of a
    /// `pgbench -S` transaction).
    pub fn io(context: impl Into<Cow<'static, str>>) -> impl FnOnce(std::io::Error) -> Self {
        let context = context.into();
        move |source| Self::Io { context, source }
    }
}
