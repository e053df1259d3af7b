//! Keeps the Raft metrics that need history (leader changes) or per-peer labels (replication
//! lag) up to date from openraft's metrics channel, for the life of the node.

use std::sync::Arc;

use openraft::ServerState;

use crate::authority::type_config::{NodeId, Raft};
use crate::metrics::Metrics;

/// Runs until Raft shuts down (its metrics channel closes).
pub async fn run(raft: Raft, metrics: Arc<Metrics>) {
    let mut rx = raft.metrics();
    let mut leader: Option<NodeId> = None;
    loop {
        {
            let m = rx.borrow_and_update();
            if m.current_leader.is_some() && m.current_leader != leader {
                metrics.leader_changes.inc();
            }
            leader = m.current_leader;
            metrics.has_leader.set(i64::from(leader.is_some()));
            metrics.term.set(m.current_term as i64);
            metrics
                .is_leader
                .set(i64::from(m.state == ServerState::Leader));
            let last = m.last_log_index.unwrap_or(0);
            metrics.last_log_index.set(last as i64);
            match (&m.replication, m.state == ServerState::Leader) {
                (Some(peers), true) => {
                    // Removed peers must not keep their last value.
                    metrics.clear_replication_lag();
                    for (peer, matched) in peers.iter().filter(|(peer, _)| **peer != m.id) {
                        // Entries the peer has yet to confirm (all of them when none yet).
                        let lag = match matched {
                            Some(log_id) => last.saturating_sub(log_id.index),
                            None => last,
                        };
                        metrics.replication_lag(*peer).set(lag as i64);
                    }
                }
                // Only a leader knows its followers' progress: no stale series elsewhere.
                _ => metrics.clear_replication_lag(),
            }
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}
