//! The Redis filter's errors. Refusals are not errors: they are [`fencegate_core::Verdict`]s.

use std::borrow::Cow;

use thiserror::Error;

/// Why a RESP frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    /// More bytes are needed (internal to the parser; never reaches a caller of `parse`).
    #[error("incomplete frame")]
    Incomplete,
    /// The peer sent something that is not RESP.
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    /// The frame is larger than the configured maximum.
    #[error("request is larger than max_request_bytes ({limit} bytes)")]
    TooLarge {
        /// The configured maximum.
        limit: usize,
    },
}

/// Errors of the Redis gateway.
#[derive(Debug, Error)]
pub enum RedisError {
    /// Network I/O failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: Cow<'static, str>,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A peer broke the protocol.
    #[error("{context}: {source}")]
    Frame {
        /// Which peer.
        context: &'static str,
        /// The decoding error.
        source: FrameError,
    },
    /// The upstream answered something unexpected (e.g. to `COMMAND` or `AUTH`).
    #[error("upstream {0}")]
    Upstream(String),
    /// Fence keys could be evicted or lost on this upstream, and the config does not accept it.
    #[error("refusing to enforce on upstream {upstream}: {problems}")]
    FencesAtRisk {
        /// The upstream address.
        upstream: String,
        /// Every reason, joined.
        problems: String,
    },
    /// The config is invalid.
    #[error("redis config: {0}")]
    Config(String),
}

impl RedisError {
    /// A closure that wraps an I/O error with `context`, for `map_err`; a `&'static str` is
    /// kept without an allocation (the closure is built for every read and write).
    pub(crate) fn io(context: impl Into<Cow<'static, str>>) -> impl FnOnce(std::io::Error) -> Self {
        let context = context.into();
        move |source| RedisError::Io { context, source }
    }
}
