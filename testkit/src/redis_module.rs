//! Where fencegate's Redis module (filters/redis/module) is, for a [`RedisServer`] that loads
//! it: `FENCEGATE_REDIS_MODULE`, else beside the running executable (see
//! [`build_artifact`](crate::build_artifact)). The crates whose tests load it depend on it, so
//! cargo builds it before them.
//!
//! [`RedisServer`]: crate::redis_server::RedisServer

use std::path::PathBuf;

use crate::build_artifact::build_artifact;
use crate::redis_server::RedisServer;

/// The module to load; panics with what to build when there is none.
pub fn redis_module_path() -> PathBuf {
    build_artifact(
        "libfencegate_redis_module.so",
        "FENCEGATE_REDIS_MODULE",
        "cargo build -p fencegate-redis-module",
    )
}

impl RedisServer {
    /// [`RedisServer::start`] with fencegate's module loaded (`--loadmodule`).
    pub fn start_with_module() -> Self {
        Self::start_with_module_and(&[])
    }

    /// [`RedisServer::start_with_module`] with `extra` command-line settings.
    pub fn start_with_module_and(extra: &[&str]) -> Self {
        let path = redis_module_path();
        let mut args = vec!["--loadmodule", path.to_str().expect("a UTF-8 module path")];
        args.extend_from_slice(extra);
        Self::start_with(&args)
    }
}
