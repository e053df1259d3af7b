//! The connection to the upstream server: plain TCP, or TLS with the certificate chain and the
//! host name verified (`upstream_tls = "verify-full"`, as libpq's `sslmode=verify-full`).

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use crate::config::{PostgresConfig, UpstreamTls};
use crate::error::PostgresError;
use fencegate_core::stream::MaybeTls;

/// An upstream connection.
pub type UpstreamStream = MaybeTls<TcpStream, Box<TlsStream<TcpStream>>>;

/// The reading half of an [`UpstreamStream`] ([`fencegate_core::stream::split`]).
pub type UpstreamRead = fencegate_core::stream::ReadHalf<Box<TlsStream<TcpStream>>>;

/// The writing half of an [`UpstreamStream`].
pub type UpstreamWrite = fencegate_core::stream::WriteHalf<Box<TlsStream<TcpStream>>>;

/// `SSLRequest`: length 8, code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// How the gateway connects upstream; built once, when the gateway starts.
pub struct Upstream {
    addr: String,
    tls: Option<(TlsConnector, ServerName<'static>)>,
    /// Names the settings in errors, so the operator knows what to change.
    settings: String,
}

impl Upstream {
    /// From the `[postgres]` section: reads `upstream_ca_file` (or the system's roots) now,
    /// so a bad file stops the start instead of every session.
    pub fn new(config: &PostgresConfig) -> Result<Self, PostgresError> {
        let addr = config.upstream.clone();
        if config.upstream_tls == UpstreamTls::Disable {
            return Ok(Self {
                addr,
                tls: None,
                settings: String::new(),
            });
        }
        let client = fencegate_core::tls::client_config(config.upstream_ca_file.as_deref())
            .map_err(|e| PostgresError::Config(format!("upstream_tls = \"verify-full\": {e}")))?;
        let host = host_of(&addr);
        let name = ServerName::try_from(host.to_owned()).map_err(|e| {
            PostgresError::Config(format!(
                "upstream {addr:?}: {host:?} is not a host name or IP address to verify the server's certificate against: {e}"
            ))
        })?;
        let settings = match &config.upstream_ca_file {
            Some(path) => format!(
                "upstream_tls = \"verify-full\", upstream_ca_file = {:?}",
                path.display().to_string()
            ),
            None => "upstream_tls = \"verify-full\", the system's root certificates (no upstream_ca_file)"
                .to_owned(),
        };
        Ok(Self {
            addr,
            tls: Some((TlsConnector::from(client), name)),
            settings,
        })
    }

    /// Connects, and with TLS configured asks the server for TLS and verifies its certificate;
    /// a server that refuses TLS is an error (never a plain fallback).
    pub async fn connect(&self) -> Result<UpstreamStream, PostgresError> {
        let mut tcp = TcpStream::connect(&self.addr)
            .await
            .map_err(PostgresError::io(format!(
                "connecting to the upstream server {}",
                self.addr
            )))?;
        let _ = tcp.set_nodelay(true);
        let Some((connector, name)) = &self.tls else {
            return Ok(MaybeTls::Plain(tcp));
        };
        let refused = |what: String| PostgresError::UpstreamTls {
            upstream: self.addr.clone(),
            settings: self.settings.clone(),
            what,
        };
        tcp.write_all(&SSL_REQUEST)
            .await
            .map_err(|e| refused(format!("sending SSLRequest: {e}")))?;
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer)
            .await
            .map_err(|e| refused(format!("reading the answer to SSLRequest: {e}")))?;
        if answer[0] != b'S' {
            return Err(refused(
                "the server does not accept TLS (enable ssl on the server, or set upstream_tls = \"disable\")"
                    .to_owned(),
            ));
        }
        let tls = connector
            .connect(name.clone(), tcp)
            .await
            .map_err(|e| refused(describe(&e)))?;
        Ok(MaybeTls::Tls(Box::new(tls)))
    }
}

/// The host part of `host:port` (`[v6]:port` too), as the name the certificate must hold.
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// What a handshake error means, in words an operator can act on.
fn describe(e: &io::Error) -> String {
    let inner = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
    match inner {
        Some(rustls::Error::InvalidCertificate(why)) => {
            format!("the server's certificate is not accepted: {why:?}")
        }
        _ => format!("the TLS handshake failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_is_the_name_verified() {
        assert_eq!(host_of("db.example.com:5432"), "db.example.com");
        assert_eq!(host_of("127.0.0.1:5432"), "127.0.0.1");
        assert_eq!(host_of("[::1]:5432"), "::1");
        assert_eq!(host_of("db"), "db");
    }
}
