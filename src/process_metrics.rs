//! The standard `process_*` metrics (what Prometheus client libraries export), read from
//! `/proc/self` at scrape time. Linux only: elsewhere the section is empty.

use std::fmt::Write;

/// `/proc/[pid]/stat` counts CPU time in USER_HZ ticks, which Linux fixes at 100 for user
/// space whatever the kernel's own tick rate.
const TICKS_PER_SECOND: f64 = 100.0;

/// The process metrics in the classic text format, or an empty string where `/proc` is absent.
pub fn render() -> String {
    let mut out = String::new();
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return out;
    };
    // Fields after the command name, which is in parentheses and may contain spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // Numbered as in proc(5): field 3 (state) is fields[0].
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    if let (Some(utime), Some(stime)) = (field(14), field(15)) {
        metric(
            &mut out,
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            (utime + stime) / TICKS_PER_SECOND,
        );
    }
    if let Some(vsize) = field(23) {
        metric(
            &mut out,
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            vsize,
        );
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let status_value = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
    };
    if let Some(kib) = status_value("VmRSS:") {
        metric(
            &mut out,
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            kib * 1024.0,
        );
    }
    if let Some(threads) = status_value("Threads:") {
        metric(
            &mut out,
            "process_threads",
            "gauge",
            "Number of OS threads in the process.",
            threads,
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        metric(
            &mut out,
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            fds.count() as f64,
        );
    }
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let max_fds = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok());
    if let Some(max_fds) = max_fds {
        metric(
            &mut out,
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            max_fds,
        );
    }
    let boot = std::fs::read_to_string("/proc/stat")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    if let (Some(boot), Some(start)) = (boot, field(22)) {
        metric(
            &mut out,
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            boot + start / TICKS_PER_SECOND,
        );
    }
    out
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    let _ = writeln!(out, "{name} {value}");
}
