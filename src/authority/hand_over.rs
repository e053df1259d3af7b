//! A draining leader's hand-over. openraft 0.9 has no leadership transfer, and a real one
//! (Raft's TimeoutNow) has voters grant a vote inside their leader lease, which
//! `Authority::recent_leadership` relies on them refusing. What can be done without that: once
//! the leader has stopped Raft, it names its most up-to-date follower, which campaigns as soon
//! as every voter's lease can have run out (`election_timeout_max` after the last heartbeat,
//! plus one heartbeat for those still in flight) instead of waiting for the lease *and* its own
//! random election timeout. It waits even for its own lease, and checks it: `Raft::trigger()
//! .elect()` votes for itself without doing so, and the message proves nothing (a forged one
//! must not depose a leader that still heartbeats).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use openraft::ServerState;
use serde::{Deserialize, Serialize};

use super::network::HAND_OVER_PATH;
use super::type_config::NodeId;
use super::Authority;

/// From a leader that stopped Raft to the follower it chose.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct HandOver {
    pub leader: NodeId,
    pub term: u64,
}

/// How long a hand-over message may take.
const SEND_TIMEOUT: Duration = Duration::from_secs(1);

impl Authority {
    /// While leading: the voter whose log is furthest along (it can win), and its peer address.
    pub fn successor(&self) -> Option<(NodeId, String)> {
        let metrics = self.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let voters: Vec<NodeId> = membership.voter_ids().collect();
        let (id, _) = metrics
            .replication?
            .into_iter()
            .filter(|(id, _)| *id != self.id && voters.contains(id))
            .max_by_key(|(_, matched)| *matched)?;
        Some((id, membership.get_node(&id)?.peer.clone()))
    }

    /// Tells `to` (from [`Authority::successor`], taken while leading in `term`) to campaign.
    /// Call only once Raft has stopped here. A failure is logged: the followers then elect a
    /// successor on their own timers.
    pub async fn hand_over(&self, (to, addr): &(NodeId, String), term: u64) {
        let message = HandOver {
            leader: self.id,
            term,
        };
        match self
            .network
            .post::<_, bool>(addr, HAND_OVER_PATH, &message, SEND_TIMEOUT)
            .await
        {
            Ok(true) => tracing::info!(to, "draining: handed leadership over; it campaigns once the followers' leader lease has run out"),
            Ok(false) => tracing::warn!(to, "draining: the successor declined the hand-over (it follows another leader or term); the followers elect on their own timers"),
            Err(e) => tracing::warn!(to, error = %e, "draining: the hand-over did not reach the successor; the followers elect on their own timers"),
        }
    }

    /// A follower's side: campaign once every voter's lease can have run out, if nothing changed
    /// meanwhile. `false` when the message does not come from the leader of this term, this
    /// node is draining itself, or a hand-over is already pending here.
    ///
    /// The message is not trusted to mean the leader stopped (anyone who reaches the peer route
    /// can send one, and leader and term are public): after the wait, this node campaigns only
    /// if it has itself received no AppendEntries for `election_timeout_max + heartbeat`, which
    /// is the leader lease it would honour without the message.
    pub fn campaign_after_hand_over(self: &Arc<Self>, from: HandOver) -> bool {
        let metrics = self.raft.metrics().borrow().clone();
        let from_leader = metrics.current_leader == Some(from.leader)
            && metrics.current_term == from.term
            && from.leader != self.id;
        let voter = metrics
            .membership_config
            .membership()
            .voter_ids()
            .any(|v| v == self.id);
        if !from_leader || !voter || self.draining() {
            return false;
        }
        // One pending hand-over at a time: duplicates neither pile up tasks nor elect twice.
        if self
            .hand_over_pending
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        let pending = Pending(self.clone());
        let config = self.raft.config();
        let wait = Duration::from_millis(config.election_timeout_max + config.heartbeat_interval);
        tokio::spawn(async move {
            let authority = &pending.0;
            tokio::time::sleep(wait).await;
            let now = authority.raft.metrics().borrow().clone();
            // Another election already happened, or this node began to drain: nothing to do.
            let unchanged = now.current_term == from.term
                && now.current_leader == Some(from.leader)
                && now.state != ServerState::Leader;
            if !unchanged || authority.draining() {
                return;
            }
            // This node's own lease: a leader that still sends heartbeats did not stop.
            if authority.since_heard_from_leader() < wait {
                tracing::info!(
                    leader = from.leader,
                    term = from.term,
                    "not campaigning on a hand-over: the leader is still heartbeating"
                );
                return;
            }
            tracing::info!(
                leader = from.leader,
                term = from.term,
                "campaigning: the draining leader handed over"
            );
            if let Err(e) = authority.raft.trigger().elect().await {
                tracing::warn!(error = %e, "campaign after a hand-over failed");
            }
        });
        true
    }
}

/// Clears `hand_over_pending` when the hand-over task ends, however it ends.
struct Pending(Arc<Authority>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.hand_over_pending.store(false, Ordering::Release);
    }
}
