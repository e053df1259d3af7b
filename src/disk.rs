//! The disk reservation checked at start: the Raft log must never share a failure with the
//! audit log (DESIGN rule 10). The Raft directory can be its own volume (`[node] raft_dir`);
//! either way the node starts only when that volume has `[node] min_free_bytes` free, plus what
//! the audit log may still grow when it sits on the same volume, and the audit volume has the
//! reservation too.

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::config::Config;

/// The Raft log, vote and state machine: one redb file in the Raft directory.
pub const RAFT_FILE: &str = "authority.redb";

#[derive(Debug, Error)]
pub enum DiskError {
    // Not a `source`: the message already says it, and `{:#}` would print it twice.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path} has {free} bytes free, below the {needed} bytes this node reserves ({why}); free space on that volume, give the Raft log its own volume with [node] raft_dir, or lower [node] min_free_bytes / [audit] max_total_bytes")]
    Low {
        path: PathBuf,
        free: u64,
        needed: u64,
        why: String,
    },
    #[error("{old} holds the Raft log from before [node] raft_dir was set, and {new} holds none: with the node stopped, move {old} to {new} (or unset raft_dir); starting with an empty log would issue tokens again from revision 1")]
    Moved { old: PathBuf, new: PathBuf },
}

/// Bytes an unprivileged process may still write on the volume holding `path`.
// The field types differ between platforms.
#[allow(clippy::unnecessary_cast)]
pub fn free_bytes(path: &Path) -> Result<u64, DiskError> {
    let stat = nix::sys::statvfs::statvfs(path).map_err(|e| DiskError::Io {
        path: path.to_owned(),
        error: e.into(),
    })?;
    Ok(stat.blocks_available() as u64 * stat.fragment_size() as u64)
}

/// The volume (device) `path` lives on.
fn device(path: &Path) -> Result<u64, DiskError> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .map(|m| m.dev())
        .map_err(|error| DiskError::Io {
            path: path.to_owned(),
            error,
        })
}

/// Bytes of the regular files directly in `dir` (the audit log keeps no subdirectories).
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn create(dir: &Path) -> Result<(), DiskError> {
    std::fs::create_dir_all(dir).map_err(|error| DiskError::Io {
        path: dir.to_owned(),
        error,
    })
}

/// Creates the Raft and audit directories and checks the reservation; see the module doc.
pub fn check(config: &Config) -> Result<(), DiskError> {
    let raft = config.node.raft_dir();
    let audit = config.audit.dir(&config.node.data_dir);
    let legacy = config.node.data_dir.join(RAFT_FILE);
    if raft != config.node.data_dir && legacy.exists() && !raft.join(RAFT_FILE).exists() {
        return Err(DiskError::Moved {
            old: legacy,
            new: raft.join(RAFT_FILE),
        });
    }
    create(&raft)?;
    create(&audit)?;
    let reserve = config.node.min_free_bytes;
    let shared = device(&raft)? == device(&audit)?;
    // On a shared volume the audit log may still grow to its budget; that growth must not eat
    // the Raft log's reservation.
    let audit_headroom = if shared {
        config
            .audit
            .max_total_bytes
            .saturating_sub(dir_bytes(&audit))
    } else {
        0
    };
    let needed = reserve.saturating_add(audit_headroom);
    let free = free_bytes(&raft)?;
    if free < needed {
        let why = if shared {
            format!(
                "min_free_bytes {reserve} for the Raft log, plus {audit_headroom} the audit log in {} may still write on the same volume",
                audit.display()
            )
        } else {
            format!("min_free_bytes {reserve} for the Raft log")
        };
        return Err(DiskError::Low {
            path: raft,
            free,
            needed,
            why,
        });
    }
    if !shared {
        let free = free_bytes(&audit)?;
        if free < reserve {
            return Err(DiskError::Low {
                path: audit,
                free,
                needed: reserve,
                why: format!("min_free_bytes {reserve}, so the audit log can record refusals"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path, extra: &str) -> Config {
        let text = format!(
            "[node]\ndata_dir = \"{}\"\n{extra}\n[security]\ninsecure = true\n",
            dir.join("data").display()
        );
        Config::parse(Path::new("test.toml"), &text).unwrap()
    }

    #[test]
    fn a_reservation_above_the_free_space_refuses_to_start() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        let c = config(dir.path(), &format!("min_free_bytes = {}\n", free * 2));
        let err = check(&c).unwrap_err().to_string();
        assert!(
            err.contains("below the") && err.contains("raft_dir"),
            "{err}"
        );
        assert!(err.contains("audit log"), "same volume: {err}");
        let c = config(
            dir.path(),
            "min_free_bytes = 1024\n[audit]\nmax_total_bytes = 1024\n",
        );
        check(&c).unwrap();
        assert!(dir.path().join("data/audit").is_dir());
    }

    #[test]
    fn the_audit_budget_counts_against_a_shared_volume() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        let c = config(
            dir.path(),
            &format!(
                "min_free_bytes = 1024\n[audit]\nmax_total_bytes = {}\n",
                free * 2
            ),
        );
        let err = check(&c).unwrap_err().to_string();
        assert!(err.contains("may still write on the same volume"), "{err}");
    }

    #[test]
    fn a_raft_log_left_in_data_dir_is_not_silently_abandoned() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("data")).unwrap();
        std::fs::write(dir.path().join("data").join(RAFT_FILE), b"").unwrap();
        let raft = dir.path().join("raft");
        let c = config(
            dir.path(),
            &format!(
                "raft_dir = \"{}\"\nmin_free_bytes = 0\n[audit]\nmax_total_bytes = 1\n",
                raft.display()
            ),
        );
        let err = check(&c).unwrap_err().to_string();
        assert!(err.contains("move") && err.contains("revision 1"), "{err}");
        // Without raft_dir the old layout keeps working.
        let c = config(
            dir.path(),
            "min_free_bytes = 0\n[audit]\nmax_total_bytes = 1\n",
        );
        check(&c).unwrap();
    }
}
