//! The `[redis]` config section.
//!
//! ```toml
//! [redis]
//! listen = "127.0.0.1:6380"          # where clients connect
//! upstream = "127.0.0.1:6379"        # the Redis server the gateway relays to
//! username = "gateway"               # optional ACL user for the upstream connection
//! password_env = "REDIS_PASSWORD"    # optional: name of the env var holding its password
//! max_request_bytes = 67108864       # larger requests are refused and the connection closed
//! partial_request_timeout_seconds = 30  # a request must arrive whole this soon after its start
//! idle_timeout_seconds = 0           # close silent connections after this long (0: never)
//! max_buffered_bytes = 536870912     # partial requests of all connections together
//! allow_functions = []               # FCALL names allowed while a rule enforces (see below)
//! allow_scripts = []                 # EVALSHA SHA-1s allowed while a rule enforces
//! accept_evictable_fences = false    # enforce even under maxmemory-policy allkeys-*
//! accept_unpersisted_fences = false  # enforce even without appendonly yes
//!
//! # Which keys are protected. The first rule whose pattern matches a key decides; keys that no
//! # rule matches are not protected. Default: one rule, `*` enforced (every key).
//! [[redis.protect]]
//! pattern = "cache:*"
//! mode = "off"
//! [[redis.protect]]
//! pattern = "*"
//! mode = "enforce"
//! ```

use std::net::SocketAddr;

use serde::Deserialize;

use crate::error::RedisError;
use crate::glob;

/// The `[redis]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// Address the gateway listens on for Redis clients.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// The upstream Redis server, `host:port`.
    #[serde(default = "default_upstream")]
    pub upstream: String,
    /// ACL user for upstream connections (with `password_env`).
    #[serde(default)]
    pub username: Option<String>,
    /// Name of an environment variable that holds the upstream password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// The largest request accepted from a client, in bytes.
    #[serde(default = "default_max_request_bytes")]
    pub max_request_bytes: usize,
    /// A request must arrive whole within this many seconds of its first byte, or the
    /// connection is closed (a client trickling bytes holds buffers and a task).
    #[serde(default = "default_partial_request_timeout")]
    pub partial_request_timeout_seconds: u64,
    /// Close connections that send nothing for this many seconds; 0 (default) never does
    /// (pooled and pub/sub connections are idle by design).
    #[serde(default)]
    pub idle_timeout_seconds: u64,
    /// Bytes of partial requests all connections together may buffer; the connection whose
    /// read goes over is closed.
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: usize,
    /// Protected key patterns; the first match decides.
    #[serde(default = "default_protect")]
    pub protect: Vec<ProtectRule>,
    /// Redis Functions (`FCALL` names) clients may call while a rule enforces. A script cannot
    /// run under the fence, so a call is accepted only when every key it declares is
    /// unprotected; the operator vouches that the function writes no key it does not declare.
    #[serde(default)]
    pub allow_functions: Vec<String>,
    /// Cached scripts (`EVALSHA` SHA-1, hex) clients may call while a rule enforces; same rule
    /// as `allow_functions`. `EVAL` with an inline body is never allowed then.
    #[serde(default)]
    pub allow_scripts: Vec<String>,
    /// Enforce even when the upstream may evict fence keys (`maxmemory-policy allkeys-*`). An
    /// evicted fence lets a stale write through; set only if nothing can fill memory.
    #[serde(default)]
    pub accept_evictable_fences: bool,
    /// Enforce even when the upstream persists nothing (no RDB `save`, no AOF): a restart
    /// loses every fence and lets stale writes through.
    #[serde(default)]
    pub accept_unpersisted_fences: bool,
}

/// One protection rule.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProtectRule {
    /// A Redis-style glob (`*`, `?`, `[a-z]`, `\` escapes) matched against key names.
    pub pattern: String,
    /// `enforce` (writes need a current token) or `off` (pass through).
    #[serde(default)]
    pub mode: ProtectMode,
}

/// Whether writes to matching keys are fenced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProtectMode {
    /// Writes need a current token and run inside the fence script.
    #[default]
    Enforce,
    /// Writes pass through unchanged.
    Off,
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:6380".parse().expect("literal address")
}
fn default_upstream() -> String {
    "127.0.0.1:6379".to_owned()
}
fn default_max_request_bytes() -> usize {
    64 * 1024 * 1024
}
fn default_partial_request_timeout() -> u64 {
    30
}
fn default_max_buffered_bytes() -> usize {
    512 * 1024 * 1024
}
fn default_protect() -> Vec<ProtectRule> {
    vec![ProtectRule {
        pattern: "*".to_owned(),
        mode: ProtectMode::Enforce,
    }]
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            upstream: default_upstream(),
            username: None,
            password_env: None,
            max_request_bytes: default_max_request_bytes(),
            partial_request_timeout_seconds: default_partial_request_timeout(),
            idle_timeout_seconds: 0,
            max_buffered_bytes: default_max_buffered_bytes(),
            protect: default_protect(),
            allow_functions: Vec::new(),
            allow_scripts: Vec::new(),
            accept_evictable_fences: false,
            accept_unpersisted_fences: false,
        }
    }
}

