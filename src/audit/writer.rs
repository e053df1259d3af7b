//! The single writer: a bounded queue, batched writes with one fsync per batch, the hash chain,
//! size-based rotation (each new file starts with a checkpoint of the chain's head), and what
//! happens when the disk refuses a write.
//!
//! A write that fails (disk full, read-only volume, I/O error) fails its batch: the refusals in
//! it still refuse, their submitters get the error, and the node reports it (the
//! `fencegate_audit_write_failing` gauge, `/healthz`, one log line). Nothing acknowledged is
//! touched: before the next write, the active file is cut back to its last acknowledged byte, so
//! a batch that was half written never becomes part of the chain, and the chain goes on from
//! the last record on disk once the volume takes writes again.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate_core::{
    now_millis, AuditEvent, AuditRecord, AuditSink, AuditSinkError, SinkFuture, GENESIS_HASH,
};
use tokio::sync::{mpsc, oneshot};

use super::aggregate::{Admit, Aggregator};
use super::files::{self, checkpoint_line, rotated_name, Entry, Head, ACTIVE, NEXT};
use super::{io_error, AuditConfig, AuditError, FenceCounters};

struct Submission {
    event: AuditEvent,
    done: oneshot::Sender<Result<(), AuditSinkError>>,
}

/// What the writer thread receives.
// Nearly every message is a refusal: boxing it would cost an allocation per refusal.
#[allow(clippy::large_enum_variant)]
enum Message {
    Refusal(Submission),
    /// While the log cannot be written: try again without a refusal waiting, so that the node
    /// reports the log healthy as soon as the volume takes writes again.
    Probe,
}

/// Starts the writer thread; see [`AuditWriter::start`].
pub struct AuditWriter;

/// What filters hold to submit refusals and count applied writes. Cheap to clone.
#[derive(Clone)]
pub struct AuditHandle {
    queue: mpsc::Sender<Message>,
    counters: FenceCounters,
    aggregator: Arc<Mutex<Aggregator>>,
}

/// Reasons that are only counted while the log is over its size budget (the aggregated ones).
const SUPPRESSIBLE: &[&str] = &["missing", "malformed"];

struct State {
    dir: PathBuf,
    node: String,
    max_file_bytes: u64,
    /// Bytes of every file in the directory, and the budget for them.
    total_bytes: u64,
    max_total_bytes: u64,
    file: File,
    /// Bytes of the active file that are acknowledged (written and fsync'd).
    file_bytes: u64,
    /// Seq of the first record in the active file (for its name when rotated).
    file_first_seq: Option<u64>,
    last_seq: u64,
    last_hash: String,
    /// Why the last write failed, until one succeeds. While set, the active file may hold
    /// bytes of the failed batch after `file_bytes`; they are cut before the next write.
    failure: Option<String>,
    /// Free bytes the audit volume must keep (`[node] min_free_bytes`): below it the log acts
    /// as over budget, so a flood cannot take the space the Raft log may share. 0: no check.
    reserve: u64,
}

impl AuditWriter {
    /// Opens (or creates) the log in `config.dir(data_dir)`, recovers the chain's tail, and
    /// starts the writer thread. Dropping every handle stops it. While the volume has less
    /// than `reserve` bytes free, the log behaves as over its budget.
    pub fn start(
        config: &AuditConfig,
        data_dir: &Path,
        node: &str,
        counters: FenceCounters,
        reserve: u64,
    ) -> Result<AuditHandle, AuditError> {
        let dir = config.dir(data_dir);
        let mut state = State::open(&dir, node, config.max_file_bytes)?;
        state.max_total_bytes = config.max_total_bytes;
        state.reserve = reserve;
        tracing::info!(dir = %dir.display(), last_seq = state.last_seq, bytes = state.total_bytes, budget = state.max_total_bytes, "audit log open");
        let (queue, rx) = mpsc::channel(config.queue.max(1));
        let batch = config.batch.max(1);
        let thread_counters = counters.clone();
        std::thread::Builder::new()
            .name("audit-writer".into())
            .spawn(move || run(state, rx, batch, thread_counters))
            .map_err(io_error(&dir))?;
        let aggregator = Arc::new(Mutex::new(Aggregator::default()));
        // Writes each second's aggregates once the second is over, even if no refusal follows,
        // and asks the writer to retry while the log cannot be written.
        let (weak, ticking, failing) = (queue.downgrade(), aggregator.clone(), counters.clone());
        std::thread::Builder::new()
            .name("audit-aggregate".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(500));
                let Some(queue) = weak.upgrade() else { return };
                let due = lock(&ticking).take_due(now_millis() / 1000);
                for event in due {
                    let (done, _) = oneshot::channel();
                    let message = Message::Refusal(Submission { event, done });
                    if queue.blocking_send(message).is_err() {
                        return;
                    }
                }
                if failing.write_failure().is_some() {
                    // A full queue has refusals that will retry anyway.
                    let _ = queue.try_send(Message::Probe);
                }
            })
            .map_err(io_error(&dir))?;
        Ok(AuditHandle {
            queue,
            counters,
            aggregator,
        })
    }
}

