//! Retention: `fencegate audit prune --keep N` removes the oldest rotated files, keeping the
//! newest `N` and the active file, and records where the remaining log starts (`audit.pruned`)
//! so that `audit verify` checks the chain from that checkpoint and detects files removed later
//! without a prune.
//!
//! Safe while the node runs: the writer only appends to the active file and renames it into a
//! newer rotated file, never touches older ones.

use std::fs;
use std::path::{Path, PathBuf};

use super::files::{self, checkpoint_line, Entry, Head, ACTIVE};
use super::verify::{verify, VerifyError};
use super::{io_error, AuditError};

/// The record of the last prune: `{"seq":N,"hash":"...","time":"...","files_removed":K}`.
pub const MARK: &str = "audit.pruned";

/// What `audit prune` recorded: the checkpoint the remaining log starts from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mark {
    /// Seq of the last record removed (the oldest remaining file's checkpoint).
    pub seq: u64,
    /// Its hash.
    pub hash: String,
    /// When the prune ran, RFC 3339 UTC.
    pub time: String,
    /// How many files that prune removed.
    pub files_removed: usize,
}

/// What a prune did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pruned {
    /// The files removed, oldest first.
    pub removed: Vec<PathBuf>,
    /// The checkpoint the log now starts from (`None`: nothing was removed).
    pub from: Option<Head>,
}

/// Why a prune did not run.
#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    /// The log does not verify; removing files would destroy the evidence of what broke.
    #[error("the audit log does not verify, so nothing was removed (keep the files as evidence, or move the log aside and start a new one): {0}")]
    Unverified(VerifyError),
    /// The active file would be the oldest left but has no checkpoint.
    #[error("the active file {0} has no checkpoint (written by an older version), so the log could not be verified without the files before it; keep at least 1 rotated file")]
    ActiveWithoutCheckpoint(PathBuf),
    /// File I/O failed.
    #[error(transparent)]
    Io(#[from] AuditError),
}

/// The mark of the last prune, if there was one.
pub fn read_mark(dir: &Path) -> Result<Option<Mark>, AuditError> {
    let path = dir.join(MARK);
    match fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| AuditError::Parse {
                path,
                line: 1,
                message: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error(&path)(e)),
    }
}

/// Removes all but the newest `keep` rotated files of the log in `dir` (never the active one),
/// after checking the whole log verifies.
pub fn prune(dir: &Path, keep: usize) -> Result<Pruned, PruneError> {
    verify(dir).map_err(PruneError::Unverified)?;
    let files = files::list(dir)?;
    let active = dir.join(ACTIVE);
    let rotated: Vec<PathBuf> = files
        .into_iter()
        .map(|f| f.path)
        .filter(|p| *p != active)
        .collect();
    if rotated.len() <= keep {
        return Ok(Pruned {
            removed: Vec::new(),
            from: None,
        });
    }
    let (remove, kept) = rotated.split_at(rotated.len() - keep);
    let oldest_kept = kept.first().unwrap_or(&active);
    let last_removed = remove.last().expect("at least one file to remove");
    let from = last_position(last_removed)?;
    if first_entry(oldest_kept)?.is_none_or(|e| !matches!(e, Entry::Checkpoint(_))) {
        // A log written before checkpoints: give the oldest kept file its checkpoint. The
        // writer never rewrites a rotated file, so this cannot race with it.
        if *oldest_kept == active {
            return Err(PruneError::ActiveWithoutCheckpoint(active));
        }
        prepend_checkpoint(oldest_kept, &from)?;
    }
    // The mark first: a crash before the removals leaves a log that still verifies.
    let mark = Mark {
        seq: from.seq,
        hash: from.hash.clone(),
        time: fencegate_core::rfc3339_millis(fencegate_core::now_millis()),
        files_removed: remove.len(),
    };
    let text = serde_json::to_string(&mark).expect("a mark always serializes");
    write_durably(dir, MARK, text.as_bytes())?;
    // Oldest first, so that a crash midway leaves the newest files, still a valid suffix.
    for path in remove {
        fs::remove_file(path).map_err(io_error(path))?;
    }
    sync_dir(dir)?;
    tracing::info!(
        removed = remove.len(),
        from_seq = from.seq,
        "audit log pruned"
    );
    Ok(Pruned {
        removed: remove.to_vec(),
        from: Some(from),
    })
}

fn first_entry(path: &Path) -> Result<Option<Entry>, AuditError> {
    let text = fs::read_to_string(path).map_err(io_error(path))?;
    let Some(line) = text.lines().next() else {
        return Ok(None);
    };
    Entry::parse(line).map(Some).map_err(|e| AuditError::Parse {
        path: path.to_owned(),
        line: 1,
        message: e.to_string(),
    })
}

