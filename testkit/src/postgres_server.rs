//! A real PostgreSQL: initdb into a temp dir, run as the `postgres` OS user, on a free loopback
//! port; stopped on drop.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::port::free_port;

/// Users the harness creates, with the login each one uses (see `pg_hba.conf` below).
pub const SCRAM_USER: &str = "scram_user";
pub const MD5_USER: &str = "md5_user";
pub const CLEARTEXT_USER: &str = "cleartext_user";
pub const PASSWORD: &str = "s3cret-Pa55";

/// Where Debian and Ubuntu install the server binaries; `PG_BIN` overrides. `Err` says how to
/// install them (the tests panic with it, the benchmarks report it).
pub fn try_bin_dir() -> Result<PathBuf, String> {
    if let Ok(dir) = std::env::var("PG_BIN") {
        return Ok(PathBuf::from(dir));
    }
    for version in ["17", "16", "15", "14"] {
        let dir = PathBuf::from(format!("/usr/lib/postgresql/{version}/bin"));
        if dir.join("initdb").exists() {
            return Ok(dir);
        }
    }
    Err(
        "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin; \
         install them with `apt-get install postgresql` (or set PG_BIN)"
            .to_owned(),
    )
}

pub(crate) fn bin_dir() -> PathBuf {
    try_bin_dir().unwrap_or_else(|e| panic!("{e}"))
}