fn run(mut state: State, mut rx: mpsc::Receiver<Message>, batch: usize, counters: FenceCounters) {
    while let Some(first) = rx.blocking_recv() {
        let mut submissions = Vec::new();
        let mut next = Some(first);
        while let Some(message) = next.take() {
            if let Message::Refusal(s) = message {
                submissions.push(s);
            }
            if submissions.len() < batch {
                next = rx.try_recv().ok();
            }
        }
        if submissions.is_empty() {
            state.probe();
            report_failure(&state, &counters);
            continue;
        }
        if state.total_bytes >= state.max_total_bytes {
            // Files may have been pruned or archived since: count again before alarming.
            state.total_bytes = dir_bytes(&state.dir);
        }
        let low_disk = state.reserve > 0
            && crate::disk::free_bytes(&state.dir).is_ok_and(|free| free < state.reserve);
        let over = state.total_bytes >= state.max_total_bytes || low_disk;
        if over != counters.over_budget() {
            if low_disk {
                tracing::error!(reserve = state.reserve, "audit volume has less free space than [node] min_free_bytes: tokenless and malformed refusals are now only counted; free space on it");
            } else if over {
                tracing::error!(bytes = state.total_bytes, budget = state.max_total_bytes, "audit log over its size budget: tokenless and malformed refusals are now only counted; prune or archive rotated files (`fencegate audit prune --keep N`)");
            } else {
                tracing::info!("audit log back under its size budget");
            }
            counters.set_over_budget(over);
        }
        if over {
            let (dropped, kept): (Vec<_>, Vec<_>) = submissions
                .into_iter()
                .partition(|s| SUPPRESSIBLE.contains(&s.event.reason.as_str()));
            for s in dropped {
                counters.suppressed();
                counters.refused(&s.event.store, &s.event.reason);
                let _ = s.done.send(Ok(()));
            }
            if kept.is_empty() {
                continue;
            }
            submissions = kept;
        }
        counters.gateway.audit_queue_depth(rx.len());
        let started = std::time::Instant::now();
        let result = state.append(submissions.iter().map(|s| &s.event));
        counters.gateway.audit_fsync(started.elapsed());
        if result.is_err() {
            counters.write_error(submissions.len() as u64);
        }
        report_failure(&state, &counters);
        for s in submissions {
            // An operator's fence reset is audited but is not a refusal.
            if result.is_ok() && s.event.reason != crate::fence_reset::RESET_REASON {
                counters.refused(&s.event.store, &s.event.reason);
                counters.saw_fence(s.event.fence);
            }
            let _ = s.done.send(result.clone());
        }
    }
}

/// Publishes the writer's failure state; logs when it changes (once, not per refusal: a flood
/// against a full disk must not flood the log too).
fn report_failure(state: &State, counters: &FenceCounters) {
    let before = counters.write_failure();
    if before == state.failure {
        return;
    }
    match (&before, &state.failure) {
        (None, Some(failure)) => {
            tracing::error!(error = %failure, "audit log cannot be written: refusals still refuse but leave no audit record until it can; free space on its volume or make it writable (writing resumes by itself)")
        }
        (Some(_), None) => tracing::info!(
            last_seq = state.last_seq,
            "audit log writable again; the chain goes on"
        ),
        _ => {}
    }
    counters.set_write_failure(state.failure.clone());
}