/// The chain's position at the end of the (rotated, complete) file `path`.
fn last_position(path: &Path) -> Result<Head, AuditError> {
    let text = fs::read_to_string(path).map_err(io_error(path))?;
    let count = text.lines().count();
    let line = text.lines().last().ok_or_else(|| AuditError::Parse {
        path: path.to_owned(),
        line: 1,
        message: "a rotated file without records".into(),
    })?;
    Entry::parse(line)
        .map(|e| e.position())
        .map_err(|e| AuditError::Parse {
            path: path.to_owned(),
            line: count,
            message: e.to_string(),
        })
}

fn prepend_checkpoint(path: &Path, from: &Head) -> Result<(), AuditError> {
    let text = fs::read_to_string(path).map_err(io_error(path))?;
    let name = path
        .file_name()
        .expect("a log file has a name")
        .to_string_lossy();
    let dir = path.parent().expect("a log file is in a directory");
    write_durably(dir, &name, (checkpoint_line(from) + &text).as_bytes())
}

/// Writes `dir/name` through a temp file, fsync'd, renamed, the directory fsync'd.
fn write_durably(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), AuditError> {
    let tmp = dir.join(format!("{name}.tmp"));
    let result = (|| {
        let mut file = fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut file, bytes)?;
        file.sync_all()?;
        fs::rename(&tmp, dir.join(name))
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(io_error(&tmp)(e));
    }
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), AuditError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
}

#[cfg(test)]
mod tests {
    use fencegate_core::{AuditRecord, AuditSink, GENESIS_HASH};

    use super::*;
    use crate::audit::fixture::event;
    use crate::audit::{AuditConfig, AuditWriter, FenceCounters};

    /// Writes `n` refusals through the real writer, rotating every ~2 KB (about 4 records).
    async fn write(dir: &Path, range: std::ops::Range<usize>) {
        let config = AuditConfig {
            dir: Some(dir.to_owned()),
            max_file_bytes: 2_000,
            ..AuditConfig::default()
        };
        let handle = AuditWriter::start(&config, dir, "1", FenceCounters::default(), 0).unwrap();
        for n in range {
            handle.refused(event(n)).await.unwrap();
        }
    }

    fn rotated(dir: &Path) -> Vec<PathBuf> {
        files::list(dir)
            .unwrap()
            .into_iter()
            .map(|f| f.path)
            .filter(|p| !p.ends_with(ACTIVE))
            .collect()
    }

