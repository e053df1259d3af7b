//! TLS settings every gateway builds the same way, once: a server config that presents the
//! section's `tls_cert`/`tls_key` (the client side; a [`ServerCert`] that SIGHUP can replace)
//! and a client config that trusts a CA file or the system roots (the upstream side). rustls
//! with the ring provider (no C build).

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;

use crate::ServerCert;
use thiserror::Error;

/// A TLS setting that cannot be used; the message names the setting and the file.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct TlsSetupError(String);

impl TlsSetupError {
    pub(crate) fn new(message: String) -> Self {
        Self(message)
    }
}

fn bad(what: &str, path: &Path, e: &dyn std::fmt::Display) -> TlsSetupError {
    TlsSetupError(format!("{what} {}: {e}", path.display()))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(crate) fn read_certs(
    what: &str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let file = std::fs::File::open(path).map_err(|e| bad(what, path, &e))?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut io::BufReader::new(file))
        .collect::<Result<_, _>>()
        .map_err(|e| bad(what, path, &e))?;
    if certs.is_empty() {
        return Err(bad(what, path, &"no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The server side: presents `cert` (the one in force at each handshake). No client
/// certificates are asked for.
pub fn server_config(cert: &Arc<ServerCert>) -> Result<Arc<rustls::ServerConfig>, TlsSetupError> {
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_cert_resolver(cert.clone());
    Ok(Arc::new(config))
}

/// The client side: trusts the certificates in `ca_file` (PEM), or the system's roots when
/// there is none; the server's name is checked against its certificate by the caller's
/// connector.
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, TlsSetupError> {
    client_config_named("upstream_ca_file", ca_file)
}

/// [`client_config`] for a CA file that another setting names (errors say `setting`), e.g.
/// libpq's `sslrootcert` in the PostgreSQL tools' DSNs.
pub fn client_config_named(
    setting: &str,
    ca_file: Option<&Path>,
) -> Result<Arc<rustls::ClientConfig>, TlsSetupError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in read_certs(setting, path)? {
                roots.add(cert).map_err(|e| bad(setting, path, &e))?;
            }
        }
        None => {
            // Unreadable system certificates are skipped; none at all is an error.
            let native = rustls_native_certs::load_native_certs()
                .map_err(|e| TlsSetupError(format!("reading the system's CA certificates: {e}")))?;
            let (added, _) = roots.add_parsable_certificates(native);
            if added == 0 {
                return Err(TlsSetupError(format!(
                    "the system has no CA certificates to verify the server with; set {setting}"
                )));
            }
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