impl RedisConfig {
    /// Checks values serde cannot: sizes and patterns.
    pub fn validate(&self) -> Result<(), RedisError> {
        if self.max_request_bytes < 1024 {
            return Err(RedisError::Config(format!(
                "max_request_bytes ({}) must be at least 1024",
                self.max_request_bytes
            )));
        }
        if self.partial_request_timeout_seconds == 0 {
            return Err(RedisError::Config(
                "partial_request_timeout_seconds must be at least 1".to_owned(),
            ));
        }
        if self.max_buffered_bytes < self.max_request_bytes {
            return Err(RedisError::Config(format!(
                "max_buffered_bytes ({}) must be at least max_request_bytes ({})",
                self.max_buffered_bytes, self.max_request_bytes
            )));
        }
        if self.protect.iter().any(|r| r.pattern.is_empty()) {
            return Err(RedisError::Config(
                "a protect rule has an empty pattern".to_owned(),
            ));
        }
        if let Some(name) = self
            .allow_functions
            .iter()
            .find(|f| f.to_ascii_lowercase().starts_with("fencegate_"))
        {
            return Err(RedisError::Config(format!(
                "allow_functions names {name}: functions named fencegate_* are the gateway's own and never callable by clients"
            )));
        }
        if let Some(sha) = self
            .allow_scripts
            .iter()
            .find(|s| s.len() != 40 || !s.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(RedisError::Config(format!(
                "allow_scripts entry {sha:?} is not a SHA-1 (40 hex digits, as SCRIPT LOAD returns)"
            )));
        }
        if self.username.is_some() && self.password_env.is_none() {
            return Err(RedisError::Config(
                "username is set but password_env is not".to_owned(),
            ));
        }
        Ok(())
    }

    /// The mode for `key`: the first matching rule's, or `Off` when none matches.
    pub fn mode_for(&self, key: &[u8]) -> ProtectMode {
        self.protect
            .iter()
            .find(|r| glob::matches(r.pattern.as_bytes(), key))
            .map_or(ProtectMode::Off, |r| r.mode)
    }

    /// Whether any rule enforces (then keyspace-wide writes such as `FLUSHALL` are refused).
    pub fn enforces_any(&self) -> bool {
        self.protect.iter().any(|r| r.mode == ProtectMode::Enforce)
    }

    /// Whether clients may call this Redis Function (by name, case-insensitive as in Redis).
    pub fn allows_function(&self, name: &[u8]) -> bool {
        self.allow_functions
            .iter()
            .any(|f| f.as_bytes().eq_ignore_ascii_case(name))
    }

    /// Whether clients may call the cached script with this SHA-1.
    pub fn allows_script(&self, sha: &[u8]) -> bool {
        self.allow_scripts
            .iter()
            .any(|s| s.as_bytes().eq_ignore_ascii_case(sha))
    }

    /// The upstream password, read from the configured environment variable.
    pub fn password(&self) -> Result<Option<String>, RedisError> {
        match &self.password_env {
            None => Ok(None),
            Some(name) => std::env::var(name).map(Some).map_err(|_| {
                RedisError::Config(format!("password_env names {name}, which is not set"))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_protects_every_key() {
        let c = RedisConfig::default();
        assert_eq!(c.mode_for(b"anything"), ProtectMode::Enforce);
        assert_eq!(c.mode_for(b""), ProtectMode::Enforce);
        c.validate().unwrap();
    }

    #[test]
    fn parses_toml_with_defaults_and_refuses_unknown_keys() {
        let c: RedisConfig = toml::from_str(
            "listen = \"127.0.0.1:7000\"\n[[protect]]\npattern = \"cache:*\"\nmode = \"off\"\n[[protect]]\npattern = \"*\"\n",
        )
        .unwrap();
        assert_eq!(c.listen.port(), 7000);
        assert_eq!(c.upstream, "127.0.0.1:6379");
        assert_eq!(c.max_request_bytes, 64 * 1024 * 1024);
        assert_eq!(c.mode_for(b"cache:1"), ProtectMode::Off);
        assert_eq!(c.mode_for(b"x"), ProtectMode::Enforce);
        let empty: RedisConfig = toml::from_str("").unwrap();
        assert_eq!(empty.protect, default_protect());
        let err = toml::from_str::<RedisConfig>("listen = \"127.0.0.1:7000\"\nupstrem = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown field `upstrem`") && err.contains("line 2"),
            "{err}"
        );
        let err = toml::from_str::<RedisConfig>("[[protect]]\npattern = \"*\"\nmode = \"on\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown variant `on`"), "{err}");
    }

    #[test]
    fn first_matching_rule_decides() {
        let c = RedisConfig {
            protect: vec![
                ProtectRule {
                    pattern: "cache:*".into(),
                    mode: ProtectMode::Off,
                },
                ProtectRule {
                    pattern: "billing:*".into(),
                    mode: ProtectMode::Enforce,
                },
            ],
            ..RedisConfig::default()
        };
        assert_eq!(c.mode_for(b"cache:x"), ProtectMode::Off);
        assert_eq!(c.mode_for(b"billing:x"), ProtectMode::Enforce);
        assert_eq!(c.mode_for(b"other"), ProtectMode::Off);
    }
}