    fn broken(dir: &Path) -> String {
        match verify(dir) {
            Err(VerifyError::Broken(b)) => b.to_string(),
            other => panic!("expected a broken chain, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn pruned_log_verifies_from_its_checkpoint_and_edits_still_fail() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 0..40).await;
        let before = rotated(dir.path());
        assert!(before.len() >= 5, "{before:?}");

        let pruned = prune(dir.path(), 2).unwrap();
        assert_eq!(pruned.removed, before[..before.len() - 2]);
        let kept = rotated(dir.path());
        assert_eq!(kept, before[before.len() - 2..]);
        let report = verify(dir.path()).unwrap();
        let from = report.from.clone().expect("verified from a checkpoint");
        assert_eq!(Some(&from), pruned.from.as_ref());
        assert_eq!(report.mark.as_ref().map(|m| m.seq), Some(from.seq));
        assert_eq!(report.records, 40 - from.seq);

        // Editing a kept record still fails, in the oldest kept file and in a newer one.
        for (file, line) in [(&kept[0], 2), (&kept[1], 3)] {
            let text = fs::read_to_string(file).unwrap();
            let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
            lines[line - 1] = lines[line - 1].replace("\"stale\"", "\"missing\"");
            fs::write(file, lines.join("\n") + "\n").unwrap();
            let err = broken(dir.path());
            assert!(err.contains(&format!(":{line}: record seq")), "{err}");
            assert!(err.contains("was altered"), "{err}");
            fs::write(file, text).unwrap();
        }
        // So does editing the oldest kept file's checkpoint.
        let text = fs::read_to_string(&kept[0]).unwrap();
        let (_, rest) = text.split_once('\n').unwrap();
        let forged = Head {
            seq: from.seq,
            hash: GENESIS_HASH.to_owned(),
        };
        fs::write(&kept[0], checkpoint_line(&forged) + rest).unwrap();
        let err = broken(dir.path());
        assert!(
            err.contains("another hash than `audit prune` recorded"),
            "{err}"
        );
        fs::write(&kept[0], &text).unwrap();

        // Deleting a middle file fails.
        let middle = fs::read(&kept[1]).unwrap();
        fs::remove_file(&kept[1]).unwrap();
        let err = broken(dir.path());
        assert!(err.contains("a file between them was removed"), "{err}");
        fs::write(&kept[1], middle).unwrap();

        // Deleting the oldest kept file without a prune fails.
        fs::remove_file(&kept[0]).unwrap();
        let err = broken(dir.path());
        assert!(err.contains("files were removed since"), "{err}");
        fs::write(&kept[0], &text).unwrap();

        // The node writes on after a prune, and a second prune moves the start again.
        write(dir.path(), 40..50).await;
        assert_eq!(verify(dir.path()).unwrap().from, Some(from.clone()));
        let again = prune(dir.path(), 1).unwrap().from.unwrap();
        assert!(again.seq > from.seq);
        let report = verify(dir.path()).unwrap();
        assert_eq!(report.from, Some(again.clone()));
        assert_eq!(report.records, 50 - again.seq);

        // Nothing left to remove.
        assert_eq!(prune(dir.path(), 1).unwrap().from, None);
    }

    /// `verify` and `prune` run against a log the node is writing and rotating: every verify
    /// passes and the log stays whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn verify_and_prune_while_the_writer_rotates() {
        let dir = tempfile::tempdir().unwrap();
        let config = AuditConfig {
            dir: Some(dir.path().to_owned()),
            max_file_bytes: 1_500,
            batch: 2,
            ..AuditConfig::default()
        };
        let handle =
            AuditWriter::start(&config, dir.path(), "1", FenceCounters::default(), 0).unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let checker = {
            let (dir, done) = (dir.path().to_owned(), done.clone());
            std::thread::spawn(move || {
                let (mut verified, mut pruned) = (0, 0);
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Err(e) = verify(&dir) {
                        panic!("verify failed while the writer rotates: {e}");
                    }
                    verified += 1;
                    if verified % 5 == 0 {
                        pruned += prune(&dir, 3).unwrap().removed.len();
                    }
                }
                (verified, pruned)
            })
        };
        for n in 0..300 {
            handle.refused(event(n)).await.unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let (verified, pruned) = checker.join().unwrap();
        println!("{verified} verifies and {pruned} files pruned while 300 records were written");
        assert!(verified > 0 && pruned > 0, "{verified} {pruned}");
        let report = verify(dir.path()).unwrap();
        let from = report.from.map_or(0, |f| f.seq);
        assert_eq!(from + report.records, 300);
    }

    /// A log written before checkpoints: rotated files without them.
    fn old_log(dir: &Path, files: usize, per_file: u64) {
        let mut prev = GENESIS_HASH.to_owned();
        let mut seq = 0;
        for f in 0..files {
            let mut text = String::new();
            let first = seq + 1;
            for _ in 0..per_file {
                seq += 1;
                let record = AuditRecord::chain(seq, 1000 + seq, "1", event(seq as usize), &prev);
                prev = record.hash.clone();
                text += &(serde_json::to_string(&record).unwrap() + "\n");
            }
            let name = if f + 1 == files {
                ACTIVE.to_owned()
            } else {
                files::rotated_name(first)
            };
            fs::write(dir.join(name), text).unwrap();
        }
    }

    #[test]
    fn an_old_log_verifies_from_the_start_and_prunes_with_a_checkpoint_added() {
        let dir = tempfile::tempdir().unwrap();
        old_log(dir.path(), 4, 3);
        let report = verify(dir.path()).unwrap();
        assert_eq!((report.records, report.files, report.from), (12, 4, None));

        // The active file has no checkpoint: it cannot be the oldest file left.
        let err = prune(dir.path(), 0).unwrap_err();
        assert!(
            matches!(err, PruneError::ActiveWithoutCheckpoint(_)),
            "{err}"
        );
        assert_eq!(verify(dir.path()).unwrap().records, 12, "nothing removed");

        let pruned = prune(dir.path(), 1).unwrap();
        assert_eq!(pruned.removed.len(), 2);
        let report = verify(dir.path()).unwrap();
        assert_eq!(report.from.map(|f| f.seq), Some(6));
        assert_eq!(report.records, 6);
        let first = fs::read_to_string(dir.path().join(files::rotated_name(7))).unwrap();
        assert!(first.starts_with("{\"checkpoint\":{\"seq\":6,"), "{first}");
    }

    #[test]
    fn a_broken_log_is_not_pruned() {
        let dir = tempfile::tempdir().unwrap();
        old_log(dir.path(), 3, 2);
        let path = dir.path().join(files::rotated_name(3));
        let text = fs::read_to_string(&path).unwrap();
        fs::write(&path, text.replace("refusal 3", "refusal 9")).unwrap();
        let err = prune(dir.path(), 0).unwrap_err();
        assert!(matches!(err, PruneError::Unverified(_)), "{err}");
        assert_eq!(files::list(dir.path()).unwrap().len(), 3);
    }
}
