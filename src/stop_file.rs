//! `lock run --stop-file PATH`: the runner keeps its stop time in a file, so a command that
//! wants to stop by itself in time (finish a batch, checkpoint) can read it, and so can a test
//! that checks the runner's promise against the next holder's grant.
//!
//! The file is one JSON line, replaced whole (written aside, then renamed) every time the stop
//! time moves, so a reader never sees half of it:
//! `{"revision":42,"stop_monotonic_ns":...,"expires_monotonic_ns":...}`. Times are
//! CLOCK_MONOTONIC nanoseconds, the clock every process on the machine shares (Python's
//! `time.monotonic_ns()`, `clock_gettime(CLOCK_MONOTONIC)`): `stop` is when the runner stops the
//! command (last renewal's send time + ttl - margin), `expires` the earliest the lease can end as
//! the runner knows it (send time + ttl). The runner never deletes it: the caller owns the path.

use std::path::{Path, PathBuf};

use serde::Serialize;
use tokio::time::Instant;

pub struct StopFile {
    path: PathBuf,
    revision: u64,
}

#[derive(Serialize)]
struct Contents {
    revision: u64,
    stop_monotonic_ns: u64,
    expires_monotonic_ns: u64,
}

impl StopFile {
    /// A stop file at `path` for the lease of `revision`; nothing is written yet.
    pub fn new(path: &Path, revision: u64) -> Self {
        Self {
            path: path.to_owned(),
            revision,
        }
    }

    /// Replaces the file with the stop time `stop` and the lease end `expires`.
    pub fn write(&self, stop: Instant, expires: Instant) -> std::io::Result<()> {
        // One reading of the clock for both, so their difference is exact.
        let clock = Clock::now();
        let line = serde_json::to_string(&Contents {
            revision: self.revision,
            stop_monotonic_ns: clock.ns(stop),
            expires_monotonic_ns: clock.ns(expires),
        })
        .expect("three numbers always serialize");
        let mut aside = self.path.clone().into_os_string();
        aside.push(".tmp");
        std::fs::write(&aside, format!("{line}\n"))?;
        std::fs::rename(&aside, &self.path)
    }
}

/// An `Instant` and CLOCK_MONOTONIC read together. `Instant` reads CLOCK_MONOTONIC on Linux
/// but keeps its value private, so a time is written as its offset from the instant added to
/// the clock.
struct Clock {
    instant: Instant,
    ns: u64,
}

impl Clock {
    fn now() -> Self {
        let instant = Instant::now();
        let clock = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
            .expect("CLOCK_MONOTONIC is always readable");
        let ns = clock.tv_sec() as u64 * 1_000_000_000 + clock.tv_nsec() as u64;
        Self { instant, ns }
    }

    /// `at` on CLOCK_MONOTONIC, in nanoseconds.
    fn ns(&self, at: Instant) -> u64 {
        if at >= self.instant {
            self.ns + (at - self.instant).as_nanos() as u64
        } else {
            self.ns
                .saturating_sub((self.instant - at).as_nanos() as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_file_holds_the_times_on_the_shared_clock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stop.json");
        let file = StopFile::new(&path, 42);
        let before = Clock::now().ns;
        let now = Instant::now();
        file.write(now + Duration::from_secs(2), now + Duration::from_secs(3))
            .unwrap();
        let after = Clock::now().ns;
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["revision"], 42);
        let stop = v["stop_monotonic_ns"].as_u64().unwrap();
        let expires = v["expires_monotonic_ns"].as_u64().unwrap();
        assert!(stop >= before + 2_000_000_000 && stop <= after + 2_000_000_000);
        assert_eq!(expires, stop + 1_000_000_000);
        // A past time stays in the past, and a rewrite replaces the file whole.
        file.write(Instant::now(), Instant::now()).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert!(v["stop_monotonic_ns"].as_u64().unwrap() < stop);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
