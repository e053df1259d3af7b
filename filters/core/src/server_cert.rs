//! A TLS server certificate that can be replaced while the listener runs: SIGHUP reads the
//! certificate and key files again and, once the pair is known to be good, swaps it in. New
//! handshakes present the new certificate; connections already open keep theirs (a TLS
//! session never looks at its certificate again after the handshake).
//!
//! `arc-swap` rather than a `RwLock`: every handshake reads the certificate, a reload writes it
//! perhaps once a month; a lock-free load never makes a handshake wait behind a reload, and
//! there is no lock poisoning to handle on a path that must not fail.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::client::ResolvesClientCert;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::SignatureScheme;

use crate::tls::TlsSetupError;

/// A certificate chain and its private key, read from two PEM files, replaceable with
/// [`ServerCert::reload`]. It resolves the server side of a handshake (and the client side, for
/// a node that presents the same certificate to its peers).
#[derive(Debug)]
pub struct ServerCert {
    cert: PathBuf,
    key: PathBuf,
    /// The settings that name the files, for error messages (`tls_cert`, `security.cert_file`).
    settings: [&'static str; 2],
    current: ArcSwap<CertifiedKey>,
}

impl ServerCert {
    /// Reads a gateway's `tls_cert` (the chain, leaf first) and `tls_key` (PKCS#8, PKCS#1 or
    /// SEC1), both PEM, and checks that the key belongs to the certificate.
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<Self>, TlsSetupError> {
        Self::load_named(["tls_cert", "tls_key"], cert, key)
    }

    /// [`ServerCert::load`] for files that other settings name (errors say `settings`).
    pub fn load_named(
        settings: [&'static str; 2],
        cert: &Path,
        key: &Path,
    ) -> Result<Arc<Self>, TlsSetupError> {
        let pair = read_pair(settings, cert, key)?;
        Ok(Arc::new(Self {
            cert: cert.to_owned(),
            key: key.to_owned(),
            settings,
            current: ArcSwap::from_pointee(pair),
        }))
    }

    /// Reads both files again from the same paths; only a readable pair whose key matches its
    /// certificate replaces the one in force. On error the one in force stays.
    pub fn reload(&self) -> Result<(), TlsSetupError> {
        let pair = read_pair(self.settings, &self.cert, &self.key)?;
        self.current.store(Arc::new(pair));
        Ok(())
    }

    /// The certificate file (for logs).
    pub fn cert_path(&self) -> &Path {
        &self.cert
    }

    /// The certificate and key new handshakes use.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current.load_full()
    }
}

impl ResolvesServerCert for ServerCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl ResolvesClientCert for ServerCert {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

fn bad(what: &str, path: &Path, e: &dyn std::fmt::Display) -> TlsSetupError {
    TlsSetupError::new(format!("{what} {}: {e}", path.display()))
}

/// The pair, checked as rustls checks `with_single_cert` at start: the key parses with the ring
/// provider and its public half is the certificate's.
fn read_pair(
    [cert_setting, key_setting]: [&'static str; 2],
    cert: &Path,
    key: &Path,
) -> Result<CertifiedKey, TlsSetupError> {
    let chain = crate::tls::read_certs(cert_setting, cert)?;
    let file = std::fs::File::open(key).map_err(|e| bad(key_setting, key, &e))?;
    let key_der = rustls_pemfile::private_key(&mut io::BufReader::new(file))
        .map_err(|e| bad(key_setting, key, &e))?
        .ok_or_else(|| bad(key_setting, key, &"no PEM private key in the file"))?;
    CertifiedKey::from_der(chain, key_der, &rustls::crypto::ring::default_provider()).map_err(
        |e| match e {
            rustls::Error::InconsistentKeys(_) => TlsSetupError::new(format!(
                "{key_setting} {} is not the key of {cert_setting} {} (they must be replaced together)",
                key.display(),
                cert.display()
            )),
            e => bad(key_setting, key, &e),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A throwaway self-signed certificate and its key, PEM.
    fn pair(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn write(dir: &Path, cert: &str, key: &str) -> (PathBuf, PathBuf) {
        let (c, k) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&c, cert).unwrap();
        std::fs::write(&k, key).unwrap();
        (c, k)
    }

    #[test]
    fn a_good_pair_replaces_the_one_in_force_a_bad_one_never_does() {
        let dir = tempfile::tempdir().unwrap();
        let ((cert_a, key_a), (cert_b, key_b)) = (pair("a.test"), pair("b.test"));
        let (c, k) = write(dir.path(), &cert_a, &key_a);
        let live = ServerCert::load(&c, &k).unwrap();
        let first = live.current().cert[0].clone();

        // A mismatched pair is refused, naming both files; the first stays.
        write(dir.path(), &cert_b, &key_a);
        let e = live.reload().unwrap_err().to_string();
        assert!(e.contains("is not the key of tls_cert"), "{e}");
        assert_eq!(live.current().cert[0], first);
        // A key file with no key in it: the same.
        write(dir.path(), &cert_b, "not a key\n");
        let e = live.reload().unwrap_err().to_string();
        assert!(e.contains("no PEM private key"), "{e}");
        assert_eq!(live.current().cert[0], first);

        write(dir.path(), &cert_b, &key_b);
        live.reload().unwrap();
        assert_ne!(live.current().cert[0], first);
    }
}
