//! The node's TOML config: every section, its defaults and its validation.
//!
//! Unknown keys are errors (a typo must not silently fall back to a default), and every error
//! names the file and line.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use fencegate_core::Revision;
use serde::Deserialize;
use thiserror::Error;

use crate::config_source::ConfigSource;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}:{line}: {key}: {message}")]
    Invalid {
        path: PathBuf,
        line: usize,
        key: String,
        message: String,
    },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub node: NodeConfig,
    #[serde(default)]
    pub authority: AuthorityConfig,
    #[serde(default)]
    pub log: LogConfig,
    /// The Redis gateway; absent: no Redis listener.
    #[serde(default)]
    pub redis: Option<fencegate_redis::RedisConfig>,
    /// The PostgreSQL gateway; absent: no PostgreSQL listener.
    #[serde(default)]
    pub postgres: Option<fencegate_postgres::PostgresConfig>,
    /// The S3 gateway; absent: no S3 listener.
    #[serde(default)]
    pub s3: Option<fencegate_s3::S3Config>,
    /// The audit log of refused writes.
    #[serde(default)]
    pub audit: crate::audit::AuditConfig,
    /// Who may call the API and the Raft RPCs, and over what.
    #[serde(default)]
    pub security: SecurityConfig,
}

/// The `[security]` section: TLS for the API and the peer port, client credentials.
///
/// Secure by default: a node without certificates and credentials refuses to start unless
/// `insecure = true` says this is local development.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecurityConfig {
    /// Plain HTTP on the API and peer ports, and no credentials needed (credentials that are
    /// configured are still enforced). For local development only; logged loudly at start.
    #[serde(default)]
    pub insecure: bool,
    /// The cluster CA (PEM): peers' client certificates must chain to it; clients and peers
    /// trust it for this node's certificate.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// This node's certificate chain (PEM), served on the API and peer ports and presented to
    /// peers as a client certificate.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// The private key of `cert_file` (PEM).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// API credentials, one `name role secret` per line (`#` comments); role is `client` or
    /// `admin`.
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// Name of an environment variable holding credentials as `name:role:secret,...`.
    #[serde(default)]
    pub credentials_env: Option<String>,
}

impl SecurityConfig {
    /// Whether TLS is configured (all three files named).
    pub fn tls(&self) -> bool {
        self.ca_file.is_some() && self.cert_file.is_some() && self.key_file.is_some()
    }

