//! Starts `fencegate serve` as a real process with an `[s3]` gateway in front of its own moto,
//! for the CLI and restart tests. Buckets: `ledger` (keys under `data/` in manifest mode,
//! resource `job`; the rest plain) and `fenced` (object mode, resource `job`).

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use super::free_port;
use super::gateway_node::GatewayNode;
use super::s3_server::{run_client, wait_for_port, MotoServer};

pub const ACCESS_KEY: &str = "AKIDNODE";
pub const SECRET: &str = "node-client-secret";
const ENV: &[(&str, &str)] = &[
    ("S3_UPSTREAM_SECRET", "gateway-secret"),
    ("S3_CLIENTS", "AKIDNODE:node-client-secret"),
];

/// The node's `[s3]` section: listening on `port`, fronting `upstream`.
fn section(port: u16, upstream: &str) -> String {
    format!(
        "[s3]\nlisten = \"127.0.0.1:{port}\"\nupstream = \"{upstream}\"\nupstream_access_key = \"gateway\"\n\
         upstream_secret_env = \"S3_UPSTREAM_SECRET\"\nclients_env = \"S3_CLIENTS\"\n\n\
         [[s3.protect]]\nbucket = \"ledger\"\nprefix = \"data/\"\nmode = \"manifest\"\nresource = \"job\"\n\n\
         [[s3.protect]]\nbucket = \"fenced\"\nmode = \"object\"\nresource = \"job\"\n"
    )
}

/// A second node of [`S3Node::second_node`].
pub struct SecondNode {
    pub node: GatewayNode,
    pub endpoint: String,
}

impl SecondNode {
    /// Runs boto3 steps through this node.
    pub fn run(&self, steps: Value) -> Vec<Value> {
        run_client(&self.endpoint, ACCESS_KEY, SECRET, steps)
            .as_array()
            .unwrap()
            .clone()
    }
}

/// A `fencegate serve` node whose S3 gateway fronts its own moto.
pub struct S3Node {
    /// The node: its config, log and audit directory.
    pub node: GatewayNode,
    /// The store (reach it directly to see what the gateway wrote).
    pub moto: MotoServer,
    port: u16,
    /// `http://127.0.0.1:<port>` of the gateway.
    pub endpoint: String,
}

impl S3Node {
    pub fn start() -> Self {
        let moto = MotoServer::start();
        let created = moto.direct(serde_json::json!([
            {"op": "create_bucket", "bucket": "ledger"},
            {"op": "create_bucket", "bucket": "fenced"},
        ]));
        assert!(
            created.as_array().unwrap().iter().all(|r| r["ok"] == true),
            "{created}"
        );
        let port = free_port();
        let node = GatewayNode::start(&section(port, &moto.endpoint), ENV);
        let mut node = Self {
            node,
            moto,
            port,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        node.wait_listening();
        node
    }

    /// Another node (its own authority, audit log and caches) in front of the same moto.
    pub fn second_node(&self) -> SecondNode {
        let port = free_port();
        let mut node = GatewayNode::start(&section(port, &self.moto.endpoint), ENV);
        node.wait_ready(
            "its S3 gateway accepted connections",
            Duration::from_secs(30),
            || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        );
        SecondNode {
            node,
            endpoint: format!("http://127.0.0.1:{port}"),
        }
    }

    /// Kills the node and starts it again (same config, same port).
    pub fn restart(&mut self) {
        self.node.restart();
        self.wait_listening();
    }

    fn wait_listening(&mut self) {
        let port = self.port;
        self.node.wait_ready(
            "its S3 gateway accepted connections",
            Duration::from_secs(30),
            || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        );
        wait_for_port(port, Duration::from_secs(1));
    }

    /// Runs boto3 steps through the gateway; one result per step.
    pub fn run(&self, steps: Value) -> Vec<Value> {
        run_client(&self.endpoint, ACCESS_KEY, SECRET, steps)
            .as_array()
            .unwrap()
            .clone()
    }

    /// Runs boto3 steps directly against moto.
    pub fn direct(&self, steps: Value) -> Vec<Value> {
        self.moto.direct(steps).as_array().unwrap().clone()
    }

    /// Runs `fencegate <args>` with the node's environment (the upstream secret); returns
    /// (exit code, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_fencegate"))
            .args(args)
            .envs(ENV.iter().copied())
            .output()
            .expect("run fencegate");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The node's config file, as a string for `--config`.
    pub fn config(&self) -> String {
        self.node.config.display().to_string()
    }

    /// Refusal records of the node's audit log (other lines, e.g. seals, left out).
    pub fn refusals(&self) -> Vec<Value> {
        let mut records = self.node.audit_records();
        records.retain(|r| r.get("store").is_some());
        records
    }
}
