//! Checks the whole chain: every line parses, seqs follow without gaps, every `prev` is the
//! previous record's `hash`, every `hash` matches the record, and every file after the first
//! starts with a checkpoint equal to where the previous file ended. The chain starts at seq 1
//! (genesis) or, once older files were pruned, at the oldest remaining file's checkpoint; a log
//! written before checkpoints existed verifies from seq 1 as before.

use std::path::{Path, PathBuf};

use fencegate_core::GENESIS_HASH;

use super::files::{lines, read_head, Entry, Head};
use super::prune::{read_mark, Mark};
use super::AuditError;

/// A chain that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// Records checked.
    pub records: u64,
    /// Files checked.
    pub files: usize,
    /// The last record's hash (the value to anchor elsewhere).
    pub head: String,
    /// The checkpoint verification started from, when older files were pruned (`None`: from
    /// seq 1).
    pub from: Option<Head>,
    /// What `audit prune` recorded, if it ever ran. When `from` is set and this is `None`, the
    /// older files were removed by something other than `audit prune`.
    pub mark: Option<Mark>,
}

/// The first broken record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}:{line}: {problem}", path.display())]
pub struct Broken {
    /// The file.
    pub path: PathBuf,
    /// 1-based line number in it.
    pub line: usize,
    /// What is wrong.
    pub problem: String,
}

/// Why verification did not pass.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// The chain is broken here.
    #[error("audit chain broken at {0}")]
    Broken(Broken),
    /// The files could not be read.
    #[error(transparent)]
    Io(#[from] AuditError),
}

/// Verifies the log in `dir`.
pub fn verify(dir: &Path) -> Result<Report, VerifyError> {
    // The head before the lines: the writer rewrites it only after the records it names are
    // on disk, so read first it never leads the lines read after it, even while the node writes.
    let head = read_head(dir)?;
    let lines = lines(dir)?;
    let mut files: Vec<&PathBuf> = lines.iter().map(|l| &l.path).collect();
    files.dedup();
    let files = files.len();
    let mark = read_mark(dir)?;
    // Where the chain is after the entries checked so far; `None` before the first.
    let mut at: Option<Head> = None;
    let mut from = None;
    let mut records = 0u64;
    // Whether the chain passed the position `audit prune` recorded (it must: files removed
    // after the last prune, without one, are detected).
    let mut passed_mark = mark.is_none();
    for line in &lines {
        let broken = |problem: String| {
            VerifyError::Broken(Broken {
                path: line.path.clone(),
                line: line.number,
                problem,
            })
        };
        let entry =
            Entry::parse(&line.text).map_err(|e| broken(format!("not an audit record ({e})")))?;
        match &entry {
            Entry::Checkpoint(checkpoint) => {
                if line.number != 1 {
                    return Err(broken(
                        "a checkpoint inside a file (checkpoints only start files)".into(),
                    ));
                }
                match &at {
                    // The oldest remaining file: the chain is checked from here.
                    None => from = Some(checkpoint.clone()),
                    Some(end) if end != checkpoint => {
                        return Err(broken(format!(
                            "this file starts at checkpoint seq {} but the previous file ends at seq {}{}: a file between them was removed or altered",
                            checkpoint.seq,
                            end.seq,
                            if end.seq == checkpoint.seq { " with another hash" } else { "" },
                        )));
                    }
                    Some(_) => {}
                }
            }
            Entry::Record(record) => {
                let prev = at.clone().unwrap_or_else(|| Head {
                    seq: 0,
                    hash: GENESIS_HASH.to_owned(),
                });
                if record.hash != record.compute_hash() {
                    return Err(broken(format!(
                        "record seq {} was altered: its hash does not match its content",
                        record.seq
                    )));
                }
                if record.prev != prev.hash {
                    return Err(broken(format!(
                        "record seq {} does not follow the previous record (a record before it was removed, reordered or altered)",
                        record.seq
                    )));
                }
                if record.seq != prev.seq + 1 {
                    return Err(broken(format!(
                        "record seq {} where seq {} was expected",
                        record.seq,
                        prev.seq + 1
                    )));
                }
                records += 1;
            }
        }
        let position = entry.position();
        if let Some(mark) = &mark {
            if position.seq == mark.seq {
                if position.hash != mark.hash {
                    return Err(broken(format!(
                        "seq {} has another hash than `audit prune` recorded in {} (the log was altered or replaced)",
                        mark.seq,
                        super::prune::MARK
                    )));
                }
                passed_mark = true;
            } else if at.is_none() && position.seq > mark.seq {
                return Err(broken(format!(
                    "the log starts at seq {} but the last `audit prune` kept it from seq {} ({}): files were removed since",
                    position.seq,
                    mark.seq,
                    super::prune::MARK
                )));
            }
        }
        at = Some(position);
    }
    let last = at.unwrap_or_else(|| Head {
        seq: 0,
        hash: GENESIS_HASH.to_owned(),
    });
    if let (Some(mark), false) = (&mark, passed_mark) {
        return Err(VerifyError::Broken(Broken {
            path: dir.join(super::prune::MARK),
            line: 1,
            problem: format!(
                "the log ends at seq {} before seq {}, which `audit prune` kept (files were removed)",
                last.seq, mark.seq
            ),
        }));
    }
    if let Some(kept) = std::fs::read_dir(dir)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("audit.head.mismatch-"))
        })
    {
        return Err(VerifyError::Broken(Broken {
            path: kept,
            line: 1,
            problem: "the writer found the log shorter than its recorded head at startup (records were removed from the end)".into(),
        }));
    }
    if let Some(head) = head {
        // The head may lag the log (a crash between the batch's fsync and the head's), never
        // lead it: a head beyond the last record means records were cut off the end. A head
        // before the oldest remaining file (pruned) cannot be checked.
        let start = from.as_ref().map_or(0, |f| f.seq);
        let at_head = lines.iter().rev().find_map(|l| {
            let position = Entry::parse(&l.text).ok()?.position();
            (position.seq == head.seq).then_some(position.hash)
        });
        let matches =
            head.seq == 0 || head.seq < start || at_head.as_deref() == Some(head.hash.as_str());
        if head.seq > last.seq || !matches {
            return Err(VerifyError::Broken(Broken {
                path: dir.join(super::files::HEAD),
                line: 1,
                problem: format!(
                    "the log ends at seq {} but its head file records seq {} (records were removed from the end)",
                    last.seq, head.seq
                ),
            }));
        }
    }
    Ok(Report {
        records,
        files,
        head: last.hash,
        from,
        mark,
    })
}