impl State {
    fn open(dir: &Path, node: &str, max_file_bytes: u64) -> Result<Self, AuditError> {
        fs::create_dir_all(dir).map_err(io_error(dir))?;
        let active = dir.join(ACTIVE);
        let next = dir.join(NEXT);
        if next.exists() {
            if active.exists() {
                // A rotation cut before its first rename: the old file is still the active one.
                fs::remove_file(&next).map_err(io_error(&next))?;
            } else {
                // Cut between its renames: finish it.
                fs::rename(&next, &active).map_err(io_error(&active))?;
            }
        }
        if let Ok(text) = fs::read(&active) {
            // A crash mid-write leaves a line without its newline; it was never acknowledged.
            if let Some(end) = text.iter().rposition(|&b| b == b'\n') {
                if end + 1 != text.len() {
                    tracing::warn!(path = %active.display(), "dropping an unacknowledged partial line at the end of the audit log");
                    let f = OpenOptions::new()
                        .write(true)
                        .open(&active)
                        .map_err(io_error(&active))?;
                    f.set_len(end as u64 + 1).map_err(io_error(&active))?;
                    f.sync_all().map_err(io_error(&active))?;
                }
            } else if !text.is_empty() {
                let f = OpenOptions::new()
                    .write(true)
                    .open(&active)
                    .map_err(io_error(&active))?;
                f.set_len(0).map_err(io_error(&active))?;
            }
        }
        let entries = files::entries(dir)?;
        let last = entries.last().map_or_else(
            || Head {
                seq: 0,
                hash: GENESIS_HASH.to_owned(),
            },
            |(_, e)| e.position(),
        );
        let file_first_seq = entries.iter().find_map(|(line, e)| match e {
            Entry::Record(r) if line.path == active => Some(r.seq),
            _ => None,
        });
        if let Some(head) = files::read_head(dir)? {
            let known = entries.iter().find(|(_, e)| e.position().seq == head.seq);
            if head.seq > last.seq || known.is_some_and(|(_, e)| e.position().hash != head.hash) {
                // Records were removed from the end while the node was down. Keep the evidence:
                // the head is about to be overwritten by the next batch.
                let kept = dir.join(format!("{}.mismatch-{}", files::HEAD, head.seq));
                fs::copy(dir.join(files::HEAD), &kept).map_err(io_error(&kept))?;
                tracing::error!(head_seq = head.seq, last_seq = last.seq, kept = %kept.display(), "the audit log ends before its recorded head: records were removed; `fencegate audit verify` will report it");
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&active)
            .map_err(io_error(&active))?;
        let file_bytes = file.metadata().map_err(io_error(&active))?.len();
        sync_dir(dir)?;
        Ok(Self {
            dir: dir.to_owned(),
            node: node.to_owned(),
            max_file_bytes,
            total_bytes: dir_bytes(dir),
            max_total_bytes: u64::MAX,
            file,
            file_bytes,
            file_first_seq,
            last_seq: last.seq,
            last_hash: last.hash,
            failure: None,
            reserve: 0,
        })
    }

    fn append<'a>(
        &mut self,
        events: impl Iterator<Item = &'a AuditEvent>,
    ) -> Result<(), AuditSinkError> {
        if self.failure.is_some() {
            if let Err(e) = self.recover() {
                self.failure = Some(e.to_string());
                return Err(AuditSinkError::Io(e.to_string()));
            }
        }
        if let Err(e) = self.write_records(events) {
            self.failure = Some(e.to_string());
            // Cut what the batch left right away when the volume lets us (a full one does), so
            // readers meanwhile see no half record; otherwise before the next write.
            let _ = self.recover();
            return Err(AuditSinkError::Io(e.to_string()));
        }
        // The records are on disk whatever happens to the head (which may lag, never lead).
        self.failure = self.write_head().err().map(|e| e.to_string());
        Ok(())
    }

    /// While the log cannot be written: tries to, without a record (the head file is
    /// rewritten unchanged, a real write on the same volume).
    fn probe(&mut self) {
        if self.failure.is_some() {
            self.failure = self
                .recover()
                .and_then(|()| self.write_head())
                .err()
                .map(|e| e.to_string());
        }
    }

    fn write_head(&self) -> Result<(), AuditError> {
        files::write_head(
            &self.dir,
            &Head {
                seq: self.last_seq,
                hash: self.last_hash.clone(),
            },
        )
    }

