//! Servers under test: real processes on free loopback ports, killed on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Ports from the test kit: outside the ephemeral range, each handed out once.
pub use fencegate_testkit::free_port;

/// A child process that is killed when dropped.
pub struct Server {
    child: Child,
}

impl Server {
    pub fn start(name: &str, command: &mut Command, log: PathBuf) -> anyhow::Result<Self> {
        let log =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name} ({command:?}); is it installed?"))?;
        Ok(Self { child })
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `fencegate` binary built next to this one.
pub fn fencegate_binary() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let path = me.with_file_name("fencegate");
    if !path.exists() {
        bail!(
            "{} not found; build it with: cargo build --release -p fencegate -p fencegate-bench",
            path.display()
        );
    }
    Ok(path)
}

/// fencegate's Redis module, built with the bench (a dependency): in the binary's `deps/`
/// directory, where cargo leaves a dependency's library and updates it with every build of the
/// bench, else beside the binary (built on its own with `-p fencegate-redis-module`).
pub fn redis_module() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let dir = me.parent().context("the bench's directory")?;
    [dir.join("deps"), dir.to_path_buf()]
        .into_iter()
        .map(|d| d.join("libfencegate_redis_module.so"))
        .find(|p| p.exists())
        .with_context(|| {
            format!(
                "libfencegate_redis_module.so not found in {}; build it with: cargo build --release -p fencegate -p fencegate-bench",
                dir.display()
            )
        })
}

/// Polls `probe` until it yields a value, for at most 30 s.
pub async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(value) = probe().await {
            return Ok(value);
        }
        if Instant::now() > deadline {
            bail!("{what} was not ready after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
