//! openraft's own storage test suite, run against the redb log store and the state machine,
//! plus the restart behaviour the suite cannot see.

use std::sync::Arc;

use openraft::testing::{StoreBuilder, Suite};
use openraft::{Entry, EntryPayload, LogId, RaftSnapshotBuilder, Vote};
use redb::Database;
use tempfile::TempDir;

use super::log_store::LogStore;
use super::state::Command;
use super::state_machine::StateMachine;
use super::type_config::{StorageError, TypeConfig};
use super::waiters::Waiters;

struct Builder;

fn open(dir: &TempDir) -> (LogStore, StateMachine) {
    let db = Arc::new(Database::create(dir.path().join("authority.redb")).expect("create db"));
    let log = LogStore::open(db.clone()).expect("open log");
    let sm = StateMachine::open(
        db,
        Arc::new(Waiters::default()),
        fencegate_core::SharedKeyRing::default(),
        None,
        fencegate_core::IssuedRevision::default(),
    )
    .expect("open state machine");
    (log, sm)
}

impl StoreBuilder<TypeConfig, LogStore, StateMachine, TempDir> for Builder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachine), StorageError> {
        let dir = TempDir::new().expect("temp dir");
        let (log, sm) = open(&dir);
        Ok((dir, log, sm))
    }
}

#[test]
#[allow(clippy::result_large_err)] // openraft's error type, returned as the suite gives it
fn openraft_storage_suite() -> Result<(), StorageError> {
    Suite::test_all(Builder)
}

fn entry(index: u64, command: Command) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(command),
    }
}

#[tokio::test]
async fn log_vote_and_snapshot_survive_reopening() {
    use openraft::storage::{RaftLogReader, RaftLogStorage, RaftLogStorageExt, RaftStateMachine};

    let dir = TempDir::new().unwrap();
    {
        let (mut log, mut sm) = open(&dir);
        log.save_vote(&Vote::new(3, 2)).await.unwrap();
        let acquire = Command::Acquire {
            resource: "job".into(),
            ttl_ms: 1000,
            request_id: None,
            holder: None,
            secret: None,
        };
        let entries = vec![
            entry(1, acquire.clone()),
            entry(2, Command::Bump { by: 10 }),
        ];
        // The blocking append path: write, fsync, then the callback.
        log.blocking_append(entries.clone()).await.unwrap();
        sm.apply(entries).await.unwrap();
        sm.build_snapshot().await.unwrap();
    }
    let (mut log, mut sm) = open(&dir);
    assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(3, 2)));
    // What a leader would send: the stored snapshot, held in memory from the start.
    let current = sm
        .get_current_snapshot()
        .await
        .unwrap()
        .expect("a snapshot");
    assert_eq!(current.meta.last_log_id.map(|id| id.index), Some(2));
    assert_eq!(log.try_get_log_entries(1..3).await.unwrap().len(), 2);
    let applied = sm.applied();
    let applied = applied.read().await;
    assert_eq!(
        applied.state.revision, 11,
        "the snapshot brings the revision back"
    );
    assert!(applied.state.locks.contains_key("job"));
}

/// A snapshot built from an older copy of the state (openraft builds on a task of its own,
/// beside an install) does not replace a newer stored one: a restart loads the newer.
#[tokio::test]
async fn an_older_snapshot_never_replaces_a_newer_one() {
    use openraft::storage::RaftStateMachine;
    use std::io::Cursor;

    let dir = TempDir::new().unwrap();
    let acquire = |resource: &str| Command::Acquire {
        resource: resource.into(),
        ttl_ms: 1000,
        request_id: None,
        holder: None,
        secret: None,
    };
    {
        let (_log, mut sm) = open(&dir);
        // A copy of the state machine at index 1: its builder, still serializing.
        sm.apply(vec![entry(1, acquire("old"))]).await.unwrap();
        let (_other_dir, _, mut builder) = {
            let other = TempDir::new().unwrap();
            let (log, b) = open(&other);
            (other, log, b)
        };
        builder.apply(vec![entry(1, acquire("old"))]).await.unwrap();
        let older = builder.build_snapshot().await.unwrap();

        // Meanwhile the node moved on to index 2 and stored that.
        sm.apply(vec![entry(2, acquire("new"))]).await.unwrap();
        sm.build_snapshot().await.unwrap();
        // The older one arrives last (as an install it would be refused by openraft; as a
        // build it must not overwrite).
        sm.install_snapshot(
            &older.meta,
            Box::new(Cursor::new(older.snapshot.into_inner())),
        )
        .await
        .unwrap();
        let current = sm
            .get_current_snapshot()
            .await
            .unwrap()
            .expect("a snapshot");
        assert_eq!(
            current.meta.last_log_id.map(|id| id.index),
            Some(2),
            "the older snapshot is what a leader would send"
        );
    }
    let (_log, sm) = open(&dir);
    let applied = sm.applied();
    let applied = applied.read().await;
    assert!(
        applied.state.locks.contains_key("new"),
        "a restart loaded the older snapshot"
    );
}

/// Replication reads batches of about `MAX_APPEND_BYTES`, at least one entry, however large.
#[tokio::test]
async fn replication_reads_batches_of_a_bounded_size() {
    use openraft::storage::{RaftLogReader, RaftLogStorageExt};

    let dir = TempDir::new().unwrap();
    let (mut log, _sm) = open(&dir);
    // Entries of about 100 KiB each (a long holder stands in for a restore part).
    let big = |i: u64| Command::Acquire {
        resource: format!("job{i}"),
        ttl_ms: 1000,
        request_id: None,
        holder: Some("h".repeat(100 * 1024)),
        secret: None,
    };
    let entries: Vec<_> = (1..=20).map(|i| entry(i, big(i))).collect();
    log.blocking_append(entries).await.unwrap();
    let batch = log.limited_get_log_entries(1, 21).await.unwrap();
    assert!(
        (1..=5).contains(&batch.len()),
        "{} entries of 100 KiB in one batch",
        batch.len()
    );
    assert_eq!(batch[0].log_id.index, 1);
    // One entry over the size still goes, alone.
    let huge = Command::Acquire {
        resource: "huge".into(),
        ttl_ms: 1000,
        request_id: None,
        holder: Some("h".repeat(super::network::MAX_APPEND_BYTES * 2)),
        secret: None,
    };
    log.blocking_append(vec![entry(21, huge)]).await.unwrap();
    assert_eq!(log.limited_get_log_entries(21, 22).await.unwrap().len(), 1);
    // Small entries come as many as asked.
    assert_eq!(log.limited_get_log_entries(1, 2).await.unwrap().len(), 1);
}
