//! Whether fence keys survive on this upstream: a fence that is evicted or lost on restart
//! reads as "no fence", and the next stale write passes. Checked at start and again while
//! serving; a pure function of what `CONFIG GET` answered, so it is golden-tested.

use crate::config::RedisConfig;

/// What the upstream said about eviction and persistence (`None`: it would not say).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Settings {
    /// `maxmemory-policy`.
    pub maxmemory_policy: Option<String>,
    /// `appendonly`.
    pub appendonly: Option<String>,
    /// `appendfsync`.
    pub appendfsync: Option<String>,
}

/// Why fence keys may not survive on this upstream, given what the config accepts. Empty:
/// they survive (as far as the server's settings tell).
pub fn problems(settings: &Settings, config: &RedisConfig) -> Vec<String> {
    let mut out = Vec::new();
    if !config.accept_evictable_fences {
        match settings.maxmemory_policy.as_deref() {
            // volatile-* evicts only keys with a TTL; fence keys never get one.
            Some(p) if p == "noeviction" || p.starts_with("volatile-") => {}
            Some(p) => out.push(format!(
                "maxmemory-policy is {p}, which can evict fence keys (then a stale write passes); set noeviction or a volatile-* policy, or accept_evictable_fences = true"
            )),
            None => out.push(
                "could not read maxmemory-policy (CONFIG GET refused or renamed; allow it for the gateway's user), or set accept_evictable_fences = true".to_owned(),
            ),
        }
    }
    if !config.accept_unpersisted_fences {
        match (settings.appendonly.as_deref(), settings.appendfsync.as_deref()) {
            (Some("yes"), Some("always" | "everysec")) => {}
            (Some("yes"), Some(sync)) => out.push(format!(
                "appendfsync is {sync}: fences raised shortly before a machine crash can be lost; set everysec or always, or accept_unpersisted_fences = true"
            )),
            (Some(_), _) => out.push(
                "appendonly is off: a restart loses every fence raised since the last RDB snapshot (then a stale write passes); set appendonly yes, or accept_unpersisted_fences = true".to_owned(),
            ),
            (None, _) => out.push(
                "could not read appendonly (CONFIG GET refused or renamed; allow it for the gateway's user), or set accept_unpersisted_fences = true".to_owned(),
            ),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(policy: &str, aof: &str, sync: &str) -> Settings {
        Settings {
            maxmemory_policy: Some(policy.into()),
            appendonly: Some(aof.into()),
            appendfsync: Some(sync.into()),
        }
    }

    #[test]
    fn golden() {
        let c = RedisConfig::default();
        assert!(problems(&settings("noeviction", "yes", "everysec"), &c).is_empty());
        assert!(problems(&settings("volatile-lru", "yes", "always"), &c).is_empty());
        let p = problems(&settings("allkeys-lru", "yes", "everysec"), &c);
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("maxmemory-policy is allkeys-lru, which can evict fence keys"));
        let p = problems(&settings("noeviction", "no", "everysec"), &c);
        assert!(p[0].starts_with("appendonly is off"), "{p:?}");
        let p = problems(&settings("noeviction", "yes", "no"), &c);
        assert!(p[0].starts_with("appendfsync is no"), "{p:?}");
        assert_eq!(problems(&Settings::default(), &c).len(), 2);
        let accepting = RedisConfig {
            accept_evictable_fences: true,
            accept_unpersisted_fences: true,
            ..RedisConfig::default()
        };
        assert!(problems(&Settings::default(), &accepting).is_empty());
        assert!(problems(&settings("allkeys-random", "no", "no"), &accepting).is_empty());
    }
}
