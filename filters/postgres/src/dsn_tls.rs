//! TLS for the tools' connections (`install`, `protect`, `status`, `sync-keys`), from libpq's
//! `sslmode` and `sslrootcert` in the DSN. tokio-postgres parses `sslmode` up to `require`
//! only, and no `sslrootcert`: [`split`] takes them out of the DSN first.
//!
//! `require`, `verify-ca` and `verify-full` all verify the server's chain and host name with
//! rustls (stricter than libpq's `require`, which checks nothing without a root certificate);
//! the roots are `sslrootcert`, else `PGSSLROOTCERT`, else `~/.postgresql/root.crt` if it
//! exists, else the system's (`sslrootcert=system` too). `prefer` (the default) and `disable`
//! connect without TLS, as before.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
use tokio_rustls::rustls::pki_types::{InvalidDnsNameError, ServerName};
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::TlsConnector;

use crate::error::PostgresError;

/// A DSN with the TLS options tokio-postgres does not parse taken out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DsnTls {
    /// The DSN for tokio-postgres (`sslmode=verify-*` became `require`).
    pub dsn: String,
    /// `sslrootcert`, if given.
    pub root_cert: Option<String>,
}

/// Takes `sslmode=verify-ca|verify-full` (made `require`) and `sslrootcert` out of a key/value
/// or URL DSN.
pub fn split(dsn: &str) -> DsnTls {
    let mut root_cert = None;
    let mut take = |key: &str, value: &str| -> Option<String> {
        match (key, value) {
            ("sslmode", "verify-ca" | "verify-full") => Some("require".to_owned()),
            ("sslrootcert", v) => {
                root_cert = Some(v.to_owned());
                Some(String::new())
            }
            _ => None,
        }
    };
    let trimmed = dsn.trim();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let Some((base, query)) = trimmed.split_once('?') else {
            return DsnTls {
                dsn: dsn.to_owned(),
                root_cert: None,
            };
        };
        let kept: Vec<String> = query
            .split('&')
            .filter_map(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                match take(k, &percent_decode(v)) {
                    None => Some(pair.to_owned()),
                    Some(v) if v.is_empty() => None,
                    Some(v) => Some(format!("{k}={v}")),
                }
            })
            .collect();
        let dsn = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return DsnTls { dsn, root_cert };
    }
    let mut kept = Vec::new();
    for (key, value, raw) in key_values(dsn) {
        match take(&key, &value) {
            None => kept.push(raw),
            Some(v) if v.is_empty() => {}
            Some(v) => kept.push(format!("{key}={v}")),
        }
    }
    DsnTls {
        dsn: kept.join(" "),
        root_cert,
    }
}

/// `key=value` pairs of a libpq key/value string (values may be single-quoted with `\`
/// escapes; spaces around `=` are allowed), each with its text as written.
fn key_values(dsn: &str) -> Vec<(String, String, String)> {
    let b = dsn.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let skip_space = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    loop {
        skip_space(&mut i);
        if i >= b.len() {
            return out;
        }
        let start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = dsn[start..i].to_owned();
        skip_space(&mut i);
        if i >= b.len() || b[i] != b'=' {
            // Not a pair: kept as written for tokio-postgres to judge.
            out.push((key.clone(), String::new(), key));
            continue;
        }
        i += 1;
        skip_space(&mut i);
        let mut value = String::new();
        if i < b.len() && b[i] == b'\'' {
            i += 1;
            let mut chars = dsn[i..].char_indices();
            let mut end = dsn.len() - i;
            while let Some((at, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            value.push(n);
                        }
                    }
                    '\'' => {
                        end = at + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            i += end;
        } else {
            let from = i;
            while i < b.len() && !b[i].is_ascii_whitespace() {
                i += 1;
            }
            value = dsn[from..i].to_owned();
        }
        out.push((key, value, dsn[start..i].to_owned()));
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The roots for a tool connection: `sslrootcert`, `PGSSLROOTCERT`, `~/.postgresql/root.crt`,
/// or the system's.
pub fn connector(root_cert: Option<&str>) -> Result<RustlsConnect, PostgresError> {
    let from_env = std::env::var("PGSSLROOTCERT").ok();
    let default = std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".postgresql/root.crt"))
        .filter(|p| p.exists());
    let file: Option<PathBuf> = match root_cert.or(from_env.as_deref()) {
        Some("system") => None,
        Some(path) => Some(PathBuf::from(path)),
        None => default,
    };
    let config = fencegate_core::tls::client_config_named("sslrootcert", file.as_deref())
        .map_err(|e| PostgresError::Config(format!("TLS for the DSN's sslmode: {e}")))?;
    Ok(RustlsConnect { config })
}

/// tokio-postgres's TLS hook over rustls: the server's chain and host name are verified.
#[derive(Clone)]
pub struct RustlsConnect {
    config: Arc<ClientConfig>,
}

impl<S> MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnectOne;
    type Error = InvalidDnsNameError;

    fn make_tls_connect(&mut self, host: &str) -> Result<RustlsConnectOne, InvalidDnsNameError> {
        Ok(RustlsConnectOne {
            connector: TlsConnector::from(self.config.clone()),
            name: ServerName::try_from(host.to_owned())?,
        })
    }
}

/// One connection's handshake.
pub struct RustlsConnectOne {
    connector: TlsConnector,
    name: ServerName<'static>,
}

impl<S> TlsConnect<S> for RustlsConnectOne
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let tls = self.connector.connect(self.name, stream).await?;
            Ok(RustlsStream(Box::new(tls)))
        })
    }
}

/// A tool connection's TLS stream.
pub struct RustlsStream<S>(Box<tokio_rustls::client::TlsStream<S>>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(self.get_mut().0.as_mut()).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.get_mut().0.as_mut()).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.get_mut().0.as_mut()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.get_mut().0.as_mut()).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    /// No SCRAM channel binding: tokio-postgres then uses plain SCRAM (its default `prefer`).
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_modes_and_root_certs_are_taken_out() {
        let s = split("host=db port=5432 sslmode=verify-full sslrootcert='/etc/my ca.pem' user=u");
        assert_eq!(s.dsn, "host=db port=5432 sslmode=require user=u");
        assert_eq!(s.root_cert.as_deref(), Some("/etc/my ca.pem"));
        let s = split("host = db sslmode = verify-ca");
        assert_eq!(s.dsn, "host = db sslmode=require");
        let s = split("host=db sslmode=prefer password='a b\\'c'");
        assert_eq!(s.dsn, "host=db sslmode=prefer password='a b\\'c'");
        assert_eq!(s.root_cert, None);
        let s = split("postgresql://u@db:5432/app?sslmode=verify-full&sslrootcert=%2Fca.pem&x=1");
        assert_eq!(s.dsn, "postgresql://u@db:5432/app?sslmode=require&x=1");
        assert_eq!(s.root_cert.as_deref(), Some("/ca.pem"));
        let s = split("postgres://db/app?sslrootcert=system");
        assert_eq!(s.dsn, "postgres://db/app");
        assert_eq!(s.root_cert.as_deref(), Some("system"));
    }
}
