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
    let (mut log, sm) = open(&dir);
    assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(3, 2)));
    assert_eq!(log.try_get_log_entries(1..3).await.unwrap().len(), 2);
    let applied = sm.applied();
    let applied = applied.read().await;
    assert_eq!(
        applied.state.revision, 11,
        "the snapshot brings the revision back"
    );
    assert!(applied.state.locks.contains_key("job"));
}
