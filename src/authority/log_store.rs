//! The durable Raft log: entries, vote, committed and purged ids in one redb file.
//!
//! redb commits are fsync'd before `commit()` returns (its default durability), so an append is
//! reported to openraft only once it is on disk. The committed id is saved without fsync: it is
//! a hint that lets a restart re-apply sooner, and losing it is safe.

// openraft's trait methods return its StorageError, which is large; boxing it here would
// only move the cost.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{
    AnyError, Entry, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftLogId, StorageIOError, Vote,
};
use redb::{Database, Durability, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::type_config::{NodeId, StorageError, TypeConfig};

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const PURGED: &str = "purged";

#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

fn io_err(
    subject: ErrorSubject<NodeId>,
    verb: ErrorVerb,
    e: impl std::error::Error + 'static,
) -> StorageError {
    StorageIOError::new(subject, verb, AnyError::new(&e)).into()
}

fn read_err(e: impl std::error::Error + 'static) -> StorageError {
    io_err(ErrorSubject::Logs, ErrorVerb::Read, e)
}

fn write_err(e: impl std::error::Error + 'static) -> StorageError {
    io_err(ErrorSubject::Logs, ErrorVerb::Write, e)
}

impl LogStore {
    pub fn open(db: Arc<Database>) -> Result<Self, redb::Error> {
        let tx = db.begin_write()?;
        tx.open_table(LOG)?;
        tx.open_table(META)?;
        tx.commit()?;
        Ok(Self { db })
    }

    fn get_meta<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, StorageError> {
        let tx = self.db.begin_read().map_err(read_err)?;
        let table = tx.open_table(META).map_err(read_err)?;
        let Some(value) = table.get(key).map_err(read_err)? else {
            return Ok(None);
        };
        serde_json::from_slice(value.value())
            .map(Some)
            .map_err(read_err)
    }

    /// Writes `key` in its own transaction; blocking, so callers run it off the async threads.
    fn put_meta<T: Serialize>(
        db: &Database,
        key: &str,
        value: &T,
        durable: bool,
    ) -> Result<(), StorageError> {
        let bytes = serde_json::to_vec(value).map_err(write_err)?;
        let mut tx = db.begin_write().map_err(write_err)?;
        if !durable {
            tx.set_durability(Durability::None);
        }
        tx.open_table(META)
            .map_err(write_err)?
            .insert(key, bytes.as_slice())
            .map_err(write_err)?;
        tx.commit().map_err(write_err)
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, StorageError> + Send + 'static,
    ) -> Result<T, StorageError> {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || f(&db))
            .await
            .map_err(write_err)?
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError> {
        self.read_entries(range, usize::MAX)
    }

    /// What replication sends in one AppendEntries call: the entries of `start..end` up to
    /// seven eighths of [`super::network::MAX_APPEND_BYTES`] as stored (the JSON they are sent
    /// as; the rest leaves room for the request around them), at
    /// least one. openraft's default reads the whole range (up to 300 entries), and a batch
    /// too large for the call's time would only be refused by the network and read again.
    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError> {
        self.read_entries(start..end, super::network::MAX_APPEND_BYTES / 8 * 7)
    }
}

impl LogStore {
    /// The entries of `range`, in order, stopping before the one that would take their stored
    /// size past `budget` bytes (the first is read whatever its size).
    fn read_entries(
        &self,
        range: impl RangeBounds<u64>,
        budget: usize,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError> {
        let tx = self.db.begin_read().map_err(read_err)?;
        let table = tx.open_table(LOG).map_err(read_err)?;
        let mut entries = Vec::new();
        let mut bytes = 0usize;
        for item in table.range(range).map_err(read_err)? {
            let (_, value) = item.map_err(read_err)?;
            bytes = bytes.saturating_add(value.value().len());
            if !entries.is_empty() && bytes > budget {
                break;
            }
            entries.push(serde_json::from_slice(value.value()).map_err(read_err)?);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId<NodeId>> = self.get_meta(PURGED)?;
        let tx = self.db.begin_read().map_err(read_err)?;
        let table = tx.open_table(LOG).map_err(read_err)?;
        let last = match table.last().map_err(read_err)? {
            Some((_, value)) => {
                let entry: Entry<TypeConfig> =
                    serde_json::from_slice(value.value()).map_err(read_err)?;
                Some(*entry.get_log_id())
            }
            None => last_purged_log_id,
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let vote = *vote;
        self.blocking(move |db| Self::put_meta(db, VOTE, &vote, true))
            .await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.get_meta(VOTE)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError> {
        self.blocking(move |db| Self::put_meta(db, COMMITTED, &committed, false))
            .await
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError> {
        Ok(self.get_meta::<Option<LogId<NodeId>>>(COMMITTED)?.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut encoded = Vec::new();
        for entry in entries {
            encoded.push((
                entry.get_log_id().index,
                serde_json::to_vec(&entry).map_err(write_err)?,
            ));
        }
        let result = self
            .blocking(move |db| {
                let tx = db.begin_write().map_err(write_err)?;
                {
                    let mut table = tx.open_table(LOG).map_err(write_err)?;
                    for (index, bytes) in &encoded {
                        table.insert(*index, bytes.as_slice()).map_err(write_err)?;
                    }
                }
                tx.commit().map_err(write_err)
            })
            .await;
        // Only now, with the entries fsync'd, may openraft count them as durable.
        callback.log_io_completed(
            result
                .clone()
                .map_err(|e| std::io::Error::other(e.to_string())),
        );
        result
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        self.blocking(move |db| {
            let tx = db.begin_write().map_err(write_err)?;
            {
                let mut table = tx.open_table(LOG).map_err(write_err)?;
                table
                    .retain_in(log_id.index.., |_, _| false)
                    .map_err(write_err)?;
            }
            tx.commit().map_err(write_err)
        })
        .await
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        self.blocking(move |db| {
            let bytes = serde_json::to_vec(&log_id).map_err(write_err)?;
            let tx = db.begin_write().map_err(write_err)?;
            {
                tx.open_table(META)
                    .map_err(write_err)?
                    .insert(PURGED, bytes.as_slice())
                    .map_err(write_err)?;
                let mut table = tx.open_table(LOG).map_err(write_err)?;
                table
                    .retain_in(..=log_id.index, |_, _| false)
                    .map_err(write_err)?;
            }
            tx.commit().map_err(write_err)
        })
        .await
    }
}
