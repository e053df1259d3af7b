//! The `[redis]` config section.
//!
//! ```toml
//! [redis]
//! listen = "127.0.0.1:6380"          # where clients connect
//! upstream = "127.0.0.1:6379"        # the Redis server: host:port, or rediss://host:port (TLS)
//! upstream_ca_file = "/etc/fencegate/redis-ca.crt"  # with rediss://: the CA (PEM); absent: system roots
//! tls_cert = "/etc/fencegate/redis.crt"  # optional PEM chain; with tls_key, clients connect
//! tls_key = "/etc/fencegate/redis.key"   # over TLS (rustls), as [postgres] and [s3] do
//! username = "gateway"               # optional ACL user for the upstream connection
//! password_env = "REDIS_PASSWORD"    # optional: name of the env var holding its password
//! max_request_bytes = 67108864       # larger requests are refused and the connection closed
//! partial_request_timeout_seconds = 30  # a request must arrive whole this soon after its start
//! idle_timeout_seconds = 0           # close silent connections after this long (0: never)
//! max_buffered_bytes = 536870912     # partial requests of all connections together
//! shared_upstream_connections = 1    # upstream connections clients share until one changes its
//!                                    #   connection's state (SELECT, AUTH, MULTI, ...); 0: never share
//! session_threads = 1                # threads running the sessions, each with its own epoll
//!                                    #   (default 1, as twemproxy: the least CPU per request)
//! max_client_connections = 10000     # more clients at once get Redis's own "-ERR max number
//!                                    #   of clients reached" (Redis's maxclients default)
//! refusals_per_second = 300          # refusals of clients without a valid token, all connections
//! refusal_burst = 600                #   together; beyond them the refused connection waits
//! tarpit_initial_ms = 10             #   this long before its next request, doubling with each
//! tarpit_max_ms = 1000               #   further refusal up to this, until a write is accepted
//! allow_functions = []               # FCALL names allowed while a rule enforces (see below)
//! allow_scripts = []                 # EVALSHA SHA-1s allowed while a rule enforces
//! accept_evictable_fences = false    # enforce even under maxmemory-policy allkeys-*
//! accept_unpersisted_fences = false  # enforce even without appendonly yes
//! fence_module = "auto"              # fencegate's Redis module for the fence check where the
//!                                    #   server loaded it ("auto"), never ("off"), or refuse to
//!                                    #   start without it ("require"); see docs/REDIS_MODULE.md
//!
//! # Which keys are protected. The first rule whose pattern matches a key decides; keys that no
//! # rule matches are not protected. Required: a section without rules refuses to start
//! # (`protect = []` says on purpose that the gateway fences nothing: a pass-through). An
//! # enforce rule must name its resource: fixed, or a template of the pattern's `*` captures
//! # ({1} = what the first `*` matched).
//! [[redis.protect]]
//! pattern = "cache:*"
//! mode = "off"
//! [[redis.protect]]
//! pattern = "billing:*:*"
//! mode = "enforce"
//! resource = "billing:{1}"
//! ```

