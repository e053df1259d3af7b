//! The `[postgres]` config section.
//!
//! ```toml
//! [postgres]
//! listen = "127.0.0.1:6433"        # where clients connect (default)
//! upstream = "127.0.0.1:5432"      # the PostgreSQL server, host:port (default)
//! upstream_tls = "disable"         # or "verify-full": TLS to the server, its certificate chain
//!                                  # and host name (the host of `upstream`) verified
//! upstream_ca_file = "/etc/fencegate/pg-upstream-ca.pem" # CAs for verify-full (PEM); absent:
//!                                  # the system's root certificates
//! databases = ["*"]                # protected databases; "*" = all (default)
//! unprotected_schemas = []         # writes naming only tables in these schemas pass (default:
//!                                  # none), if those tables are all they can write: no call of
//!                                  # a function not known to be read-only, no dot inside a
//!                                  # quoted name, no CASCADE, no COPY to or from a file or
//!                                  # program, no CREATE TRIGGER, and (DDL) no other relation
//!                                  # named. What such a write sets off elsewhere (triggers,
//!                                  # foreign keys, views) is for the store's fence (`protect`).
//!                                  # The `fencegate` schema is never written by clients: writes
//!                                  # to it are refused (FG006); only the guard writes it.
//! resource = "billing"             # required when `databases` is not empty: the only resource
//!                                  # tokens may name here; also the resource of plain numeric
//!                                  # tokens (with accept_plain). Bind the tables to it in the
//!                                  # store with `fencegate postgres protect --resource billing`.
//! accept_plain = false             # accept bare decimal revisions as tokens (needs `resource`)
//! install_on_start = false         # run fence.sql at startup (needs install_dsn_env)
//! install_dsn_env = "FENCEGATE_PG_DSN" # env var holding the fence schema owner's DSN: for the
//!                                     # install, and to keep the store's token keys in step
//! max_message_bytes = 67108864     # larger client messages: 08P01 and the connection closes
//! session_threads = 1              # threads running the sessions, each with its own epoll
//!                                  # (default 1, as PgBouncer: the least CPU per request)
//! tls_cert = "/etc/fencegate/pg.crt" # optional PEM chain; with tls_key, SSLRequest is accepted
//! tls_key = "/etc/fencegate/pg.key"  # and TLS terminated with rustls (else SSLRequest gets 'N')
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use fencegate_core::Resource;
use serde::Deserialize;

use crate::error::PostgresError;

/// The `[postgres]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresConfig {
    /// Address the gateway listens on for PostgreSQL clients.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// The upstream PostgreSQL server, `host:port`.
    #[serde(default = "default_upstream")]
    pub upstream: String,
    /// TLS to the upstream server.
    #[serde(default)]
    pub upstream_tls: UpstreamTls,
    /// PEM file of the CA certificates that verify the upstream server's certificate (with
    /// `upstream_tls = "verify-full"`); absent: the system's root certificates.
    #[serde(default)]
    pub upstream_ca_file: Option<PathBuf>,
    /// Protected database names; `"*"` matches every database.
    #[serde(default = "default_databases")]
    pub databases: Vec<String>,
    /// Schemas whose tables are not protected: a write whose every target is schema-qualified
    /// with one of these passes without a token. Unqualified names are always protected.
    #[serde(default = "default_unprotected_schemas")]
    pub unprotected_schemas: Vec<String>,
    /// The resource this gateway's writes belong to: tokens must name it (others are refused as
    /// out of scope). Required when any database is protected.
    #[serde(default)]
    pub resource: Option<String>,
    /// Accept a bare decimal revision as a token for `resource`.
    #[serde(default)]
    pub accept_plain: bool,
    /// Install `fence.sql` when the node starts (with the DSN in `install_dsn_env`).
    #[serde(default)]
    pub install_on_start: bool,
    /// Name of the environment variable holding the DSN used to install `fence.sql`.
    #[serde(default)]
    pub install_dsn_env: Option<String>,
    /// The largest message accepted from a client, in bytes.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// How many threads run the sessions, each a single-threaded runtime with its own epoll;
    /// a session stays on one for its life (see `fencegate_core::SessionThreads`).
    #[serde(default = "default_session_threads")]
    pub session_threads: usize,
    /// The most client connections open at once (each holds two file descriptors, the
    /// client's and the server's); a client over it gets SQLSTATE 53300, as from PostgreSQL's
    /// own `max_connections` or PgBouncer's `max_client_conn`.
    #[serde(default = "default_max_client_connections")]
    pub max_client_connections: usize,
    /// PEM certificate chain for client TLS (with `tls_key`).
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for client TLS (with `tls_cert`).
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
}

/// TLS to the upstream server, named as libpq's `sslmode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UpstreamTls {
    /// Plain TCP.
    #[default]
    Disable,
    /// TLS required; the server's certificate chain is verified and must name the host of
    /// `upstream`.
    VerifyFull,
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:6433".parse().expect("literal address")
}
fn default_upstream() -> String {
    "127.0.0.1:5432".to_owned()
}
fn default_databases() -> Vec<String> {
    vec!["*".to_owned()]
}
fn default_unprotected_schemas() -> Vec<String> {
    Vec::new()
}
fn default_max_message_bytes() -> usize {
    64 * 1024 * 1024
}
fn default_session_threads() -> usize {
    1
}
/// Ten times PostgreSQL's default `max_connections`: the server refuses past its own bound
/// anyway; this one keeps the node's descriptors for its authority (2,000 of systemd's 65,536).
fn default_max_client_connections() -> usize {
    1000
}
/// The largest `max_client_connections` accepted.
const MAX_CLIENT_CONNECTIONS: usize = fencegate_core::ConnectionCap::MOST;

