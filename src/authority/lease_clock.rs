//! Lease deadlines, kept only in the leader's memory on its monotonic clock.
//!
//! Keepalives are not log entries: a renewal just moves a deadline here. That is safe because a
//! new leader starts every lease over at its full TTL (the deadlines below are forgotten on
//! every change of leadership), so a failover can lengthen a lease but never shorten it.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct LeaseClock {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The leadership term these deadlines belong to; `None` when not leader.
    term: Option<u64>,
    deadlines: HashMap<u64, Instant>,
    /// Leases whose expiry has been proposed and not yet applied.
    expiring: HashSet<u64>,
}

/// Why a renewal was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The deadline passed (or its expiry is proposed): the lease is gone.
    Expired,
    /// The caller's leadership term is not the one these deadlines belong to: a leadership
    /// change is under way, and the client should retry.
    OtherTerm,
}

impl Inner {
    /// Forgets every deadline when leadership changed, so each lease restarts at full length.
    fn enter(&mut self, term: Option<u64>) {
        if self.term != term {
            self.term = term;
            self.deadlines.clear();
            self.expiring.clear();
        }
    }
}

impl LeaseClock {
    /// Records the current leadership: `Some(term)` while this node leads in `term`.
    pub fn observe(&self, leader_term: Option<u64>) {
        self.inner
            .lock()
            .expect("lease clock poisoned")
            .enter(leader_term);
    }

    /// Renews `lease_id` for `ttl` from `now`, unless its deadline already passed (its expiry
    /// may be on its way through the log: answering yes would promise time it does not have).
    pub fn renew(
        &self,
        term: u64,
        lease_id: u64,
        ttl: Duration,
        now: Instant,
    ) -> Result<(), Refusal> {
        let mut inner = self.inner.lock().expect("lease clock poisoned");
        // Only the leadership watcher moves the clock to a new term; a renewal for any other
        // term than the current one is refused rather than allowed to reset the deadlines.
        if inner.term != Some(term) {
            return Err(Refusal::OtherTerm);
        }
        let deadline = inner.deadlines.entry(lease_id).or_insert(now + ttl);
        if *deadline <= now || inner.expiring.contains(&lease_id) {
            return Err(Refusal::Expired);
        }
        inner.deadlines.insert(lease_id, now + ttl);
        Ok(())
    }

    /// Time left on `lease_id` as this leader sees it.
    pub fn remaining(&self, lease_id: u64, ttl: Duration, now: Instant) -> Duration {
        let inner = self.inner.lock().expect("lease clock poisoned");
        match inner.deadlines.get(&lease_id) {
            Some(deadline) => deadline.saturating_duration_since(now),
            None if inner.term.is_some() => ttl,
            None => Duration::ZERO,
        }
    }

    /// Given every live lease `(id, ttl)`, starts the clock on new ones, drops dead ones, and
    /// returns the ids whose deadline passed and whose expiry has not been proposed yet.
    pub fn due(
        &self,
        term: u64,
        leases: impl IntoIterator<Item = (u64, Duration)>,
        now: Instant,
    ) -> Vec<u64> {
        let mut inner = self.inner.lock().expect("lease clock poisoned");
        inner.enter(Some(term));
        let mut live = HashSet::new();
        let mut due = Vec::new();
        for (id, ttl) in leases {
            live.insert(id);
            let deadline = *inner.deadlines.entry(id).or_insert(now + ttl);
            if deadline <= now && inner.expiring.insert(id) {
                due.push(id);
            }
        }
        inner.deadlines.retain(|id, _| live.contains(id));
        inner.expiring.retain(|id| live.contains(id));
        due
    }

    /// Lets a lease whose expiry proposal failed be proposed again on the next scan.
    pub fn retry_expiry(&self, lease_id: u64) {
        self.inner
            .lock()
            .expect("lease clock poisoned")
            .expiring
            .remove(&lease_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    #[test]
    fn renewal_moves_the_deadline_and_expiry_is_proposed_once() {
        let clock = LeaseClock::default();
        let t0 = Instant::now();
        assert!(clock.due(1, [(7, TTL)], t0).is_empty());
        assert_eq!(clock.renew(1, 7, TTL, t0 + Duration::from_secs(9)), Ok(()));
        assert!(clock
            .due(1, [(7, TTL)], t0 + Duration::from_secs(18))
            .is_empty());
        assert_eq!(
            clock.due(1, [(7, TTL)], t0 + Duration::from_secs(19)),
            vec![7]
        );
        assert!(
            clock
                .due(1, [(7, TTL)], t0 + Duration::from_secs(20))
                .is_empty(),
            "proposed once"
        );
        assert_eq!(
            clock.renew(1, 7, TTL, t0 + Duration::from_secs(20)),
            Err(Refusal::Expired),
            "no renewal after the deadline"
        );
    }

    #[test]
    fn renewals_for_another_term_are_refused() {
        let clock = LeaseClock::default();
        let t0 = Instant::now();
        assert_eq!(
            clock.renew(1, 7, TTL, t0),
            Err(Refusal::OtherTerm),
            "not leader yet"
        );
        clock.observe(Some(3));
        assert_eq!(
            clock.renew(2, 7, TTL, t0),
            Err(Refusal::OtherTerm),
            "a stale term"
        );
        assert_eq!(clock.renew(3, 7, TTL, t0), Ok(()));
    }

    #[test]
    fn a_new_term_restarts_every_lease_at_full_length() {
        let clock = LeaseClock::default();
        let t0 = Instant::now();
        clock.due(1, [(7, TTL)], t0);
        let later = t0 + Duration::from_secs(9);
        clock.observe(None);
        clock.observe(Some(2));
        assert!(clock.due(2, [(7, TTL)], later).is_empty());
        assert_eq!(clock.remaining(7, TTL, later), TTL);
        assert!(clock
            .due(2, [(7, TTL)], later + TTL - Duration::from_millis(1))
            .is_empty());
        assert_eq!(clock.due(2, [(7, TTL)], later + TTL), vec![7]);
    }
}
