//! What a config needs from outside its file (environment variables, files, certificates),
//! checked as `serve` uses it, each error at the file and line of the key that asks for it.
//! `serve` runs [`sources`] before it starts; `check-config` runs [`build`], which also builds
//! every section as `serve` does, without binding a port.

use std::path::PathBuf;

use crate::config::{Config, ConfigError};
use crate::config_source::ConfigSource;
use crate::server::Secrets;

/// The environment variables the config names, by key.
fn env_vars(config: &Config) -> Vec<(&'static str, &str)> {
    let mut all: Vec<(&'static str, Option<&String>)> = vec![
        (
            "authority.token_key_env",
            config.authority.token_key_env.as_ref(),
        ),
        (
            "security.credentials_env",
            config.security.credentials_env.as_ref(),
        ),
    ];
    if let Some(redis) = &config.redis {
        all.push(("redis.password_env", redis.password_env.as_ref()));
    }
    if let Some(postgres) = &config.postgres {
        all.push((
            "postgres.install_dsn_env",
            postgres.install_dsn_env.as_ref(),
        ));
    }
    if let Some(s3) = &config.s3 {
        all.push(("s3.upstream_secret_env", Some(&s3.upstream_secret_env)));
        all.push(("s3.clients_env", s3.clients_env.as_ref()));
    }
    all.into_iter()
        .filter_map(|(key, var)| Some((key, var?.as_str())))
        .collect()
}

/// The files the config names, by key.
fn files(config: &Config) -> Vec<(&'static str, &PathBuf)> {
    let s = &config.security;
    let mut all: Vec<(&'static str, Option<&PathBuf>)> = vec![
        (
            "authority.token_key_file",
            config.authority.token_key_file.as_ref(),
        ),
        ("security.ca_file", s.ca_file.as_ref()),
        ("security.cert_file", s.cert_file.as_ref()),
        ("security.key_file", s.key_file.as_ref()),
        ("security.credentials_file", s.credentials_file.as_ref()),
    ];
    if let Some(r) = &config.redis {
        all.push(("redis.tls_cert", r.tls_cert.as_ref()));
        all.push(("redis.tls_key", r.tls_key.as_ref()));
        all.push(("redis.upstream_ca_file", r.upstream_ca_file.as_ref()));
    }
    if let Some(p) = &config.postgres {
        all.push(("postgres.tls_cert", p.tls_cert.as_ref()));
        all.push(("postgres.tls_key", p.tls_key.as_ref()));
        all.push(("postgres.upstream_ca_file", p.upstream_ca_file.as_ref()));
    }
    if let Some(s3) = &config.s3 {
        all.push(("s3.tls_cert", s3.tls_cert.as_ref()));
        all.push(("s3.tls_key", s3.tls_key.as_ref()));
        all.push(("s3.upstream_ca_file", s3.upstream_ca_file.as_ref()));
        all.push(("s3.clients_file", s3.clients_file.as_ref()));
    }
    all.into_iter()
        .filter_map(|(key, file)| Some((key, file?)))
        .collect()
}

/// Every environment variable the config names is set, and every file it names can be read.
pub fn sources(source: &ConfigSource, config: &Config) -> Result<(), ConfigError> {
    for (key, var) in env_vars(config) {
        if std::env::var_os(var).is_none() {
            return Err(source.error(
                key,
                format!("environment variable {var} is not set; set it, or remove {key}"),
            ));
        }
    }
    for (key, file) in files(config) {
        if let Err(e) = std::fs::File::open(file) {
            return Err(source.error(key, format!("cannot read {}: {e}", file.display())));
        }
    }
    Ok(())
}

/// [`sources`], then every section built as `serve` builds it (secrets, certificates, each
/// gateway with its TLS and upstream settings), without binding a port.
pub fn build(source: &ConfigSource, config: &Config) -> Result<(), ConfigError> {
    sources(source, config)?;
    let secrets = Secrets::load(config).map_err(|e| {
        let at = match &e {
            crate::server::ServeError::KeyMissing(_) | crate::server::ServeError::KeyShort(_) => {
                if config.authority.token_key_env.is_some() {
                    "authority.token_key_env"
                } else {
                    "authority.token_key_file"
                }
            }
            crate::server::ServeError::KeyFile { .. } => "authority.token_key_file",
            _ => "security",
        };
        source.error(at, e)
    })?;
    if let Some(tls) = &secrets.tls {
        tls.api_acceptor()
            .and_then(|_| tls.peer_acceptor())
            .and_then(|_| tls.peer_client(config.node.peer_source))
            .map_err(|e| source.error("security.cert_file", e))?;
    }
    let policy = fencegate_core::TokenPolicy {
        keys: fencegate_core::SharedKeyRing::default(),
        accept_unsigned: config.authority.accept_unsigned,
        accept_plain: false,
        issued: fencegate_core::IssuedRevision::default(),
    };
    // Gateways built only to be checked serve no request: nothing reaches this sink.
    let sink: std::sync::Arc<dyn fencegate_core::AuditSink> =
        std::sync::Arc::new(fencegate_core::MemoryAuditSink::default());
    if let Some(redis) = config.redis.clone() {
        fencegate_redis::Gateway::new(redis, policy.clone(), sink.clone())
            .map_err(|e| source.error("redis", e))?;
    }
    if let Some(postgres) = config.postgres.clone() {
        fencegate_postgres::Gateway::new(postgres, policy.clone(), sink.clone())
            .map_err(|e| source.error("postgres", e))?;
    }
    if let Some(s3) = config.s3.clone() {
        fencegate_s3::S3Gateway::new(s3, policy, sink).map_err(|e| source.error("s3", e))?;
    }
    Ok(())
}
