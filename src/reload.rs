//! SIGHUP: the config file is read and checked again; what can change while the node runs is
//! applied, what needs a restart is named in a warning and left as it is. A file that does not
//! parse or check keeps the config in force, and the log says why. Sessions are not dropped.
//!
//! Applied: `[log] level` (unless `FENCEGATE_LOG` overrides it), the Redis gateway's protect
//! rules (`[[redis.protect]]`), which open sessions apply from their next request, and client
//! credentials: the API's (`[security] credentials_file` / `credentials_env`) and the S3
//! gateway's (`clients_file` / `clients_env`), read again on every SIGHUP since their files
//! change without the config changing; and every TLS server certificate (the node's
//! `[security] cert_file`/`key_file`, the gateways' `tls_cert`/`tls_key`), read again from the
//! same paths: a pair whose key does not match stays out and the one in force stays. New
//! handshakes present the new certificate; open connections keep theirs. The CA (`ca_file`) is
//! read at start only: a changed one is named in a warning.

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::Config;
use crate::config_check;

/// Keys whose changes a running node applies; every other change needs a restart.
const APPLIED: &[&str] = &[
    "log.level",
    "redis.protect",
    "security.credentials_file",
    "security.credentials_env",
    "s3.clients_file",
    "s3.clients_env",
];

/// Sets the log filter (the subscriber's reload handle, hidden behind a function so this
/// module does not name the subscriber's types).
pub type SetLogLevel = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The running parts SIGHUP can change.
pub struct Live {
    pub credentials: Arc<crate::api::auth::LiveCredentials>,
    pub redis: Option<Arc<fencegate_redis::Gateway>>,
    pub s3: Option<fencegate_s3::S3Clients>,
    /// Every TLS listener's certificate, with the listener's name for the log.
    pub certs: Vec<(&'static str, Arc<fencegate_core::ServerCert>)>,
    /// The node's TLS (to tell a changed CA file).
    pub node_tls: Option<crate::tls::NodeTls>,
}

/// What SIGHUP can change, and the config the node started with.
pub struct Reloader {
    path: PathBuf,
    /// The file's text at start: what the running node is built from.
    running: toml::Table,
    set_log_level: SetLogLevel,
    live: Live,
}

/// What one reload did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Changed keys that are applied now.
    pub apply: Vec<String>,
    /// Changed keys that need a restart.
    pub restart: Vec<String>,
}

impl Reloader {
    pub fn new(path: PathBuf, set_log_level: SetLogLevel, live: Live) -> Self {
        let running = std::fs::read_to_string(&path)
            .ok()
            .and_then(|text| text.parse().ok())
            .unwrap_or_default();
        Self {
            path,
            running,
            set_log_level,
            live,
        }
    }

    /// Reads the file again and applies what can be applied; logs what it did and why not.
    pub fn reload(&self) {
        let (config, text) = match self.read() {
            Ok(read) => read,
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: the config was not reloaded; the one in force stays: fix the file and send SIGHUP again");
                return;
            }
        };
        let plan = plan(&changed_keys(&self.running, &text));
        if plan.apply.iter().any(|k| k == "log.level") {
            if std::env::var_os("FENCEGATE_LOG").is_some() {
                tracing::warn!("SIGHUP: FENCEGATE_LOG is set and overrides [log] level; unset it to set the level from the file");
            } else if let Err(e) = (self.set_log_level)(&config.log.level) {
                tracing::error!(error = %e, "SIGHUP: [log] level not applied");
            }
        }
        if plan.apply.iter().any(|k| k.starts_with("redis.protect")) {
            if let (Some(gateway), Some(redis)) = (&self.live.redis, &config.redis) {
                if let Err(e) = gateway.set_protect_rules(redis) {
                    tracing::error!(error = %e, "SIGHUP: Redis protect rules not applied; the rules in force stay");
                }
            }
        }
        match crate::api::auth::Credentials::load(&config.security) {
            Ok(Some(credentials)) => {
                tracing::info!(
                    credentials = credentials.len(),
                    "SIGHUP: API credentials read again"
                );
                self.live.credentials.replace(Arc::new(credentials));
            }
            // No credentials at all would open the API: not without a restart.
            Ok(None) => {
                if self.live.credentials.current().is_some() {
                    tracing::warn!("SIGHUP: the file names no API credentials; the ones in force stay (removing them needs a restart)");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: API credentials not reloaded; the ones in force stay");
            }
        }
        if let (Some(clients), Some(s3)) = (&self.live.s3, &config.s3) {
            match clients.reload(s3) {
                Ok(n) => tracing::info!(clients = n, "SIGHUP: S3 client credentials read again"),
                Err(e) => {
                    tracing::error!(error = %e, "SIGHUP: S3 client credentials not reloaded; the ones in force stay")
                }
            }
        }
        for (listener, cert) in &self.live.certs {
            match cert.reload() {
                Ok(()) => {
                    tracing::info!(listener, cert = %cert.cert_path().display(), "SIGHUP: certificate read again; new connections get it")
                }
                Err(e) => {
                    tracing::error!(listener, error = %e, "SIGHUP: certificate not reloaded; the one in force stays: fix the files (the key must be the certificate's) and send SIGHUP again")
                }
            }
        }
        if let Some(tls) = self.live.node_tls.as_ref().filter(|tls| tls.ca_changed()) {
            tracing::warn!(ca_file = %tls.ca_path().display(), "SIGHUP: the CA file changed on disk; the CA is read at start only: restart the node to use it");
        }
        if !plan.restart.is_empty() {
            tracing::warn!(keys = %plan.restart.join(", "), "SIGHUP: these changes need a restart and are not applied");
        }
        tracing::info!(applied = %plan.apply.join(", "), "SIGHUP: config reloaded");
    }

