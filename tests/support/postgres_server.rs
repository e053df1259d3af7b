//! A real PostgreSQL (from `fencegate-testkit`, shared with `fencegate-chaos`) and a
//! `fencegate serve` process whose `[postgres]` gateway relays to it. Both stop on drop.

use std::path::Path;
use std::process::Command;

pub use fencegate_testkit::postgres_server::*;

use super::gateway_node::GatewayNode;

/// A `fencegate serve` node with a `[postgres]` gateway in front of its own [`PgServer`].
pub struct PgGateway {
    /// The node: its config, log and audit directory.
    pub node: GatewayNode,
    /// The upstream server (connect to it directly to check what was stored).
    pub pg: PgServer,
    /// The gateway's port on 127.0.0.1.
    pub port: u16,
}

impl PgGateway {
    /// Starts PostgreSQL, installs fence.sql with `fencegate postgres install`, then starts a
    /// node; `extra` is appended to the `[postgres]` section, `env` given to the process.
    pub fn start(extra: &str, env: &[(&str, &str)]) -> Self {
        Self::install_and_start_on(PgServer::start(), extra, env)
    }

    /// Installs fence.sql in `pg` with `fencegate postgres install`, then starts a node in
    /// front of it.
    pub fn install_and_start_on(pg: PgServer, extra: &str, env: &[(&str, &str)]) -> Self {
        let (code, out, err) = cli(&["postgres", "install", "--dsn", &pg.dsn("postgres")]);
        assert_eq!(code, 0, "fencegate postgres install failed:\n{out}\n{err}");
        Self::start_on(pg, extra, env)
    }

    /// Starts a node in front of `pg` as it is (no install step of its own).
    pub fn start_on(pg: PgServer, extra: &str, env: &[(&str, &str)]) -> Self {
        // A protecting gateway names its resource; the tests' tokens are for `job`.
        let resource = if extra.contains("resource") {
            ""
        } else {
            "resource = \"job\"\n"
        };
        let section = format!(
            "[postgres]\nlisten = \"127.0.0.1:0\"\nupstream = \"{}\"\n{resource}{extra}\n",
            pg.addr()
        );
        let mut node = GatewayNode::start(&section, env);
        let port = node.bound_port("postgres gateway listening");
        Self { node, pg, port }
    }

    /// A libpq key/value DSN for `user` through the gateway.
    pub fn dsn(&self, user: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} dbname=postgres",
            self.port
        )
    }

    /// Runs psql through the gateway with `extra` environment (e.g. `PGPASSWORD`,
    /// `PGOPTIONS`); returns (exit code, stdout, stderr).
    pub fn psql(&self, user: &str, sql: &str, env: &[(&str, &str)]) -> (i32, String, String) {
        let out = Command::new("psql")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", user])
            .args(["-d", "postgres", "-X", "-v", "ON_ERROR_STOP=1", "-Atq"])
            .args(["-c", sql])
            .envs(env.iter().copied())
            .output()
            .expect("run psql");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The node's stderr so far.
    pub fn log_text(&self) -> String {
        self.node.log_text()
    }

    /// Every audit record written so far, parsed.
    pub fn audit_records(&self) -> Vec<serde_json::Value> {
        self.node.audit_records()
    }

    /// The temp dir holding config, data and logs.
    pub fn dir(&self) -> &Path {
        self.node.dir.path()
    }
}

/// Runs `fencegate` with `args`; returns (exit code, stdout, stderr).
pub fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(args)
        .output()
        .expect("run fencegate");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `fencegate postgres install --dsn <dsn> --enforce <enforce>`; returns (exit code, stdout,
/// stderr).
pub fn install_enforce(dsn: &str, enforce: &str) -> (i32, String, String) {
    cli(&["postgres", "install", "--dsn", dsn, "--enforce", enforce])
}

/// The language (`plpgsql`, `c`) of the function `signature` (`fencegate.guard(text)`).
pub fn function_language(pg: &PgServer, signature: &str) -> String {
    pg.psql_as(
        "postgres",
        &format!(
            "SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang \
             WHERE p.oid = '{signature}'::regprocedure"
        ),
    )
}

/// A tokio-postgres client for `dsn`, its connection driven on a task; panics if it cannot
/// connect.
pub async fn connect(dsn: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(dsn, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {dsn}: {e}"));
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// The SQLSTATE of `e`, or a text that says there was none.
pub fn code(e: &tokio_postgres::Error) -> String {
    e.code()
        .map(|c| c.code().to_owned())
        .unwrap_or_else(|| format!("no SQLSTATE: {e}"))
}

/// One frontend message of the wire protocol: its tag, its length, its body.
pub fn message(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![tag];
    m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
    m.extend_from_slice(body);
    m
}

/// Parse (unnamed), Bind, Execute of `sql`, for raw extended-protocol pipelines.
pub fn statement(sql: &str) -> Vec<u8> {
    let mut parse = b"\0".to_vec();
    parse.extend_from_slice(sql.as_bytes());
    parse.extend_from_slice(b"\0\0\0");
    let mut out = message(b'P', &parse);
    out.extend(message(b'B', b"\0\0\0\0\0\0\0\0"));
    out.extend(message(b'E', b"\0\0\0\0\0"));
    out
}