/// Whether this process runs as root (then the server's binaries run as `postgres`).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Runs a server binary as the `postgres` OS user (PostgreSQL refuses to run as root).
pub fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// `output` if the command ran and succeeded; else what failed, with its output.
pub fn try_check(output: std::io::Result<Output>, what: &str) -> Result<Output, String> {
    let output = output.map_err(|e| format!("{what}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{what} failed ({}):\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(output)
}

fn check(output: std::io::Result<Output>, what: &str) -> Output {
    try_check(output, what).unwrap_or_else(|e| panic!("{e}"))
}

/// `initdb` of `data` as the `postgres` user (superuser `postgres`, trust, UTF8; `extra`
/// arguments after those), then `conf` (postgresql.conf lines, if any) appended: in the file,
/// not on pg_ctl's command line, which goes through a shell that would expand `$libdir`.
pub fn try_initdb(bin: &Path, data: &Path, extra: &[&str], conf: &str) -> Result<(), String> {
    try_check(
        as_postgres(&bin.join("initdb"))
            .arg("-D")
            .arg(data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8"])
            .args(extra)
            .output(),
        "initdb",
    )?;
    if !conf.is_empty() {
        use std::io::Write;
        let path = data.join("postgresql.conf");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut file| writeln!(file, "{conf}"))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// `pg_ctl start` of `data` with these server `options`, its log in `log`; returns once the
/// server is up (at most 60 s).
pub fn try_pg_ctl_start(bin: &Path, data: &Path, log: &Path, options: &str) -> Result<(), String> {
    try_check(
        as_postgres(&bin.join("pg_ctl"))
            .arg("-D")
            .arg(data)
            .arg("-l")
            .arg(log)
            .args(["-o", options, "-w", "-t", "60", "start"])
            .stdout(Stdio::null())
            .output(),
        "pg_ctl start",
    )
    .map(drop)
}

/// `pg_ctl stop -m immediate` of `data`: as a crash would (no checkpoint, sessions cut).
pub fn try_pg_ctl_stop(bin: &Path, data: &Path) -> Result<(), String> {
    try_check(
        as_postgres(&bin.join("pg_ctl"))
            .arg("-D")
            .arg(data)
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .output(),
        "pg_ctl stop",
    )
    .map(drop)
}

/// A server's temp dir, owned by `postgres` (the server refuses to run as root), with an empty
/// `sock` directory for its Unix socket (returned).
fn server_dir() -> (TempDir, PathBuf) {
    try_server_dir("fencegate-pg").unwrap_or_else(|e| panic!("{e}"))
}

/// [`server_dir`] named `prefix...`, for harnesses that report errors rather than panic (the
/// benchmarks): `Err` says what failed.
pub fn try_server_dir(prefix: &str) -> Result<(TempDir, PathBuf), String> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map_err(|e| format!("a temp dir: {e}"))?;
    let sockdir = dir.path().join("sock");
    std::fs::create_dir(&sockdir).map_err(|e| format!("{}: {e}", sockdir.display()))?;
    if is_root() {
        let chown = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("chown the temp dir to postgres: {e}"))?;
        if !chown.status.success() {
            return Err(format!(
                "chown the temp dir to postgres: {}",
                String::from_utf8_lossy(&chown.stderr)
            ));
        }
    }
    Ok((dir, sockdir))
}

/// The server's command-line settings: loopback only, its socket in `sockdir`, commit
/// timestamps (tests/postgres_race.rs), no fsync.
fn server_options(port: u16, sockdir: &Path) -> String {
    format!(
        "-p {port} -k {} -c listen_addresses=127.0.0.1 -c track_commit_timestamp=on -c fsync=off -c max_connections=100",
        sockdir.display()
    )
}

/// A running PostgreSQL server.
pub struct PgServer {
    /// Where it listens (127.0.0.1).
    pub port: u16,
    bin: PathBuf,
    data: PathBuf,
    /// The server's command-line settings, for a restart.
    options: String,
    dir: TempDir,
}

impl PgServer {
    /// initdb, configure trust + SCRAM + MD5 + cleartext logins, start, wait until it answers.
    pub fn start() -> Self {
        Self::start_with(None, "")
    }

    /// The same, with `conf` (postgresql.conf lines, e.g.
    /// [`enforce_library_conf`](crate::enforce_library::enforce_library_conf)) appended to
    /// the server's configuration.
    pub fn start_with_conf(conf: &str) -> Self {
        Self::start_with(None, conf)
    }

    /// The same, with `ssl=on` and this PEM certificate chain and key (TCP clients may then
    /// use TLS; `host` lines in pg_hba.conf match both).
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Self {
        Self::start_with(Some((cert_pem, key_pem)), "")
    }

    fn start_with(tls: Option<(&str, &str)>, conf: &str) -> Self {
        let bin = bin_dir();
        let (dir, sockdir) = server_dir();
        let data = dir.path().join("data");
        try_initdb(&bin, &data, &["--no-sync"], conf).unwrap_or_else(|e| panic!("{e}"));
        let hba = format!(
            "host all {SCRAM_USER} 127.0.0.1/32 scram-sha-256\n\
             host all {MD5_USER} 127.0.0.1/32 md5\n\
             host all {CLEARTEXT_USER} 127.0.0.1/32 password\n\
             host all all 127.0.0.1/32 trust\n\
             host replication postgres 127.0.0.1/32 trust\n\
             local all all trust\n"
        );
        std::fs::write(data.join("pg_hba.conf"), hba).unwrap();
        let port = free_port();
        let mut options = server_options(port, &sockdir);
        if let Some((cert, key)) = tls {
            use std::os::unix::fs::PermissionsExt;
            // The server refuses a key readable by others; both files belong to `postgres`.
            std::fs::write(data.join("server.crt"), cert).unwrap();
            std::fs::write(data.join("server.key"), key).unwrap();
            std::fs::set_permissions(
                data.join("server.key"),
                std::fs::Permissions::from_mode(0o600),
            )
            .unwrap();
            if is_root() {
                check(
                    Command::new("chown")
                        .args(["postgres:postgres"])
                        .arg(data.join("server.crt"))
                        .arg(data.join("server.key"))
                        .output(),
                    "chown the server's certificate and key",
                );
            }
            options.push_str(" -c ssl=on");
        }
        let server = Self {
            port,
            bin,
            data,
            options,
            dir,
        };
        server.pg_ctl_start();
        server.psql_as(
            "postgres",
            &format!(
                "CREATE ROLE {SCRAM_USER} LOGIN SUPERUSER PASSWORD '{PASSWORD}';\
                 SET password_encryption = 'md5';\
                 CREATE ROLE {MD5_USER} LOGIN SUPERUSER PASSWORD '{PASSWORD}';\
                 RESET password_encryption;\
                 CREATE ROLE {CLEARTEXT_USER} LOGIN SUPERUSER PASSWORD '{PASSWORD}';"
            ),
        );
        server
    }

    fn pg_ctl_start(&self) {
        let log = self.dir.path().join("server.log");
        try_pg_ctl_start(&self.bin, &self.data, &log, &self.options)
            .unwrap_or_else(|e| panic!("{e}"));
        self.wait_ready(Duration::from_secs(30));
    }

    /// A hot standby of this server: `pg_basebackup -R` (streaming from this one, same
    /// configuration and library path), started on a port of its own. Waits until it accepts
    /// connections; see [`PgServer::wait_replayed`] for its data.
    pub fn standby(&self) -> PgServer {
        let (dir, sockdir) = server_dir();
        let data = dir.path().join("data");
        check(
            as_postgres(&self.bin.join("pg_basebackup"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                ])
                .arg("-D")
                .arg(&data)
                .args(["-R", "-X", "stream", "--no-sync"])
                .output(),
            "pg_basebackup",
        );
        let port = free_port();
        let standby = Self {
            port,
            bin: self.bin.clone(),
            data,
            options: server_options(port, &sockdir),
            dir,
        };
        standby.pg_ctl_start();
        standby
    }

    /// Waits (bounded) until `standby` has replayed everything this server has written so far.
    pub fn wait_replayed(&self, standby: &PgServer) {
        let lsn = self.psql_as("postgres", "SELECT pg_current_wal_lsn()");
        let deadline = Instant::now() + Duration::from_secs(30);
        while standby.psql_as(
            "postgres",
            &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
        ) != "t"
        {
            assert!(
                Instant::now() < deadline,
                "the standby on port {} did not replay up to {lsn} within 30 s:\n{}",
                standby.port,
                standby.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`: no checkpoint, sessions
    /// cut) and starts it again on the same port and data; recovery replays what it committed.
    pub fn restart(&self) {
        try_pg_ctl_stop(&self.bin, &self.data).unwrap_or_else(|e| panic!("{e}"));
        self.pg_ctl_start();
    }

    fn wait_ready(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let ok = TcpStream::connect(self.addr()).is_ok()
                && Command::new("psql")
                    .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                    .args(["-U", "postgres", "-d", "postgres", "-Atqc", "SELECT 1"])
                    .output()
                    .is_ok_and(|o| o.status.success());
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "PostgreSQL on port {} did not accept a connection within {within:?}:\n{}",
                self.port,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> SocketAddr {
        format!("127.0.0.1:{}", self.port).parse().unwrap()
    }

    /// A libpq key/value DSN for `user` on database `postgres`, directly (not via the gateway).
    pub fn dsn(&self, user: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} dbname=postgres",
            self.port
        )
    }

    /// Runs `sql` with psql directly against the server; returns stdout (unaligned, tuples only).
    pub fn psql_as(&self, user: &str, sql: &str) -> String {
        let out = check(
            Command::new("psql")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", user])
                .args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-Atqc", sql])
                .output(),
            "psql",
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The server log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = try_pg_ctl_stop(&self.bin, &self.data);
    }
}
