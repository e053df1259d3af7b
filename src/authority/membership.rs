//! Online membership changes: a node is added as a learner, catches up, then votes; a node is
//! removed; a removed node notices and stops.
//!
//! openraft stops replicating to a removed node at once, so the removed node never receives
//! the entry that removes it (unless it led the change). It notices in one of two ways: it
//! applies a committed membership without itself (it was the leader), or it stops hearing from
//! any leader and a peer reports a committed membership without it, later than the last one it
//! was in. That last index is kept next to the Raft log, so a removed node that restarts
//! notices too, and a node still catching up on old entries (which name older memberships)
//! never mistakes them for its removal.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use openraft::error::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, ServerState};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::network::MEMBERSHIP_PATH;
use super::type_config::{Node, NodeId};
use super::{Authority, AuthorityError, Member};

/// How long a learner may take to catch up before `add_node` gives up (it stays a learner).
const CATCH_UP: Duration = Duration::from_secs(60);
/// A learner is caught up when it is at most this many entries behind the leader's log.
const CATCH_UP_LAG: u64 = 64;
/// How often a node checks whether it is still a member.
const CHECK_EVERY: Duration = Duration::from_millis(500);
/// Without an AppendEntries for this long, a node asks its peers whether it was removed
/// (twenty heartbeats at the default 100 ms: an election settles well within it).
const QUIET: Duration = Duration::from_secs(2);
/// How long each peer may take to answer that question.
const ASK_TIMEOUT: Duration = Duration::from_secs(1);
/// The file, next to the Raft log, holding the log index of the latest committed membership
/// that named this node.
const SEEN_FILE: &str = "membership-seen";

/// A node's committed membership, as it answers a peer that asks (`MEMBERSHIP_PATH`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CommittedMembership {
    /// Log index of the membership entry; `None` before the node has any.
    pub index: Option<u64>,
    pub members: BTreeSet<NodeId>,
}

/// This node's side of membership: when it last heard from a leader, and whether it knows it
/// was removed.
pub struct Watch {
    heard: Mutex<Instant>,
    /// Index of the latest committed membership naming this node, and its file.
    seen: Mutex<Option<u64>>,
    seen_path: PathBuf,
    removed: watch::Sender<bool>,
}

impl Watch {
    pub fn open(data_dir: &std::path::Path) -> Self {
        let seen_path = data_dir.join(SEEN_FILE);
        let seen = std::fs::read_to_string(&seen_path)
            .ok()
            .and_then(|text| text.trim().parse().ok());
        Self {
            heard: Mutex::new(Instant::now()),
            seen: Mutex::new(seen),
            seen_path,
            removed: watch::channel(false).0,
        }
    }

    fn seen(&self) -> Option<u64> {
        *self.seen.lock().expect("seen lock")
    }

    /// Records that the committed membership at `index` names this node.
    fn saw_self(&self, index: u64) {
        let mut seen = self.seen.lock().expect("seen lock");
        if *seen >= Some(index) {
            return;
        }
        *seen = Some(index);
        let tmp = self.seen_path.with_extension("partial");
        let written = std::fs::write(&tmp, format!("{index}\n"))
            .and_then(|()| std::fs::rename(&tmp, &self.seen_path));
        if let Err(e) = written {
            // Only a restart of a removed node depends on the file; it then keeps running
            // until stopped by hand.
            tracing::warn!(path = %self.seen_path.display(), error = %e, "cannot record this node's membership");
        }
    }
}

impl Authority {
    /// Called for every AppendEntries and snapshot a leader sends this node.
    pub fn heard_from_leader(&self) {
        *self.membership.heard.lock().expect("heard lock") = Instant::now();
    }

    /// How long ago this node last received an AppendEntries or snapshot (or started).
    pub(super) fn since_heard_from_leader(&self) -> std::time::Duration {
        self.membership.heard.lock().expect("heard lock").elapsed()
    }

    /// Becomes `true` once this node knows it is no longer a member; `serve` then stops.
    pub fn removed(&self) -> watch::Receiver<bool> {
        self.membership.removed.subscribe()
    }

