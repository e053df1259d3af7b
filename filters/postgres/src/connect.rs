//! Connections for the tools (`install`, `protect`, `status`): libpq's password sources
//! (`PGPASSWORD`, then `PGPASSFILE` or `~/.pgpass`), which tokio-postgres does not read itself.

use std::path::PathBuf;

use tokio::task::JoinHandle;
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::{Client, Config, NoTls};

use crate::error::PostgresError;

/// Connects to `dsn`; returns the client and the task driving its connection. With
/// `sslmode=require`, `verify-ca` or `verify-full` the connection is TLS with the server's
/// chain and host name verified (see [`crate::dsn_tls`]); otherwise plain.
pub async fn connect(dsn: &str) -> Result<(Client, JoinHandle<()>), PostgresError> {
    let tls = crate::dsn_tls::split(dsn);
    let mut config: Config = tls.dsn.parse().map_err(|e| {
        PostgresError::Config(format!(
            "the DSN is not a libpq connection string or URL: {e}"
        ))
    })?;
    if config.get_password().is_none() {
        if let Some(password) = password_for(&config) {
            config.password(password);
        }
    }
    let connected = if config.get_ssl_mode() == SslMode::Require {
        let connector = crate::dsn_tls::connector(tls.root_cert.as_deref())?;
        config
            .connect(connector)
            .await
            .map(|(client, connection)| (client, tokio::spawn(drive(connection))))
    } else {
        config
            .connect(NoTls)
            .await
            .map(|(client, connection)| (client, tokio::spawn(drive(connection))))
    };
    let (client, task) = connected.map_err(|e| {
        if e.to_string().contains("password missing") {
            PostgresError::Config(format!(
                "the server wants a password for user {}: put it in the DSN, PGPASSWORD or ~/.pgpass",
                config.get_user().unwrap_or("(none)")
            ))
        } else {
            PostgresError::Install(e)
        }
    })?;
    Ok((client, task))
}

async fn drive<F: std::future::Future<Output = Result<(), tokio_postgres::Error>>>(connection: F) {
    if let Err(e) = connection.await {
        tracing::warn!(error = %e, "tool connection ended with an error");
    }
}

/// `PGPASSWORD`, else the first matching `~/.pgpass` line.
fn password_for(config: &Config) -> Option<Vec<u8>> {
    if let Ok(password) = std::env::var("PGPASSWORD") {
        return Some(password.into_bytes());
    }
    let file = std::env::var_os("PGPASSFILE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pgpass")))?;
    let text = std::fs::read_to_string(file).ok()?;
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(Host::Unix(_)) | None => "localhost".to_owned(),
        #[cfg(not(unix))]
        None => "localhost".to_owned(),
    };
    let port = config
        .get_ports()
        .first()
        .copied()
        .unwrap_or(5432)
        .to_string();
    let user = config.get_user().unwrap_or_default().to_owned();
    let dbname = config.get_dbname().unwrap_or(&user).to_owned();
    pgpass_lookup(&text, [&host, &port, &dbname, &user]).map(String::into_bytes)
}

/// Finds the password in `.pgpass` text for `[host, port, database, user]` (`*` matches any
/// value; `\:` and `\\` are escapes), as libpq does.
pub fn pgpass_lookup(text: &str, wanted: [&str; 4]) -> Option<String> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .find_map(|line| {
            let fields = split_pgpass(line);
            if fields.len() < 5 {
                return None;
            }
            let matches = fields[..4]
                .iter()
                .zip(wanted)
                .all(|(f, w)| f == "*" || f == w);
            matches.then(|| fields[4..].join(":"))
        })
}

fn split_pgpass(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    fields.last_mut().expect("never empty").push(n);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut().expect("never empty").push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pgpass_matches_like_libpq() {
        let text = "# comment\nother:5432:*:u:nope\n127.0.0.1:*:app:u:pa\\:ss\n*:*:*:*:fallback\n";
        assert_eq!(
            pgpass_lookup(text, ["127.0.0.1", "5433", "app", "u"]).as_deref(),
            Some("pa:ss")
        );
        assert_eq!(
            pgpass_lookup(text, ["h", "1", "d", "x"]).as_deref(),
            Some("fallback")
        );
        assert_eq!(pgpass_lookup("short:line", ["a", "b", "c", "d"]), None);
    }
}