    fn validate(&self) -> Result<(), (String, String)> {
        let named = [&self.ca_file, &self.cert_file, &self.key_file]
            .iter()
            .filter(|f| f.is_some())
            .count();
        if named != 0 && named != 3 {
            return Err((
                "security".into(),
                "ca_file, cert_file and key_file go together: name all three, or none".into(),
            ));
        }
        if self.insecure {
            return Ok(());
        }
        if !self.tls() {
            return Err((
                "security".into(),
                "no TLS configured: set [security] ca_file, cert_file and key_file (`fencegate certs init` makes a cluster CA and node certificates), or `insecure = true` for local development".into(),
            ));
        }
        if self.credentials_file.is_none() && self.credentials_env.is_none() {
            return Err((
                "security".into(),
                "no API credentials configured: set [security] credentials_file or credentials_env (`fencegate certs init` writes a credentials file), or `insecure = true` for local development".into(),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// This node's Raft id; unique in the cluster.
    #[serde(default = "default_node_id")]
    pub id: u64,
    /// HTTP API address (clients; also Raft RPCs when `peer` is not set).
    #[serde(default = "default_api")]
    pub api: SocketAddr,
    /// Raft RPC address, served with mutual TLS. Required unless `[security] insecure`.
    #[serde(default)]
    pub peer: Option<SocketAddr>,
    /// The local IP address this node's Raft RPCs to its peers leave from. Unset: the one the
    /// system's routes pick. For hosts with several addresses where the peers' firewalls admit
    /// one, or to tell nodes on one host apart by source address (the chaos suite's proxies).
    #[serde(default)]
    pub peer_source: Option<IpAddr>,
    /// The node's data: the audit log (unless `[audit] dir`), and the Raft log unless
    /// `raft_dir` is set (relative paths: to the working directory).
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    /// Where the Raft log, vote and snapshots live (`authority.redb`). Default: `data_dir`.
    /// Give it its own volume so nothing else written on the node can fill it.
    #[serde(default)]
    pub raft_dir: Option<PathBuf>,
    /// Free bytes the Raft directory's volume (and the audit directory's) must have at start;
    /// when both share a volume, what the audit log may still grow (`[audit]
    /// max_total_bytes` minus its size) is reserved on top. The node refuses to start short
    /// of it; while it runs, an audit volume below it makes the audit log act as over its
    /// budget (tokenless and malformed refusals only counted, alarm on).
    #[serde(default = "default_min_free_bytes")]
    pub min_free_bytes: u64,
    /// How long SIGTERM waits for gateway sessions to finish their transaction, pipeline or
    /// request before it cuts them (and for API requests, at most 5 s; 1 s on a leader).
    #[serde(default = "default_shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// The most connections the API port (and, apart, the Raft peer port) holds open at once;
    /// over it a plain-HTTP client gets `503` with `Retry-After`, a TLS client a closed
    /// connection.
    #[serde(default = "default_max_api_connections")]
    pub max_api_connections: usize,
}

impl NodeConfig {
    /// [`NodeConfig::shutdown_grace_ms`] as a duration.
    pub fn shutdown_grace(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.shutdown_grace_ms)
    }
}

impl NodeConfig {
    /// The directory of the Raft log: `raft_dir`, or `data_dir`.
    pub fn raft_dir(&self) -> PathBuf {
        self.raft_dir
            .clone()
            .unwrap_or_else(|| self.data_dir.clone())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthorityConfig {
    /// The cluster's voters at its first start. Empty: a one-node cluster of this node alone.
    /// Later changes go through `fencegate cluster add-node` / `remove-node`; the members
    /// listed here are only used the first time and for API addresses older logs lack.
    #[serde(default)]
    pub members: Vec<MemberConfig>,
    /// Join mode: this node forms no cluster of its own; it starts empty and waits until a
    /// member adds it (`fencegate cluster add-node`). `members` must then be empty.
    #[serde(default)]
    pub join: bool,
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    #[serde(default = "default_election_min_ms")]
    pub election_timeout_min_ms: u64,
    #[serde(default = "default_election_max_ms")]
    pub election_timeout_max_ms: u64,
    /// The longest lease a client may ask for.
    #[serde(default = "default_max_ttl_ms")]
    pub max_ttl_ms: u64,
    /// The longest a client may wait for a held lock.
    #[serde(default = "default_max_wait_ms")]
    pub max_wait_ms: u64,
    /// The most live leases the cluster holds: an acquire beyond it is refused (429), so that
    /// clients cannot grow the replicated state, its snapshots and every node's memory without
    /// end (DESIGN rule 10).
    #[serde(default = "default_max_leases")]
    pub max_leases: u64,
    /// Added to the revision when a snapshot is restored, so no token is handed out twice.
    #[serde(default = "default_restore_bump")]
    pub restore_bump: u64,
    /// Raft log entries between automatic snapshots (log compaction).
    #[serde(default = "default_snapshot_logs")]
    pub snapshot_every_logs: u64,
    /// Log entries kept after a snapshot, so a briefly lagging follower catches up from the
    /// log rather than by a full snapshot transfer.
    #[serde(default = "default_snapshot_keep_logs")]
    pub snapshot_keep_logs: u64,
    /// Name of an environment variable holding an operator-supplied token signing secret
    /// (32+ bytes). Without it (and without `token_key_file`) the cluster makes its own key at
    /// first start and replicates it; either way tokens are signed.
    #[serde(default)]
    pub token_key_env: Option<String>,
    /// A file holding an operator-supplied token signing secret (32+ bytes, trailing newline
    /// ignored). Every node must be given the same secret.
    #[serde(default)]
    pub token_key_file: Option<PathBuf>,
    /// Accept unsigned tokens (`fg1~<rev>~<resource>`): any client can then type one. For
    /// development only; logged loudly at start.
    #[serde(default)]
    pub accept_unsigned: bool,
    /// No token is ever issued at or below this revision: set it above the fences the stores
    /// hold when the authority's data was lost or re-created.
    #[serde(default)]
    pub initial_revision: u64,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MemberConfig {
    pub id: u64,
    /// `host:port` clients (and followers forwarding to a leader) reach the member at: an IP
    /// address, or a DNS name (Docker Compose service, Kubernetes StatefulSet pod).
    pub api: String,
    /// `host:port` of the member's peer (Raft) port; with TLS the host must be in its
    /// certificate. Unset: Raft runs on `api` (insecure mode only).
    #[serde(default)]
    pub peer: Option<String>,
}

impl MemberConfig {
    /// Where Raft RPCs reach this member.
    pub fn raft_addr(&self) -> &str {
        self.peer.as_deref().unwrap_or(&self.api)
    }
}

impl MemberConfig {
    /// The port of `api`, if `api` is `host:port` with a non-empty host.
    fn port(&self) -> Option<u16> {
        let (host, port) = self.api.rsplit_once(':')?;
        (!host.is_empty()).then_some(())?;
        port.parse().ok()
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A tracing filter such as `info` or `fencegate=debug,openraft=warn`.
    #[serde(default = "default_log_level")]
    pub level: String,
    /// `text` (one human-readable line per event) or `json` (one JSON object per line, for a
    /// log shipper).
    #[serde(default)]
    pub format: LogFormat,
}

/// How log lines are written (`[log] format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

fn default_node_id() -> u64 {
    1
}
fn default_api() -> SocketAddr {
    "127.0.0.1:7070".parse().expect("literal address")
}
fn default_data_dir() -> PathBuf {
    PathBuf::from("./data")
}
fn default_min_free_bytes() -> u64 {
    64 * 1024 * 1024
}
fn default_shutdown_grace_ms() -> u64 {
    30_000
}
/// Lock holders keep a connection each (keepalives), and a few clients poll: thousands.
fn default_max_api_connections() -> usize {
    4096
}
// Fast failover (see README, "Failover time"): a follower campaigns after openraft's leader
// lease (= max) plus its own timeout in [min, max), i.e. 750-900 ms without a heartbeat. The
// heartbeat is also openraft's AppendEntries timeout, so it stays at 100 ms: at 50 ms a slow
// first append to a restarted node timed out and the node campaigned.
fn default_heartbeat_ms() -> u64 {
    100
}
fn default_election_min_ms() -> u64 {
    300
}
fn default_election_max_ms() -> u64 {
    450
}
fn default_max_ttl_ms() -> u64 {
    300_000
}
fn default_max_wait_ms() -> u64 {
    300_000
}
fn default_max_leases() -> u64 {
    100_000
}
fn default_restore_bump() -> u64 {
    1_000_000
}
fn default_snapshot_logs() -> u64 {
    10_000
}
fn default_snapshot_keep_logs() -> u64 {
    1000
}
fn default_log_level() -> String {
    "info,openraft=warn".to_owned()
}

impl Default for AuthorityConfig {
    fn default() -> Self {
        Self {
            members: Vec::new(),
            join: false,
            heartbeat_ms: default_heartbeat_ms(),
            election_timeout_min_ms: default_election_min_ms(),
            election_timeout_max_ms: default_election_max_ms(),
            max_ttl_ms: default_max_ttl_ms(),
            max_leases: default_max_leases(),
            max_wait_ms: default_max_wait_ms(),
            restore_bump: default_restore_bump(),
            snapshot_every_logs: default_snapshot_logs(),
            snapshot_keep_logs: default_snapshot_keep_logs(),
            token_key_env: None,
            token_key_file: None,
            accept_unsigned: false,
            initial_revision: 0,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: default_log_level(),
            format: LogFormat::default(),
        }
    }
}

impl Config {
    /// Reads, parses and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &text)
    }

    /// Parses and validates `text`; `path` is used in messages only.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        // toml's messages already carry "at line N, column M" and a snippet.
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        config
            .validate()
            .map_err(|(key, message)| ConfigSource::new(path, text).error(&key, message))?;
        Ok(config)
    }

    /// Reads, parses and validates `path`; also returns its source, for errors found later
    /// (`check-config`, reload) to name their line.
    pub fn load_with_source(path: &Path) -> Result<(Self, ConfigSource), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let config = Self::parse(path, &text)?;
        Ok((config, ConfigSource::new(path, &text)))
    }

    /// The voters: the configured members, or this node alone.
    pub fn members(&self) -> Vec<MemberConfig> {
        if self.authority.members.is_empty() {
            vec![MemberConfig {
                id: self.node.id,
                api: self.node.api.to_string(),
                peer: self.node.peer.map(|p| p.to_string()),
            }]
        } else {
            self.authority.members.clone()
        }
    }

    /// Every listener this config opens, by the key that names it.
    pub fn listeners(&self) -> Vec<(&'static str, SocketAddr)> {
        let mut all = vec![("node.api", self.node.api)];
        all.extend(self.node.peer.map(|a| ("node.peer", a)));
        all.extend(self.redis.as_ref().map(|r| ("redis.listen", r.listen)));
        all.extend(
            self.postgres
                .as_ref()
                .map(|p| ("postgres.listen", p.listen)),
        );
        all.extend(self.s3.as_ref().map(|s| ("s3.listen", s.listen)));
        all
    }

    fn validate(&self) -> Result<(), (String, String)> {
        let a = &self.authority;
        if self.node.id == 0 {
            return Err(("node.id".into(), "node ids start at 1".into()));
        }
        let most = fencegate_core::ConnectionCap::MOST;
        if !(1..=most).contains(&self.node.max_api_connections) {
            return Err((
                "node.max_api_connections".into(),
                format!(
                    "max_api_connections ({}) must be between 1 and {most} (the Linux default of fs.nr_open)",
                    self.node.max_api_connections
                ),
            ));
        }
        self.security.validate()?;
        // Each gateway's own rules (protect rules name their resource, ...), exactly as serve
        // checks them, so check-config passes only what serve accepts.
        if let Some(redis) = &self.redis {
            redis.validate().map_err(|e| gateway_error("redis", e))?;
        }
        if let Some(postgres) = &self.postgres {
            postgres
                .validate()
                .map_err(|e| gateway_error("postgres", e))?;
        }
        if let Some(s3) = &self.s3 {
            s3.validate().map_err(|e| gateway_error("s3", e))?;
        }
        let listeners = self.listeners();
        for (i, (key, addr)) in listeners.iter().enumerate() {
            if let Some((other, _)) = listeners[..i].iter().find(|(_, o)| collide(*o, *addr)) {
                return Err((
                    (*key).into(),
                    format!("{key} ({addr}) is the address of {other} too: give each listener its own port"),
                ));
            }
        }
        if !self.security.insecure && self.node.peer.is_none() {
            return Err((
                "node.peer".into(),
                "[node] peer is not set: Raft RPCs need their own port with mutual TLS (e.g. peer = \"127.0.0.1:7170\"), or `[security] insecure = true` for local development".into(),
            ));
        }
        if self.node.peer == Some(self.node.api) {
            return Err((
                "node.peer".into(),
                "node.peer and node.api must be different ports".into(),
            ));
        }
        if a.token_key_env.is_some() && a.token_key_file.is_some() {
            return Err((
                "authority.token_key_file".into(),
                "token_key_env and token_key_file both name a key; keep one".into(),
            ));
        }
        if a.initial_revision > Revision::MAX {
            return Err((
                "authority.initial_revision".into(),
                format!("initial_revision must be at most {}", Revision::MAX),
            ));
        }
        if a.heartbeat_ms == 0 || a.heartbeat_ms * 3 > a.election_timeout_min_ms {
            return Err((
                "authority.heartbeat_ms".into(),
                format!(
                    "heartbeat_ms ({}) must be positive and at most a third of election_timeout_min_ms ({})",
                    a.heartbeat_ms, a.election_timeout_min_ms
                ),
            ));
        }
        if a.election_timeout_min_ms >= a.election_timeout_max_ms {
            return Err((
                "authority.election_timeout_max_ms".into(),
                format!(
                    "election_timeout_max_ms ({}) must be above election_timeout_min_ms ({})",
                    a.election_timeout_max_ms, a.election_timeout_min_ms
                ),
            ));
        }
        if a.max_ttl_ms == 0 {
            return Err((
                "authority.max_ttl_ms".into(),
                "max_ttl_ms must be positive".into(),
            ));
        }
        if !(1..=10_000_000).contains(&a.max_leases) {
            return Err((
                "authority.max_leases".into(),
                format!("max_leases ({}) must be in 1..=10000000", a.max_leases),
            ));
        }
        if a.restore_bump == 0 {
            return Err((
                "authority.restore_bump".into(),
                "restore_bump must be positive, or a restore could reissue tokens".into(),
            ));
        }
        if a.snapshot_every_logs == 0 {
            return Err((
                "authority.snapshot_every_logs".into(),
                "snapshot_every_logs must be positive".into(),
            ));
        }
        if let Some(bad) = a
            .members
            .iter()
            .find(|m| m.peer.is_none() && !self.security.insecure)
        {
            return Err((
                "authority.members".into(),
                format!(
                    "member {} has no peer address; every member needs one unless [security] insecure = true",
                    bad.id
                ),
            ));
        }
        if a.join && !a.members.is_empty() {
            return Err((
                "authority.join".into(),
                "join = true: a joining node learns the members from the cluster that adds it; remove [[authority.members]] (or drop join to form a new cluster)".into(),
            ));
        }
        if !a.members.is_empty() {
            let mut ids: Vec<u64> = a.members.iter().map(|m| m.id).collect();
            ids.sort_unstable();
            ids.dedup();
            if ids.len() != a.members.len() {
                return Err(("authority.members".into(), "two members share an id".into()));
            }
            if let Some(bad) = a.members.iter().find(|m| m.port().is_none()) {
                return Err((
                    "authority.members".into(),
                    format!(
                        "member {} has api {:?}; expected host:port",
                        bad.id, bad.api
                    ),
                ));
            }
            match a.members.iter().find(|m| m.id == self.node.id) {
                None => {
                    return Err((
                        "authority.members".into(),
                        format!("node id {} is not among the members", self.node.id),
                    ))
                }
                // Binding 0.0.0.0 (or ::), or naming the member by DNS, is fine as long as the
                // port is the one peers use.
                Some(me) if !self.binds(me) => {
                    return Err((
                        "authority.members".into(),
                        format!(
                            "member {} has api {} but node.api is {}",
                            me.id, me.api, self.node.api
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

impl Config {
    /// Whether `node.api` is where peers reach `member`.
    fn binds(&self, member: &MemberConfig) -> bool {
        let bind = self.node.api;
        match member.api.parse::<SocketAddr>() {
            Ok(addr) => addr == bind || (bind.ip().is_unspecified() && addr.port() == bind.port()),
            Err(_) => member.port() == Some(bind.port()),
        }
    }
}

/// Whether two listen addresses would take the same port (port 0 asks for any free port).
fn collide(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0
        && a.port() == b.port()
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// A gateway's own validation error, at the key it is about: a protect rule's entry when the
/// message names the rule ("protect rule N"), else the gateway's section.
fn gateway_error(section: &str, error: impl std::fmt::Display) -> (String, String) {
    let message = error.to_string();
    let rule = message
        .split("protect rule ")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|n| *n >= 1);
    let at = match rule {
        Some(n) => format!("{section}.protect.{}", n - 1),
        None => section.to_owned(),
    };
    (at, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("test.toml"), text)
    }

    /// The same config in insecure mode, for tests about other sections.
    fn parse_insecure(text: &str) -> Result<Config, ConfigError> {
        parse(&format!("{text}\n[security]\ninsecure = true\n"))
    }

    #[test]
    fn secure_by_default() {
        let err = parse("[node]\n").unwrap_err().to_string();
        assert!(err.contains("fencegate certs init"), "{err}");
        assert!(err.contains("insecure = true"), "{err}");
        let tls = "[security]\nca_file = \"ca.crt\"\ncert_file = \"n.crt\"\nkey_file = \"n.key\"\n";
        let err = parse(&format!("[node]\npeer = \"127.0.0.1:7170\"\n{tls}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no API credentials"), "{err}");
        let err = parse(&format!("[node]\n{tls}credentials_env = \"C\"\n"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("peer is not set"), "{err}");
        assert!(parse(&format!(
            "[node]\npeer = \"127.0.0.1:7170\"\n{tls}credentials_env = \"C\"\n"
        ))
        .is_ok());
    }

    #[test]
    fn defaults_make_a_one_node_cluster() {
        let c = parse("[node]\n[security]\ninsecure = true\n").unwrap();
        assert_eq!(
            c.members(),
            vec![MemberConfig {
                id: 1,
                api: "127.0.0.1:7070".into(),
                peer: None,
            }]
        );
        assert_eq!(c.authority.restore_bump, 1_000_000);
    }

    #[test]
    fn peer_source_is_an_ip_address_without_port() {
        let c = parse_insecure("[node]\npeer = \"127.0.0.1:7170\"\npeer_source = \"127.0.1.2\"\n")
            .unwrap();
        assert_eq!(c.node.peer_source, Some("127.0.1.2".parse().unwrap()));
        let err = parse_insecure("[node]\npeer_source = \"127.0.1.2:7000\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn unknown_keys_name_the_line() {
        let err = parse_insecure("[node]\nid = 1\nttl = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 3"), "{err}");
        assert!(err.contains("unknown field `ttl`"), "{err}");
    }

    #[test]
    fn invalid_values_name_the_line_and_key() {
        let err = parse_insecure(
            "[node]\n[authority]\nelection_timeout_min_ms = 900\nelection_timeout_max_ms = 800\n",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "test.toml:4: authority.election_timeout_max_ms: election_timeout_max_ms (800) must be above election_timeout_min_ms (900)"
        );
    }

    #[test]
    fn a_node_may_bind_every_interface_on_its_member_port() {
        let members = "[[authority.members]]\nid = 1\napi = \"10.0.0.1:7071\"\n";
        assert!(parse_insecure(&format!("[node]\napi = \"0.0.0.0:7071\"\n{members}")).is_ok());
        assert!(parse_insecure(&format!("[node]\napi = \"0.0.0.0:7072\"\n{members}")).is_err());
    }

    #[test]
    fn members_may_be_named_by_dns() {
        let text = "[node]\nid = 2\napi = \"0.0.0.0:7070\"\n[authority]\nmembers = [\n  { id = 1, api = \"fencegate-0.fencegate:7070\" },\n  { id = 2, api = \"fencegate-1.fencegate:7070\" },\n]\n";
        assert_eq!(
            parse_insecure(text).unwrap().members()[1].api,
            "fencegate-1.fencegate:7070"
        );
        let err = parse_insecure(&text.replace("fencegate-1.fencegate:7070", "fencegate-1"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected host:port"), "{err}");
        assert!(
            parse_insecure(&text.replace("fencegate-1.fencegate:7070", "fencegate-1:7071"))
                .is_err()
        );
    }

    #[test]
    fn gateway_rules_are_checked_as_serve_checks_them() {
        let text = "[node]\n\n[redis]\nlisten = \"127.0.0.1:6380\"\n\n[[redis.protect]]\npattern = \"billing:*\"\nmode = \"enforce\"\n";
        let err = parse_insecure(text).unwrap_err().to_string();
        assert!(err.starts_with("test.toml:6: redis.protect.0:"), "{err}");
        assert!(err.contains("resource"), "{err}");
        let fixed = text.replace(
            "mode = \"enforce\"\n",
            "mode = \"enforce\"\nresource = \"billing\"\n",
        );
        assert!(parse_insecure(&fixed).is_ok());
        let bare = "[node]\n\n[redis]\nlisten = \"127.0.0.1:6380\"\n";
        let err = parse_insecure(bare).unwrap_err().to_string();
        assert!(
            err.starts_with("test.toml:3: redis:") && err.contains("no protect rules"),
            "{err}"
        );
        assert!(parse_insecure(&format!("{bare}protect = []\n")).is_ok());
        let pg = "[node]\n\n[postgres]\nlisten = \"127.0.0.1:6433\"\n";
        let err = parse_insecure(pg).unwrap_err().to_string();
        assert!(
            err.contains("postgres") && err.contains("resource"),
            "{err}"
        );
    }

    #[test]
    fn a_joining_node_lists_no_members() {
        let join = "[node]\nid = 4\napi = \"127.0.0.1:7074\"\n[authority]\njoin = true\n";
        assert!(parse_insecure(join).unwrap().authority.join);
        let err = parse_insecure(&format!(
            "{join}[[authority.members]]\nid = 4\napi = \"127.0.0.1:7074\"\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains(":5: authority.join: "), "{err}");
    }

    #[test]
    fn two_listeners_on_one_port_name_the_second() {
        let text = "[node]\napi = \"127.0.0.1:7070\"\n\n[redis]\nlisten = \"0.0.0.0:7070\"\nupstream = \"127.0.0.1:6379\"\nprotect = []\n";
        let err = parse_insecure(text).unwrap_err().to_string();
        assert!(
            err.starts_with("test.toml:5: redis.listen: redis.listen (0.0.0.0:7070) is the address of node.api too"),
            "{err}"
        );
        assert!(parse_insecure(&text.replace("0.0.0.0:7070", "127.0.0.1:0")).is_ok());
    }

    #[test]
    fn this_node_must_be_a_member() {
        let text = "[node]\nid = 4\napi = \"127.0.0.1:7074\"\n[[authority.members]]\nid = 1\napi = \"127.0.0.1:7071\"\n";
        let err = parse_insecure(text).unwrap_err().to_string();
        assert!(
            err.contains(":4: authority.members: node id 4 is not among the members"),
            "{err}"
        );
    }
}
