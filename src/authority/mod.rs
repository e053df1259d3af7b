//! The token authority: a Raft-replicated lease service that hands out fencing tokens.
//!
//! Acquire, release, expire and restore go through the Raft log (a majority has them on disk
//! before anyone is told). Keepalives do not: the leader answers them from memory, but only
//! after a quorum has confirmed its leadership, so a deposed or partitioned leader extends
//! nothing.

pub mod hand_over;
mod lease_clock;
mod lock_list;
pub mod log_store;
pub mod membership;
pub mod network;
mod snapshot_receipt;
pub mod state;
pub mod state_machine;
#[cfg(test)]
mod store_test;
pub mod type_config;
mod waiters;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_core::{IssuedRevision, Resource, Revision, SharedKeyRing, Token, TokenKey};
use openraft::error::{
    CheckIsLeaderError, ClientWriteError, ForwardToLeader, InitializeError, RaftError,
};
use openraft::{ServerState, SnapshotPolicy};
use redb::Database;
use serde::Serialize;
use thiserror::Error;
use tokio::sync::RwLock;

use crate::config::{AuthorityConfig, Config, MemberConfig};
use crate::metrics::Metrics;
use lease_clock::LeaseClock;
use log_store::LogStore;
use network::Network;
use state::{AuthorityState, Command, Outcome};
use state_machine::{Applied, StateMachine};
pub use type_config::{Node, NodeId, Raft};
use waiters::Waiters;

#[derive(Debug, Error)]
pub enum AuthorityError {
    /// This node is not the leader; `leader` is its API address when known.
    #[error("this node is not the leader")]
    NotLeader { leader: Option<String> },
    #[error("the cluster cannot answer now ({0}); retry, or check that a majority of nodes is up")]
    Unavailable(String),
    #[error("cannot open the data directory {path}: {message}")]
    Open { path: String, message: String },
    #[error(
        "the revision is at its maximum ({}); no further tokens can be issued",
        Revision::MAX
    )]
    RevisionExhausted,
    #[error("the snapshot is not consistent: {0}")]
    BadSnapshot(String),
    #[error("request id {0:?} names a lease on another resource: give each acquire its own request id (the same one only to retry that acquire)")]
    RequestIdInUse(String),
    #[error("another restore began before this one was applied whole; nothing of this one was applied: run it again (only one restore at a time)")]
    RestoreInterrupted,
    #[error("token key change refused: {0}")]
    KeyRefused(String),
    #[error("membership change refused: {0}")]
    Membership(String),
    #[error(
        "the cluster holds its [authority] max_leases ({max}) live leases; release leases no longer needed (or let them expire), or raise max_leases on every node"
    )]
    TooManyLeases { max: u64 },
}

/// A lock granted to a client.
#[derive(Debug, Clone, Serialize)]
pub struct Grant {
    pub resource: String,
    pub token: String,
    pub revision: u64,
    /// The lease handle, `<id>.<secret>`: a credential, needed to renew or release.
    pub lease_id: String,
    pub ttl_ms: u64,
}

/// A lease handle as clients present it: the lease's number and its secret part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseHandle {
    pub id: u64,
    secret: Option<String>,
}

impl LeaseHandle {
    /// Parses `<id>.<32 hex digits>` (or a bare `<id>` for leases that predate handles).
    pub fn parse(text: &str) -> Option<Self> {
        let (id, secret) = match text.split_once('.') {
            Some((id, secret)) => (id, Some(secret)),
            None => (text, None),
        };
        let id = id.parse().ok().filter(|id| *id > 0)?;
        if let Some(secret) = secret {
            if secret.len() != 32 || !secret.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
        }
        Some(Self {
            id,
            secret: secret.map(str::to_owned),
        })
    }

    fn render(id: u64, secret: Option<&str>) -> String {
        match secret {
            Some(secret) => format!("{id}.{secret}"),
            None => id.to_string(),
        }
    }

    /// Whether this handle opens `lease`; compares the secret in constant time.
    fn opens(&self, lease: &state::Lease) -> bool {
        match (&self.secret, &lease.secret) {
            (Some(given), Some(stored)) => {
                given.len() == stored.len()
                    && given
                        .bytes()
                        .zip(stored.bytes())
                        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                        == 0
            }
            (_, None) => true,
            (None, Some(_)) => false,
        }
    }
}

