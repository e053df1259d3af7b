//! A `fencegate serve` node run for one gateway's tests: config, stderr log, data and audit log
//! in a temp dir; killed on drop.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::free_port;

pub struct GatewayNode {
    child: Child,
    env: Vec<(String, String)>,
    /// The node's config file.
    pub config: PathBuf,
    /// The audit log directory.
    pub audit_dir: PathBuf,
    /// The node's stderr.
    pub log: PathBuf,
    pub dir: TempDir,
    /// The node's HTTP API port (plain HTTP: the node runs insecure).
    pub api: u16,
}

/// What a test may add to the node's own sections.
#[derive(Default)]
pub struct NodeOptions<'a> {
    /// Lines for `[node]` (e.g. `min_free_bytes = 1048576`).
    pub node: &'a str,
    /// Lines for `[audit]` (e.g. `max_total_bytes = 1048576`).
    pub audit: &'a str,
    /// The data and audit directories go on this volume instead of the temp dir.
    pub volume: Option<&'a std::path::Path>,
    /// The audit directory (only) goes on this volume.
    pub audit_volume: Option<&'a std::path::Path>,
}

impl GatewayNode {
    /// Starts a one-node `fencegate serve` whose config is `[node]` and `[audit]` in a temp dir
    /// followed by `gateway` (the gateway's own section); `env` is given to the process.
    ///
    /// The node runs insecure (plain HTTP API) and, unless `gateway` has its own `[authority]`
    /// section (a test of signed tokens), accepts unsigned tokens, so tests can type them.
    pub fn start(gateway: &str, env: &[(&str, &str)]) -> Self {
        Self::start_with(&NodeOptions::default(), gateway, env)
    }

    /// Like [`GatewayNode::start`], with `options`.
    pub fn start_with(options: &NodeOptions, gateway: &str, env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data_root = options.volume.unwrap_or(dir.path()).to_owned();
        let audit_dir = options.audit_volume.unwrap_or(&data_root).join("audit");
        let config = dir.path().join("fencegate.toml");
        let unsigned = if gateway.contains("[authority]") {
            ""
        } else {
            "[authority]\naccept_unsigned = true\n"
        };
        let api = free_port();
        let text = format!(
            "[node]\nid = 1\napi = \"127.0.0.1:{api}\"\ndata_dir = \"{data}\"\n{node_extra}\n\n[audit]\ndir = \"{audit}\"\n{audit_extra}\n\n{gateway}\n\n{unsigned}\n[security]\ninsecure = true\n",
            data = data_root.join("data").display(),
            audit = audit_dir.display(),
            node_extra = options.node,
            audit_extra = options.audit,
        );
        std::fs::write(&config, text).unwrap();
        let log = dir.path().join("fencegate.log");
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let child = spawn(&config, File::create(&log).unwrap(), &env);
        Self {
            child,
            env,
            config,
            audit_dir,
            log,
            dir,
            api,
        }
    }

    /// Kills the node (SIGKILL: nothing in its memory survives) and starts it again with the
    /// same config and environment; its log goes on in the same file.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .unwrap();
        self.child = spawn(&self.config, log, &self.env);
    }

    /// Polls `ready` until it is true; panics with the node's log if the node exits first or
    /// `within` passes.
    pub fn wait_ready(&mut self, what: &str, within: Duration, mut ready: impl FnMut() -> bool) {
        let deadline = Instant::now() + within;
        loop {
            if ready() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "fencegate exited ({status}) before {what}:\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "fencegate: {what} not within {within:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the node's log line `message` (e.g. "postgres gateway listening") and returns
    /// the port of its `listen=` field. Gateways configured with port 0 are bound by the node
    /// itself, so no other process can take the port between choosing and binding it.
    pub fn bound_port(&mut self, message: &str) -> u16 {
        let log = self.log.clone();
        let mut port = None;
        self.wait_ready(message, Duration::from_secs(30), || {
            port = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(message))
                .find_map(|l| {
                    let addr = l.split("listen=").nth(1)?.split_whitespace().next()?;
                    addr.rsplit(':').next()?.parse().ok()
                });
            port.is_some()
        });
        port.unwrap()
    }

    /// Sends `signal` to the node.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, signal).expect("signal the node");
    }

    /// Waits (bounded) for the node to exit; `None` if it still runs after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (bounded) until the log has a line containing `text`; panics with the log if not.
    pub fn wait_for_log(&mut self, text: &str, within: Duration) {
        let log = self.log.clone();
        self.wait_ready(&format!("log line {text:?}"), within, || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains(text)
        });
    }

    /// `/healthz`'s status and JSON body; `None` while the API does not answer.
    pub async fn healthz(&self) -> Option<(u16, serde_json::Value)> {
        let reply = reqwest::get(format!("http://127.0.0.1:{}/healthz", self.api))
            .await
            .ok()?;
        let status = reply.status().as_u16();
        Some((status, reply.json().await.ok()?))
    }

    /// The value of the `/metrics` sample `series` (name and labels exactly as exposed);
    /// `None` while the API does not answer or the series is not exposed.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", self.api))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        super::metrics::sample(&text, series)
    }

    /// The node's stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Every audit record written so far, parsed.
    pub fn audit_records(&self) -> Vec<serde_json::Value> {
        super::audit::records(&self.audit_dir)
    }
}

fn spawn(config: &std::path::Path, log: File, env: &[(String, String)]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["serve", "--config"])
        .arg(config)
        .env("FENCEGATE_LOG", "info,openraft=warn")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start fencegate serve")
}

impl Drop for GatewayNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
