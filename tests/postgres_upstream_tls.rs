//! Issue 11: TLS from the PostgreSQL gateway to its upstream, `upstream_tls = "verify-full"`:
//! the server's certificate chain and host name are verified, against a real PostgreSQL
//! started with `ssl=on` and a test CA.

mod support;

use std::path::Path;
use std::sync::Arc;

use fencegate_core::{MemoryAuditSink, TokenPolicy};
use fencegate_postgres::{Gateway, PostgresConfig, UpstreamTls};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
use support::postgres_server::{cli, code, connect, PgGateway, PgServer};

/// A CA: its certificate (PEM) and what signs with it.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Self { cert, key }
    }

    /// A server certificate for `hosts` and its key, PEM.
    fn server(&self, hosts: &[&str]) -> (String, String) {
        let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        let mut params = CertificateParams::new(hosts).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "test postgres");
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn write(&self, path: &Path) {
        std::fs::write(path, self.cert.pem()).unwrap();
    }
}

/// An in-process gateway to `upstream` with verify-full and `ca_file`; returns a DSN to it.
async fn verifying_gateway(upstream: String, ca_file: &Path) -> String {
    let config = PostgresConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream,
        upstream_tls: UpstreamTls::VerifyFull,
        upstream_ca_file: Some(ca_file.to_owned()),
        resource: Some("job".into()),
        ..PostgresConfig::default()
    };
    let gateway = Gateway::new(
        config,
        TokenPolicy::unsigned(),
        Arc::new(MemoryAuditSink::default()),
    )
    .unwrap();
    let listener = gateway.bind().await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(gateway.serve(listener));
    format!("host=127.0.0.1 port={port} user=postgres dbname=postgres")
}

/// The message a login through `dsn` fails with.
async fn login_error(dsn: &str) -> String {
    match tokio_postgres::connect(dsn, tokio_postgres::NoTls).await {
        Ok(_) => panic!("the login through {dsn} succeeded"),
        Err(e) => e
            .as_db_error()
            .map(|d| format!("{} {}", d.code().code(), d.message()))
            .unwrap_or_else(|| e.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn fenced_writes_go_over_verified_tls_and_a_wrong_certificate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test upstream CA");
    let other = Ca::new("another CA");
    let (cert, key) = ca.server(&["127.0.0.1"]);
    let ca_file = dir.path().join("ca.pem");
    let other_file = dir.path().join("other.pem");
    ca.write(&ca_file);
    other.write(&other_file);

    let pg = PgServer::start_tls(&cert, &key);
    let gw = PgGateway::install_and_start_on(
        pg,
        &format!(
            "upstream_tls = \"verify-full\"\nupstream_ca_file = \"{}\"",
            ca_file.display()
        ),
        &[],
    );
    gw.pg.psql_as(
        "postgres",
        "CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL)",
    );
    // The tools take libpq's TLS options in the DSN, verified the same way.
    let tls_dsn = |ca: &Path| {
        format!(
            "{} sslmode=verify-full sslrootcert='{}'",
            gw.pg.dsn("postgres"),
            ca.display()
        )
    };
    let (c, out, err) = cli(&[
        "postgres",
        "protect",
        "--dsn",
        &tls_dsn(&ca_file),
        "--table",
        "items",
    ]);
    assert_eq!(c, 0, "{out}{err}");
    let (c, out, err) = cli(&["postgres", "status", "--dsn", &tls_dsn(&other_file)]);
    assert_ne!(c, 0, "{out}{err}");
    assert!(err.contains("UnknownIssuer"), "{err}");
    let direct = connect(&gw.pg.dsn("postgres")).await;

    // A fenced write through the gateway commits, and the session upstream is TLS.
    let holder = connect(&format!(
        "{} options='-c fencegate.token=fg1~5~job'",
        gw.dsn("postgres")
    ))
    .await;
    let ssl: bool = holder
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl, "the gateway's upstream session is not TLS");
    holder
        .execute("INSERT INTO items VALUES (1, 1)", &[])
        .await
        .unwrap();
    // Still fenced: a tokenless write over the same TLS upstream is refused.
    let tokenless = connect(&gw.dsn("postgres")).await;
    let e = tokenless
        .execute("INSERT INTO items VALUES (2, 2)", &[])
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    let ids: Vec<i32> = direct
        .query("SELECT id FROM items ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, vec![1]);

    // A server certificate from another CA than the configured one: refused, naming the
    // settings.
    let dsn = verifying_gateway(gw.pg.addr().to_string(), &other_file).await;
    let e = login_error(&dsn).await;
    assert!(e.starts_with("08006 "), "{e}");
    assert!(e.contains("upstream_tls = \"verify-full\""), "{e}");
    assert!(e.contains("upstream_ca_file"), "{e}");
    assert!(e.contains("UnknownIssuer"), "{e}");

    // The right CA, but the certificate does not name the host the gateway connects to.
    let dsn = verifying_gateway(format!("localhost:{}", gw.pg.port), &ca_file).await;
    let e = login_error(&dsn).await;
    assert!(e.contains("upstream_tls = \"verify-full\""), "{e}");
    assert!(e.contains("NotValidForName"), "{e}");

    // Nothing was written by the refused sessions.
    let n: i64 = direct
        .query_one("SELECT count(*) FROM items", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
}

/// verify-full never falls back to plain TCP: a server without TLS is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_server_without_tls_is_refused_under_verify_full() {
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    Ca::new("test upstream CA").write(&ca_file);
    let pg = PgServer::start();
    let dsn = verifying_gateway(pg.addr().to_string(), &ca_file).await;
    let e = login_error(&dsn).await;
    assert!(e.contains("does not accept TLS"), "{e}");
    assert!(e.contains("upstream_tls"), "{e}");
}
