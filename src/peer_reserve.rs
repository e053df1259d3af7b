//! Slots of the Raft peer port kept for the cluster's members.
//!
//! The peer port holds at most `[node] max_api_connections`, and anyone who can reach it can
//! hold slots: a TLS handshake that never finishes holds one for its 10 s. Were the port full,
//! a member could not open a connection, and members open new ones exactly when the cluster
//! needs them: a follower campaigning after the leader died calls the other followers for the
//! first time. A flood of handshakes would then keep the cluster without a leader (DESIGN
//! rule 10). So the last [`PeerReserve::slots`] slots are only for the members' addresses,
//! known two ways, neither of which a stranger controls:
//! - the addresses the members' peer hosts resolve to, from the Raft membership
//!   ([`follow_members`]): a follower knows the other followers before either ever called
//!   the other (a member's calls leave from that address on a host with one, or with
//!   `[node] peer_source` set to it);
//! - the addresses connections came from that completed the port's mutual TLS handshake, with
//!   a certificate of the cluster's CA (a member behind an address of another kind, NAT say,
//!   once it called).

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use crate::authority::type_config::Raft;

/// The member addresses the peer port knows, and the slots it keeps for them.
#[derive(Debug)]
pub struct PeerReserve {
    slots: usize,
    /// Addresses that completed the mutual TLS handshake, oldest first.
    known: Mutex<VecDeque<IpAddr>>,
    /// What the members' peer hosts resolve to.
    members: Mutex<Vec<IpAddr>>,
}

impl PeerReserve {
    /// Member addresses remembered at most: far more than a cluster has (3 or 5 nodes, a few
    /// more through replacements); the oldest is forgotten past it.
    const KNOWN: usize = 64;

    /// The reserve of a port holding at most `max` connections: a quarter of them, at most 64
    /// (a member holds a few connections to each peer); none below 4, so that strangers (a
    /// member too, before the node has read its membership) always have a slot.
    pub fn new(max: usize) -> Self {
        Self {
            slots: (max / 4).min(64),
            known: Mutex::new(VecDeque::new()),
            members: Mutex::new(Vec::new()),
        }
    }

    /// The slots a stranger may not take.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether `ip` is a member's: a member's peer host resolves to it, or it proved membership.
    pub fn knows(&self, ip: IpAddr) -> bool {
        // A dual-stack listener sees IPv4 clients as IPv4-mapped IPv6 addresses.
        let ip = ip.to_canonical();
        self.members
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&ip)
            || self
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&ip)
    }

    /// Sets what the members' peer hosts resolve to now.
    pub fn set_members(&self, ips: Vec<IpAddr>) {
        let ips = ips.into_iter().map(|ip| ip.to_canonical()).collect();
        *self.members.lock().unwrap_or_else(|e| e.into_inner()) = ips;
    }

    /// Remembers `ip`: a connection from it just completed the mutual TLS handshake.
    pub fn remember(&self, ip: IpAddr) {
        let ip = ip.to_canonical();
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.contains(&ip) {
            return;
        }
        if known.len() == Self::KNOWN {
            known.pop_front();
        }
        known.push_back(ip);
    }

    /// What the port's connection cap is asked to admit a connection from `ip` beside `open`
    /// others: a stranger counts the reserve as taken.
    pub fn counted(&self, ip: IpAddr, open: usize) -> usize {
        if self.knows(ip) {
            open
        } else {
            open.saturating_add(self.slots)
        }
    }
}

/// How often the members' peer hosts are resolved again when the membership does not change:
/// a name may come to point elsewhere (a rescheduled pod).
const RESOLVE_AGAIN: Duration = Duration::from_secs(60);

/// The longest one resolution may take: a slow resolver only delays the next one.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Keeps `reserve`'s member addresses: the members' peer hosts (learners' too: a node about
/// to be promoted is known already), resolved on every membership change and every
/// [`RESOLVE_AGAIN`]; a host that does not resolve keeps the addresses it had. Runs until Raft
/// shuts down.
pub async fn follow_members(raft: Raft, reserve: std::sync::Arc<PeerReserve>) {
    // The server metrics change only with the vote, the state or the membership, not with
    // every heartbeat.
    let mut rx = raft.server_metrics();
    let mut peers: Vec<String> = Vec::new();
    let mut resolved: HashMap<String, Vec<IpAddr>> = HashMap::new();
    let mut resolved_at: Option<tokio::time::Instant> = None;
    loop {
        let now: Vec<String> = rx
            .borrow_and_update()
            .membership_config
            .nodes()
            .map(|(_, node)| node.peer.clone())
            .collect();
        if now != peers || resolved_at.is_none_or(|at| at.elapsed() >= RESOLVE_AGAIN) {
            peers = now;
            let mut lookups = Vec::with_capacity(peers.len());
            for peer in &peers {
                let found = match tokio::time::timeout(
                    RESOLVE_TIMEOUT,
                    tokio::net::lookup_host(peer),
                )
                .await
                {
                    Ok(Ok(addrs)) => Some(addrs.map(|a| a.ip()).collect::<Vec<_>>()),
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "a member's peer host did not resolve; the Raft port keeps its reserve for the addresses it had");
                        None
                    }
                    Err(_) => {
                        tracing::warn!(%peer, timeout = ?RESOLVE_TIMEOUT, "resolving a member's peer host timed out; the Raft port keeps its reserve for the addresses it had");
                        None
                    }
                };
                lookups.push((peer.clone(), found));
            }
            resolved = merged(lookups, &resolved);
            reserve.set_members(resolved.values().flatten().copied().collect());
            resolved_at = Some(tokio::time::Instant::now());
        }
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = tokio::time::sleep(RESOLVE_AGAIN) => {}
        }
    }
}

