//! TLS settings every gateway builds the same way, once: a server config from the section's
//! `tls_cert`/`tls_key` (the client side) and a client config that trusts a CA file or the
//! system roots (the upstream side). rustls with the ring provider (no C build).

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use thiserror::Error;

/// A TLS setting that cannot be used; the message names the setting and the file.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct TlsSetupError(String);

fn bad(what: &str, path: &Path, e: &dyn std::fmt::Display) -> TlsSetupError {
    TlsSetupError(format!("{what} {}: {e}", path.display()))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let file = std::fs::File::open(path).map_err(|e| bad(what, path, &e))?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut io::BufReader::new(file))
        .collect::<Result<_, _>>()
        .map_err(|e| bad(what, path, &e))?;
    if certs.is_empty() {
        return Err(bad(what, path, &"no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The server side: `cert` holds the chain (leaf first), `key` the private key (PKCS#8, PKCS#1
/// or SEC1), both PEM. No client certificates are asked for.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsSetupError> {
    let certs = read_certs("tls_cert", cert)?;
    let file = std::fs::File::open(key).map_err(|e| bad("tls_key", key, &e))?;
    let key_der = rustls_pemfile::private_key(&mut io::BufReader::new(file))
        .map_err(|e| bad("tls_key", key, &e))?
        .ok_or_else(|| bad("tls_key", key, &"no PEM private key in the file"))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)
        .map_err(|e| TlsSetupError(format!("TLS certificate and key: {e}")))?;
    Ok(Arc::new(config))
}

/// The client side: trusts the certificates in `ca_file` (PEM), or the system's roots when
/// there is none; the server's name is checked against its certificate by the caller's
/// connector.
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, TlsSetupError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in read_certs("upstream_ca_file", path)? {
                roots
                    .add(cert)
                    .map_err(|e| bad("upstream_ca_file", path, &e))?;
            }
        }
        None => {
            // Unreadable system certificates are skipped; none at all is an error.
            let native = rustls_native_certs::load_native_certs()
                .map_err(|e| TlsSetupError(format!("reading the system's CA certificates: {e}")))?;
            let (added, _) = roots.add_parsable_certificates(native);
            if added == 0 {
                return Err(TlsSetupError(
                    "the system has no CA certificates to verify the upstream with; set upstream_ca_file".into(),
                ));
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
