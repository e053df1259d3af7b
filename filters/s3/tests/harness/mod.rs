//! Shared by the S3 gateway tests: moto on a free port, the gateway in-process on another,
//! boto3 as the client.

#![allow(dead_code)]

pub use fencegate_testkit::s3_server;

use std::sync::Arc;
use std::time::Duration;

use fencegate_core::{MemoryAuditSink, TokenKey, TokenPolicy};
use fencegate_s3::{GatewayHandle, ProtectMode, ProtectRule, S3Config, S3Gateway};
use fencegate_testkit::free_port;
use s3_server::{run_client, wait_for_port, MotoServer};
use serde_json::Value;

pub const ACCESS_KEY: &str = "AKIDFENCEGATETEST";
pub const SECRET: &str = "client-secret-for-tests";
const UPSTREAM_SECRET_ENV: &str = "FENCEGATE_TEST_S3_UPSTREAM_SECRET";

/// moto + a gateway in front of it, protecting bucket `fenced` (object mode, resource `job`),
/// bucket `mixed` (`tmp/` off, `other/` for resource `other`, the rest for `job`), bucket
/// `ledger` in manifest mode (resource `job`) and leaving
/// bucket `open` unprotected.
pub struct Harness {
    pub moto: MotoServer,
    gateway: Option<GatewayHandle>,
    pub endpoint: String,
    pub audit: Arc<MemoryAuditSink>,
    config: S3Config,
    policy: TokenPolicy,
    _dir: tempfile::TempDir,
}

/// A second gateway node in front of the same store (its own audit log).
pub struct Node {
    _gateway: GatewayHandle,
    pub endpoint: String,
    pub audit: Arc<MemoryAuditSink>,
}

impl Node {
    /// Runs boto3 steps through this node.
    pub fn run(&self, steps: Value) -> Vec<Value> {
        run_client(&self.endpoint, ACCESS_KEY, SECRET, steps)
            .as_array()
            .unwrap()
            .clone()
    }
}

impl Harness {
    pub fn start() -> Self {
        Self::with_policy(TokenPolicy::unsigned())
    }

    pub fn with_key(key: &TokenKey) -> Self {
        Self::with_policy(TokenPolicy::with_key(key.clone()))
    }

    pub fn with_policy(policy: TokenPolicy) -> Self {
        Self::build(policy, false, false, |_| {})
    }

    /// The default harness with its config changed by `configure` before the gateway starts.
    pub fn with_config(configure: impl FnOnce(&mut S3Config)) -> Self {
        Self::build(TokenPolicy::unsigned(), false, false, configure)
    }

    /// The gateway's config.
    pub fn config(&self) -> S3Config {
        self.config.clone()
    }

    /// Starts another gateway node with the same config in front of the same moto.
    pub fn second_node(&self) -> Node {
        let port = free_port();
        let mut config = self.config.clone();
        config.listen = format!("127.0.0.1:{port}").parse().unwrap();
        let audit = Arc::new(MemoryAuditSink::default());
        let gateway = S3Gateway::new(config, self.policy.clone(), audit.clone())
            .expect("gateway config")
            .start()
            .expect("gateway start");
        wait_for_port(port, Duration::from_secs(10));
        Node {
            _gateway: gateway,
            endpoint: format!("http://127.0.0.1:{port}"),
            audit,
        }
    }

    /// moto serves HTTPS (a fresh self-signed certificate, given to the gateway as
    /// `upstream_ca_file`); the gateway listens on plain HTTP. Sets `S3_CA_BUNDLE` so the
    /// boto3 script trusts moto directly too.
    pub fn with_tls_upstream() -> Self {
        Self::build(TokenPolicy::unsigned(), false, true, |_| {})
    }

    /// A gateway serving HTTPS with a fresh self-signed certificate (clients trust
    /// [`Harness::ca_bundle`] through `S3_CA_BUNDLE`).
    pub fn with_tls() -> Self {
        Self::build(TokenPolicy::unsigned(), true, false, |_| {})
    }

    /// An HTTPS gateway with its config changed by `configure` before it starts.
    pub fn with_tls_config(configure: impl FnOnce(&mut S3Config)) -> Self {
        Self::build(TokenPolicy::unsigned(), true, false, configure)
    }

    /// How many requests the gateway has begun since it started.
    pub fn requests_begun(&self) -> u64 {
        self.gateway.as_ref().expect("running").requests_begun()
    }

    /// The CA certificate clients must trust (HTTPS harnesses only).
    pub fn ca_bundle(&self) -> std::path::PathBuf {
        self._dir.path().join("ca.pem")
    }