/// What `GET /v1/token-keys` shows: ids and states, never secrets.
#[derive(Debug, Clone, Serialize)]
pub struct KeyInfo {
    pub kid: u32,
    pub retired: bool,
    pub signing: bool,
}

pub enum AcquireOutcome {
    Granted(Grant),
    Held { revision: u64 },
}

/// What `GET /v1/locks/{resource}` shows. The token string is left out on purpose: a signed
/// token is a credential, and a status reader is not the holder.
#[derive(Debug, Clone, Serialize)]
pub struct LockStatus {
    pub resource: String,
    pub revision: u64,
    /// The lease's number (not its handle, which is the holder's credential).
    pub lease: u64,
    pub holder: Option<String>,
    pub ttl_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Member {
    pub id: NodeId,
    pub api: String,
    pub peer: String,
    /// A voter; otherwise a learner (a node being added, catching up).
    pub voter: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ClusterStatus {
    pub node_id: NodeId,
    pub leader_id: Option<NodeId>,
    pub state: String,
    pub term: u64,
    pub members: Vec<Member>,
    pub last_applied: Option<u64>,
    /// Last log index covered by this node's latest snapshot.
    pub snapshot: Option<u64>,
    pub revision: u64,
    /// A fence a store reported above every revision issued so far (the authority was reset
    /// below the stores): writes to that resource are refused until the revision passes it.
    pub fence_above_authority: Option<u64>,
}

pub struct AcquireRequest {
    pub resource: Resource,
    pub ttl: Duration,
    pub wait: Duration,
    pub request_id: Option<String>,
    pub holder: Option<String>,
}

pub struct Authority {
    id: NodeId,
    raft: Raft,
    applied: Arc<RwLock<Applied>>,
    clock: Arc<LeaseClock>,
    waiters: Arc<Waiters>,
    keys: SharedKeyRing,
    /// Tokens are never issued below this (see `authority.initial_revision`).
    initial_revision: u64,
    /// The configured members' API addresses, by node id: used for members that the
    /// membership records without one (see `type_config::Node`).
    apis: BTreeMap<NodeId, String>,
    /// Asks peers whether this node was removed.
    network: Network,
    membership: membership::Watch,
    /// Serializes making and promoting token keys.
    key_setup: tokio::sync::Mutex<()>,
    /// How long a new key verifies before it signs.
    key_settle: Duration,
    metrics: Arc<Metrics>,
    restore_bump: u64,
    max_ttl_ms: u64,
    max_leases: u64,
    /// The last quorum confirmation of leadership: when its round started, and the term.
    confirmed: tokio::sync::Mutex<Option<(Instant, u64)>>,
    /// How long a confirmation may be reused; see `recent_leadership`.
    lease_window: Duration,
    /// The leader's heartbeat interval (`[authority] heartbeat_ms`).
    heartbeat: Duration,
    /// The highest term a peer asked this node's vote for (see `snapshot_receipt`).
    campaign_term: std::sync::atomic::AtomicU64,
    /// Set by [`Authority::drain`]: this node never campaigns again (not even after a
    /// hand-over).
    draining: Arc<std::sync::atomic::AtomicBool>,
    /// A hand-over is waiting to campaign: a second one is declined (see `hand_over`).
    hand_over_pending: std::sync::atomic::AtomicBool,
}

impl Authority {
    /// Opens the node's data, starts Raft, forms the cluster on first start, and starts the
    /// leader's expiry loop.
    pub async fn start(
        config: &Config,
        keys: SharedKeyRing,
        issued: IssuedRevision,
        pinned: Option<TokenKey>,
        metrics: Arc<Metrics>,
        network: Network,
    ) -> Result<Arc<Self>, AuthorityError> {
        let dir = &config.node.raft_dir();
        let open_err = |message: String| AuthorityError::Open {
            path: dir.display().to_string(),
            message,
        };
        std::fs::create_dir_all(dir).map_err(|e| open_err(e.to_string()))?;
        let db = Arc::new(
            Database::create(dir.join(crate::disk::RAFT_FILE))
                .map_err(|e| open_err(e.to_string()))?,
        );
        let log = LogStore::open(db.clone()).map_err(|e| open_err(e.to_string()))?;
        let waiters = Arc::new(Waiters::default());
        let sm = StateMachine::open(db, waiters.clone(), keys.clone(), pinned, issued)
            .map_err(|e| open_err(e.to_string()))?;
        let applied = sm.applied();
        let raft_config = raft_config(&config.authority).map_err(AuthorityError::Unavailable)?;
        let raft = Raft::new(
            config.node.id,
            Arc::new(raft_config),
            network.clone(),
            log,
            sm,
        )
        .await
        .map_err(|e| open_err(e.to_string()))?;

        if config.authority.join {
            tracing::info!(
                node_id = config.node.id,
                "join mode: waiting to be added to a cluster (fencegate cluster add-node)"
            );
        } else {
            initialize(&raft, &config.members()).await?;
        }

        let authority = Arc::new(Self {
            id: config.node.id,
            raft,
            applied,
            clock: Arc::new(LeaseClock::default()),
            waiters,
            keys,
            initial_revision: config.authority.initial_revision,
            apis: config
                .members()
                .into_iter()
                .map(|m| (m.id, m.api))
                .collect(),
            network,
            membership: membership::Watch::open(dir),
            key_setup: tokio::sync::Mutex::new(()),
            key_settle: Duration::from_millis(config.authority.heartbeat_ms * 5),
            metrics,
            restore_bump: config.authority.restore_bump,
            max_ttl_ms: config.authority.max_ttl_ms,
            max_leases: config.authority.max_leases,
            confirmed: tokio::sync::Mutex::new(None),
            lease_window: Duration::from_millis(config.authority.election_timeout_min_ms / 2),
            heartbeat: Duration::from_millis(config.authority.heartbeat_ms),
            campaign_term: Default::default(),
            draining: Arc::default(),
            hand_over_pending: Default::default(),
        });
        tokio::spawn(watch_leadership(authority.clone()));
        tokio::spawn(membership::watch_membership(authority.clone()));
        tokio::spawn(expire_leases(authority.clone(), authority.heartbeat));
        Ok(authority)
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Readies Raft for this node's shutdown: it never campaigns again, so a node going away
    /// cannot win an election it will not serve. Returns whether it leads now.
    pub fn drain(&self) -> bool {
        self.draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.raft.runtime_config().elect(false);
        self.raft.metrics().borrow().state == ServerState::Leader
    }

    /// The API address of the leader this node knows of, if it is not itself.
    pub fn leader_api(&self) -> Option<String> {
        let metrics = self.raft.metrics().borrow().clone();
        let leader = metrics.current_leader.filter(|l| *l != self.id)?;
        let node = metrics.membership_config.membership().get_node(&leader)?;
        self.api_of(leader, node)
    }

    /// Grants the lock, waiting (in arrival order) up to `wait` while it is held.
    pub async fn acquire(&self, req: AcquireRequest) -> Result<AcquireOutcome, AuthorityError> {
        let resource = req.resource.as_str().to_owned();
        if let Some(id) = &req.request_id {
            let known = self.applied.read().await.state.by_request(id, &resource);
            if let Some(Outcome::Acquired {
                token,
                lease_id,
                ttl_ms,
                secret,
                ..
            }) = known
            {
                return Ok(AcquireOutcome::Granted(self.grant(
                    &req.resource,
                    token,
                    LeaseHandle::render(lease_id, secret.as_deref()),
                    ttl_ms,
                )?));
            }
        }
        // Checked by the leader (a follower forwards the acquire to it) and not where commands
        // are applied: every node must apply the same log the same way whatever its config
        // says. Acquires proposed at once may pass the bound by their number.
        let leads = self.raft.metrics().borrow().state == ServerState::Leader;
        if leads {
            let applied = self.applied.read().await;
            // A held lock is answered as held (409, or the wait), at the bound too.
            let held = applied.state.locks.contains_key(&resource);
            if !held && applied.state.leases.len() as u64 >= self.max_leases {
                self.metrics.leases_refused.inc();
                return Err(AuthorityError::TooManyLeases {
                    max: self.max_leases,
                });
            }
            // The same id for another resource would take the index from the first lease,
            // whose retries would then get a new lease and token. (A retry of this acquire
            // applied since the check above goes on: applying it answers with its lease.)
            if let Some(id) = req.request_id.as_ref().filter(|id| {
                applied.state.requests.contains_key(id.as_str())
                    && applied.state.by_request(id, &resource).is_none()
            }) {
                return Err(AuthorityError::RequestIdInUse(id.clone()));
            }
        }
        self.ensure_signing_key().await?;
        let command = Command::Acquire {
            resource: resource.clone(),
            ttl_ms: req.ttl.as_millis() as u64,
            request_id: req.request_id.clone(),
            holder: req.holder.clone(),
            secret: Some(random_hex()),
        };
        let slot = self.waiters.slot(&resource);
        let _waiting = (!req.wait.is_zero()).then(|| Waiting::new(&self.metrics));
        let deadline = tokio::time::Instant::now() + req.wait;
        // Whoever holds the turn is first in line; a later arrival waits behind it or, if it
        // will not wait, is told the lock is held.
        let _turn = match slot.turn.try_lock() {
            Ok(turn) => turn,
            Err(_) if req.wait.is_zero() => {
                return Ok(AcquireOutcome::Held {
                    revision: self.holder_revision(&resource).await,
                })
            }
            Err(_) => match tokio::time::timeout_at(deadline, slot.turn.lock()).await {
                Ok(turn) => turn,
                Err(_) => {
                    return Ok(AcquireOutcome::Held {
                        revision: self.holder_revision(&resource).await,
                    })
                }
            },
        };
        loop {
            match self.propose(command.clone()).await? {
                Outcome::Acquired {
                    token,
                    lease_id,
                    ttl_ms,
                    secret,
                    ..
                } => {
                    self.metrics.acquires.inc();
                    return Ok(AcquireOutcome::Granted(self.grant(
                        &req.resource,
                        token,
                        LeaseHandle::render(lease_id, secret.as_deref()),
                        ttl_ms,
                    )?));
                }
                Outcome::Held { revision } => {
                    if tokio::time::timeout_at(deadline, slot.freed.notified())
                        .await
                        .is_err()
                    {
                        return Ok(AcquireOutcome::Held { revision });
                    }
                }
                Outcome::RevisionExhausted => return Err(AuthorityError::RevisionExhausted),
                other => {
                    return Err(AuthorityError::Unavailable(format!(
                        "unexpected outcome {other:?}"
                    )))
                }
            }
        }
    }

    /// Renews a lease; `None` when it has expired, never existed, or the handle's secret does
    /// not match (the same answer, so handles cannot be probed).
    pub async fn keepalive(&self, handle: &LeaseHandle) -> Result<Option<u64>, AuthorityError> {
        let term = self.recent_leadership().await?;
        let lease_id = handle.id;
        let ttl_ms = match self.applied.read().await.state.leases.get(&lease_id) {
            Some(lease) if handle.opens(lease) => lease.ttl_ms,
            _ => return Ok(None),
        };
        match self.clock.renew(
            term,
            lease_id,
            Duration::from_millis(ttl_ms),
            Instant::now(),
        ) {
            Ok(()) => {
                self.metrics.keepalives.inc();
                Ok(Some(ttl_ms))
            }
            Err(lease_clock::Refusal::Expired) => Ok(None),
            Err(lease_clock::Refusal::OtherTerm) => Err(AuthorityError::Unavailable(
                "leadership is changing; retry".into(),
            )),
        }
    }

    /// Releases a lease and its locks; `false` when there was no such lease or the handle's
    /// secret does not match.
    pub async fn release(&self, handle: &LeaseHandle) -> Result<bool, AuthorityError> {
        let lease_id = handle.id;
        let opens = match self.applied.read().await.state.leases.get(&lease_id) {
            Some(lease) => handle.opens(lease),
            None => false,
        };
        if !opens {
            // A follower's copy may lag: let the leader judge.
            if self.raft.metrics().borrow().state != ServerState::Leader {
                return Err(AuthorityError::NotLeader {
                    leader: self.leader_api(),
                });
            }
            return Ok(false);
        }
        match self.propose(Command::Release { lease_id }).await? {
            Outcome::Released { .. } => {
                self.metrics.releases.inc();
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    pub async fn status(&self, resource: &Resource) -> Result<Option<LockStatus>, AuthorityError> {
        self.confirm_leadership().await?;
        let applied = self.applied.read().await;
        let Some(lock) = applied.state.locks.get(resource.as_str()) else {
            return Ok(None);
        };
        let ttl = applied
            .state
            .leases
            .get(&lock.lease_id)
            .map_or(0, |l| l.ttl_ms);
        let left = self
            .clock
            .remaining(lock.lease_id, Duration::from_millis(ttl), Instant::now());
        Ok(Some(LockStatus {
            resource: resource.to_string(),
            revision: lock.token,
            lease: lock.lease_id,
            holder: lock.holder.clone(),
            ttl_ms: left.as_millis() as u64,
        }))
    }

    /// This node's view of the cluster; answered locally, without asking the leader.
    pub async fn cluster(&self) -> ClusterStatus {
        let metrics = self.raft.metrics().borrow().clone();
        let revision = self.applied.read().await.state.revision;
        let members = self.members();
        ClusterStatus {
            node_id: self.id,
            leader_id: metrics.current_leader,
            state: format!("{:?}", metrics.state),
            term: metrics.current_term,
            members,
            last_applied: metrics.last_applied.map(|l| l.index),
            snapshot: metrics.snapshot.map(|l| l.index),
            revision,
            fence_above_authority: self.metrics.fences.check_floor(revision),
        }
    }

    /// The whole state, read linearizably on the leader.
    pub async fn snapshot(&self) -> Result<AuthorityState, AuthorityError> {
        self.confirm_leadership().await?;
        let mut state = self.applied.read().await.state.clone();
        // A restore still arriving is not part of what a backup holds.
        state.restoring = None;
        Ok(state)
    }

    /// Replaces the state with `state` and bumps the revision above both it and the current one.
    pub async fn restore(&self, state: AuthorityState) -> Result<u64, AuthorityError> {
        state
            .validate(self.max_ttl_ms)
            .map_err(AuthorityError::BadSnapshot)?;
        let pieces = state.pieces(state::RESTORE_PART_BYTES);
        let parts = u32::try_from(pieces.len())
            .map_err(|_| AuthorityError::BadSnapshot("the state is too large".into()))?;
        let restore = random_hex();
        let mut outcome = Outcome::Nothing;
        // In order, each once the one before is applied: the state machine takes a part only
        // after the one before it.
        for (index, piece) in (0..parts).zip(pieces) {
            outcome = self
                .propose(Command::RestorePart {
                    restore: restore.clone(),
                    index,
                    parts,
                    piece: Box::new(piece),
                    bump: self.restore_bump,
                })
                .await?;
            if outcome == Outcome::RestoreInterrupted {
                return Err(AuthorityError::RestoreInterrupted);
            }
        }
        match outcome {
            Outcome::Bumped { revision } => Ok(revision),
            Outcome::RevisionExhausted => Err(AuthorityError::RevisionExhausted),
            other => Err(AuthorityError::Unavailable(format!(
                "unexpected outcome {other:?}"
            ))),
        }
    }

    /// Refreshes the gauges that are read off Raft and the state at scrape time.
    pub async fn refresh_gauges(&self) {
        let m = self.raft.metrics().borrow().clone();
        self.metrics.term.set(m.current_term as i64);
        self.metrics
            .is_leader
            .set(i64::from(m.state == ServerState::Leader));
        self.metrics
            .commit_index
            .set(m.last_applied.map_or(0, |l| l.index as i64));
        let applied = self.applied.read().await;
        self.metrics
            .active_leases
            .set(applied.state.leases.len() as i64);
        self.metrics.revision.set(applied.state.revision as i64);
        self.metrics.fences.check_floor(applied.state.revision);
    }

    fn grant(
        &self,
        resource: &Resource,
        token: u64,
        lease_id: String,
        ttl_ms: u64,
    ) -> Result<Grant, AuthorityError> {
        let revision = Revision::new(token).expect("the state machine issues revisions in range");
        let encoded = self
            .keys
            .read(|ring| {
                ring.signer()
                    .map(|key| Token::new(resource.clone(), revision).signed(key))
            })
            .ok_or_else(|| {
                AuthorityError::Unavailable(
                    "no active token signing key; rotate one in (fencegate token-key rotate)"
                        .into(),
                )
            })?;
        Ok(Grant {
            resource: resource.to_string(),
            token: encoded.to_string(),
            revision: token,
            lease_id,
            ttl_ms,
        })
    }

    /// Makes the cluster's first token key if it has none, and raises the revision to
    /// `initial_revision`; run by a leader before it grants anything.
    async fn ensure_signing_key(&self) -> Result<(), AuthorityError> {
        let (has_signer, revision) = (
            self.keys.read(|ring| ring.signer().is_some()),
            self.applied.read().await.state.revision,
        );
        if revision < self.initial_revision {
            self.propose(Command::Floor {
                revision: self.initial_revision,
            })
            .await?;
        }
        if has_signer {
            return Ok(());
        }
        // One setup at a time: concurrent first acquires wait for the same key.
        let _setup = self.key_setup.lock().await;
        if self.keys.read(|ring| ring.signer().is_some()) {
            return Ok(());
        }
        let pending = {
            let state = &self.applied.read().await.state;
            state
                .token_keys
                .iter()
                .rev()
                .find(|(_, k)| !k.retired)
                .map(|(kid, _)| *kid)
        };
        let kid = match pending {
            // A key added by an earlier leader that was never promoted.
            Some(kid) => kid,
            None => self.add_key().await?,
        };
        self.promote_key(kid).await?;
        tracing::info!(kid, "the cluster's first token signing key is in use");
        Ok(())
    }

    /// Proposes a new verify-only key with the next id.
    async fn add_key(&self) -> Result<u32, AuthorityError> {
        let next = self
            .applied
            .read()
            .await
            .state
            .newest_key()
            .map_or(1, |kid| kid + 1);
        match self.propose(new_key_command(next)).await? {
            Outcome::KeyAdded { kid } => Ok(kid),
            Outcome::KeyRefused { reason } => Err(AuthorityError::KeyRefused(reason)),
            other => Err(AuthorityError::Unavailable(format!(
                "unexpected outcome {other:?}"
            ))),
        }
    }

    /// Lets `kid` sign, once followers have had time to apply it: they learn of a commit with
    /// the next heartbeat, so a few heartbeats cover every node that is up and in touch.
    async fn promote_key(&self, kid: u32) -> Result<(), AuthorityError> {
        tokio::time::sleep(self.key_settle).await;
        match self.propose(Command::PromoteTokenKey { kid }).await? {
            Outcome::KeyAdded { .. } => Ok(()),
            Outcome::KeyRefused { reason } => Err(AuthorityError::KeyRefused(reason)),
            other => Err(AuthorityError::Unavailable(format!(
                "unexpected outcome {other:?}"
            ))),
        }
    }

    /// Adds a new token signing key; once replicated it signs, and older keys still verify.
    pub async fn rotate_key(&self) -> Result<u32, AuthorityError> {
        self.confirm_leadership().await?;
        let _setup = self.key_setup.lock().await;
        let kid = self.add_key().await?;
        self.promote_key(kid).await?;
        tracing::info!(kid, "rotated the token signing key");
        Ok(kid)
    }

    /// Retires key `kid`: tokens it signed are refused by every gateway from now on.
    pub async fn retire_key(&self, kid: u32) -> Result<(), AuthorityError> {
        match self.propose(Command::RetireTokenKey { kid }).await? {
            Outcome::KeyRetired { .. } => Ok(()),
            Outcome::KeyRefused { reason } => Err(AuthorityError::KeyRefused(reason)),
            other => Err(AuthorityError::Unavailable(format!(
                "unexpected outcome {other:?}"
            ))),
        }
    }

    /// The token keys this node knows, without secrets.
    pub fn key_list(&self) -> Vec<KeyInfo> {
        self.keys.read(|ring| {
            let signer = ring.signer().map(TokenKey::id);
            ring.keys()
                .map(|(key, state)| KeyInfo {
                    kid: key.id(),
                    retired: state == fencegate_core::KeyState::Retired,
                    signing: Some(key.id()) == signer,
                })
                .collect()
        })
    }

    /// Raises the revision by `by` (after restoring stores from a backup, say).
    pub async fn bump(&self, by: u64) -> Result<u64, AuthorityError> {
        match self.propose(Command::Bump { by }).await? {
            Outcome::Bumped { revision } => Ok(revision),
            Outcome::RevisionExhausted => Err(AuthorityError::RevisionExhausted),
            other => Err(AuthorityError::Unavailable(format!(
                "unexpected outcome {other:?}"
            ))),
        }
    }

    /// This node's applied revision and the token of `resource`'s current holder, if any: what
    /// an operator's fence reset may lower a fence to. Read locally (a follower may lag by an
    /// entry or two; the reset is a compare-and-set in the store either way).
    pub async fn fence_floor(&self, resource: &Resource) -> (u64, Option<u64>) {
        let applied = self.applied.read().await;
        let holder = applied.state.locks.get(resource.as_str()).map(|l| l.token);
        (applied.state.revision, holder)
    }

    /// Forgets the fences stores reported (after an operator reset one), so the
    /// fence-above-authority report reflects only refusals seen from now on.
    pub fn forget_fences(&self) {
        self.metrics.fences.forget();
    }

    async fn holder_revision(&self, resource: &str) -> u64 {
        self.applied
            .read()
            .await
            .state
            .locks
            .get(resource)
            .map_or(0, |l| l.token)
    }

    async fn propose(&self, command: Command) -> Result<Outcome, AuthorityError> {
        match self.raft.client_write(command).await {
            Ok(response) => Ok(response.data),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                Err(self.not_leader(f))
            }
            Err(e) => Err(AuthorityError::Unavailable(e.to_string())),
        }
    }

    /// The leadership term, confirmed by a quorum no longer than `lease_window` ago.
    ///
    /// A follower that acknowledged a heartbeat refuses to vote for anyone else for an election
    /// timeout (openraft's leader lease), so no other leader can exist until at least
    /// `confirmed_at + election_timeout_max`. Reusing a confirmation for half the minimum
    /// election timeout stays well inside that, and lets concurrent keepalives share one round
    /// of heartbeats instead of each sending its own. `confirmed_at` is read on this node's
    /// monotonic clock *before* the round starts, so a node paused after confirming sees an
    /// old confirmation when it wakes and must confirm again (which a deposed leader cannot).
    async fn recent_leadership(&self) -> Result<u64, AuthorityError> {
        let mut confirmed = self.confirmed.lock().await;
        if let Some((at, term)) = *confirmed {
            // Only while this node still leads that term: a node that saw a higher term or
            // stepped down must not answer from an older confirmation.
            let still = {
                let metrics = self.raft.metrics();
                let metrics = metrics.borrow();
                metrics.state == ServerState::Leader && metrics.current_term == term
            };
            if still && at.elapsed() < self.lease_window {
                return Ok(term);
            }
        }
        let started = Instant::now();
        *confirmed = None;
        let term = self.confirm_leadership().await?;
        *confirmed = Some((started, term));
        Ok(term)
    }

    /// Confirms with a quorum that this node still leads, waits until its state machine has
    /// applied everything committed before, and returns the term.
    async fn confirm_leadership(&self) -> Result<u64, AuthorityError> {
        match self.raft.ensure_linearizable().await {
            Ok(_) => {}
            Err(RaftError::APIError(CheckIsLeaderError::ForwardToLeader(f))) => {
                return Err(self.not_leader(f))
            }
            Err(e) => return Err(AuthorityError::Unavailable(e.to_string())),
        }
        let metrics = self.raft.metrics().borrow().clone();
        if metrics.state != ServerState::Leader {
            return Err(AuthorityError::NotLeader {
                leader: self.leader_api(),
            });
        }
        Ok(metrics.current_term)
    }

    fn not_leader(&self, f: ForwardToLeader<NodeId, Node>) -> AuthorityError {
        let named = match (f.leader_id, &f.leader_node) {
            (Some(id), Some(node)) => self.api_of(id, node),
            _ => None,
        };
        AuthorityError::NotLeader {
            leader: named.or_else(|| self.leader_api()),
        }
    }
}

/// 128 random bits as 32 hex digits: lease handle secrets.
fn random_hex() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::thread_rng().gen();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A new token key with a fresh 256-bit secret, made by the proposer (applying stays
/// deterministic: the secret is in the entry).
fn new_key_command(kid: u32) -> Command {
    use base64::Engine;
    use rand::Rng;
    let secret: [u8; 32] = rand::thread_rng().gen();
    Command::AddTokenKey {
        kid,
        secret: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(secret),
    }
}

/// Counts an acquire in `waiting_acquires` for as long as it lives.
struct Waiting<'a>(&'a Metrics);

impl<'a> Waiting<'a> {
    fn new(metrics: &'a Metrics) -> Self {
        metrics.waiting_acquires.inc();
        Self(metrics)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting_acquires.dec();
    }
}

/// The size of one snapshot chunk sent to a lagging node (about 1 MiB as JSON).
const SNAPSHOT_CHUNK_BYTES: u64 = 256 * 1024;

/// How long one snapshot chunk may take to be sent, and the last one to be installed with the
/// whole state (`[authority] max_leases` of them at most).
const SNAPSHOT_CHUNK_TIMEOUT: Duration = Duration::from_secs(10);

fn raft_config(c: &AuthorityConfig) -> Result<openraft::Config, String> {
    openraft::Config {
        cluster_name: "fencegate".into(),
        heartbeat_interval: c.heartbeat_ms,
        election_timeout_min: c.election_timeout_min_ms,
        election_timeout_max: c.election_timeout_max_ms,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(c.snapshot_every_logs),
        max_in_snapshot_log_to_keep: c.snapshot_keep_logs,
        // openraft's defaults (3 MiB chunks, 200 ms to send one, and to install the whole
        // snapshot with the last) held only for small states: a chunk is about 12 MiB of JSON,
        // and a state of many leases takes longer than that to install, so a lagging node
        // never caught up. Small chunks, each with time to spare.
        snapshot_max_chunk_size: SNAPSHOT_CHUNK_BYTES,
        install_snapshot_timeout: SNAPSHOT_CHUNK_TIMEOUT.as_millis() as u64,
        ..Default::default()
    }
    .validate()
    .map_err(|e| e.to_string())
}

/// Forms the cluster on its very first start. Every member may call this with the same
/// membership (openraft allows it); on a node that has a log or a vote it is refused with
/// `NotAllowed`, which is what makes a restart safe.
async fn initialize(raft: &Raft, members: &[MemberConfig]) -> Result<(), AuthorityError> {
    let nodes: BTreeMap<NodeId, Node> = members
        .iter()
        .map(|m| {
            (
                m.id,
                Node {
                    peer: m.raft_addr().to_owned(),
                    api: m.api.clone(),
                },
            )
        })
        .collect();
    match raft.initialize(nodes).await {
        Ok(()) => {
            tracing::info!(members = members.len(), "initialized a new cluster");
            Ok(())
        }
        Err(RaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
        Err(e) => Err(AuthorityError::Unavailable(format!(
            "cannot initialize the cluster: {e}"
        ))),
    }
}

/// Keeps the lease clock's idea of leadership in step with Raft's.
async fn watch_leadership(authority: Arc<Authority>) {
    let mut metrics = authority.raft.metrics();
    loop {
        let leader_term = {
            let m = metrics.borrow_and_update();
            (m.state == ServerState::Leader).then_some(m.current_term)
        };
        authority.clock.observe(leader_term);
        if leader_term.is_some() {
            // A new leader makes the cluster's first key (and applies initial_revision) before
            // anyone asks for a token.
            let authority = authority.clone();
            tokio::spawn(async move {
                if let Err(e) = authority.ensure_signing_key().await {
                    tracing::debug!(error = %e, "token key setup deferred to the first acquire");
                }
            });
        }
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

/// On the leader, proposes an expiry for every lease whose deadline passed.
async fn expire_leases(authority: Arc<Authority>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let term = {
            let m = authority.raft.metrics().borrow().clone();
            if m.running_state.is_err() {
                return;
            }
            if m.state != ServerState::Leader {
                continue;
            }
            m.current_term
        };
        let leases: Vec<(u64, Duration)> = {
            let applied = authority.applied.read().await;
            applied
                .state
                .leases
                .iter()
                .map(|(id, l)| (*id, Duration::from_millis(l.ttl_ms)))
                .collect()
        };
        for lease_id in authority.clock.due(term, leases, Instant::now()) {
            let authority = authority.clone();
            tokio::spawn(async move {
                match authority.propose(Command::Expire { lease_id }).await {
                    Ok(Outcome::Released { revision }) => {
                        authority.metrics.expiries.inc();
                        tracing::info!(lease_id, revision, "lease expired");
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(lease_id, error = %e, "could not propose a lease expiry; will retry");
                        authority.clock.retry_expiry(lease_id);
                    }
                }
            });
        }
    }
}
