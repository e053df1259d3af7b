//! Starts `fencegate serve` as a real process with a `[redis]` gateway in front of a real
//! `redis-server`, and stops both on drop.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::redis_server::{free_port, RedisServer};

/// A `fencegate serve` node whose Redis gateway relays to its own `redis-server`.
pub struct RedisGateway {
    child: Child,
    /// The upstream Redis (connect to it directly to check what was stored).
    pub redis: RedisServer,
    /// Where the gateway listens for Redis clients.
    pub addr: SocketAddr,
    /// The node's config file.
    pub config: PathBuf,
    /// The audit log directory.
    pub audit_dir: PathBuf,
    /// The node's stderr.
    pub log: PathBuf,
    dir: TempDir,
}

impl RedisGateway {
    /// Starts a node with the default protection (every key); `extra` is appended to the
    /// `[redis]` section, `env` given to the process.
    pub fn start(extra: &str, env: &[(&str, &str)]) -> Self {
        let redis = RedisServer::start();
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let api = free_port();
        let audit_dir = dir.path().join("audit");
        let config = dir.path().join("fencegate.toml");
        let text = format!(
            "[node]\nid = 1\napi = \"127.0.0.1:{api}\"\ndata_dir = \"{data}\"\n\n[audit]\ndir = \"{audit}\"\n\n[redis]\nlisten = \"127.0.0.1:{port}\"\nupstream = \"{upstream}\"\n{extra}\n",
            data = dir.path().join("data").display(),
            audit = audit_dir.display(),
            upstream = redis.addr,
        );
        std::fs::write(&config, text).unwrap();
        let log = dir.path().join("fencegate.log");
        let child = Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(["serve", "--config"])
            .arg(&config)
            .env("FENCEGATE_LOG", "info,openraft=warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(File::create(&log).unwrap())
            .spawn()
            .expect("start fencegate serve");
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut gateway = Self {
            child,
            redis,
            addr,
            config,
            audit_dir,
            log,
            dir,
        };
        gateway.wait_ready(Duration::from_secs(30));
        gateway
    }

    fn wait_ready(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(mut s) = TcpStream::connect(self.addr) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut buf = [0u8; 64];
                if s.write_all(b"*1\r\n$4\r\nPING\r\n").is_ok() {
                    if let Ok(n) = s.read(&mut buf) {
                        if buf[..n].starts_with(b"+PONG") {
                            return;
                        }
                    }
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "fencegate exited ({status}) before it served Redis:\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "fencegate's Redis gateway did not answer PING within {within:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The node's stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `redis://` URL of the gateway.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Every audit record written so far, parsed.
    pub fn audit_records(&self) -> Vec<serde_json::Value> {
        super::audit::records(&self.audit_dir)
    }

    /// Runs `fencegate` with `args`; returns (exit code, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
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

    /// The temp dir holding config, data and logs.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }
}

impl Drop for RedisGateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
