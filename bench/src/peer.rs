//! The proxies users would pick instead of fencegate, started beside it in front of the same
//! store: twemproxy (Debian `nutcracker`) for Redis and PgBouncer (session pool) for
//! PostgreSQL. Each runs in the foreground on a free loopback port from a generated config, and
//! is killed on drop.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use tempfile::TempDir;

use crate::process::{free_port, Server};
use fencegate_testkit::postgres_server::is_root;

use crate::servers::wait_port;

const NUTCRACKER: &str = "/usr/sbin/nutcracker";
const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// The binary at `path` (or the one named by `env`), or an error saying how to install it.
fn binary(env: &str, path: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::var_os(env).map_or_else(|| PathBuf::from(path), PathBuf::from);
    if !path.exists() {
        bail!(
            "{} not found: the peer benchmarks need twemproxy and PgBouncer: apt-get install nutcracker pgbouncer (or set {env})",
            path.display()
        );
    }
    Ok(path)
}

/// twemproxy with one server pool: the one redis-server at `upstream`.
pub struct Twemproxy {
    pub port: u16,
    server: Server,
    _dir: TempDir,
}

impl Twemproxy {
    pub fn start(upstream: u16) -> anyhow::Result<Self> {
        let program = binary("NUTCRACKER", NUTCRACKER)?;
        let dir = tempfile::Builder::new()
            .prefix("fencegate-bench-twemproxy")
            .tempdir()?;
        let port = free_port();
        // One server connection (twemproxy's default): every client's requests are pipelined
        // onto it, which is how twemproxy is meant to run.
        let config = dir.path().join("nutcracker.yml");
        std::fs::write(
            &config,
            format!(
                "bench:\n  listen: 127.0.0.1:{port}\n  redis: true\n  hash: fnv1a_64\n  distribution: ketama\n  \
                 auto_eject_hosts: false\n  server_connections: 1\n  servers:\n   - 127.0.0.1:{upstream}:1\n"
            ),
        )?;
        // Its stats server listens too (default port 22222): give it a free one.
        let stats = free_port();
        let mut command = Command::new(&program);
        command.arg("-c").arg(&config).args([
            "-a",
            "127.0.0.1",
            "-s",
            &stats.to_string(),
            "-v",
            "4",
        ]);
        let server = Server::start(
            "nutcracker",
            &mut command,
            dir.path().join("nutcracker.log"),
        )
        .context("apt-get install nutcracker")?;
        wait_port(port, "nutcracker")?;
        Ok(Self {
            port,
            server,
            _dir: dir,
        })
    }

    pub fn pid(&self) -> u32 {
        self.server.id()
    }
}

/// PgBouncer in session mode in front of database `postgres` at `upstream`, `trust` auth
/// (as the bench's PostgreSQL), so a client's session holds one server connection as it would
/// through fencegate.
pub struct Pgbouncer {
    pub port: u16,
    server: Server,
    _dir: TempDir,
}

impl Pgbouncer {
    pub fn start(upstream: u16, max_clients: u32) -> anyhow::Result<Self> {
        let program = binary("PGBOUNCER", PGBOUNCER)?;
        let dir = tempfile::Builder::new()
            .prefix("fencegate-bench-pgbouncer")
            .tempdir()?;
        let port = free_port();
        let auth = dir.path().join("userlist.txt");
        std::fs::write(&auth, "\"postgres\" \"\"\n")?;
        let config = dir.path().join("pgbouncer.ini");
        std::fs::write(
            &config,
            format!(
                "[databases]\npostgres = host=127.0.0.1 port={upstream} dbname=postgres user=postgres\n\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {auth}\npool_mode = session\n\
                 max_client_conn = {max_clients}\ndefault_pool_size = {max_clients}\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 log_connections = 0\nlog_disconnections = 0\nlog_pooler_errors = 1\n",
                auth = auth.display()
            ),
        )?;
        let mut command = Command::new(&program);
        // PgBouncer refuses to run as root: it drops to `postgres` itself, so the child we hold
        // is PgBouncer (its CPU time is the one measured), not a wrapper.
        if is_root() {
            chown_postgres(dir.path())?;
            command.args(["-u", "postgres"]);
        }
        command.arg(&config);
        let server = Server::start("pgbouncer", &mut command, dir.path().join("pgbouncer.log"))
            .context("apt-get install pgbouncer")?;
        wait_port(port, "pgbouncer")?;
        Ok(Self {
            port,
            server,
            _dir: dir,
        })
    }

    pub fn pid(&self) -> u32 {
        self.server.id()
    }

    /// PgBouncer's log so far (for error messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("pgbouncer.log")).unwrap_or_default()
    }
}

fn chown_postgres(dir: &Path) -> anyhow::Result<()> {
    let status = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(dir)
        .status()
        .context("chown")?;
    if !status.success() {
        bail!("chown -R postgres:postgres {} failed", dir.display());
    }
    Ok(())
}