#[cfg(test)]
mod tests {
    use fencegate_core::{AuditEvent, AuditRecord, OperationSummary};

    use super::*;

    fn write_log(dir: &Path, n: u64) -> Vec<String> {
        let mut prev = GENESIS_HASH.to_owned();
        let mut lines = Vec::new();
        for seq in 1..=n {
            let event = AuditEvent {
                store: "redis".into(),
                client_addr: "c".into(),
                client_identity: None,
                resource: Some("job".into()),
                token: None,
                token_signed: false,
                revision: None,
                fence: None,
                reason: "missing".into(),
                detail: String::new(),
                operation: OperationSummary::default(),
                request_id: seq.to_string(),
            };
            let record = AuditRecord::chain(seq, 1000 + seq, "1", event, &prev);
            prev = record.hash.clone();
            lines.push(serde_json::to_string(&record).unwrap());
        }
        std::fs::write(dir.join("audit.jsonl"), lines.join("\n") + "\n").unwrap();
        lines
    }

    #[test]
    fn intact_log_passes() {
        let dir = tempfile::tempdir().unwrap();
        write_log(dir.path(), 5);
        let report = verify(dir.path()).unwrap();
        assert_eq!((report.records, report.files), (5, 1));
    }

    #[test]
    fn edited_deleted_and_reordered_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let lines = write_log(dir.path(), 5);

        let mut edited = lines.clone();
        edited[2] = edited[2].replace("\"missing\"", "\"stale\"");
        std::fs::write(&path, edited.join("\n") + "\n").unwrap();
        let err = verify(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("audit.jsonl:3: record seq 3 was altered"),
            "{err}"
        );

        let mut deleted = lines.clone();
        deleted.remove(1);
        std::fs::write(&path, deleted.join("\n") + "\n").unwrap();
        let err = verify(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("audit.jsonl:2: record seq 3 does not follow"),
            "{err}"
        );

        std::fs::write(&path, lines[..4].join("\n") + "\n").unwrap();
        let last = serde_json::from_str::<AuditRecord>(&lines[4]).unwrap();
        crate::audit::files::write_head(
            dir.path(),
            &crate::audit::files::Head {
                seq: 5,
                hash: last.hash,
            },
        )
        .unwrap();
        let err = verify(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("audit.head:1: the log ends at seq 4 but its head file records seq 5"),
            "{err}"
        );
        std::fs::remove_file(dir.path().join("audit.head")).unwrap();

        let mut reordered = lines.clone();
        reordered.swap(3, 4);
        std::fs::write(&path, reordered.join("\n") + "\n").unwrap();
        let err = verify(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("audit.jsonl:4: record seq 5 does not follow"),
            "{err}"
        );
    }
}