use std::borrow::Cow;
use std::net::SocketAddr;
use std::path::PathBuf;

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
    /// The upstream Redis server: `host:port` (or `redis://host:port`), or
    /// `rediss://host:port` for TLS, verified against `upstream_ca_file` with the host checked
    /// against the server's certificate.
    #[serde(default = "default_upstream")]
    pub upstream: String,
    /// With `rediss://`: the CA certificate(s) (PEM) the upstream's certificate must chain to.
    /// Absent: the system's roots.
    #[serde(default)]
    pub upstream_ca_file: Option<PathBuf>,
    /// PEM certificate chain for client TLS (with `tls_key`): clients then must connect with
    /// TLS.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for client TLS (with `tls_cert`).
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
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
    /// Close connections that send nothing for this many seconds (checked eight times a
    /// period: closed at most an eighth later); 0 (default) never does
    /// (pooled and pub/sub connections are idle by design).
    #[serde(default)]
    pub idle_timeout_seconds: u64,
    /// Bytes of partial requests all connections together may buffer; the connection whose
    /// read goes over is closed.
    #[serde(default = "default_max_buffered_bytes")]
    pub max_buffered_bytes: usize,
    /// Upstream connections that client sessions share while none of their requests could
    /// change a connection's state (see `fencegate_redis::sharing`): their requests reach Redis
    /// batched with other clients', as through twemproxy. A session moves to a connection of
    /// its own, for the rest of its life, at its first request that could (`SELECT`, `AUTH`,
    /// `HELLO`, `CLIENT ...`, `MULTI`, `WATCH`, a subscription, a blocking command, a script).
    /// A slow command delays the other sessions on its connection. 0: every session has its
    /// own connection from the start.
    #[serde(default = "default_shared_upstream_connections")]
    pub shared_upstream_connections: usize,
    /// How many threads run the sessions, each a single-threaded runtime with its own epoll;
    /// a session stays on one for its life (see `fencegate_core::SessionThreads`). A shared
    /// upstream connection runs on the thread of the session that opened it.
    #[serde(default = "default_session_threads")]
    pub session_threads: usize,
    /// The most client connections open at once; a client over it gets Redis's own
    /// `-ERR max number of clients reached` (as from the server's `maxclients`) and is closed.
    #[serde(default = "default_max_client_connections")]
    pub max_client_connections: usize,
    /// Refusals per second the gateway serves without delay to clients that present no valid
    /// token (no token, a malformed or forged one), all connections together. Beyond it (and
    /// `refusal_burst`), the connection whose request was refused waits before its next
    /// request is read (the tarpit): a flood costs the flooder time, not the other clients
    /// CPU. Connections that write with a valid token are never delayed.
    #[serde(default = "default_refusals_per_second")]
    pub refusals_per_second: u32,
    /// Refusals served at once before `refusals_per_second` applies.
    #[serde(default = "default_refusal_burst")]
    pub refusal_burst: u32,
    /// The first tarpit wait, in milliseconds; each further refusal over the budget doubles
    /// it, up to `tarpit_max_ms`, until the connection's next accepted write.
    #[serde(default = "default_tarpit_initial_ms")]
    pub tarpit_initial_ms: u64,
    /// The longest tarpit wait, in milliseconds (keep it below clients' read timeouts: every
    /// refusal is still answered, in order, only later).
    #[serde(default = "default_tarpit_max_ms")]
    pub tarpit_max_ms: u64,
    /// Protected key patterns; the first match decides. `None` (no rule in the config) is
    /// refused by `validate`: there is no silent default; `Some(vec![])` is an explicit
    /// pass-through that fences nothing.
    #[serde(default)]
    pub protect: Option<Vec<ProtectRule>>,
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
    /// Whether the fence check runs in fencegate's Redis module (filters/redis/module) instead
    /// of the Lua functions.
    #[serde(default)]
    pub fence_module: FenceModule,
}

/// `fence_module`: where the store runs the fence check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FenceModule {
    /// The module's commands when `MODULE LIST` shows it loaded, else the functions.
    #[default]
    Auto,
    /// Always the functions (Lua).
    Off,
    /// The module's commands; the gateway does not start on a server without it.
    Require,
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
    /// With `enforce`: the resource whose tokens may write matching keys (a token for another
    /// resource is refused `-BADFENCE`, out of scope). A fixed name (`billing`), or a template
    /// whose `{1}`, `{2}`... are the texts the pattern's first, second... `*` matched (pattern
    /// `billing:*:*`, resource `billing:{1}`: key `billing:2026:09` belongs to `billing:2026`;
    /// each `*` binds the shortest text that lets the rest match, left to right). `*` alone:
    /// any resource's token may write (no scope; the built-in default rule).
    #[serde(default)]
    pub resource: Option<String>,
}

