//! The stores and the gateway node each suite runs against: redis-server, PostgreSQL (initdb and
//! pg_ctl as the `postgres` user when run as root), moto's S3 server and `fencegate serve`, all on
//! free loopback ports in a temp dir, stopped on drop.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tempfile::TempDir;

use fencegate_testkit::postgres_server::{
    try_bin_dir, try_check, try_initdb, try_pg_ctl_start, try_pg_ctl_stop, try_server_dir,
};

use crate::process::{fencegate_binary, free_port, Server};

/// Waits until something accepts connections on `127.0.0.1:port`.
pub fn wait_port(port: u16, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("{what} did not listen on 127.0.0.1:{port} within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn check(output: std::io::Result<Output>, what: &str) -> anyhow::Result<Output> {
    try_check(output, what).map_err(anyhow::Error::msg)
}

/// A redis-server without persistence.
pub struct Redis {
    pub port: u16,
    _server: Server,
}

impl Redis {
    /// The redis-server process id.
    pub fn pid(&self) -> u32 {
        self._server.id()
    }

    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        Self::start_with(dir, &[])
    }

    /// [`Redis::start`] with fencegate's module loaded: a gateway in front of it runs the fence
    /// check there unless its config says `fence_module = "off"`.
    pub fn start_with_module(dir: &Path) -> anyhow::Result<Self> {
        let module = crate::process::redis_module()?;
        Self::start_with(dir, &["--loadmodule".into(), module.display().to_string()])
    }

    fn start_with(dir: &Path, extra: &[String]) -> anyhow::Result<Self> {
        let port = free_port();
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--maxclients", "10000"])
            .args(extra)
            .arg("--dir")
            .arg(dir);
        let server = Server::start("redis-server", &mut command, dir.join("redis.log"))
            .context("apt-get install redis-server")?;
        wait_port(port, "redis-server")?;
        Ok(Self {
            port,
            _server: server,
        })
    }
}

/// Where Debian installs the PostgreSQL server binaries.
pub fn pg_bin() -> anyhow::Result<PathBuf> {
    try_bin_dir().map_err(anyhow::Error::msg)
}

/// A PostgreSQL server with durable commits (fsync and synchronous_commit on, the defaults).
pub struct Postgres {
    pub port: u16,
    bin: PathBuf,
    data: PathBuf,
    _dir: TempDir,
}

impl Postgres {
    pub fn start(max_connections: u32) -> anyhow::Result<Self> {
        Self::start_with_conf(max_connections, "")
    }

    /// The same, with `conf` appended to postgresql.conf (in the file: pg_ctl's `-o` goes
    /// through a shell, which would expand `$libdir`).
    pub fn start_with_conf(max_connections: u32, conf: &str) -> anyhow::Result<Self> {
        let bin = pg_bin()?;
        let (dir, sock) = try_server_dir("fencegate-bench-pg").map_err(anyhow::Error::msg)?;
        let data = dir.path().join("data");
        // Synced: the suites measure durable commits.
        try_initdb(&bin, &data, &[], conf).map_err(anyhow::Error::msg)?;
        let port = free_port();
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=on -c synchronous_commit=on \
             -c max_connections={max_connections} -c shared_buffers=128MB",
            sock.display()
        );
        try_pg_ctl_start(&bin, &data, &dir.path().join("server.log"), &options)
            .map_err(anyhow::Error::msg)?;
        let server = Self {
            port,
            bin,
            data,
            _dir: dir,
        };
        server.psql("SELECT 1")?;
        Ok(server)
    }

    pub fn dsn(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    pub fn psql(&self, sql: &str) -> anyhow::Result<String> {
        let out = check(
            Command::new("psql")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args([
                    "-U",
                    "postgres",
                    "-d",
                    "postgres",
                    "-X",
                    "-v",
                    "ON_ERROR_STOP=1",
                ])
                .args(["-Atqc", sql])
                .output(),
            "psql",
        )?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = try_pg_ctl_stop(&self.bin, &self.data);
    }
}

/// The venv's python with moto: `FENCEGATE_VENV`, else `./.venv`.
pub fn venv_python() -> anyhow::Result<PathBuf> {
    let venv =
        std::env::var_os("FENCEGATE_VENV").map_or_else(|| PathBuf::from(".venv"), PathBuf::from);
    let python = venv.join("bin/python");
    let ok = python.exists()
        && Command::new(&python)
            .args(["-c", "import moto.server"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        bail!(
            "moto[server] is not installed in {}: python3 -m venv .venv && .venv/bin/pip install 'moto[server]' boto3 (or set FENCEGATE_VENV)",
            venv.display()
        );
    }
    Ok(python)
}

/// moto's S3 server; its request log (one line per request) goes to `log`.
pub struct Moto {
    pub port: u16,
    pub log: PathBuf,
    _server: Server,
}

impl Moto {
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        let python = venv_python()?;
        let port = free_port();
        let log = dir.join("moto.log");
        let mut command = Command::new(python);
        command
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .env("MOTO_S3_CUSTOM_ENDPOINTS", "");
        let server = Server::start("moto", &mut command, log.clone())?;
        wait_port(port, "moto")?;
        Ok(Self {
            port,
            log,
            _server: server,
        })
    }

    /// Requests moto has logged so far (`"METHOD /path HTTP/1.1" status` lines).
    pub fn requests_logged(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(" HTTP/1.1\" "))
            .count()
    }
}