    /// After a failed write: finishes a rotation cut between its renames, reopens the active
    /// file and cuts it back to its last acknowledged byte (what a failed batch may have left
    /// after it was never acknowledged, so it must not become part of the chain).
    fn recover(&mut self) -> Result<(), AuditError> {
        let active = self.dir.join(ACTIVE);
        let next = self.dir.join(NEXT);
        if !active.exists() && next.exists() {
            fs::rename(&next, &active).map_err(io_error(&active))?;
            sync_dir(&self.dir)?;
        }
        // Not `create`: a missing active file was removed by someone, and recreating it
        // would break the chain silently.
        let file = OpenOptions::new()
            .append(true)
            .open(&active)
            .map_err(io_error(&active))?;
        let len = file.metadata().map_err(io_error(&active))?.len();
        if len < self.file_bytes {
            return Err(AuditError::Io {
                path: active,
                source: std::io::Error::other(format!(
                    "the file is {len} bytes but {} were acknowledged: it was cut by something else; restart the node and run `fencegate audit verify`",
                    self.file_bytes
                )),
            });
        }
        if len > self.file_bytes {
            file.set_len(self.file_bytes).map_err(io_error(&active))?;
            file.sync_all().map_err(io_error(&active))?;
        }
        self.file = file;
        Ok(())
    }

    fn write_records<'a>(
        &mut self,
        events: impl Iterator<Item = &'a AuditEvent>,
    ) -> Result<(), AuditError> {
        if self.file_bytes >= self.max_file_bytes {
            self.rotate()?;
        }
        let mut text = String::new();
        let mut seq = self.last_seq;
        let mut hash = self.last_hash.clone();
        for event in events {
            seq += 1;
            let record = AuditRecord::chain(seq, now_millis(), &self.node, event.clone(), &hash);
            hash.clone_from(&record.hash);
            text.push_str(&serde_json::to_string(&record).expect("a record always serializes"));
            text.push('\n');
        }
        let path = self.dir.join(ACTIVE);
        self.file
            .write_all(text.as_bytes())
            .map_err(io_error(&path))?;
        self.file.sync_data().map_err(io_error(&path))?;
        self.file_bytes += text.len() as u64;
        self.total_bytes += text.len() as u64;
        self.file_first_seq.get_or_insert(self.last_seq + 1);
        self.last_seq = seq;
        self.last_hash = hash;
        Ok(())
    }

    /// Renames the active file to `audit-<first seq>.jsonl` and starts a new one with the
    /// checkpoint of the chain's head. The new file is made complete (checkpoint written and
    /// fsync'd) before the old one is renamed, so a failure at any step leaves either the old
    /// active file or the new one, never a file without its checkpoint.
    fn rotate(&mut self) -> Result<(), AuditError> {
        let Some(first) = self.file_first_seq else {
            return Ok(());
        };
        let active = self.dir.join(ACTIVE);
        let next = self.dir.join(NEXT);
        let rotated = self.dir.join(rotated_name(first));
        let checkpoint = checkpoint_line(&Head {
            seq: self.last_seq,
            hash: self.last_hash.clone(),
        });
        let made = (|| {
            let mut file = OpenOptions::new().create(true).append(true).open(&next)?;
            file.set_len(0)?;
            file.write_all(checkpoint.as_bytes())?;
            file.sync_all()?;
            Ok(file)
        })();
        let file = match made {
            Ok(file) => file,
            Err(e) => {
                let _ = fs::remove_file(&next);
                return Err(io_error(&next)(e));
            }
        };
        fs::rename(&active, &rotated).map_err(io_error(&rotated))?;
        // From here on the new file is the one written; `recover` finishes a rename cut here.
        self.file = file;
        self.file_bytes = checkpoint.len() as u64;
        self.file_first_seq = None;
        self.total_bytes += checkpoint.len() as u64;
        fs::rename(&next, &active).map_err(io_error(&active))?;
        sync_dir(&self.dir)?;
        // Files may have been pruned since the last count.
        self.total_bytes = dir_bytes(&self.dir);
        tracing::info!(rotated = %rotated.display(), checkpoint_seq = self.last_seq, "audit log rotated");
        Ok(())
    }
}

/// Bytes of the regular files in `dir` (unreadable entries count as empty).
fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn lock(aggregator: &Mutex<Aggregator>) -> std::sync::MutexGuard<'_, Aggregator> {
    aggregator.lock().unwrap_or_else(|p| p.into_inner())
}

