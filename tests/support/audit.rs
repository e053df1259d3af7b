//! Reads a node's audit log the way an auditor would: the rotated `audit-*.jsonl` files in
//! order, then the live `audit.jsonl` (the chain-head file and anything else are skipped).

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
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| serde_json::from_str(l).unwrap())
                .collect::<Vec<_>>()
        })
        .collect()
}
