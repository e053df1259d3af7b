//! Slots of the Raft peer port kept for the cluster's members.
//!
//! The peer port holds at most `[node] max_api_connections`, and anyone who can reach it can
//! hold slots: a TLS handshake that never finishes holds one for its 10 s. Were the port full,
//! a member could not open a connection, and members open new ones exactly when the cluster
//! needs them: a follower campaigning after the leader died calls the other followers for the
//! first time. A flood of handshakes would then keep the cluster without a leader (DESIGN
//! rule 10). So the last [`PeerReserve::slots`] slots are only for addresses that proved
//! membership: a connection from them completed the port's mutual TLS handshake, with a
//! certificate of the cluster's CA. The members' addresses are learnt from the heartbeats
//! within moments of a start; a stranger can never add one.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::Mutex;

/// The member addresses the peer port knows, and the slots it keeps for them.
#[derive(Debug)]
pub struct PeerReserve {
    slots: usize,
    /// Addresses that completed the mutual TLS handshake, oldest first.
    known: Mutex<VecDeque<IpAddr>>,
}

impl PeerReserve {
    /// Member addresses remembered at most: far more than a cluster has (3 or 5 nodes, a few
    /// more through replacements); the oldest is forgotten past it.
    const KNOWN: usize = 64;

    /// The reserve of a port holding at most `max` connections: a quarter of them, at most 64
    /// (a member holds a few connections to each peer); none below 4, so that strangers, which
    /// every member is until its first handshake, always have a slot.
    pub fn new(max: usize) -> Self {
        Self {
            slots: (max / 4).min(64),
            known: Mutex::new(VecDeque::new()),
        }
    }

    /// The slots a stranger may not take.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether `ip` proved membership before.
    pub fn knows(&self, ip: IpAddr) -> bool {
        self.known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&ip)
    }

    /// Remembers `ip`: a connection from it just completed the mutual TLS handshake.
    pub fn remember(&self, ip: IpAddr) {
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
