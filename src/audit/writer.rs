//! The single writer: a bounded queue, batched writes with one fsync per batch, the hash chain,
//! and size-based rotation.

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
use super::files::{self, rotated_name, ACTIVE};
use super::{io_error, AuditConfig, AuditError, FenceCounters};

struct Submission {
    event: AuditEvent,
    done: oneshot::Sender<Result<(), AuditSinkError>>,
}

/// Starts the writer thread; see [`AuditWriter::start`].
pub struct AuditWriter;

/// What filters hold to submit refusals and count applied writes. Cheap to clone.
#[derive(Clone)]
pub struct AuditHandle {
    queue: mpsc::Sender<Submission>,
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
    file_bytes: u64,
    /// Seq of the first record in the active file (for its name when rotated).
    file_first_seq: Option<u64>,
    last_seq: u64,
    last_hash: String,
    /// Set after an I/O error: the chain's tail on disk is unknown, so nothing more is written.
    failed: Option<String>,
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
        // Writes each second's aggregates once the second is over, even if no refusal follows.
        let (weak, ticking) = (queue.downgrade(), aggregator.clone());
        std::thread::Builder::new()
            .name("audit-aggregate".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(500));
                let Some(queue) = weak.upgrade() else { return };
                let due = lock(&ticking).take_due(now_millis() / 1000);
                for event in due {
                    let (done, _) = oneshot::channel();
                    if queue.blocking_send(Submission { event, done }).is_err() {
                        return;
                    }
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

fn run(
    mut state: State,
    mut rx: mpsc::Receiver<Submission>,
    batch: usize,
    counters: FenceCounters,
) {
    while let Some(first) = rx.blocking_recv() {
        let mut submissions = vec![first];
        while submissions.len() < batch {
            match rx.try_recv() {
                Ok(s) => submissions.push(s),
                Err(_) => break,
            }
        }
        let low_disk = state.reserve > 0
            && crate::disk::free_bytes(&state.dir).is_ok_and(|free| free < state.reserve);
        let over = state.total_bytes >= state.max_total_bytes || low_disk;
        if over != counters.over_budget() {
            if low_disk {
                tracing::error!(reserve = state.reserve, "audit volume has less free space than [node] min_free_bytes: tokenless and malformed refusals are now only counted; free space on it");
            } else if over {
                tracing::error!(bytes = state.total_bytes, budget = state.max_total_bytes, "audit log over its size budget: tokenless and malformed refusals are now only counted; archive rotated files");
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
        if let Err(e) = &result {
            tracing::error!(error = %e, records = submissions.len(), "audit log write failed; refusals are not being logged");
        }
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

impl State {
    fn open(dir: &Path, node: &str, max_file_bytes: u64) -> Result<Self, AuditError> {
        fs::create_dir_all(dir).map_err(io_error(dir))?;
        let active = dir.join(ACTIVE);
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
        let records = files::read_records(dir)?;
        let (last_seq, last_hash) = records
            .last()
            .map_or((0, GENESIS_HASH.to_owned()), |r| (r.seq, r.hash.clone()));
        let in_active: Vec<&AuditRecord> = {
            let active_lines = fs::read_to_string(&active).unwrap_or_default();
            let n = active_lines.lines().count();
            records.iter().rev().take(n).collect()
        };
        if let Some(head) = files::read_head(dir)? {
            let known = records.iter().find(|r| r.seq == head.seq);
            if head.seq > last_seq || known.is_some_and(|r| r.hash != head.hash) {
                // Records were removed from the end while the node was down. Keep the evidence:
                // the head is about to be overwritten by the next batch.
                let kept = dir.join(format!("{}.mismatch-{}", files::HEAD, head.seq));
                fs::copy(dir.join(files::HEAD), &kept).map_err(io_error(&kept))?;
                tracing::error!(head_seq = head.seq, last_seq, kept = %kept.display(), "the audit log ends before its recorded head: records were removed; `fencegate audit verify` will report it");
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
            file_first_seq: in_active.last().map(|r| r.seq),
            last_seq,
            last_hash,
            failed: None,
            reserve: 0,
        })
    }

    fn append<'a>(
        &mut self,
        events: impl Iterator<Item = &'a AuditEvent>,
    ) -> Result<(), AuditSinkError> {
        if let Some(e) = &self.failed {
            return Err(AuditSinkError::Io(e.clone()));
        }
        let result = self.try_append(events);
        if let Err(e) = &result {
            self.failed = Some(e.to_string());
        }
        result.map_err(|e| AuditSinkError::Io(e.to_string()))
    }

    fn try_append<'a>(
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
            if self.file_first_seq.is_none() {
                self.file_first_seq = Some(seq);
            }
        }
        let path = self.dir.join(ACTIVE);
        self.file
            .write_all(text.as_bytes())
            .map_err(io_error(&path))?;
        self.file.sync_data().map_err(io_error(&path))?;
        self.file_bytes += text.len() as u64;
        self.total_bytes += text.len() as u64;
        self.last_seq = seq;
        self.last_hash = hash;
        files::write_head(
            &self.dir,
            &files::Head {
                seq: self.last_seq,
                hash: self.last_hash.clone(),
            },
        )
    }

    fn rotate(&mut self) -> Result<(), AuditError> {
        let Some(first) = self.file_first_seq else {
            return Ok(());
        };
        let active = self.dir.join(ACTIVE);
        let rotated = self.dir.join(rotated_name(first));
        fs::rename(&active, &rotated).map_err(io_error(&rotated))?;
        self.file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&active)
            .map_err(io_error(&active))?;
        sync_dir(&self.dir)?;
        self.file_bytes = 0;
        self.file_first_seq = None;
        tracing::info!(rotated = %rotated.display(), "audit log rotated");
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
                    .send(Submission {
                        event: aggregate,
                        done,
                    })
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
                .send(Submission { event, done })
                .await
                .map_err(|_| AuditSinkError::Closed)?;
            wait.await.map_err(|_| AuditSinkError::Closed)?
        })
    }

    fn applied(&self, store: &str) {
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
    use fencegate_core::OperationSummary;

    use super::*;
    use crate::audit::verify::verify;

    fn event(n: usize) -> AuditEvent {
        AuditEvent {
            store: "redis".into(),
            client_addr: "127.0.0.1:1".into(),
            client_identity: None,
            resource: Some("job".into()),
            token: Some("fg1~3~job".into()),
            token_signed: false,
            revision: Some(3),
            fence: Some(5),
            reason: "stale".into(),
            detail: format!("refusal {n}"),
            operation: OperationSummary {
                command: "SET".into(),
                objects: vec!["k".into()],
                args: 3,
                bytes: 20,
            },
            request_id: format!("r{n}"),
        }
    }

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