fn sync_dir(dir: &Path) -> Result<(), AuditError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
}

impl AuditHandle {
    /// As a shared sink for filters.
    pub fn sink(&self) -> Arc<dyn AuditSink> {
        Arc::new(self.clone())
    }
}

impl AuditSink for AuditHandle {
    fn refused(&self, event: AuditEvent) -> SinkFuture<'_> {
        Box::pin(async move {
            let (admit, due) = lock(&self.aggregator).admit(&event, now_millis() / 1000);
            for aggregate in due {
                let (done, _) = oneshot::channel();
                self.queue
                    .send(Message::Refusal(Submission {
                        event: aggregate,
                        done,
                    }))
                    .await
                    .map_err(|_| AuditSinkError::Closed)?;
            }
            if admit == Admit::Counted {
                // Part of this second's aggregate record for this client and kind.
                self.counters.refused(&event.store, &event.reason);
                return Ok(());
            }
            let (done, wait) = oneshot::channel();
            // `send` waits while the queue is full: backpressure, never a silent drop.
            self.queue
                .send(Message::Refusal(Submission { event, done }))
                .await
                .map_err(|_| AuditSinkError::Closed)?;
            wait.await.map_err(|_| AuditSinkError::Closed)?
        })
    }

    fn applied(&self, store: fencegate_core::Store) {
        self.counters.applied(store);
    }
}

impl fencegate_core::Observer for AuditHandle {
    fn connection_opened(&self, store: fencegate_core::Store) {
        self.counters.gateway.connection_opened(store);
    }

    fn connection_closed(&self, store: fencegate_core::Store) {
        self.counters.gateway.connection_closed(store);
    }

    fn connection_refused(&self, store: fencegate_core::Store) {
        self.counters.gateway.connection_refused(store);
    }

    fn request_done(&self, store: fencegate_core::Store, elapsed: Duration) {
        self.counters.gateway.request_done(store, elapsed);
    }