    /// The file parsed and checked as `serve` checks it at start.
    fn read(&self) -> Result<(Config, toml::Table), crate::config::ConfigError> {
        let (config, source) = Config::load_with_source(&self.path)?;
        config_check::sources(&source, &config)?;
        let text = std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or_default();
        Ok((config, text))
    }
}

/// PURE: the dotted keys whose values differ between two parsed files (a table or array that
/// is added, removed or changed counts once, at its own key).
pub fn changed_keys(old: &toml::Table, new: &toml::Table) -> Vec<String> {
    let mut changed = Vec::new();
    diff("", old, new, &mut changed);
    changed
}

fn diff(prefix: &str, old: &toml::Table, new: &toml::Table, out: &mut Vec<String>) {
    let mut keys: Vec<&String> = old.keys().chain(new.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match (old.get(key), new.get(key)) {
            (Some(toml::Value::Table(a)), Some(toml::Value::Table(b))) => diff(&path, a, b, out),
            (a, b) if a != b => out.push(path),
            _ => {}
        }
    }
}

/// PURE: which changed keys are applied and which need a restart.
pub fn plan(changed: &[String]) -> Plan {
    let mut plan = Plan::default();
    for key in changed {
        let applied = APPLIED
            .iter()
            .any(|a| key == a || key.starts_with(&format!("{a}.")));
        if applied {
            plan.apply.push(key.clone());
        } else {
            plan.restart.push(key.clone());
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> toml::Table {
        text.parse().unwrap()
    }

    #[test]
    fn rules_and_level_apply_addresses_need_a_restart() {
        let old = table("[node]\napi = \"127.0.0.1:7070\"\n[log]\nlevel = \"info\"\n[redis]\nlisten = \"127.0.0.1:6380\"\nprotect = [{ pattern = \"a:*\", resource = \"a\" }]\n");
        let new = table("[node]\napi = \"127.0.0.1:7071\"\n[log]\nlevel = \"debug\"\n[redis]\nlisten = \"127.0.0.1:6380\"\nprotect = [{ pattern = \"a:*\", resource = \"a\" }, { pattern = \"b:*\", resource = \"b\" }]\n");
        let changed = changed_keys(&old, &new);
        assert_eq!(changed, ["log.level", "node.api", "redis.protect"]);
        assert_eq!(
            plan(&changed),
            Plan {
                apply: vec!["log.level".into(), "redis.protect".into()],
                restart: vec!["node.api".into()],
            }
        );
        assert!(changed_keys(&old, &old).is_empty());
    }

    #[test]
    fn a_removed_section_needs_a_restart() {
        let old = table("[node]\n[s3]\nlisten = \"127.0.0.1:9000\"\n");
        let new = table("[node]\n");
        assert_eq!(plan(&changed_keys(&old, &new)).restart, ["s3"]);
    }
}
