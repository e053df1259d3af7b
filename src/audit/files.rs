//! The log's files, in chain order, and reading their lines: records, and the checkpoint each
//! file after the first starts with.

use std::fs;
use std::path::{Path, PathBuf};

use fencegate_core::AuditRecord;

use super::{io_error, AuditError};

/// The file being written.
pub const ACTIVE: &str = "audit.jsonl";

/// The chain's head (`{"seq":N,"hash":"..."}`), rewritten after each fsync'd batch, so that
/// deleting the *last* records is detected too. It may lag the log after a crash, never lead it.
pub const HEAD: &str = "audit.head";

/// A rotation being made: the next active file, holding only its checkpoint line until it is
/// renamed to [`ACTIVE`] (a crash between the two renames of a rotation leaves it behind; the
/// writer finishes the rotation at startup).
pub const NEXT: &str = "audit.jsonl.next";

/// A position in the chain: the head file's content, and a file's starting checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Head {
    /// Seq of the last record known durable.
    pub seq: u64,
    /// Its hash.
    pub hash: String,
}

/// Writes the head file (temp file, rename).
pub fn write_head(dir: &Path, head: &Head) -> Result<(), AuditError> {
    let tmp = dir.join("audit.head.tmp");
    let text = serde_json::to_string(head).expect("a head always serializes");
    let file = fs::File::create(&tmp).map_err(io_error(&tmp))?;
    std::io::Write::write_all(&mut &file, text.as_bytes()).map_err(io_error(&tmp))?;
    // Not fsync'd: the records are; a head lost or emptied by a crash only lags (or is
    // ignored), it never makes an intact log fail.
    fs::rename(&tmp, dir.join(HEAD)).map_err(io_error(&tmp))
}

/// The head file, if there is one.
pub fn read_head(dir: &Path) -> Result<Option<Head>, AuditError> {
    let path = dir.join(HEAD);
    match fs::read_to_string(&path) {
        // Unreadable after a crash (the head is not fsync'd): no anchor, not a broken log.
        Ok(text) => Ok(serde_json::from_str(&text).ok()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_error(&path)(e)),
    }
}

/// One line of a file: a record, or a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
// Nearly every entry is a record: boxing it would cost an allocation per line for nothing.
#[allow(clippy::large_enum_variant)]
pub enum Entry {
    /// A refusal's record.
    Record(AuditRecord),
    /// The first line of a file after the first: the chain's head where the previous file
    /// ended. The file's first record follows it; once older files are pruned, verification
    /// starts from the oldest file's checkpoint.
    Checkpoint(Head),
}

/// How a checkpoint is written: `{"checkpoint":{"seq":N,"hash":"..."}}`.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckpointLine {
    checkpoint: Head,
}

impl Entry {
    /// Parses one line (without its newline).
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        if text.starts_with("{\"checkpoint\"") {
            let line: CheckpointLine = serde_json::from_str(text)?;
            return Ok(Self::Checkpoint(line.checkpoint));
        }
        serde_json::from_str(text).map(Self::Record)
    }

    /// The chain's position after this entry.
    pub fn position(&self) -> Head {
        match self {
            Self::Record(r) => Head {
                seq: r.seq,
                hash: r.hash.clone(),
            },
            Self::Checkpoint(c) => c.clone(),
        }
    }
}

/// The checkpoint line for `head`, with its newline.
pub fn checkpoint_line(head: &Head) -> String {
    let line = CheckpointLine {
        checkpoint: head.clone(),
    };
    serde_json::to_string(&line).expect("a checkpoint always serializes") + "\n"
}

/// One file of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogFile {
    /// Its path.
    pub path: PathBuf,
}

/// The name a rotated file gets: `audit-<first seq>.jsonl`.
pub fn rotated_name(first_seq: u64) -> String {
    format!("audit-{first_seq:020}.jsonl")
}

/// The log's files in chain order: rotated files by first seq, then the active file.
pub fn list(dir: &Path) -> Result<Vec<LogFile>, AuditError> {
    let mut rotated = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_error(dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io_error(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("audit-") && name.ends_with(".jsonl") {
            rotated.push(name);
        }
    }
    rotated.sort();
    let mut files: Vec<LogFile> = rotated
        .into_iter()
        .map(|name| LogFile {
            path: dir.join(name),
        })
        .collect();
    let active = dir.join(ACTIVE);
    if active.exists() {
        files.push(LogFile { path: active });
    }
    Ok(files)
}

/// One line of a file, parsed or not.
pub struct Line {
    /// The file.
    pub path: PathBuf,
    /// 1-based line number in it.
    pub number: usize,
    /// The text, without the newline.
    pub text: String,
}

/// Every complete line of every file, in chain order. A last line without its newline (a write
/// cut by a crash, never acknowledged) is left out.
pub fn lines(dir: &Path) -> Result<Vec<Line>, AuditError> {
    // A rotation between listing and reading would show the new active file in place of the
    // old one: read again (bounded) until the listing is the same after the reads.
    let mut files = list(dir)?;
    for _ in 0..5 {
        let (out, missing) = read_lines(&files)?;
        let after = list(dir)?;
        if after == files && !missing {
            return Ok(out);
        }
        files = after;
    }
    Ok(read_lines(&files)?.0)
}

/// The complete lines of `files`, and whether one of them was gone (rotated away meanwhile).
fn read_lines(files: &[LogFile]) -> Result<(Vec<Line>, bool), AuditError> {
    let mut out = Vec::new();
    let mut missing = false;
    for file in files {
        let text = match fs::read_to_string(&file.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                missing = true;
                continue;
            }
            Err(e) => return Err(io_error(&file.path)(e)),
        };
        let complete = match text.rfind('\n') {
            Some(end) => &text[..=end],
            None => "",
        };
        for (i, line) in complete.lines().enumerate() {
            out.push(Line {
                path: file.path.clone(),
                number: i + 1,
                text: line.to_owned(),
            });
        }
    }
    Ok((out, missing))
}

/// Every line of the log with its entry, in order; the first unparseable line is an error.
pub fn entries(dir: &Path) -> Result<Vec<(Line, Entry)>, AuditError> {
    lines(dir)?
        .into_iter()
        .map(|line| match Entry::parse(&line.text) {
            Ok(entry) => Ok((line, entry)),
            Err(e) => Err(AuditError::Parse {
                path: line.path.clone(),
                line: line.number,
                message: e.to_string(),
            }),
        })
        .collect()
}

/// Every record of the log, in order (checkpoints left out); the first unparseable line is an
/// error.
pub fn read_records(dir: &Path) -> Result<Vec<AuditRecord>, AuditError> {
    Ok(entries(dir)?
        .into_iter()
        .filter_map(|(_, entry)| match entry {
            Entry::Record(r) => Some(r),
            Entry::Checkpoint(_) => None,
        })
        .collect())
}
