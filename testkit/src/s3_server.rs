//! Starts moto's S3 server (`moto[server]` from PyPI, in the repo's `.venv`, through
//! `tests/s3/moto_atomic.py` so that each request is applied atomically as on S3) on a free
//! loopback port, and stops it on drop; runs the boto3 client script `tests/s3/client.py`.
//!
//! Install once: `python3 -m venv .venv && .venv/bin/pip install 'moto[server]' boto3`.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::port::free_port;

const INSTALL: &str =
    "from the repository's root: python3 -m venv .venv && .venv/bin/pip install 'moto[server]' boto3 \
     (or set FENCEGATE_VENV to a venv that has them)";

/// A running moto S3 server, killed when dropped.
pub struct MotoServer {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
}

/// The repository root (the directory holding `tests/s3/client.py`).
pub fn repo_root() -> PathBuf {
    let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    while !dir.join("tests/s3/client.py").exists() {
        assert!(
            dir.pop(),
            "cannot find tests/s3/client.py above {}",
            env!("CARGO_MANIFEST_DIR")
        );
    }
    dir
}

/// The venv's python, with moto and boto3 importable; panics with install instructions.
pub fn venv_python() -> PathBuf {
    let venv = std::env::var_os("FENCEGATE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv"));
    let python = venv.join("bin/python");
    let ok = python.exists()
        && Command::new(&python)
            .args(["-c", "import moto.server, boto3, flask"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        ok,
        "moto[server] and boto3 are not installed in {}; install them with: {INSTALL}",
        venv.display()
    );
    python
}

impl MotoServer {
    /// Starts moto's S3 server and waits until it accepts connections.
    pub fn start() -> Self {
        Self::start_inner(None)
    }

    /// Starts moto's S3 server over HTTPS with this PEM certificate and key (clients must
    /// trust the certificate: `S3_CA_BUNDLE` for `tests/s3/client.py`).
    pub fn start_tls(cert: &Path, key: &Path) -> Self {
        Self::start_inner(Some((cert, key)))
    }

    fn start_inner(tls: Option<(&Path, &Path)>) -> Self {
        let python = venv_python();
        let port = free_port();
        let mut command = Command::new(python);
        // moto's server applies each request atomically only through this wrapper (see its
        // docstring: plain moto's conditional PUTs are not atomic under concurrency).
        command.arg(repo_root().join("tests/s3/moto_atomic.py"));
        command.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        if let Some((cert, key)) = tls {
            command
                .arg("--ssl-cert")
                .arg(cert)
                .arg("--ssl-key")
                .arg(key);
        }
        let child = command
            .env("MOTO_S3_CUSTOM_ENDPOINTS", "")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start moto.server: {e}; install it with: {INSTALL}")
            });
        let server = Self {
            child,
            endpoint: format!(
                "{}://127.0.0.1:{port}",
                if tls.is_some() { "https" } else { "http" }
            ),
        };
        wait_for_port(port, Duration::from_secs(30));
        server
    }

    /// Runs a boto3 step list against this server directly (bucket setup, inspection).
    pub fn direct(&self, steps: serde_json::Value) -> serde_json::Value {
        run_client(&self.endpoint, "moto", "moto", steps)
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until something accepts connections on `127.0.0.1:port`.
pub fn wait_for_port(port: u16, timeout: Duration) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < timeout,
            "nothing listens on 127.0.0.1:{port} after {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `tests/s3/client.py` (boto3, default settings) with `steps` against `endpoint`;
/// returns its JSON output (one result per step).
pub fn run_client(
    endpoint: &str,
    access_key: &str,
    secret: &str,
    steps: serde_json::Value,
) -> serde_json::Value {
    let script = repo_root().join("tests/s3/client.py");
    run_python(&script, &[endpoint, access_key, secret, &steps.to_string()])
}

/// Runs a Python script from the venv and parses its stdout as JSON.
pub fn run_python(script: &Path, args: &[&str]) -> serde_json::Value {
    let output = Command::new(venv_python())
        .arg(script)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{} failed: {stdout}",
        script.display()
    );
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{} printed no JSON ({e}): {stdout}", script.display()))
}
