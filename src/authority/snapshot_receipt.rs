//! A follower receiving a snapshot from the leader, one chunk per RPC.
//!
//! openraft 0.9 takes a chunk outside its core: a chunk does not reset the follower's election
//! timer, and the leader sends no heartbeat to a node while a snapshot to it is in flight. A
//! transfer (and the install that comes with the last chunk) that outlasts the election
//! timeout made the follower campaign. Its higher term deposed the leader, the next leader began
//! the transfer again, and under CPU load a lagging node never caught up (seen in CI). So while a
//! chunk is received (and the last one installed) the core hears the leader's heartbeat.
//!
//! The heartbeat is the AppendEntries a leader sends from the start of the log with nothing in
//! it: no previous entry, no entries, nothing committed. openraft checks its vote like any
//! other (an older vote is refused and changes nothing) and, for the leader's own vote, only
//! records that the leader was heard from now. It appends, truncates and commits nothing.
//!
//! The beats hold this node's vote from other candidates for a leader lease each, as a real
//! heartbeat does: they stop when a peer campaigns for a later term (the leader is gone for it),
//! so a leader lost during an install delays a failover by about one election, not the install.

use std::sync::atomic::Ordering;

use futures_util::stream::{FuturesUnordered, StreamExt};
use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, InstallSnapshotResponse};
use openraft::Vote;
use tokio::time::{Instant, MissedTickBehavior};

use super::type_config::{NodeId, TypeConfig};
use super::{Authority, SNAPSHOT_CHUNK_TIMEOUT};

impl Authority {
    /// Receives one chunk of a snapshot from the leader (see the module's doc).
    pub async fn receive_snapshot_chunk(
        &self,
        req: InstallSnapshotRequest<TypeConfig>,
    ) -> Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        self.heard_from_leader();
        let vote = req.vote;
        let install = self.raft.install_snapshot(req);
        if !vote.is_committed() {
            // Not a leader's vote: nothing to beat for (openraft refuses or takes it alone).
            return install.await;
        }
        tokio::pin!(install);
        // The leader waits for this chunk (for the last one, for the install) and gives up after
        // the chunk's timeout; the heartbeat stops then too, or as soon as a peer campaigns for
        // a later term: the leader is gone for it, and each beat would hold this node's vote
        // from that peer for another leader lease (a failover held up by an install).
        let until = Instant::now() + SNAPSHOT_CHUNK_TIMEOUT;
        let mut every = tokio::time::interval_at(Instant::now() + self.heartbeat, self.heartbeat);
        every.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let beating = || Instant::now() < until && !self.campaign_after(vote.leader_id.term);
        // Not awaited one by one: the core answers an AppendEntries only after the commands
        // queued before it, the install among them. It takes the vote as it reads the request,
        // which the first poll sends: the first beat goes before the chunk (`biased`), since a
        // chunk is often taken before a timer's first tick.
        let mut beats = FuturesUnordered::new();
        beats.push(self.leader_heard(vote));
        loop {
            tokio::select! {
                biased;
                // Not `heard_from_leader`: a beat is this node's, not the leader's, and a
                // hand-over waits for the leader to fall silent.
                _ = every.tick(), if beating() => beats.push(self.leader_heard(vote)),
                Some(()) = beats.next() => {}
                done = &mut install => return done,
            }
        }
    }

    /// Notes that a peer asked this node's vote for `term`.
    pub fn vote_requested(&self, term: u64) {
        self.campaign_term.fetch_max(term, Ordering::Relaxed);
    }

    /// Whether a peer has asked for a vote for a term after `term`.
    fn campaign_after(&self, term: u64) -> bool {
        self.campaign_term.load(Ordering::Relaxed) > term
    }

    /// Tells the core that the leader of `vote` was just heard from (the empty AppendEntries).
    async fn leader_heard(&self, vote: Vote<NodeId>) {
        let beat = AppendEntriesRequest {
            vote,
            prev_log_id: None,
            entries: Vec::new(),
            leader_commit: None,
        };
        // A refusal (this node saw a newer vote) is the chunk's to report; a fatal error too.
        if let Err(e) = self.raft.append_entries(beat).await {
            tracing::debug!(error = %e, "snapshot chunk: the leader's heartbeat was not taken");
        }
    }
}