    fn upstream_failed(
        &self,
        store: fencegate_core::Store,
        failure: fencegate_core::UpstreamFailure,
    ) {
        self.counters.gateway.upstream_failed(store, failure);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::fixture::event;
    use crate::audit::verify::verify;

    #[tokio::test]
    async fn writes_chains_rotates_and_resumes() {
        let dir = tempfile::tempdir().unwrap();
        let config = AuditConfig {
            dir: Some(dir.path().to_owned()),
            max_file_bytes: 2_000,
            queue: 4,
            batch: 3,
            ..AuditConfig::default()
        };
        let handle =
            AuditWriter::start(&config, dir.path(), "1", FenceCounters::default(), 0).unwrap();
        let mut tasks = Vec::new();
        for n in 0..40 {
            let h = handle.clone();
            tasks.push(tokio::spawn(async move { h.refused(event(n)).await }));
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        drop(handle);
        let files = files::list(dir.path()).unwrap();
        assert!(files.len() > 2, "rotation happened: {files:?}");
        let report = verify(dir.path()).unwrap();
        assert_eq!(report.records, 40);
        // Every file after the first starts with the checkpoint of where the previous ended.
        let mut ended = None;
        for file in &files {
            let text = fs::read_to_string(&file.path).unwrap();
            let first = Entry::parse(text.lines().next().unwrap()).unwrap();
            match (&ended, first) {
                (None, Entry::Record(r)) => assert_eq!(r.seq, 1),
                (Some(end), Entry::Checkpoint(c)) => assert_eq!(&c, end),
                (end, first) => panic!("{:?} starts with {first:?} after {end:?}", file.path),
            }
            ended = Some(
                Entry::parse(text.lines().last().unwrap())
                    .unwrap()
                    .position(),
            );
        }

        // A restart continues the chain.
        let handle =
            AuditWriter::start(&config, dir.path(), "1", FenceCounters::default(), 0).unwrap();
        handle.refused(event(40)).await.unwrap();
        let records = files::read_records(dir.path()).unwrap();
        assert_eq!(records.len(), 41);
        assert_eq!(records[40].seq, 41);
        assert_eq!(records[40].prev, records[39].hash);
        assert_eq!(verify(dir.path()).unwrap().records, 41);
    }

    #[tokio::test]
    async fn a_log_cut_short_while_down_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let config = AuditConfig {
            dir: Some(dir.path().to_owned()),
            ..AuditConfig::default()
        };
        let handle =
            AuditWriter::start(&config, dir.path(), "1", FenceCounters::default(), 0).unwrap();
        for n in 0..3 {
            handle.refused(event(n)).await.unwrap();
        }
        drop(handle);
        let path = dir.path().join(ACTIVE);
        let text = fs::read_to_string(&path).unwrap();
        let two: Vec<&str> = text.lines().take(2).collect();
        fs::write(&path, two.join("\n") + "\n").unwrap();
        let handle =
            AuditWriter::start(&config, dir.path(), "1", FenceCounters::default(), 0).unwrap();
        handle.refused(event(3)).await.unwrap();
        let err = verify(dir.path()).unwrap_err().to_string();
        assert!(err.contains("audit.head.mismatch-3"), "{err}");
    }

    /// What the writer does when the disk refuses a write, with the failure made by hand: a
    /// batch fails half written, the log stays unwritable for a while, then takes writes again.
    /// (tests/audit_disk_full.rs does the same with a real full volume and a real node.)
    #[test]
    fn a_failed_write_leaves_the_chain_intact_and_writing_resumes() {
        let dir = tempfile::tempdir().unwrap();
        let active = dir.path().join(ACTIVE);
        let mut state = State::open(dir.path(), "1", u64::MAX).unwrap();
        let events: Vec<AuditEvent> = (0..3).map(event).collect();
        state.append(events.iter()).unwrap();
        let good = fs::read(&active).unwrap();

        // A batch that fails after part of it reached the file (as a disk filling mid-write
        // leaves it): the writer's handle refuses writes, and half a record is in the file.
        state.file = File::open(&active).unwrap();
        let mut other = OpenOptions::new().append(true).open(&active).unwrap();
        other.write_all(b"{\"seq\":4,\"time\":\"2026-").unwrap();
        let err = state.append([event(3)].iter()).unwrap_err();
        assert!(matches!(err, AuditSinkError::Io(_)), "{err}");
        assert!(state.failure.is_some());
        assert_eq!(state.last_seq, 3, "the failed batch is not in the chain");

        // Still failing: the active file cannot be opened (here: it is not there).
        let aside = dir.path().join("aside");
        fs::rename(&active, &aside).unwrap();
        assert!(state.append([event(4)].iter()).is_err());
        state.probe();
        assert!(
            state.failure.is_some(),
            "a probe does not clear a failure that persists"
        );

        // The volume takes writes again: the probe clears the failure, the half batch is cut,
        // and the chain goes on from the last acknowledged record.
        fs::rename(&aside, &active).unwrap();
        state.probe();
        assert_eq!(state.failure, None);
        assert_eq!(
            fs::read(&active).unwrap(),
            good,
            "cut back to what was acknowledged"
        );
        state.append([event(5)].iter()).unwrap();
        let records = files::read_records(dir.path()).unwrap();
        let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
        assert_eq!(records[3].event.request_id, "r5");
        assert_eq!(verify(dir.path()).unwrap().records, 4);
    }

    /// A rotation cut between its two renames (a crash, or a failure) is finished at startup.
    #[test]
    fn a_rotation_cut_between_its_renames_is_finished() {
        let dir = tempfile::tempdir().unwrap();
        let mut state = State::open(dir.path(), "1", 1).unwrap();
        state.append([event(0)].iter()).unwrap();
        state.append([event(1)].iter()).unwrap();
        drop(state);
        // As if the node died in the next rotation, after renaming the active file but before
        // the new one took its name.
        let last = files::read_records(dir.path()).unwrap().pop().unwrap();
        let active = dir.path().join(ACTIVE);
        fs::rename(&active, dir.path().join(rotated_name(2))).unwrap();
        let checkpoint = checkpoint_line(&Head {
            seq: 2,
            hash: last.hash,
        });
        fs::write(dir.path().join(NEXT), checkpoint).unwrap();
        let mut state = State::open(dir.path(), "1", u64::MAX).unwrap();
        state.append([event(2)].iter()).unwrap();
        assert!(!dir.path().join(NEXT).exists());
        let report = verify(dir.path()).unwrap();
        assert_eq!((report.records, report.files), (3, 3));
    }

    fn tokenless(n: usize, port: u16) -> AuditEvent {
        AuditEvent {
            reason: "missing".into(),
            client_addr: format!("10.1.1.1:{port}"),
            token: None,
            resource: None,
            revision: None,
            fence: None,
            ..event(n)
        }
    }

    #[tokio::test]
    async fn a_tokenless_flood_is_aggregated_and_the_budget_holds() {
        let dir = tempfile::tempdir().unwrap();
        // A budget the flood's records stay under however fast this machine writes (at most
        // about 11 records a second): this part shows aggregation; the over-budget part below
        // shows the budget.
        let config = AuditConfig {
            dir: Some(dir.path().to_owned()),
            max_total_bytes: 1 << 20,
            ..AuditConfig::default()
        };
        let counters = FenceCounters::default();
        let handle = AuditWriter::start(&config, dir.path(), "1", counters.clone(), 0).unwrap();
        let started = std::time::Instant::now();
        let mut n = 0;
        while started.elapsed() < Duration::from_millis(2_500) {
            handle
                .refused(tokenless(n, 1000 + (n % 50) as u16))
                .await
                .unwrap();
            n += 1;
        }
        // Stale refusals are always written one by one.
        for m in 0..3 {
            handle.refused(event(m)).await.unwrap();
        }
        // The last second's aggregate: written by the ticker once the second is over.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let expected = |records: &[AuditRecord]| {
            records
                .iter()
                .filter(|r| r.event.detail.starts_with("aggregate: "))
                .map(|r| {
                    r.event.detail["aggregate: ".len()..]
                        .split(' ')
                        .next()
                        .unwrap()
                        .parse::<usize>()
                        .unwrap()
                })
                .sum::<usize>()
                + records
                    .iter()
                    .filter(|r| {
                        r.event.reason == "missing" && !r.event.detail.starts_with("aggregate")
                    })
                    .count()
        };
        let records = loop {
            let records = files::read_records(dir.path()).unwrap();
            if expected(&records) == n || std::time::Instant::now() > deadline {
                break records;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let stale = records.iter().filter(|r| r.event.reason == "stale").count();
        println!(
            "{n} tokenless refusals in 2.5 s from one client: {} records ({} bytes), every refusal accounted for: {}",
            records.len(),
            dir_bytes(dir.path()),
            expected(&records)
        );
        assert_eq!(stale, 3);
        assert_eq!(
            expected(&records),
            n,
            "every refusal is in a record or an aggregate"
        );
        // At most 10 written + 1 aggregate per second (about 3 seconds), + 3 stale.
        assert!(records.len() <= 3 + 11 * 4, "{} records", records.len());
        assert!(verify(dir.path()).is_ok());

        // Over budget: tokenless refusals are only counted, stale ones still written, alarm on.
        let big = AuditConfig {
            max_total_bytes: 1,
            ..config
        };
        drop(handle);
        let handle = AuditWriter::start(&big, dir.path(), "1", counters.clone(), 0).unwrap();
        let before = files::read_records(dir.path()).unwrap().len();
        handle.refused(tokenless(0, 9)).await.unwrap();
        handle.refused(event(9)).await.unwrap();
        let after = files::read_records(dir.path()).unwrap();
        assert_eq!(after.len(), before + 1);
        assert_eq!(after.last().unwrap().event.reason, "stale");
        assert!(counters.over_budget());
    }

    #[tokio::test]
    async fn a_volume_below_the_reservation_counts_tokenless_refusals_only() {
        let dir = tempfile::tempdir().unwrap();
        let config = AuditConfig {
            dir: Some(dir.path().to_owned()),
            ..AuditConfig::default()
        };
        let counters = FenceCounters::default();
        // No volume has this much free: as if a flood had filled it.
        let handle =
            AuditWriter::start(&config, dir.path(), "1", counters.clone(), u64::MAX).unwrap();
        handle.refused(tokenless(0, 9)).await.unwrap();
        handle.refused(event(1)).await.unwrap();
        let records = files::read_records(dir.path()).unwrap();
        let reasons: Vec<&str> = records.iter().map(|r| r.event.reason.as_str()).collect();
        assert_eq!(
            reasons,
            ["stale"],
            "stale refusals are evidence: still written"
        );
        assert!(counters.over_budget(), "the alarm is on");
    }
}
