//! What can stop a chaos run before it has a verdict (a verdict with violations is not an error).

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ChaosError {
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the worker needs {0} in its environment: run it under `fencegate lock run`")]
    Environment(&'static str),
    #[error("cannot start {what}: {source}")]
    Spawn {
        what: String,
        source: std::io::Error,
    },
    #[error("reading the store's final contents failed: {0}")]
    Store(String),
    #[error("reading node {node}'s audit log failed: {message}")]
    Audit { node: u64, message: String },
}

impl ChaosError {
    pub fn file(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::File {
            path: path.to_owned(),
            source,
        }
    }
}
