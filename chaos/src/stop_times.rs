//! The runners' own promises: every `lock run` keeps its stop file (`--stop-file`, one per run,
//! `w<slot>-<n>.stop`), and after the run those files say, per revision, when its runner
//! believed the lease ended (last renewal's send time + ttl, CLOCK_MONOTONIC): no later holder
//! may be granted before that.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;

use crate::error::ChaosError;

/// Numbers the runs of this process, so no run's file overwrites another's.
static RUNS: AtomicU64 = AtomicU64::new(1);

/// A fresh stop file path in `dir` for the next run of worker slot `worker`.
pub fn next_path(dir: &Path, worker: u32) -> PathBuf {
    let n = RUNS.fetch_add(1, Ordering::Relaxed);
    dir.join(format!("w{worker}-{n}.stop"))
}

/// What `lock run` writes (README, "Holding a lock while a command runs").
#[derive(Deserialize)]
struct StopFile {
    revision: u64,
    expires_monotonic_ns: u64,
}

/// Per revision, the end of its lease as its runner last computed it. A file that does not
/// parse (none should: the runner renames a whole file into place) is left out.
pub fn read_all(dir: &Path) -> Result<BTreeMap<u64, u64>, ChaosError> {
    let mut ends = BTreeMap::new();
    let entries = std::fs::read_dir(dir).map_err(|e| ChaosError::file(dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| ChaosError::file(dir, e))?.path();
        if path.extension().is_none_or(|x| x != "stop") {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|e| ChaosError::file(&path, e))?;
        if let Ok(file) = serde_json::from_str::<StopFile>(&text) {
            ends.insert(file.revision, file.expires_monotonic_ns);
        }
    }
    Ok(ends)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_run_has_its_own_file_and_they_read_back_by_revision() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (next_path(dir.path(), 1), next_path(dir.path(), 1));
        assert_ne!(a, b);
        std::fs::write(
            &a,
            r#"{"revision":4,"stop_monotonic_ns":10,"expires_monotonic_ns":15}"#,
        )
        .unwrap();
        std::fs::write(b.with_extension("stop.tmp"), "{\"revi").unwrap();
        std::fs::write(&b, "junk").unwrap();
        assert_eq!(read_all(dir.path()).unwrap(), BTreeMap::from([(4, 15)]));
    }
}
