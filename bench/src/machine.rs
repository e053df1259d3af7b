//! What the figures were measured on.

use std::process::Command;

pub fn describe() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").to_owned())
        })
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or("?".into(), |kb| {
            format!("{:.1} GiB", kb as f64 / 1024.0 / 1024.0)
        });
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    format!(
        "{cores} cores ({cpu}), {memory} memory, kernel {}",
        version(&["uname", "-r"])
    )
}

/// The 1, 5 and 15-minute load averages (`/proc/loadavg`), as "a, b, c".
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(", "))
        .unwrap_or_else(|| "?".into())
}

/// First line a command prints about its own version, or "not found".
pub fn version(command: &[&str]) -> String {
    Command::new(command[0])
        .args(&command[1..])
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(if o.stdout.is_empty() {
                &o.stderr
            } else {
                &o.stdout
            })
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_owned()
        })
        .unwrap_or_else(|| "not found".into())
}

/// The commit the figures were measured at, `-dirty` when tracked files other than the report
/// itself differ from it.
pub fn git_head() -> String {
    let head = version(&["git", "rev-parse", "--short", "HEAD"]);
    let dirty = std::process::Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no", "--", "."])
        .arg(":(exclude)docs/BENCHMARKS.md")
        .output()
        .is_ok_and(|o| !o.stdout.is_empty());
    if dirty {
        format!("{head}-dirty")
    } else {
        head
    }
}
