//! The history a worker leaves: one JSON line per event, appended and flushed as it happens, so
//! a worker killed at any point leaves every event before the kill.
//!
//! Times are CLOCK_MONOTONIC nanoseconds: every process on the machine reads the same clock, so
//! events of different workers and the nemesis's faults can be ordered against each other.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::ChaosError;

/// What happened to one write, or to the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// The worker started with a token (its grant, as the job saw it).
    Start,
    /// About to send a write; written before the first byte leaves.
    Invoke,
    /// The store acknowledged the write.
    Ok,
    /// The store (or gateway) refused the write: nothing of it may be stored.
    Refused,
    /// No answer (connection cut, node killed, timeout): it may or may not be stored.
    Unknown,
    /// Not sent at all (no connection): it cannot be stored.
    Fail,
}

/// One line of a worker's history.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Event {
    /// CLOCK_MONOTONIC, nanoseconds.
    pub t: u64,
    pub worker: u32,
    /// The revision of the worker's token.
    pub rev: u64,
    pub op: Op,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// Which store the write went to ("redis").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
    /// Whose gateway carried it (0: straight to the store, fencing bypassed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u64>,
    /// The refusal's code, or what went wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

impl Event {
    /// The record this write puts in the store: `<worker>:<seq>:<revision>`.
    pub fn record(&self) -> Option<String> {
        Some(record(self.worker, self.seq?, self.rev))
    }
}

/// The value written for `worker`'s write `seq` under `rev`.
pub fn record(worker: u32, seq: u64, rev: u64) -> String {
    format!("{worker}:{seq}:{rev}")
}

/// `(worker, seq, revision)` of a stored record; `None` for anything else.
pub fn parse_record(text: &str) -> Option<(u32, u64, u64)> {
    let mut parts = text.split(':');
    let worker = parts.next()?.parse().ok()?;
    let seq = parts.next()?.parse().ok()?;
    let rev = parts.next()?.parse().ok()?;
    parts.next().is_none().then_some((worker, seq, rev))
}

/// CLOCK_MONOTONIC now, in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always readable");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// Appends events to one worker's history file.
pub struct HistoryWriter {
    file: File,
    path: PathBuf,
}

impl HistoryWriter {
    /// Opens `path` for appending; a line cut by an earlier worker's death is ended first, so
    /// it cannot swallow the next event.
    pub fn open(path: &Path) -> Result<Self, ChaosError> {
        let earlier = std::fs::read(path).unwrap_or_default();
        let mut file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| ChaosError::file(path, e))?;
        if earlier.last().is_some_and(|b| *b != b'\n') {
            file.write_all(b"\n")
                .map_err(|e| ChaosError::file(path, e))?;
        }
        Ok(Self {
            file,
            path: path.to_owned(),
        })
    }

    /// Writes `event` as one line with one `write` call (O_APPEND: a line is never interleaved).
    pub fn append(&mut self, event: &Event) -> Result<(), ChaosError> {
        let mut line = serde_json::to_vec(event).expect("an event always serializes");
        line.push(b'\n');
        self.file
            .write_all(&line)
            .map_err(|e| ChaosError::file(&self.path, e))
    }
}

/// Every event of every `*.jsonl` history in `dir`; lines that do not parse (a worker killed
/// mid-line) are counted, not returned.
pub fn read_all(dir: &Path) -> Result<(Vec<Event>, usize), ChaosError> {
    let mut events = Vec::new();
    let mut torn = 0;
    let entries = std::fs::read_dir(dir).map_err(|e| ChaosError::file(dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| ChaosError::file(dir, e))?.path();
        if path.extension().is_none_or(|x| x != "jsonl") {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|e| ChaosError::file(&path, e))?;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str::<Event>(line) {
                Ok(event) => events.push(event),
                Err(_) => torn += 1,
            }
        }
    }
    events.sort_by_key(|e| e.t);
    Ok((events, torn))
}

/// The highest `seq` in a history file, so a worker's next process goes on numbering.
pub fn last_seq(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Event>(l).ok())
        .filter_map(|e| e.seq)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_junk_is_not_a_record() {
        assert_eq!(parse_record(&record(2, 17, 40)), Some((2, 17, 40)));
        assert_eq!(parse_record("2:17"), None);
        assert_eq!(parse_record("2:17:40:1"), None);
        assert_eq!(parse_record("a:b:c"), None);
    }

    #[test]
    fn a_cut_line_does_not_swallow_the_next_event() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w1.jsonl");
        std::fs::write(&path, "{\"t\":1,\"worker\":1,\"rev\":3,\"op\":\"inv").unwrap();
        let mut writer = HistoryWriter::open(&path).unwrap();
        let event = Event {
            t: 2,
            worker: 1,
            rev: 3,
            op: Op::Ok,
            seq: Some(9),
            store: Some("redis".into()),
            node: Some(1),
            detail: None,
            pid: None,
        };
        writer.append(&event).unwrap();
        let (events, torn) = read_all(dir.path()).unwrap();
        assert_eq!((events.len(), torn), (1, 1));
        assert_eq!(events[0].record().as_deref(), Some("1:9:3"));
        assert_eq!(last_seq(&path), 9);
    }
}
