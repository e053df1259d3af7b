//! Starts `fencegate serve` as a real process with a `[redis]` gateway in front of a real
//! `redis-server`, and stops both on drop.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use redis::aio::MultiplexedConnection;

use super::gateway_node::{GatewayNode, NodeOptions};
use super::redis_client::{cmd, connect};
use super::redis_server::RedisServer;

/// A `fencegate serve` node whose Redis gateway relays to its own `redis-server`.
pub struct RedisGateway {
    /// The node: its config, log and audit directory.
    pub node: GatewayNode,
    /// The upstream Redis (connect to it directly to check what was stored).
    pub redis: RedisServer,
    /// Where the gateway listens for Redis clients.
    pub addr: SocketAddr,
}

impl RedisGateway {
    /// Starts a node whose `[redis]` section has `extra` appended; unless `extra` has protect
    /// rules of its own, every key is protected (`*`, any resource's token), `env` is given to
    /// the process.
    pub fn start(extra: &str, env: &[(&str, &str)]) -> Self {
        Self::start_with(&NodeOptions::default(), extra, env)
    }

    /// Like [`RedisGateway::start`], with the node's `options`.
    pub fn start_with(options: &NodeOptions, extra: &str, env: &[(&str, &str)]) -> Self {
        Self::start_on(RedisServer::start(), options, extra, env)
    }

    /// Like [`RedisGateway::start_with`], in front of `redis` (one with fencegate's module
    /// loaded, say).
    pub fn start_on(
        redis: RedisServer,
        options: &NodeOptions,
        extra: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let every_key = if extra.contains("protect") {
            ""
        } else {
            "\n[[redis.protect]]\npattern = \"*\"\nresource = \"*\"\n"
        };
        let section = format!(
            "[redis]\nlisten = \"127.0.0.1:0\"\nupstream = \"{}\"\n{extra}\n{every_key}",
            redis.addr
        );
        let mut node = GatewayNode::start_with(options, &section, env);
        let port = node.bound_port("redis gateway listening");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        node.wait_ready(
            "its Redis gateway answered PING",
            Duration::from_secs(30),
            || answers_ping(addr),
        );
        Self { node, redis, addr }
    }

    /// The node's stderr so far.
    pub fn log_text(&self) -> String {
        self.node.log_text()
    }

    /// Two connections to the gateway: `old` fenced with revision 3 of `ledger`, `new` with 4
    /// (which wrote balance = 10), so that `old`'s writes are refused as stale.
    pub async fn old_and_new(&self) -> (MultiplexedConnection, MultiplexedConnection) {
        let mut old = connect(&self.url()).await;
        let mut new = connect(&self.url()).await;
        cmd::<()>(&mut old, &["FENCE", "fg1~3~ledger"])
            .await
            .unwrap();
        cmd::<()>(&mut new, &["FENCE", "fg1~4~ledger"])
            .await
            .unwrap();
        cmd::<()>(&mut new, &["SET", "balance", "10"])
            .await
            .unwrap();
        (old, new)
    }

    /// `redis://` URL of the gateway.
    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Every audit record written so far, parsed.
    pub fn audit_records(&self) -> Vec<serde_json::Value> {
        self.node.audit_records()
    }

    /// The audit records of stale refusals so far.
    pub fn stale_records(&self) -> Vec<serde_json::Value> {
        self.audit_records()
            .into_iter()
            .filter(|r| r["reason"] == "stale")
            .collect()
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
        self.node.dir.path()
    }
}

/// Whether a Redis server at `addr` answers PING with PONG.
fn answers_ping(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut buf = [0u8; 64];
    s.write_all(b"*1\r\n$4\r\nPING\r\n").is_ok()
        && s.read(&mut buf)
            .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
}