/// Each peer's addresses after one round of lookups: those its lookup found (`Some`), or,
/// when it failed, those it had `before`. Peers no longer in the membership are dropped.
fn merged(
    lookups: Vec<(String, Option<Vec<IpAddr>>)>,
    before: &HashMap<String, Vec<IpAddr>>,
) -> HashMap<String, Vec<IpAddr>> {
    lookups
        .into_iter()
        .map(|(peer, found)| {
            let ips = found
                .or_else(|| before.get(&peer).cloned())
                .unwrap_or_default();
            (peer, ips)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use fencegate_core::{Admission, ConnectionCap};

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn strangers_leave_the_reserve_to_members() {
        let reserve = PeerReserve::new(16);
        assert_eq!(reserve.slots(), 4);
        let cap = ConnectionCap::new(16);
        reserve.remember(ip(1));
        // With 12 open, a stranger is refused and a member admitted, up to the bound.
        assert_eq!(cap.admit(reserve.counted(ip(2), 11)), Admission::Admitted);
        assert!(matches!(
            cap.admit(reserve.counted(ip(2), 12)),
            Admission::Refused { .. }
        ));
        assert!(matches!(
            cap.admit(reserve.counted(ip(1), 15)),
            Admission::Reopened { .. }
        ));
        assert!(matches!(
            cap.admit(reserve.counted(ip(1), 16)),
            Admission::Refused { .. }
        ));
    }

    #[test]
    fn members_are_known_by_their_peer_hosts_and_mapped_addresses_are_one() {
        let reserve = PeerReserve::new(16);
        reserve.set_members(vec![ip(5)]);
        assert!(reserve.knows(ip(5)));
        assert!(!reserve.knows(ip(6)));
        let mapped: IpAddr = "::ffff:127.0.0.6".parse().unwrap();
        reserve.remember(mapped);
        assert!(reserve.knows(ip(6)));
        reserve.set_members(Vec::new());
        assert!(!reserve.knows(ip(5)));
        assert!(reserve.knows(mapped));
    }

    #[test]
    fn a_failed_lookup_keeps_the_addresses_a_member_had() {
        let before = HashMap::from([
            ("a:7171".to_owned(), vec![ip(1)]),
            ("b:7171".to_owned(), vec![ip(2)]),
            ("gone:7171".to_owned(), vec![ip(3)]),
        ]);
        let after = merged(
            vec![
                ("a:7171".into(), None),
                ("b:7171".into(), Some(vec![ip(4)])),
                ("new:7171".into(), None),
            ],
            &before,
        );
        assert_eq!(
            after,
            HashMap::from([
                ("a:7171".to_owned(), vec![ip(1)]),
                ("b:7171".to_owned(), vec![ip(4)]),
                ("new:7171".to_owned(), vec![]),
            ])
        );
    }

    #[test]
    fn the_reserve_is_sized_by_the_bound() {
        assert_eq!(PeerReserve::new(1).slots(), 0);
        assert_eq!(PeerReserve::new(4).slots(), 1);
        assert_eq!(PeerReserve::new(16).slots(), 4);
        assert_eq!(PeerReserve::new(4096).slots(), 64);
    }

    #[test]
    fn known_addresses_are_bounded_oldest_forgotten_first() {
        let reserve = PeerReserve::new(16);
        for last in 0..=PeerReserve::KNOWN as u8 {
            reserve.remember(ip(last));
            reserve.remember(ip(last));
        }
        assert!(!reserve.knows(ip(0)));
        assert!(reserve.knows(ip(1)));
        assert!(reserve.knows(ip(PeerReserve::KNOWN as u8)));
        assert_eq!(reserve.known.lock().unwrap().len(), PeerReserve::KNOWN);
    }
}
