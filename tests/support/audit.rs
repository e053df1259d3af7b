//! Reads a node's audit log the way an auditor would: the rotated `audit-*.jsonl` files in
//! order, then the live `audit.jsonl` (the chain-head file, the checkpoint line each file after
//! the first starts with, a last line without its newline, and anything else are skipped).

use std::path::{Path, PathBuf};

/// Every record in `dir`, oldest first, parsed.
pub fn records(dir: &Path) -> Vec<serde_json::Value> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
                .collect()
        })
        .unwrap_or_default();
    files.sort_by_key(|p| (p.file_name().unwrap() == "audit.jsonl", p.clone()));
    files
        .iter()
        .flat_map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            // A last line without its newline is a write in progress (or cut), not a record.
            let complete = text.rfind('\n').map_or("", |end| &text[..=end]).to_owned();
            complete
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
                .filter(|v| v.get("checkpoint").is_none())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// How many refusals the records of `dir` stand for, by reason: an aggregate record (a flood
/// of identical tokenless or malformed refusals from one client within a second) counts the
/// refusals it stands for; any other record counts one.
pub fn refusals_by_reason(dir: &Path) -> std::collections::BTreeMap<String, u64> {
    let mut counts = std::collections::BTreeMap::new();
    for record in records(dir) {
        let Some(reason) = record["reason"].as_str() else {
            continue;
        };
        let n = record["detail"]
            .as_str()
            .and_then(|d| d.strip_prefix("aggregate: "))
            .and_then(|d| d.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        *counts.entry(reason.to_owned()).or_insert(0) += n;
    }
    counts
}

/// Waits (polling, bounded) until the records of `dir` stand for exactly `want` refusals by
/// reason: aggregate records are written once their second is over.
pub fn wait_for_refusals(dir: &Path, want: &[(&str, u64)]) {
    let want: std::collections::BTreeMap<String, u64> =
        want.iter().map(|(r, n)| (r.to_string(), *n)).collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let seen = refusals_by_reason(dir);
        if seen == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "audit records stand for {seen:?}, expected {want:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
