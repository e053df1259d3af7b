//! Where fencegate's Redis module (filters/redis/module) is, for a [`RedisServer`] that loads
//! it: `FENCEGATE_REDIS_MODULE`, else next to the running executable or one directory up, as
//! [`fencegate_bin`](crate::fencegate_bin) finds the binary. `cargo test --workspace` builds it
//! with every other member before any test runs.
//!
//! [`RedisServer`]: crate::redis_server::RedisServer

use std::path::PathBuf;

use crate::redis_server::RedisServer;

/// The module's file name as cargo builds it on Linux.
const FILE: &str = "libfencegate_redis_module.so";

/// The module to load; panics with what to build when there is none.
pub fn redis_module_path() -> PathBuf {
    if let Some(path) = std::env::var_os("FENCEGATE_REDIS_MODULE") {
        return PathBuf::from(path);
    }
    let me = std::env::current_exe().expect("the running executable's path");
    let candidates: Vec<PathBuf> = me
        .ancestors()
        .skip(1)
        .take(2)
        .map(|d| d.join(FILE))
        .collect();
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "no fencegate Redis module at {candidates:?}: build it with \
                 `cargo build -p fencegate-redis-module` (same profile) or set FENCEGATE_REDIS_MODULE"
            )
        })
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