impl Default for PostgresConfig {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            upstream: default_upstream(),
            upstream_tls: UpstreamTls::Disable,
            upstream_ca_file: None,
            databases: default_databases(),
            unprotected_schemas: default_unprotected_schemas(),
            resource: None,
            accept_plain: false,
            install_on_start: false,
            install_dsn_env: None,
            max_message_bytes: default_max_message_bytes(),
            session_threads: default_session_threads(),
            max_client_connections: default_max_client_connections(),
            tls_cert: None,
            tls_key: None,
        }
    }
}

impl PostgresConfig {
    /// Checks what serde cannot.
    pub fn validate(&self) -> Result<(), PostgresError> {
        if !(1..=1024).contains(&self.session_threads) {
            return Err(PostgresError::Config(format!(
                "session_threads ({}) must be between 1 and 1024",
                self.session_threads
            )));
        }
        if !(1..=MAX_CLIENT_CONNECTIONS).contains(&self.max_client_connections) {
            return Err(PostgresError::Config(format!(
                "max_client_connections ({}) must be between 1 and {MAX_CLIENT_CONNECTIONS}",
                self.max_client_connections
            )));
        }
        if self.max_message_bytes < 64 * 1024 {
            return Err(PostgresError::Config(format!(
                "max_message_bytes ({}) must be at least 65536",
                self.max_message_bytes
            )));
        }
        if !self.databases.is_empty() && self.resource.is_none() {
            return Err(PostgresError::Config(format!(
                "the gateway protects databases {:?} but names no `resource`: set resource = \"<name>\" to the \
                 resource your lock holders take (tokens for any other resource are refused, FG005), and bind \
                 the tables to it with `fencegate postgres protect --resource <name>`; or set databases = [] \
                 to protect nothing",
                self.databases
            )));
        }
        if let Some(resource) = &self.resource {
            Resource::new(resource.as_str())
                .map_err(|e| PostgresError::Config(format!("resource {resource:?}: {e}")))?;
        }
        if self.accept_plain && self.resource.is_none() {
            return Err(PostgresError::Config(
                "accept_plain needs `resource` (a plain token names no resource)".to_owned(),
            ));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(PostgresError::Config(
                "tls_cert and tls_key go together".to_owned(),
            ));
        }
        if self.upstream_ca_file.is_some() && self.upstream_tls == UpstreamTls::Disable {
            return Err(PostgresError::Config(
                "upstream_ca_file is set but upstream_tls = \"disable\": set upstream_tls = \"verify-full\" to use it"
                    .to_owned(),
            ));
        }
        if self.install_on_start && self.install_dsn_env.is_none() {
            return Err(PostgresError::Config(
                "install_on_start needs install_dsn_env".to_owned(),
            ));
        }
        Ok(())
    }

    /// Whether writes to `database` are fenced.
    pub fn protects_database(&self, database: &str) -> bool {
        self.databases.iter().any(|d| d == "*" || d == database)
    }

    /// The configured resource, validated.
    pub fn route(&self) -> Option<Resource> {
        self.resource.as_deref().and_then(|r| Resource::new(r).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_client_connections_is_bounded_both_ways() {
        let with = |n| PostgresConfig {
            databases: Vec::new(),
            max_client_connections: n,
            ..PostgresConfig::default()
        };
        assert!(with(1).validate().is_ok());
        assert!(with(MAX_CLIENT_CONNECTIONS).validate().is_ok());
        for bad in [0, MAX_CLIENT_CONNECTIONS + 1] {
            let e = with(bad).validate().expect_err("refused").to_string();
            assert!(e.contains("max_client_connections"), "{e}");
        }
    }

    #[test]
    fn defaults_protect_every_database() {
        let c = PostgresConfig {
            resource: Some("billing".into()),
            ..PostgresConfig::default()
        };
        c.validate().unwrap();
        assert!(c.protects_database("anything"));
        assert!(c.unprotected_schemas.is_empty());
    }

    #[test]
    fn a_protecting_gateway_names_its_resource() {
        let e = PostgresConfig::default()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("names no `resource`"), "{e}");
        assert!(e.contains("fencegate postgres protect --resource"), "{e}");
        let nothing = PostgresConfig {
            databases: Vec::new(),
            ..PostgresConfig::default()
        };
        nothing.validate().unwrap();
    }

    #[test]
    fn upstream_tls_is_disable_or_verify_full() {
        let parse = |json: &str| serde_json::from_str::<PostgresConfig>(json);
        let c = parse(r#"{"upstream_tls": "verify-full", "upstream_ca_file": "/ca.pem"}"#).unwrap();
        assert_eq!(c.upstream_tls, UpstreamTls::VerifyFull);
        assert_eq!(parse("{}").unwrap().upstream_tls, UpstreamTls::Disable);
        assert!(parse(r#"{"upstream_tls": "require"}"#).is_err());
        let stray = PostgresConfig {
            databases: Vec::new(),
            upstream_ca_file: Some("/ca.pem".into()),
            ..PostgresConfig::default()
        };
        let e = stray.validate().unwrap_err().to_string();
        assert!(e.contains("upstream_tls"), "{e}");
    }

    #[test]
    fn plain_tokens_need_a_resource() {
        let c = PostgresConfig {
            accept_plain: true,
            ..PostgresConfig::default()
        };
        assert!(c.validate().is_err());
    }
}