    fn build(
        policy: TokenPolicy,
        tls: bool,
        tls_upstream: bool,
        configure: impl FnOnce(&mut S3Config),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        if tls || tls_upstream {
            // A test CA and a leaf for 127.0.0.1 signed by it (rustls refuses a self-signed
            // CA certificate as a server's own).
            let d = dir.path();
            std::fs::write(
                d.join("leaf.ext"),
                "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
            )
            .unwrap();
            let openssl = |args: &[&str]| {
                let status = std::process::Command::new("openssl")
                    .args(args)
                    .current_dir(d)
                    .stderr(std::process::Stdio::null())
                    .status()
                    .expect("openssl is needed for the HTTPS tests (apt-get install openssl)");
                assert!(status.success(), "openssl {args:?}");
            };
            openssl(
                &[
                    "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                ]
                .iter()
                .chain(&[
                    "-subj",
                    "/CN=fencegate test CA",
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.pem",
                ])
                .copied()
                .collect::<Vec<_>>(),
            );
            openssl(
                &[
                    "req",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-subj",
                    "/CN=127.0.0.1",
                ]
                .iter()
                .chain(&["-keyout", "key.pem", "-out", "leaf.csr"])
                .copied()
                .collect::<Vec<_>>(),
            );
            openssl(
                &[
                    "x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                ]
                .iter()
                .chain(&[
                    "-CAcreateserial",
                    "-days",
                    "1",
                    "-extfile",
                    "leaf.ext",
                    "-out",
                    "cert.pem",
                ])
                .copied()
                .collect::<Vec<_>>(),
            );
        }
        let ca = dir.path().join("ca.pem");
        if tls_upstream {
            std::env::set_var("S3_CA_BUNDLE", &ca);
        }
        let moto = if tls_upstream {
            MotoServer::start_tls(&cert, &key)
        } else {
            MotoServer::start()
        };
        let created = moto.direct(serde_json::json!([
            {"op": "create_bucket", "bucket": "fenced"},
            {"op": "create_bucket", "bucket": "open"},
            {"op": "create_bucket", "bucket": "mixed"},
            {"op": "create_bucket", "bucket": "ledger"},
            {"op": "create_bucket", "bucket": "versioned", "versioning": true},
        ]));
        assert!(
            created.as_array().unwrap().iter().all(|r| r["ok"] == true),
            "{created}"
        );
        let clients = dir.path().join("clients");
        std::fs::write(&clients, format!("# test clients\n{ACCESS_KEY} {SECRET}\n")).unwrap();
        // The same value every time, so concurrent tests setting it agree.
        std::env::set_var(UPSTREAM_SECRET_ENV, "gateway-upstream-secret");
        let port = free_port();
        let rule = |bucket: &str, prefix: &str, mode, resource: Option<&str>| ProtectRule {
            bucket: bucket.into(),
            prefix: prefix.into(),
            mode,
            resource: resource.map(Into::into),
        };
        let mut config = S3Config {
            upstream_ca_file: tls_upstream.then(|| ca.clone()),
            tls_cert: tls.then(|| cert.clone()),
            tls_key: tls.then(|| key.clone()),
            listen: format!("127.0.0.1:{port}").parse().unwrap(),
            upstream: moto.endpoint.clone(),
            upstream_access_key: "gateway".into(),
            upstream_secret_env: UPSTREAM_SECRET_ENV.into(),
            clients_file: Some(clients),
            virtual_host_suffix: Some("s3.test".into()),
            protect: vec![
                rule("fenced", "", ProtectMode::Object, Some("job")),
                rule("versioned", "", ProtectMode::Object, Some("job")),
                // The first rule of `mixed` is off: bucket-level writes must still be refused.
                rule("mixed", "tmp/", ProtectMode::Off, None),
                rule("mixed", "other/", ProtectMode::Object, Some("other")),
                rule("mixed", "", ProtectMode::Object, Some("job")),
                rule("ledger", "", ProtectMode::Manifest, Some("job")),
            ],
            ..S3Config::default()
        };
        configure(&mut config);
        let audit = Arc::new(MemoryAuditSink::default());
        let gateway = S3Gateway::new(config.clone(), policy.clone(), audit.clone())
            .expect("gateway config")
            .start()
            .expect("gateway start");
        wait_for_port(port, Duration::from_secs(10));
        Self {
            moto,
            gateway: Some(gateway),
            endpoint: format!("{}://127.0.0.1:{port}", if tls { "https" } else { "http" }),
            audit,
            config,
            policy,
            _dir: dir,
        }
    }

    /// Runs boto3 steps through the gateway.
    pub fn run(&self, steps: Value) -> Vec<Value> {
        run_client(&self.endpoint, ACCESS_KEY, SECRET, steps)
            .as_array()
            .unwrap()
            .clone()
    }

    /// Runs boto3 steps directly against moto (inspection behind the gateway's back).
    pub fn direct(&self, steps: Value) -> Vec<Value> {
        self.moto.direct(steps).as_array().unwrap().clone()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(gateway) = self.gateway.take() {
            gateway.shutdown();
        }
    }
}

/// `fg1~<revision>~job`.
pub fn token(revision: u64) -> String {
    format!("fg1~{revision}~job")
}
