use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The highest revision the node's authority has applied, shared with the node's gateways.
///
/// A store's fence above it cannot come from a lock this cluster granted (short of a follower
/// applying a few milliseconds late): the authority was reset or restored below the stores.
/// Gateways use it to word a stale refusal so that it does not blame the client for that.
/// Zero means "not known" (a gateway without an authority in its process).
#[derive(Debug, Clone, Default)]
pub struct IssuedRevision(Arc<AtomicU64>);

impl IssuedRevision {
    /// Notes that the authority has applied `revision`; never moves backwards.
    pub fn observe(&self, revision: u64) {
        self.0.fetch_max(revision, Ordering::Relaxed);
    }

    /// The highest revision applied so far, if any.
    pub fn get(&self) -> Option<u64> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            revision => Some(revision),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_moves_backwards_and_zero_is_unknown() {
        let issued = IssuedRevision::default();
        assert_eq!(issued.get(), None);
        issued.observe(7);
        issued.clone().observe(3);
        assert_eq!(issued.get(), Some(7));
    }
}
