//! TLS on both hops: the client side is terminated with the section's `tls_cert`/`tls_key`;
//! the upstream side is on when `upstream` is `rediss://host:port`, verified against
//! `upstream_ca_file` (or the system's roots) with the host checked against the certificate.
//! The settings themselves are built by `fencegate_core::tls`, as for the other gateways.

use std::sync::Arc;

use fencegate_core::ServerCert;
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::config::RedisConfig;
use crate::error::RedisError;
use crate::stream::Connection;

/// Where the upstream is, as `upstream` names it: `host:port`, `redis://host:port` or
/// `rediss://host:port` (TLS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTarget {
    /// `host:port`, for connecting and for messages.
    pub addr: String,
    /// The host alone: the name checked against the server's certificate.
    pub host: String,
    /// `rediss://`.
    pub tls: bool,
}

impl UpstreamTarget {
    /// Parses the `upstream` setting.
    pub fn parse(upstream: &str) -> Result<Self, String> {
        let (tls, rest) = if let Some(rest) = upstream.strip_prefix("rediss://") {
            (true, rest)
        } else if let Some(rest) = upstream.strip_prefix("redis://") {
            (false, rest)
        } else if upstream.contains("://") {
            return Err(format!(
                "upstream {upstream:?}: expected host:port, redis://host:port or rediss://host:port (TLS)"
            ));
        } else {
            (false, upstream)
        };
        let addr = rest.trim_end_matches('/');
        let bad = || {
            format!("upstream {upstream:?}: expected host:port, redis://host:port or rediss://host:port (TLS)")
        };
        let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
        if host.is_empty() || port.parse::<u16>().is_err() || addr.contains(['/', '@']) {
            return Err(bad());
        }
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        Ok(Self {
            addr: addr.to_owned(),
            host,
            tls,
        })
    }
}

/// The upstream: where it is and, with TLS, how to verify it.
pub struct Upstream {
    /// Where it is.
    pub target: UpstreamTarget,
    connector: Option<(TlsConnector, ServerName<'static>)>,
}

impl Upstream {
    /// From the config; reads `upstream_ca_file` (or the system roots) when TLS is on.
    pub fn load(config: &RedisConfig) -> Result<Self, RedisError> {
        let target = UpstreamTarget::parse(&config.upstream).map_err(RedisError::Config)?;
        let connector = if target.tls {
            let settings = fencegate_core::tls::client_config(config.upstream_ca_file.as_deref())
                .map_err(|e| RedisError::Config(e.to_string()))?;
            let name = ServerName::try_from(target.host.clone()).map_err(|e| {
                RedisError::Config(format!(
                    "upstream host {:?} is not a DNS name or IP address: {e}",
                    target.host
                ))
            })?;
            Some((TlsConnector::from(settings), name))
        } else {
            None
        };
        Ok(Self { target, connector })
    }

    /// Opens a connection (TLS handshake included when on); not yet authenticated.
    pub async fn open(&self) -> Result<Connection, RedisError> {
        let addr = &self.target.addr;
        let stream = TcpStream::connect(addr)
            .await
            .map_err(RedisError::io(format!("connecting to upstream {addr}")))?;
        stream.set_nodelay(true).ok();
        let Some((connector, name)) = &self.connector else {
            return Ok(Connection::Plain(stream));
        };
        let tls = connector
            .connect(name.clone(), stream)
            .await
            .map_err(RedisError::io(format!(
                "TLS handshake with upstream {addr} (its certificate must be signed by upstream_ca_file, or the system's roots without it, and name host {})",
                self.target.host
            )))?;
        Ok(Connection::Tls(Box::new(tls)))
    }
}

/// The client side's acceptor, when `tls_cert` and `tls_key` are set, and the certificate it
/// presents (which SIGHUP replaces).
pub fn acceptor(
    config: &RedisConfig,
) -> Result<Option<(TlsAcceptor, Arc<ServerCert>)>, RedisError> {
    let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) else {
        return Ok(None);
    };
    let config_err = |e: fencegate_core::tls::TlsSetupError| RedisError::Config(e.to_string());
    let cert = ServerCert::load(cert, key).map_err(config_err)?;
    let settings = fencegate_core::tls::server_config(&cert).map_err(config_err)?;
    Ok(Some((TlsAcceptor::from(settings), cert)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_forms() {
        let t = UpstreamTarget::parse("127.0.0.1:6379").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.host.as_str(), t.tls),
            ("127.0.0.1:6379", "127.0.0.1", false)
        );
        let t = UpstreamTarget::parse("redis://cache:6379/").unwrap();
        assert_eq!((t.addr.as_str(), t.tls), ("cache:6379", false));
        let t = UpstreamTarget::parse("rediss://redis.internal:6380").unwrap();
        assert_eq!((t.host.as_str(), t.tls), ("redis.internal", true));
        let t = UpstreamTarget::parse("rediss://[::1]:6380").unwrap();
        assert_eq!(t.host, "::1");
        for bad in [
            "cache",
            "http://cache:6379",
            "rediss://cache",
            "rediss://u:p@cache:6379",
            "redis://cache:6379/2",
            ":6379",
        ] {
            assert!(UpstreamTarget::parse(bad).is_err(), "{bad}");
        }
    }
}