impl ProtectRule {
    /// `*` enforced with resource `*`: every key, a token of any resource (tests and
    /// single-purpose Redis instances; say it in the config as such a rule).
    pub fn every_key() -> Self {
        Self {
            pattern: "*".to_owned(),
            mode: ProtectMode::Enforce,
            resource: Some(ANY_RESOURCE.to_owned()),
        }
    }
}

/// Which resource a protected key belongs to; a fixed resource is borrowed from the rule (not
/// copied per key of every fenced write).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope<'a> {
    /// No enforce rule matches the key.
    Unprotected,
    /// Protected; a token for any resource may write it.
    AnyResource,
    /// Protected; only a token for this resource may write it.
    Resource(Cow<'a, str>),
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

/// `resource = "*"`: no scope.
pub const ANY_RESOURCE: &str = "*";

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
/// One connection batches the most (Redis runs commands on one thread either way).
fn default_shared_upstream_connections() -> usize {
    1
}
fn default_session_threads() -> usize {
    1
}
/// Redis's own `maxclients` default.
fn default_max_client_connections() -> usize {
    10_000
}
/// The largest `max_client_connections` accepted.
const MAX_CLIENT_CONNECTIONS: usize = fencegate_core::ConnectionCap::MOST;
/// Refusals are rare in normal operation (a lost lock, a misconfigured client). At 300/s a
/// tokenless flood left fenced-write latency unchanged on 2 cores (tests/redis_flood.rs);
/// at 1000/s its p99 rose by a few milliseconds.
fn default_refusals_per_second() -> u32 {
    300
}
fn default_refusal_burst() -> u32 {
    600
}
fn default_tarpit_initial_ms() -> u64 {
    10
}
fn default_tarpit_max_ms() -> u64 {
    1000
}
/// The longest `tarpit_max_ms` accepted: longer waits look like a dead server to clients.
const TARPIT_MAX_MS_LIMIT: u64 = 60_000;

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            upstream: default_upstream(),
            upstream_ca_file: None,
            tls_cert: None,
            tls_key: None,
            username: None,
            password_env: None,
            max_request_bytes: default_max_request_bytes(),
            partial_request_timeout_seconds: default_partial_request_timeout(),
            idle_timeout_seconds: 0,
            max_buffered_bytes: default_max_buffered_bytes(),
            shared_upstream_connections: default_shared_upstream_connections(),
            session_threads: default_session_threads(),
            max_client_connections: default_max_client_connections(),
            refusals_per_second: default_refusals_per_second(),
            refusal_burst: default_refusal_burst(),
            tarpit_initial_ms: default_tarpit_initial_ms(),
            tarpit_max_ms: default_tarpit_max_ms(),
            protect: None,
            allow_functions: Vec::new(),
            allow_scripts: Vec::new(),
            accept_evictable_fences: false,
            accept_unpersisted_fences: false,
            fence_module: FenceModule::Auto,
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
        if !(1..=1024).contains(&self.session_threads) {
            return Err(RedisError::Config(format!(
                "session_threads ({}) must be between 1 and 1024",
                self.session_threads
            )));
        }
        if !(1..=MAX_CLIENT_CONNECTIONS).contains(&self.max_client_connections) {
            return Err(RedisError::Config(format!(
                "max_client_connections ({}) must be between 1 and {MAX_CLIENT_CONNECTIONS}",
                self.max_client_connections
            )));
        }
        if self.refusals_per_second == 0 || self.refusal_burst == 0 {
            return Err(RedisError::Config(format!(
                "refusals_per_second ({}) and refusal_burst ({}) must be at least 1",
                self.refusals_per_second, self.refusal_burst
            )));
        }
        if self.tarpit_initial_ms == 0
            || self.tarpit_max_ms < self.tarpit_initial_ms
            || self.tarpit_max_ms > TARPIT_MAX_MS_LIMIT
        {
            return Err(RedisError::Config(format!(
                "tarpit_initial_ms ({}) must be at least 1 and tarpit_max_ms ({}) between it and {TARPIT_MAX_MS_LIMIT}",
                self.tarpit_initial_ms, self.tarpit_max_ms
            )));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(RedisError::Config(
                "tls_cert and tls_key go together: set both, or neither".to_owned(),
            ));
        }
        let target =
            crate::tls::UpstreamTarget::parse(&self.upstream).map_err(RedisError::Config)?;
        if self.upstream_ca_file.is_some() && !target.tls {
            return Err(RedisError::Config(format!(
                "upstream_ca_file is set but upstream {:?} is not TLS; write rediss://host:port",
                self.upstream
            )));
        }
        let Some(rules) = &self.protect else {
            return Err(RedisError::Config(
                "no protect rules: say which keys are fenced with [[redis.protect]] rules (pattern and resource, e.g. pattern = \"billing:*\", resource = \"billing\"), or write protect = [] to run a pass-through that fences nothing".to_owned(),
            ));
        };
        if rules.iter().any(|r| r.pattern.is_empty()) {
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
        for (i, rule) in rules.iter().enumerate() {
            rule.validate(i + 1)?;
        }
        if self.username.is_some() && self.password_env.is_none() {
            return Err(RedisError::Config(
                "username is set but password_env is not".to_owned(),
            ));
        }
        Ok(())
    }

    /// The protect rules (none for a pass-through).
    pub fn rules(&self) -> &[ProtectRule] {
        self.protect.as_deref().unwrap_or_default()
    }

    /// The mode for `key`: the first matching rule's, or `Off` when none matches.
    pub fn mode_for(&self, key: &[u8]) -> ProtectMode {
        self.rules()
            .iter()
            .find(|r| glob::matches(r.pattern.as_bytes(), key))
            .map_or(ProtectMode::Off, |r| r.mode)
    }

    /// The resource `key` belongs to: from the first matching rule, if it enforces.
    pub fn scope_for(&self, key: &[u8]) -> Scope<'_> {
        let Some(rule) = self
            .rules()
            .iter()
            .find(|r| glob::matches(r.pattern.as_bytes(), key))
        else {
            return Scope::Unprotected;
        };
        if rule.mode == ProtectMode::Off {
            return Scope::Unprotected;
        }
        match rule.resource.as_deref() {
            None | Some(ANY_RESOURCE) => Scope::AnyResource,
            Some(template) if !template.contains('{') => Scope::Resource(Cow::Borrowed(template)),
            Some(template) => {
                let caps = glob::captures(rule.pattern.as_bytes(), key).unwrap_or_default();
                Scope::Resource(Cow::Owned(expand(template, &caps)))
            }
        }
    }

    /// Whether any rule enforces (then keyspace-wide writes such as `FLUSHALL` are refused).
    pub fn enforces_any(&self) -> bool {
        self.rules().iter().any(|r| r.mode == ProtectMode::Enforce)
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

impl ProtectRule {
    fn validate(&self, n: usize) -> Result<(), RedisError> {
        let bad = |why: String| {
            RedisError::Config(format!(
                "protect rule {n} (pattern {:?}): {why}",
                self.pattern
            ))
        };
        if self.mode == ProtectMode::Off {
            return Ok(());
        }
        let Some(template) = &self.resource else {
            return Err(bad(
                "mode enforce needs a resource: the resource whose tokens may write these keys, e.g. resource = \"billing\", or a template taking the pattern's * captures, e.g. pattern = \"billing:*:*\" with resource = \"billing:{1}\" (resource = \"*\" accepts any resource's token: no scope)".to_owned(),
            ));
        };
        if template == ANY_RESOURCE {
            return Ok(());
        }
        let stars = self.pattern.bytes().filter(|b| *b == b'*').count();
        let placeholders = placeholders(template).map_err(|e| bad(e.to_owned()))?;
        if let Some(&max) = placeholders.iter().max() {
            if !glob::star_only(self.pattern.as_bytes()) {
                return Err(bad(format!(
                    "resource {template:?} uses captures, which need a pattern whose only wildcard is * (no ?, [ ], or \\)"
                )));
            }
            if max == 0 || max > stars {
                return Err(bad(format!(
                    "resource {template:?} uses {{{max}}}, but the pattern has {stars} * (captures are numbered from 1)"
                )));
            }
        }
        let sample = expand(template, &vec![&b"x"[..]; stars]);
        fencegate_core::Resource::new(sample).map_err(|e| {
            bad(format!(
                "resource {template:?} does not make a valid resource name: {e}"
            ))
        })?;
        Ok(())
    }
}

/// The capture numbers a template uses (`{1}` -> 1).
fn placeholders(template: &str) -> Result<Vec<usize>, &'static str> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let close = rest[open..]
            .find('}')
            .ok_or("resource has a { without a closing }")?;
        let n = rest[open + 1..open + close]
            .parse()
            .map_err(|_| "resource has {...} that is not a capture number like {1}")?;
        out.push(n);
        rest = &rest[open + close + 1..];
    }
    Ok(out)
}

