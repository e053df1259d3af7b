//! A draining leader's hand-over. openraft 0.9 has no leadership transfer, and a real one
//! (Raft's TimeoutNow) has voters grant a vote inside their leader lease, which
//! `Authority::recent_leadership` relies on them refusing. What can be done without that: once
//! the leader has stopped Raft, it names its most up-to-date follower, which campaigns as soon
//! as every voter's lease can have run out (`election_timeout_max` after the last heartbeat,
//! plus one heartbeat for those still in flight) instead of waiting for the lease *and* its own
//! random election timeout. It waits even for its own lease: `Raft::trigger().elect()` votes
//! for itself without checking it.

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
    /// meanwhile. `false` when the message does not come from the leader of this term (or this
    /// node is draining itself).
    pub fn campaign_after_hand_over(&self, from: HandOver) -> bool {
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
        let config = self.raft.config();
        let wait = Duration::from_millis(config.election_timeout_max + config.heartbeat_interval);
        let raft = self.raft.clone();
        let draining = self.draining.clone();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            let now = raft.metrics().borrow().clone();
            // Another election already happened, or this node began to drain: nothing to do.
            let unchanged = now.current_term == from.term
                && now.current_leader == Some(from.leader)
                && now.state != ServerState::Leader;
            if !unchanged || draining.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            tracing::info!(
                leader = from.leader,
                term = from.term,
                "campaigning: the draining leader handed over"
            );
            if let Err(e) = raft.trigger().elect().await {
                tracing::warn!(error = %e, "campaign after a hand-over failed");
            }
        });
        true
    }
}
