//! The Raft state machine: `AuthorityState` in memory, its snapshots on disk.
//!
//! The state is rebuilt on start from the last snapshot plus the committed log entries that
//! openraft re-applies, so only the log and the snapshot need to be durable.

// openraft's trait methods return its StorageError, which is large; boxing it here would
// only move the cost.
#![allow(clippy::result_large_err)]

use std::io::Cursor;
use std::sync::Arc;

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    AnyError, Entry, EntryPayload, ErrorSubject, ErrorVerb, LogId, RaftSnapshotBuilder,
    SnapshotMeta, StorageIOError, StoredMembership,
};
use redb::{Database, TableDefinition};
use serde::{Deserialize, Serialize};
use tokio::sync::RwLock;

use fencegate_core::{IssuedRevision, KeyRing, KeyState, SharedKeyRing, TokenKey};

use super::state::{AuthorityState, Command, Outcome};
use super::type_config::{Node, NodeId, StorageError, TypeConfig};
use super::waiters::Waiters;

const SNAPSHOT: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshot");
const CURRENT: &str = "current";

/// What the state machine holds besides the application state.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Applied {
    pub last_applied: Option<LogId<NodeId>>,
    pub membership: StoredMembership<NodeId, Node>,
    pub state: AuthorityState,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, Node>,
    data: Vec<u8>,
}

#[derive(Clone)]
pub struct StateMachine {
    applied: Arc<RwLock<Applied>>,
    db: Arc<Database>,
    waiters: Arc<Waiters>,
    /// The node's token keys, rebuilt whenever the replicated keys change; the gateways verify
    /// with it.
    keys: SharedKeyRing,
    /// An operator-supplied key (kid 0) that signs instead of the replicated ones.
    pinned: Option<TokenKey>,
    /// The highest revision applied, shared with the gateways to word stale refusals.
    issued: IssuedRevision,
    /// Held while a snapshot is stored: a snapshot built from an older copy of the state
    /// (openraft builds on a task of its own, beside an install) must not replace a newer one,
    /// or a restart would load a state older than what the log still holds.
    saving: Arc<tokio::sync::Mutex<()>>,
    /// The snapshot stored in `db`, kept in memory: it is what a leader sends. Read back from
    /// `db` (a JSON document about four times the state's size), with many leases it took the
    /// leader long enough that the node waiting for it heard no heartbeat and campaigned.
    current: Arc<std::sync::Mutex<Option<Arc<StoredSnapshot>>>>,
}

/// The key ring for `state`'s replicated keys, plus the operator's pinned key.
pub fn key_ring(state: &AuthorityState, pinned: Option<&TokenKey>) -> KeyRing {
    use base64::Engine;
    let mut ring = KeyRing::default();
    for (kid, stored) in &state.token_keys {
        let key = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(&stored.secret)
            .ok()
            .and_then(|secret| TokenKey::new(*kid, &secret));
        match key {
            Some(key) => ring.insert(
                key,
                match (stored.retired, stored.signs) {
                    (true, _) => KeyState::Retired,
                    (false, true) => KeyState::Signing,
                    (false, false) => KeyState::Verifying,
                },
            ),
            None => tracing::error!(
                kid,
                "a replicated token key is not a valid secret; ignoring it"
            ),
        }
    }
    if let Some(key) = pinned {
        ring.pin(key.clone());
    }
    ring
}

fn sm_err(verb: ErrorVerb, e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::new(ErrorSubject::StateMachine, verb, AnyError::new(&e)).into()
}

impl StateMachine {
    /// Opens the state machine, loading the last snapshot from `db` if there is one.
    pub fn open(
        db: Arc<Database>,
        waiters: Arc<Waiters>,
        keys: SharedKeyRing,
        pinned: Option<TokenKey>,
        issued: IssuedRevision,
    ) -> Result<Self, StorageError> {
        let mut applied = Applied::default();
        let stored = Self::load(&db)?;
        if let Some(stored) = &stored {
            applied.state =
                serde_json::from_slice(&stored.data).map_err(|e| sm_err(ErrorVerb::Read, e))?;
            applied.last_applied = stored.meta.last_log_id;
            applied.membership = stored.meta.last_membership.clone();
        }
        keys.replace(key_ring(&applied.state, pinned.as_ref()));
        issued.observe(applied.state.revision);
        Ok(Self {
            applied: Arc::new(RwLock::new(applied)),
            db,
            waiters,
            keys,
            pinned,
            issued,
            saving: Arc::default(),
            current: Arc::new(std::sync::Mutex::new(stored.map(Arc::new))),
        })
    }

    /// A read handle on the applied state.
    pub fn applied(&self) -> Arc<RwLock<Applied>> {
        self.applied.clone()
    }

    fn load(db: &Database) -> Result<Option<StoredSnapshot>, StorageError> {
        let tx = db.begin_read().map_err(|e| sm_err(ErrorVerb::Read, e))?;
        let table = match tx.open_table(SNAPSHOT) {
            Ok(table) => table,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(sm_err(ErrorVerb::Read, e)),
        };
        let Some(bytes) = table.get(CURRENT).map_err(|e| sm_err(ErrorVerb::Read, e))? else {
            return Ok(None);
        };
        serde_json::from_slice(bytes.value())
            .map(Some)
            .map_err(|e| sm_err(ErrorVerb::Read, e))
    }

