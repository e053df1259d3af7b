//! Every held lock, for `fencegate lock list`.

use std::time::{Duration, Instant};

use super::{Authority, AuthorityError, LockStatus};

impl Authority {
    /// Held locks in resource order, read on a confirmed leader like `status`. Lease numbers
    /// only: a handle is its holder's credential.
    pub async fn locks(&self) -> Result<Vec<LockStatus>, AuthorityError> {
        self.confirm_leadership().await?;
        let applied = self.applied.read().await;
        let now = Instant::now();
        Ok(applied
            .state
            .locks
            .iter()
            .map(|(resource, lock)| {
                let ttl = applied
                    .state
                    .leases
                    .get(&lock.lease_id)
                    .map_or(0, |l| l.ttl_ms);
                let left = self
                    .clock
                    .remaining(lock.lease_id, Duration::from_millis(ttl), now);
                LockStatus {
                    resource: resource.clone(),
                    revision: lock.token,
                    lease: lock.lease_id,
                    holder: lock.holder.clone(),
                    ttl_ms: left.as_millis() as u64,
                }
            })
            .collect())
    }
}
