//! Starts a real `redis-server` on a free loopback port in a temp dir, and stops it on drop.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::port::free_port;

/// A running `redis-server`, killed when dropped.
pub struct RedisServer {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    binary: String,
    args: Vec<String>,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts a server that keeps fence keys (append-only file, `noeviction`) and waits until
    /// it answers `PING`.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Like [`RedisServer::start`], with `extra` command-line settings after the defaults
    /// (later ones win: `["--maxmemory-policy", "allkeys-lru"]`).
    pub fn start_with(extra: &[&str]) -> Self {
        let binary = ["/usr/bin/redis-server", "/usr/local/bin/redis-server"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .map(str::to_owned)
            .or_else(|| which("redis-server"))
            .unwrap_or_else(|| {
                panic!("redis-server is not installed; install it with `apt-get install redis-server` (tests need a real Redis 7)")
            });
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
            "--dir",
            dir.path().to_str().unwrap(),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        .map(str::to_owned)
        .to_vec();
        args.extend(extra.iter().map(|a| a.to_string()));
        let child = spawn(&binary, &args);
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let server = Self {
            child,
            addr,
            binary,
            args,
            _dir: dir,
        };
        server.wait_ready(Duration::from_secs(10));
        server
    }

    fn wait_ready(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(mut s) = TcpStream::connect(self.addr) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                let mut buf = [0u8; 64];
                if s.write_all(b"PING\r\n").is_ok() {
                    if let Ok(n) = s.read(&mut buf) {
                        if buf[..n].starts_with(b"+PONG") {
                            return;
                        }
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on {} did not answer PING within {within:?}",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL) and starts it again on the same port and data directory; its
    /// append-only file brings back what it acknowledged.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn(&self.binary, &self.args);
        self.wait_ready(Duration::from_secs(10));
    }

    /// `redis://` URL for clients.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(binary: &str, args: &[String]) -> Child {
    Command::new(binary)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn redis-server")
}

fn which(name: &str) -> Option<String> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| format!("{d}/{name}"))
        .find(|p| Path::new(p).exists())
}
