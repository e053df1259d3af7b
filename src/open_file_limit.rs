//! The node's open-file limit against what its connection bounds allow. Each gateway and the
//! API bound their connections (`max_client_connections`, `max_api_connections`), but those
//! bounds protect the node only if the process may open that many descriptors: below them,
//! accepts fail with `EMFILE` first, and so may the node's own Raft connections and audit
//! files. At start the soft limit is raised towards what the bounds need (up to the hard
//! limit, as Redis does for its `maxclients`), and a warning says when the hard limit is short.

use nix::sys::resource::{getrlimit, setrlimit, Resource};

use crate::config::Config;

/// Descriptors the node needs besides its clients': the Raft log, audit files, peer and
/// upstream connections, the refused connections being answered.
const NODE_OWN: u64 = 512;

/// Descriptors the node may hold with every bound reached: an API connection is one; a Redis
/// client one, and one more with a connection of its own upstream (after `SELECT`, `MULTI`, ...);
/// a PostgreSQL client two, and so an S3 client (its request's own connection to the store).
pub fn needed(config: &Config) -> u64 {
    let bound = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let listeners = 1 + u64::from(config.node.peer.is_some());
    let api = listeners.saturating_mul(bound(config.node.max_api_connections));
    let redis = config
        .redis
        .as_ref()
        .map_or(0, |r| 2u64.saturating_mul(bound(r.max_client_connections)));
    let postgres = config
        .postgres
        .as_ref()
        .map_or(0, |p| 2u64.saturating_mul(bound(p.max_client_connections)));
    let s3 = config
        .s3
        .as_ref()
        .map_or(0, |s| 2u64.saturating_mul(bound(s.max_client_connections)));
    NODE_OWN
        .saturating_add(api)
        .saturating_add(redis)
        .saturating_add(postgres)
        .saturating_add(s3)
}

/// Raises the soft limit on open files to `needed` (at most the hard limit); warns if that is
/// short of it. Logs what it did.
pub fn raise_to(needed: u64) {
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the open-file limit");
            return;
        }
    };
    let mut now = soft;
    if soft < needed {
        let target = needed.min(hard);
        match setrlimit(Resource::RLIMIT_NOFILE, target, hard) {
            Ok(()) => {
                tracing::info!(from = soft, to = target, "raised the open-file limit");
                now = target;
            }
            Err(e) => tracing::warn!(error = %e, "could not raise the open-file limit"),
        }
    }
    if now < needed {
        tracing::warn!(
            limit = now,
            needed,
            "the open-file limit is below what the connection bounds allow: accepts may fail with EMFILE before a bound is reached, and the node's own Raft connections and audit files with them; raise the hard limit (systemd LimitNOFILE, ulimit -Hn) or lower max_client_connections / max_api_connections"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bound_counts() {
        let base: Config =
            toml::from_str("[node]\n[security]\ninsecure = true\n").expect("a config");
        let alone = needed(&base);
        assert_eq!(alone, NODE_OWN + 4096);
        let both: Config = toml::from_str(
            "[security]\ninsecure = true\n[node]\npeer = \"127.0.0.1:7171\"\nmax_api_connections = 10\n\
             [redis]\nprotect = []\nmax_client_connections = 100\n\
             [postgres]\ndatabases = []\nmax_client_connections = 1000\n\
             [s3]\nmax_client_connections = 7\n",
        )
        .expect("a config");
        assert_eq!(
            needed(&both),
            NODE_OWN + 2 * 10 + 2 * 100 + 2 * 1000 + 2 * 7
        );
    }
}