    /// The committed membership, for a peer asking whether it was removed.
    pub async fn committed_membership(&self) -> CommittedMembership {
        let applied = self.applied.read().await;
        CommittedMembership {
            index: applied.membership.log_id().as_ref().map(|l| l.index),
            members: applied
                .membership
                .membership()
                .nodes()
                .map(|(id, _)| *id)
                .collect(),
        }
    }

    /// The members as this node sees them (its latest membership, committed or not).
    pub fn members(&self) -> Vec<Member> {
        let metrics = self.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        membership
            .nodes()
            .map(|(id, node)| Member {
                id: *id,
                api: self.api_of(*id, node).unwrap_or_default(),
                peer: node.peer.clone(),
                voter: voters.contains(id),
            })
            .collect()
    }

    /// Where member `id` serves its API: recorded in the membership, or, for members recorded
    /// before addresses were, configured in `[[authority.members]]`.
    pub(super) fn api_of(&self, id: NodeId, node: &Node) -> Option<String> {
        if node.api.is_empty() {
            self.apis.get(&id).cloned()
        } else {
            Some(node.api.clone())
        }
    }

    /// Adds node `id` as a learner, waits until it has caught up with the log, then makes it a
    /// voter. Run on the leader (elsewhere: `NotLeader`). Adding a member again with the same
    /// addresses only finishes what an interrupted call started.
    pub async fn add_node(&self, id: NodeId, node: Node) -> Result<Vec<Member>, AuthorityError> {
        let current = self
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .clone();
        if let Some(existing) = current.get_node(&id) {
            let same = existing.peer == node.peer
                && self.api_of(id, existing).as_deref() == Some(node.api.as_str());
            if !same {
                return Err(AuthorityError::Membership(format!(
                    "node {id} is already a member with peer {} and api {}; remove it first, or add the new node under a new id",
                    existing.peer,
                    self.api_of(id, existing).unwrap_or_default()
                )));
            }
        }
        self.record_configured_apis(&current).await?;
        let added = self
            .raft
            .add_learner(id, node.clone(), false)
            .await
            .map_err(|e| self.write_err(e))?;
        tracing::info!(node = id, peer = %node.peer, api = %node.api, "added a learner; waiting for it to catch up");
        self.await_catch_up(id, &node, added.log_id.index).await?;
        self.raft
            .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false)
            .await
            .map_err(|e| self.write_err(e))?;
        tracing::info!(node = id, "the new node is a voter");
        Ok(self.members())
    }

    /// Removes node `id` from the cluster (voter or learner). Run on the leader. Removing a node
    /// that is not a member changes nothing.
    pub async fn remove_node(&self, id: NodeId) -> Result<Vec<Member>, AuthorityError> {
        if self.raft.metrics().borrow().state != ServerState::Leader {
            return Err(AuthorityError::NotLeader {
                leader: self.leader_api(),
            });
        }
        let membership = self
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .clone();
        if membership.get_node(&id).is_none() {
            return Ok(self.members());
        }
        let ids = BTreeSet::from([id]);
        let change = if membership.voter_ids().any(|v| v == id) {
            ChangeMembers::RemoveVoters(ids)
        } else {
            ChangeMembers::RemoveNodes(ids)
        };
        self.raft
            .change_membership(change, false)
            .await
            .map_err(|e| self.write_err(e))?;
        tracing::info!(node = id, "removed a node from the cluster");
        Ok(self.members())
    }

    /// Members recorded without an API address (clusters formed before addresses were kept in
    /// the membership) get the one this node has configured, so a node added online can reach
    /// every member's API too.
    async fn record_configured_apis(
        &self,
        current: &openraft::Membership<NodeId, Node>,
    ) -> Result<(), AuthorityError> {
        let filled: BTreeMap<NodeId, Node> = current
            .nodes()
            .filter(|(_, node)| node.api.is_empty())
            .filter_map(|(id, node)| {
                let api = self.apis.get(id)?.clone();
                Some((
                    *id,
                    Node {
                        peer: node.peer.clone(),
                        api,
                    },
                ))
            })
            .collect();
        if filled.is_empty() {
            return Ok(());
        }
        // The peer addresses stay as they are; only the API address is added.
        self.raft
            .change_membership(ChangeMembers::SetNodes(filled), true)
            .await
            .map_err(|e| self.write_err(e))?;
        Ok(())
    }

    /// Waits until the leader has replicated to learner `id` everything up to the entry that
    /// added it, and it is at most `CATCH_UP_LAG` entries behind.
    async fn await_catch_up(
        &self,
        id: NodeId,
        node: &Node,
        added_at: u64,
    ) -> Result<(), AuthorityError> {
        let mut metrics = self.raft.metrics();
        let caught_up = tokio::time::timeout(CATCH_UP, async {
            loop {
                {
                    let m = metrics.borrow_and_update();
                    if m.state != ServerState::Leader {
                        return Err(AuthorityError::Unavailable(format!(
                            "this node stopped leading while node {id} caught up; run add-node again"
                        )));
                    }
                    let matched = m
                        .replication
                        .as_ref()
                        .and_then(|r| r.get(&id).cloned().flatten())
                        .map(|l| l.index);
                    let last = m.last_log_index.unwrap_or(0);
                    if matched.is_some_and(|i| i >= added_at && i + CATCH_UP_LAG >= last) {
                        return Ok(());
                    }
                }
                if metrics.changed().await.is_err() {
                    return Err(AuthorityError::Unavailable("Raft stopped".into()));
                }
            }
        })
        .await;
        caught_up.unwrap_or_else(|_| {
            Err(AuthorityError::Unavailable(format!(
                "node {id} was added as a learner but did not catch up within {}s: check that it runs (in join mode) and that the leader reaches its peer port at {} (with TLS, its certificate must come from the cluster CA and name that host); then run add-node again, or remove-node {id}",
                CATCH_UP.as_secs(),
                node.peer
            )))
        })
    }

    fn write_err(&self, e: RaftError<NodeId, ClientWriteError<NodeId, Node>>) -> AuthorityError {
        match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => self.not_leader(f),
            RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => {
                AuthorityError::Membership(e.to_string())
            }
            RaftError::Fatal(e) => AuthorityError::Unavailable(e.to_string()),
        }
    }

    /// Says once that this node was removed; `serve` shuts down on it.
    fn mark_removed(&self, why: &str) {
        tracing::info!(
            node = self.id,
            "this node is no longer a member of the cluster ({why}); shutting down"
        );
        // Kept even with no receiver yet: a restarted removed node can find out before `serve`
        // starts waiting for it.
        self.membership.removed.send_replace(true);
    }
}