/// The S3 client credentials the gateway verifies.
pub const S3_ACCESS_KEY: &str = "AKIDBENCH";
pub const S3_SECRET: &str = "bench-client-secret";

/// A one-node `fencegate serve` with the given gateway sections.
pub struct Node {
    server: Server,
    _dir: TempDir,
}

impl Node {
    /// Starts the node; `sections` is appended to `[node]`/`[audit]`/`[log]`; waits for `ports`.
    pub fn start(sections: &str, ports: &[u16]) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("fencegate-bench-node")
            .tempdir()?;
        let api = free_port();
        let config = dir.path().join("fencegate.toml");
        std::fs::write(
            &config,
            format!(
                "[node]\nid = 1\napi = \"127.0.0.1:{api}\"\ndata_dir = \"{data}\"\n\n[log]\nlevel = \"warn\"\n\n[authority]\naccept_unsigned = true\n\n[security]\ninsecure = true\n\n{sections}\n",
                data = dir.path().join("data").display(),
            ),
        )?;
        let mut command = Command::new(fencegate_binary()?);
        command
            .args(["serve", "--config"])
            .arg(&config)
            .env("FENCEGATE_S3_UPSTREAM_SECRET", "moto")
            .env(
                "FENCEGATE_S3_CLIENTS",
                format!("{S3_ACCESS_KEY}:{S3_SECRET}"),
            );
        let server = Server::start("fencegate serve", &mut command, dir.path().join("node.log"))?;
        let node = Self { server, _dir: dir };
        for port in ports.iter().chain([&api]) {
            // The node's own words say why it did not come up (a config error, a port taken).
            wait_port(*port, "fencegate serve")
                .map_err(|e| e.context(format!("the node's log:\n{}", node.log_text())))?;
        }
        Ok(node)
    }

    /// The node's stderr so far (for error messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("node.log")).unwrap_or_default()
    }

    /// The node's process id.
    pub fn pid(&self) -> u32 {
        self.server.id()
    }

    /// Resident memory (VmRSS) in KiB.
    pub fn rss_kib(&self) -> anyhow::Result<u64> {
        rss_kib(self.server.id())
    }
}

pub fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS in /proc/PID/status")
}

/// `section` for a Redis gateway protecting every key (a token of any resource). The bench's
/// redis-server runs without persistence, so the gateway is told to accept unpersisted fences
/// (it refuses protected writes otherwise).
pub fn redis_section(listen: u16, upstream: u16) -> String {
    redis_section_with(listen, upstream, "")
}

/// [`redis_section`] with `settings` (lines of `[redis]`, such as `fence_module = "off"`).
pub fn redis_section_with(listen: u16, upstream: u16, settings: &str) -> String {
    format!(
        "[redis]\nlisten = \"127.0.0.1:{listen}\"\nupstream = \"127.0.0.1:{upstream}\"\naccept_unpersisted_fences = true\n{settings}\n\n[[redis.protect]]\npattern = \"*\"\nmode = \"enforce\"\nresource = \"*\"\n\n"
    )
}

/// `section` for a Redis gateway that protects `bench:*` (the RESP generator's keys, a token of
/// any resource) and nothing else: redis-benchmark's `key:*` pass through.
pub fn redis_fenced_prefix_section(listen: u16, upstream: u16) -> String {
    format!(
        "[redis]\nlisten = \"127.0.0.1:{listen}\"\nupstream = \"127.0.0.1:{upstream}\"\naccept_unpersisted_fences = true\n\n[[redis.protect]]\npattern = \"bench:*\"\nmode = \"enforce\"\nresource = \"*\"\n\n"
    )
}

/// `section` for a PostgreSQL gateway that protects no database (a pass-through).
pub fn postgres_passthrough_section(listen: u16, upstream: u16) -> String {
    format!(
        "[postgres]\nlisten = \"127.0.0.1:{listen}\"\nupstream = \"127.0.0.1:{upstream}\"\ndatabases = []\n\n"
    )
}

/// `section` for a PostgreSQL gateway protecting every database for resource `bench` (a
/// protecting gateway must name its resource).
pub fn postgres_section(listen: u16, upstream: u16) -> String {
    format!(
        "[postgres]\nlisten = \"127.0.0.1:{listen}\"\nupstream = \"127.0.0.1:{upstream}\"\ndatabases = [\"*\"]\nresource = \"bench\"\n\n"
    )
}

/// `section` for an S3 gateway protecting bucket `bench` (object mode).
pub fn s3_section(listen: u16, upstream: u16) -> String {
    format!(
        "[s3]\nlisten = \"127.0.0.1:{listen}\"\nupstream = \"http://127.0.0.1:{upstream}\"\nupstream_access_key = \"moto\"\n\
         upstream_secret_env = \"FENCEGATE_S3_UPSTREAM_SECRET\"\nclients_env = \"FENCEGATE_S3_CLIENTS\"\n\n\
         [[s3.protect]]\nbucket = \"bench\"\nprefix = \"\"\nmode = \"object\"\nresource = \"bench\"\n\n"
    )
}

/// Installs fence.sql in `pg` with `fencegate postgres install`.
pub fn install_fence_sql(pg: &Postgres) -> anyhow::Result<()> {
    check(
        Command::new(fencegate_binary()?)
            .args(["postgres", "install", "--dsn", &pg.dsn()])
            .output(),
        "fencegate postgres install",
    )?;
    Ok(())
}