/// `template` with `{n}` replaced by capture n (lossy UTF-8; an invalid name is refused when
/// the token is compared, as no token can name it).
fn expand(template: &str, captures: &[&[u8]]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let n: usize = rest[open + 1..open + close].parse().unwrap_or(0);
        if let Some(c) = n.checked_sub(1).and_then(|i| captures.get(i)) {
            out.push_str(&String::from_utf8_lossy(c));
        }
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_client_connections_is_bounded_both_ways() {
        let with = |n| RedisConfig {
            protect: Some(Vec::new()),
            max_client_connections: n,
            ..RedisConfig::default()
        };
        assert!(with(1).validate().is_ok());
        assert!(with(MAX_CLIENT_CONNECTIONS).validate().is_ok());
        for bad in [0, MAX_CLIENT_CONNECTIONS + 1] {
            let e = with(bad).validate().expect_err("refused").to_string();
            assert!(e.contains("max_client_connections"), "{e}");
        }
    }

    #[test]
    fn no_rules_is_refused_and_an_empty_list_fences_nothing() {
        let err = RedisConfig::default().validate().unwrap_err().to_string();
        assert!(
            err.contains("no protect rules") && err.contains("protect = []"),
            "{err}"
        );
        let none: RedisConfig = toml::from_str("listen = \"127.0.0.1:7000\"\n").unwrap();
        assert!(none.validate().is_err());
        let pass: RedisConfig = toml::from_str("protect = []\n").unwrap();
        pass.validate().unwrap();
        assert_eq!(pass.mode_for(b"anything"), ProtectMode::Off);
        assert!(!pass.enforces_any());
        let every = RedisConfig {
            protect: Some(vec![ProtectRule::every_key()]),
            ..RedisConfig::default()
        };
        every.validate().unwrap();
        assert_eq!(every.mode_for(b""), ProtectMode::Enforce);
        assert_eq!(every.scope_for(b"k"), Scope::AnyResource);
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
        assert_eq!(
            (c.refusals_per_second, c.refusal_burst),
            (300, 600),
            "the refusal budget has defaults"
        );
        assert_eq!((c.tarpit_initial_ms, c.tarpit_max_ms), (10, 1000));
        assert_eq!(c.mode_for(b"cache:1"), ProtectMode::Off);
        assert_eq!(c.mode_for(b"x"), ProtectMode::Enforce);
        let empty: RedisConfig = toml::from_str("").unwrap();
        assert_eq!(empty.protect, None);
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
    fn the_refusal_budget_and_tarpit_are_checked() {
        let parse = |t: &str| {
            toml::from_str::<RedisConfig>(&format!("protect = []\n{t}\n"))
                .unwrap()
                .validate()
        };
        parse(
            "refusals_per_second = 5\nrefusal_burst = 1\ntarpit_initial_ms = 1\ntarpit_max_ms = 1",
        )
        .unwrap();
        for (toml, says) in [
            ("refusals_per_second = 0", "must be at least 1"),
            ("refusal_burst = 0", "must be at least 1"),
            ("tarpit_initial_ms = 0", "tarpit_initial_ms (0)"),
            (
                "tarpit_initial_ms = 50\ntarpit_max_ms = 10",
                "between it and",
            ),
            ("tarpit_max_ms = 60001", "between it and 60000"),
        ] {
            let err = parse(toml).unwrap_err().to_string();
            assert!(err.contains(says), "{toml}: {err}");
        }
    }

    #[test]
    fn enforce_rules_name_their_resource() {
        let parse = |t: &str| toml::from_str::<RedisConfig>(t).unwrap().validate();
        let err = parse("[[protect]]\npattern = \"billing:*\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("protect rule 1 (pattern \"billing:*\"): mode enforce needs a resource"),
            "{err}"
        );
        parse("[[protect]]\npattern = \"cache:*\"\nmode = \"off\"\n").unwrap();
        parse("[[protect]]\npattern = \"billing:*\"\nresource = \"billing\"\n").unwrap();
        parse("[[protect]]\npattern = \"billing:*:*\"\nresource = \"billing:{1}\"\n").unwrap();
        parse("[[protect]]\npattern = \"*\"\nresource = \"*\"\n").unwrap();
        for (toml, says) in [
            (
                "pattern = \"billing:*\"\nresource = \"billing:{2}\"",
                "uses {2}, but the pattern has 1 *",
            ),
            (
                "pattern = \"billing:?*\"\nresource = \"b:{1}\"",
                "need a pattern whose only wildcard is *",
            ),
            (
                "pattern = \"billing:*\"\nresource = \"bil ling\"",
                "does not make a valid resource name",
            ),
            (
                "pattern = \"billing:*\"\nresource = \"b:{x}\"",
                "not a capture number",
            ),
        ] {
            let err = parse(&format!("[[protect]]\n{toml}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{toml}: {err}");
        }
    }

    #[test]
    fn scope_from_fixed_names_and_captures() {
        let c: RedisConfig = toml::from_str(
            "[[protect]]\npattern = \"cache:*\"\nmode = \"off\"\n\
             [[protect]]\npattern = \"billing:*:*\"\nresource = \"billing:{1}\"\n\
             [[protect]]\npattern = \"jobs:*\"\nresource = \"jobs\"\n\
             [[protect]]\npattern = \"*\"\nresource = \"*\"\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.scope_for(b"cache:x"), Scope::Unprotected);
        assert_eq!(
            c.scope_for(b"billing:2026-09-28:chunk:3"),
            Scope::Resource("billing:2026-09-28".into())
        );
        assert_eq!(c.scope_for(b"jobs:7"), Scope::Resource("jobs".into()));
        assert_eq!(c.scope_for(b"other"), Scope::AnyResource);
        assert_eq!(RedisConfig::default().scope_for(b"k"), Scope::Unprotected);
    }

    #[test]
    fn first_matching_rule_decides() {
        let c = RedisConfig {
            protect: Some(vec![
                ProtectRule {
                    pattern: "cache:*".into(),
                    mode: ProtectMode::Off,
                    resource: None,
                },
                ProtectRule {
                    pattern: "billing:*".into(),
                    mode: ProtectMode::Enforce,
                    resource: Some("billing".into()),
                },
            ]),
            ..RedisConfig::default()
        };
        assert_eq!(c.mode_for(b"cache:x"), ProtectMode::Off);
        assert_eq!(c.mode_for(b"billing:x"), ProtectMode::Enforce);
        assert_eq!(c.mode_for(b"other"), ProtectMode::Off);
    }
}