/// Records the memberships naming this node, and notices when it was removed.
pub(super) async fn watch_membership(authority: Arc<Authority>) {
    let own = &authority.membership;
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut asked = Instant::now();
    loop {
        tick.tick().await;
        let metrics = authority.raft.metrics().borrow().clone();
        if metrics.running_state.is_err() {
            return;
        }
        let committed = authority.committed_membership().await;
        if committed.members.contains(&authority.id) {
            if let Some(index) = committed.index {
                own.saw_self(index);
            }
        }
        let Some(seen) = own.seen() else {
            // Never a member yet: a node in join mode waiting to be added.
            continue;
        };
        if let Some(index) = committed.index.filter(|i| *i > seen) {
            if !committed.members.contains(&authority.id) {
                authority.mark_removed(&format!(
                    "the membership committed at log index {index} does not name it"
                ));
                return;
            }
        }
        let quiet = own.heard.lock().expect("heard lock").elapsed() >= QUIET;
        if metrics.state == ServerState::Leader || !quiet || asked.elapsed() < QUIET {
            continue;
        }
        asked = Instant::now();
        let peers: Vec<String> = metrics
            .membership_config
            .membership()
            .nodes()
            .filter(|(id, _)| **id != authority.id)
            .map(|(_, node)| node.peer.clone())
            .collect();
        for peer in peers {
            let answer = authority
                .network
                .get::<CommittedMembership>(&peer, MEMBERSHIP_PATH, ASK_TIMEOUT)
                .await;
            if let Ok(theirs) = answer {
                if let Some(index) = theirs.index.filter(|i| *i > seen) {
                    if !theirs.members.contains(&authority.id) {
                        authority.mark_removed(&format!(
                            "the peer at {peer} committed a membership at log index {index} that does not name it"
                        ));
                        return;
                    }
                }
            }
        }
    }
}
