//! CPU time a process spent (user + system, all its threads), from `/proc/<pid>/stat`: the
//! cost of a proxy per request, which, unlike throughput, does not depend on how busy the
//! shared machine is.

use std::process::Command;
use std::time::Duration;

use anyhow::Context;

/// Reads one process's CPU time.
pub struct CpuClock {
    pid: u32,
    /// Clock ticks per second (`getconf CLK_TCK`, 100 on Linux).
    tick: f64,
}

impl CpuClock {
    pub fn new(pid: u32) -> Self {
        let tick = Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0);
        Self { pid, tick }
    }

    /// utime + stime so far. The thread group leader's line counts every thread, live or
    /// exited.
    pub fn used(&self) -> anyhow::Result<Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
            .with_context(|| format!("process {} is gone", self.pid))?;
        // The command name (field 2) is in parentheses and may hold spaces: count after it.
        let after = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest)
            .context("malformed /proc/PID/stat")?;
        let fields: Vec<&str> = after.split_whitespace().collect();
        // Fields 14 and 15 of the line; `after` starts at field 3.
        let ticks = |i: usize| -> anyhow::Result<u64> {
            fields
                .get(i - 3)
                .and_then(|v| v.parse().ok())
                .context("no utime/stime in /proc/PID/stat")
        };
        let total = ticks(14)? + ticks(15)?;
        Ok(Duration::from_secs_f64(total as f64 / self.tick))
    }
}

/// Measures the CPU time `pid` uses while `f` runs.
pub fn during<T>(
    pid: Option<u32>,
    f: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<(T, Option<Duration>)> {
    let clock = pid.map(CpuClock::new);
    let before = clock.as_ref().map(CpuClock::used).transpose()?;
    let value = f()?;
    let after = clock.as_ref().map(CpuClock::used).transpose()?;
    Ok((value, before.zip(after).map(|(b, a)| a - b)))
}
