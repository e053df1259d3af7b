//! A real PostgreSQL (from `fencegate-testkit`, shared with `fencegate-chaos`) and a
//! `fencegate serve` process whose `[postgres]` gateway relays to it. Both stop on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

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

/// Logs in as postgres (trust) on `port` with the startup `options`, sends `bytes` at once and
/// returns the reply tags (notices and parameter reports left out) up to the ReadyForQuery of
/// its last Sync, simple Query or FunctionCall, each ReadyForQuery with its status (`Z` +
/// `I`/`T`/`E`) and each error with its SQLSTATE (`E(...)`).
pub fn pipeline_replies(port: u16, options: &str, bytes: &[u8]) -> String {
    // Each Sync, simple Query and FunctionCall ends with a ReadyForQuery.
    let mut syncs = 0;
    let mut rest = bytes;
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        syncs += usize::from(matches!(rest[0], b'S' | b'Q' | b'F'));
        rest = &rest[(1 + len).min(rest.len())..];
    }
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut body = b"\0\x03\0\0user\0postgres\0database\0postgres\0options\0".to_vec();
    body.extend_from_slice(options.as_bytes());
    body.extend_from_slice(b"\0\0");
    let mut startup = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    startup.extend_from_slice(&body);
    s.write_all(&startup).unwrap();
    let (mut tags, mut ready, mut buf) = (String::new(), 0, Vec::new());
    loop {
        let mut chunk = [0u8; 8192];
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "closed early; tags so far {tags}");
        buf.extend_from_slice(&chunk[..n]);
        while buf.len() >= 5 {
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if buf.len() < len + 1 {
                break;
            }
            let frame: Vec<u8> = buf.drain(..len + 1).collect();
            match frame[0] {
                b'Z' if ready == 0 => {
                    ready = 1;
                    s.write_all(bytes).unwrap();
                }
                b'Z' => {
                    tags.push('Z');
                    tags.push(char::from(frame[5]));
                    ready += 1;
                    if ready > syncs {
                        return tags;
                    }
                }
                b'E' if ready > 0 => {
                    // The SQLSTATE, so that refusals can be told apart.
                    let code = frame[5..]
                        .split(|b| *b == 0)
                        .find_map(|f| f.strip_prefix(b"C"))
                        .map(|c| String::from_utf8_lossy(c).into_owned())
                        .unwrap_or_default();
                    tags.push_str(&format!("E({code})"));
                }
                b'N' | b'S' => {}
                tag if ready > 0 => tags.push(char::from(tag)),
                _ => {}
            }
        }
    }
}