    /// Serializes and stores `stored` off the runtime's threads: with many leases that takes
    /// long enough to hold up Raft's heartbeats if done on them.
    async fn save(&self, stored: StoredSnapshot) -> Result<(), StorageError> {
        let _saving = self.saving.lock().await;
        let upto = self.current_snapshot().and_then(|c| c.meta.last_log_id);
        if upto.is_some() && upto >= stored.meta.last_log_id {
            return Ok(());
        }
        let stored = Arc::new(stored);
        let db = self.db.clone();
        let writing = stored.clone();
        tokio::task::spawn_blocking(move || {
            let bytes = serde_json::to_vec(&*writing).map_err(|e| sm_err(ErrorVerb::Write, e))?;
            let tx = db.begin_write().map_err(|e| sm_err(ErrorVerb::Write, e))?;
            tx.open_table(SNAPSHOT)
                .map_err(|e| sm_err(ErrorVerb::Write, e))?
                .insert(CURRENT, bytes.as_slice())
                .map_err(|e| sm_err(ErrorVerb::Write, e))?;
            tx.commit().map_err(|e| sm_err(ErrorVerb::Write, e))
        })
        .await
        .map_err(|e| sm_err(ErrorVerb::Write, e))??;
        *self.current.lock().expect("snapshot lock") = Some(stored);
        Ok(())
    }

    /// The snapshot stored in `db`, if any.
    fn current_snapshot(&self) -> Option<Arc<StoredSnapshot>> {
        self.current.lock().expect("snapshot lock").clone()
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // A copy under the lock (applying waits only that long); serialized off the runtime's
        // threads.
        let (state, meta) = {
            let applied = self.applied.read().await;
            let snapshot_id = match applied.last_applied {
                Some(last) => format!(
                    "{}-{}-{}",
                    last.leader_id, last.index, applied.state.revision
                ),
                None => format!("none-{}", applied.state.revision),
            };
            let meta = SnapshotMeta {
                last_log_id: applied.last_applied,
                last_membership: applied.membership.clone(),
                snapshot_id,
            };
            (applied.state.clone(), meta)
        };
        let data = tokio::task::spawn_blocking(move || serde_json::to_vec(&state))
            .await
            .map_err(|e| sm_err(ErrorVerb::Read, e))?
            .map_err(|e| sm_err(ErrorVerb::Read, e))?;
        self.save(StoredSnapshot {
            meta: meta.clone(),
            data: data.clone(),
        })
        .await?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, Node>), StorageError> {
        let applied = self.applied.read().await;
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, StorageError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + openraft::OptionalSend,
        I::IntoIter: openraft::OptionalSend,
    {
        let mut outcomes = Vec::new();
        let mut freed = Vec::new();
        {
            let mut applied = self.applied.write().await;
            let mut keys_changed = false;
            for entry in entries {
                applied.last_applied = Some(entry.log_id);
                let outcome = match entry.payload {
                    EntryPayload::Blank => Outcome::Nothing,
                    EntryPayload::Normal(command) => {
                        keys_changed |= matches!(
                            command,
                            Command::AddTokenKey { .. }
                                | Command::PromoteTokenKey { .. }
                                | Command::RetireTokenKey { .. }
                                | Command::Restore { .. }
                                | Command::RestorePart { .. }
                        );
                        applied.state.apply(&command, &mut freed)
                    }
                    EntryPayload::Membership(membership) => {
                        applied.membership = StoredMembership::new(Some(entry.log_id), membership);
                        Outcome::Nothing
                    }
                };
                outcomes.push(outcome);
            }
            if keys_changed {
                self.keys
                    .replace(key_ring(&applied.state, self.pinned.as_ref()));
            }
            self.issued.observe(applied.state.revision);
        }
        for resource in freed {
            self.waiters.freed(&resource);
        }
        Ok(outcomes)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, Node>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let (state, data) = tokio::task::spawn_blocking(move || {
            (serde_json::from_slice::<AuthorityState>(&data), data)
        })
        .await
        .map_err(|e| sm_err(ErrorVerb::Read, e))?;
        let state = state.map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        self.save(StoredSnapshot {
            meta: meta.clone(),
            data,
        })
        .await?;
        let freed: Vec<String> = {
            let mut applied = self.applied.write().await;
            let freed = applied
                .state
                .locks
                .keys()
                .filter(|r| !state.locks.contains_key(*r))
                .cloned()
                .collect();
            self.keys.replace(key_ring(&state, self.pinned.as_ref()));
            self.issued.observe(state.revision);
            *applied = Applied {
                last_applied: meta.last_log_id,
                membership: meta.last_membership.clone(),
                state,
            };
            freed
        };
        for resource in freed {
            self.waiters.freed(&resource);
        }
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        Ok(self.current_snapshot().map(|stored| Snapshot {
            meta: stored.meta.clone(),
            snapshot: Box::new(Cursor::new(stored.data.clone())),
        }))
    }
}
