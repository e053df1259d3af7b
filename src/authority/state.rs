//! The authority's replicated state and the pure function that applies one command to it.
//!
//! Everything here is deterministic: no clocks, no I/O. Every node applies the same commands in
//! the same order and reaches the same state. Time (lease deadlines) lives only in the leader's
//! memory, in `lease_clock.rs`.

use std::collections::{BTreeMap, BTreeSet};

use fencegate_core::Revision;
use serde::{Deserialize, Serialize};

/// A command as it travels through the Raft log.
///
/// Externally tagged on purpose: serde's internally tagged enums cannot read back maps with
/// integer keys (`leases`), and a log entry that cannot be read stops the Raft node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Command {
    /// Grant a lease and create the lock under it, unless the lock is held.
    Acquire {
        resource: String,
        ttl_ms: u64,
        request_id: Option<String>,
        holder: Option<String>,
        /// The lease handle's secret part, made by the proposing leader: only the client that
        /// acquired can renew or release the lease.
        #[serde(default)]
        secret: Option<String>,
    },
    /// The holder gives the lease (and its locks) back.
    Release { lease_id: u64 },
    /// The leader's deadline for the lease passed.
    Expire { lease_id: u64 },
    /// Raise the revision by `by` without touching any lock.
    Bump { by: u64 },
    /// Raise the revision to at least `revision` (an operator's `initial_revision`, so a new or
    /// wiped authority never issues tokens below fences the stores already hold).
    Floor { revision: u64 },
    /// Add token key `kid`, verify-only until promoted. Ids only grow.
    AddTokenKey { kid: u32, secret: String },
    /// Let key `kid` sign; the newest signing key does. Proposed once every node has had time
    /// to apply the key, so no gateway meets a token signed with a key it has not seen.
    PromoteTokenKey { kid: u32 },
    /// Retire key `kid`: tokens it signed are refused from now on.
    RetireTokenKey { kid: u32 },
    /// Replace the whole state with a saved one, then raise the revision by `bump` above both
    /// the saved and the current revision. Proposed by nodes older than [`Command::RestorePart`]
    /// and still applied from their logs.
    Restore {
        state: Box<AuthorityState>,
        bump: u64,
    },
    /// One piece of a saved state; once the last of `parts` is applied, the state is restored
    /// as by [`Command::Restore`]. A whole state in one entry could not be replicated in an
    /// AppendEntries RPC's time (one heartbeat interval) once it holds many leases, and each
    /// piece is merged as it comes: the last part applies in no more time than the others.
    RestorePart {
        /// Names the restore: a part of another one does not join it.
        restore: String,
        /// This part's place, from 0, among `parts`.
        index: u32,
        parts: u32,
        /// Part 0: the saved revision, last lease id and token keys; every part: some leases
        /// with their locks and request ids.
        piece: Box<AuthorityState>,
        bump: u64,
    },
}

/// About how many bytes of JSON one part of a restore carries (a part holds at least one
/// lease, whatever its size: names are bounded, so a lease with its lock is at most a few KiB).
pub const RESTORE_PART_BYTES: usize = 128 * 1024;

/// A restore whose parts are still being applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagedRestore {
    pub restore: String,
    pub parts: u32,
    /// Parts applied so far.
    pub received: u32,
    /// Their pieces, merged.
    pub state: Box<AuthorityState>,
}

/// What applying a command produced; returned to the proposer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Acquired {
        resource: String,
        token: u64,
        lease_id: u64,
        ttl_ms: u64,
        #[serde(default)]
        secret: Option<String>,
    },
    /// The lock is held; `revision` is the holder's token.
    Held {
        revision: u64,
    },
    Released {
        revision: u64,
    },
    UnknownLease,
    Bumped {
        revision: u64,
    },
    /// The revision cannot move further without leaving what stores can keep.
    RevisionExhausted,
    KeyAdded {
        kid: u32,
    },
    KeyRetired {
        kid: u32,
    },
    /// A key command that cannot apply (an id not above the newest, an unknown key, or the
    /// last active key); the reason is for the operator.
    KeyRefused {
        reason: String,
    },
    /// A part of a restore that another restore overtook, or that came out of order: nothing
    /// of it is applied.
    RestoreInterrupted,
    /// Blank and membership entries, and the parts of a restore before its last.
    Nothing,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lock {
    pub lease_id: u64,
    /// The revision at which the lock was created: the fencing token.
    pub token: u64,
    pub holder: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub ttl_ms: u64,
    pub resources: BTreeSet<String>,
    pub request_id: Option<String>,
    /// The secret part of the lease's handle (`<id>.<secret>`); `None` for leases restored
    /// from snapshots older than handles.
    #[serde(default)]
    pub secret: Option<String>,
}

/// A replicated token signing key. The secret is base64url; it lives in the Raft log and in
/// snapshots, which is why both are admin-only and the data directory is private.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredKey {
    pub secret: String,
    pub retired: bool,
    #[serde(default)]
    pub signs: bool,
}

/// The replicated state: what a snapshot holds and a restore brings back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthorityState {
    /// Advances on every create and delete; never goes backwards.
    pub revision: u64,
    pub last_lease_id: u64,
    pub locks: BTreeMap<String, Lock>,
    pub leases: BTreeMap<u64, Lease>,
    /// Request ids of live leases, so a retried acquire gets the same lease and token.
    pub requests: BTreeMap<String, u64>,
    /// Token signing keys by id.
    #[serde(default)]
    pub token_keys: BTreeMap<u32, StoredKey>,
    /// A restore whose parts are still arriving: part of the replicated state, so that a
    /// snapshot taken between two parts carries those already applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restoring: Option<StagedRestore>,
}

impl AuthorityState {
    /// Applies `command`. Freed resources are pushed to `freed` so the leader can wake the next
    /// waiter for each.
    pub fn apply(&mut self, command: &Command, freed: &mut Vec<String>) -> Outcome {
        match command {
            Command::Acquire {
                resource,
                ttl_ms,
                request_id,
                holder,
                secret,
            } => self.acquire(
                resource,
                *ttl_ms,
                request_id.as_deref(),
                holder.as_deref(),
                secret.as_deref(),
            ),
            Command::Floor { revision } => {
                let revision = (*revision).min(Revision::MAX);
                self.revision = self.revision.max(revision);
                Outcome::Bumped {
                    revision: self.revision,
                }
            }
            Command::AddTokenKey { kid, secret } => self.add_key(*kid, secret),
            Command::RetireTokenKey { kid } => self.retire_key(*kid),
            Command::PromoteTokenKey { kid } => match self.token_keys.get_mut(kid) {
                Some(key) if !key.retired => {
                    key.signs = true;
                    Outcome::KeyAdded { kid: *kid }
                }
                _ => Outcome::KeyRefused {
                    reason: format!("there is no active key {kid}"),
                },
            },
            Command::Release { lease_id } | Command::Expire { lease_id } => {
                self.revoke(*lease_id, freed)
            }
            Command::Bump { by } => match self.advance(*by) {
                Some(revision) => Outcome::Bumped { revision },
                None => Outcome::RevisionExhausted,
            },
            Command::Restore { state, bump } => self.restore((**state).clone(), *bump, freed),
            Command::RestorePart {
                restore,
                index,
                parts,
                piece,
                bump,
            } => {
                if *index == 0 {
                    // A new restore overtakes one still arriving.
                    self.restoring = Some(StagedRestore {
                        restore: restore.clone(),
                        parts: *parts,
                        received: 0,
                        state: Box::new(piece.head()),
                    });
                }
                let Some(staged) = self
                    .restoring
                    .as_mut()
                    .filter(|s| s.restore == *restore && s.parts == *parts && s.received == *index)
                else {
                    return Outcome::RestoreInterrupted;
                };
                staged.state.merge(piece);
                staged.received += 1;
                if staged.received < staged.parts {
                    return Outcome::Nothing;
                }
                let whole = std::mem::take(&mut staged.state);
                self.restoring = None;
                self.restore(*whole, *bump, freed)
            }
        }
    }

    /// This state in pieces for [`Command::RestorePart`], each of about `max_bytes` of JSON
    /// or one lease: every lease with its locks and its request id (the whole state, once
    /// [`AuthorityState::validate`] passed); the first piece also has the revision, the last
    /// lease id and the token keys. Never empty.
    pub fn pieces(&self, max_bytes: usize) -> Vec<AuthorityState> {
        let mut pieces = vec![self.head()];
        let mut bytes = 0;
        for (id, lease) in &self.leases {
            let locks: Vec<(&String, &Lock)> = lease
                .resources
                .iter()
                .filter_map(|r| self.locks.get_key_value(r))
                .collect();
            // Only where the index points at this lease (see `validate`).
            let request = lease
                .request_id
                .as_ref()
                .filter(|r| self.requests.get(*r) == Some(id));
            // Measured as it will be written (names may need escaping).
            let size = serde_json::to_vec(&(id, lease, &locks, request)).map_or(0, |v| v.len());
            if bytes > 0 && bytes + size > max_bytes {
                pieces.push(AuthorityState::default());
                bytes = 0;
            }
            let Some(piece) = pieces.last_mut() else {
                break;
            };
            bytes += size;
            piece.leases.insert(*id, lease.clone());
            for (resource, lock) in locks {
                piece.locks.insert(resource.clone(), lock.clone());
            }
            if let Some(request_id) = request {
                piece.requests.insert(request_id.clone(), *id);
            }
        }
        pieces
    }

    /// The revision, last lease id and token keys alone: what a restore's first part carries
    /// beside its leases.
    fn head(&self) -> AuthorityState {
        AuthorityState {
            revision: self.revision,
            last_lease_id: self.last_lease_id,
            token_keys: self.token_keys.clone(),
            ..Default::default()
        }
    }

    /// Adds the leases, locks and request ids of `piece` (a restore's part).
    fn merge(&mut self, piece: &AuthorityState) {
        self.locks
            .extend(piece.locks.iter().map(|(r, l)| (r.clone(), l.clone())));
        self.leases
            .extend(piece.leases.iter().map(|(id, l)| (*id, l.clone())));
        self.requests
            .extend(piece.requests.iter().map(|(r, id)| (r.clone(), *id)));
    }

    /// Replaces the state with `state`, then raises the revision by `bump` above both the
    /// saved and the current revision.
    fn restore(
        &mut self,
        mut state: AuthorityState,
        bump: u64,
        freed: &mut Vec<String>,
    ) -> Outcome {
        let floor = self.revision.max(state.revision);
        freed.extend(
            self.locks
                .keys()
                .filter(|r| !state.locks.contains_key(*r))
                .cloned(),
        );
        // Keys are not rolled back: tokens signed since the snapshot must still verify, and a
        // retired key must stay retired.
        state
            .token_keys
            .extend(std::mem::take(&mut self.token_keys));
        state.revision = floor;
        state.restoring = None;
        *self = state;
        match self.advance(bump) {
            Some(revision) => Outcome::Bumped { revision },
            None => Outcome::RevisionExhausted,
        }
    }

    /// Checks a state from outside (a snapshot file) before it may enter the log: every lock
    /// belongs to a live lease that lists it, every name and number is in range.
    pub fn validate(&self, max_ttl_ms: u64) -> Result<(), String> {
        if self.revision > Revision::MAX {
            return Err(format!(
                "revision {} is above {}",
                self.revision,
                Revision::MAX
            ));
        }
        for (resource, lock) in &self.locks {
            fencegate_core::Resource::new(resource.as_str())
                .map_err(|e| format!("lock {resource:?}: {e}"))?;
            if lock.token == 0 || lock.token > self.revision {
                return Err(format!(
                    "lock {resource}: token {} is not in 1..={}",
                    lock.token, self.revision
                ));
            }
            let lease = self
                .leases
                .get(&lock.lease_id)
                .ok_or_else(|| format!("lock {resource}: lease {} is missing", lock.lease_id))?;
            if !lease.resources.contains(resource) {
                return Err(format!(
                    "lock {resource}: lease {} does not list it",
                    lock.lease_id
                ));
            }
        }
        for (id, lease) in &self.leases {
            if *id == 0 || *id > self.last_lease_id {
                return Err(format!("lease {id} is not in 1..={}", self.last_lease_id));
            }
            if lease.ttl_ms == 0 || lease.ttl_ms > max_ttl_ms {
                return Err(format!(
                    "lease {id}: ttl_ms {} is not in 1..={max_ttl_ms}",
                    lease.ttl_ms
                ));
            }
            if let Some(missing) = lease
                .resources
                .iter()
                .find(|r| self.locks.get(*r).map(|l| l.lease_id) != Some(*id))
            {
                return Err(format!(
                    "lease {id} lists {missing}, which it does not hold"
                ));
            }
        }
        // Each request id names a lease that carries it. (A lease whose request id names a
        // later lease is fine: states written before the leader refused reusing a request id
        // for another resource have them, and a retry finds the later one, as it did.)
        if let Some((request_id, id)) = self.requests.iter().find(|(request_id, id)| {
            self.leases.get(*id).and_then(|l| l.request_id.as_ref()) != Some(*request_id)
        }) {
            return Err(format!(
                "request {request_id} names lease {id}, which does not exist or carries another request id"
            ));
        }
        Ok(())
    }

    /// The live lease a retried request already got, with its lock.
    pub fn by_request(&self, request_id: &str, resource: &str) -> Option<Outcome> {
        let lease_id = *self.requests.get(request_id)?;
        let lease = self.leases.get(&lease_id)?;
        let lock = self
            .locks
            .get(resource)
            .filter(|l| l.lease_id == lease_id)?;
        Some(Outcome::Acquired {
            resource: resource.to_owned(),
            token: lock.token,
            lease_id,
            ttl_ms: lease.ttl_ms,
            secret: lease.secret.clone(),
        })
    }

    /// The id of the newest token key, if any.
    pub fn newest_key(&self) -> Option<u32> {
        self.token_keys.keys().next_back().copied()
    }

    fn add_key(&mut self, kid: u32, secret: &str) -> Outcome {
        if self.newest_key().is_some_and(|newest| kid <= newest) {
            return Outcome::KeyRefused {
                reason: format!("key {kid} is not above the newest key"),
            };
        }
        self.token_keys.insert(
            kid,
            StoredKey {
                secret: secret.to_owned(),
                retired: false,
                signs: false,
            },
        );
        Outcome::KeyAdded { kid }
    }

    fn retire_key(&mut self, kid: u32) -> Outcome {
        let active = self
            .token_keys
            .values()
            .filter(|k| k.signs && !k.retired)
            .count();
        match self.token_keys.get_mut(&kid) {
            None => Outcome::KeyRefused {
                reason: format!("there is no key {kid}"),
            },
            Some(key) if key.retired => Outcome::KeyRetired { kid },
            Some(_) if active <= 1 => Outcome::KeyRefused {
                reason: format!(
                    "key {kid} is the last active key; rotate first (fencegate token-key rotate)"
                ),
            },
            Some(key) => {
                key.retired = true;
                Outcome::KeyRetired { kid }
            }
        }
    }

    fn acquire(
        &mut self,
        resource: &str,
        ttl_ms: u64,
        request_id: Option<&str>,
        holder: Option<&str>,
        secret: Option<&str>,
    ) -> Outcome {
        if let Some(done) = request_id.and_then(|id| self.by_request(id, resource)) {
            return done;
        }
        if let Some(lock) = self.locks.get(resource) {
            return Outcome::Held {
                revision: lock.token,
            };
        }
        let Some(token) = self.advance(1) else {
            return Outcome::RevisionExhausted;
        };
        self.last_lease_id += 1;
        let lease_id = self.last_lease_id;
        self.locks.insert(
            resource.to_owned(),
            Lock {
                lease_id,
                token,
                holder: holder.map(str::to_owned),
            },
        );
        self.leases.insert(
            lease_id,
            Lease {
                ttl_ms,
                resources: BTreeSet::from([resource.to_owned()]),
                request_id: request_id.map(str::to_owned),
                secret: secret.map(str::to_owned),
            },
        );
        if let Some(id) = request_id {
            self.requests.insert(id.to_owned(), lease_id);
        }
        Outcome::Acquired {
            resource: resource.to_owned(),
            token,
            lease_id,
            ttl_ms,
            secret: secret.map(str::to_owned),
        }
    }

    fn revoke(&mut self, lease_id: u64, freed: &mut Vec<String>) -> Outcome {
        let Some(lease) = self.leases.remove(&lease_id) else {
            return Outcome::UnknownLease;
        };
        // Only its own: in states from before the leader refused reusing a request id, the
        // id may name a later lease.
        if let Some(id) = &lease.request_id {
            if self.requests.get(id) == Some(&lease_id) {
                self.requests.remove(id);
            }
        }
        for resource in lease.resources {
            if self.locks.remove(&resource).is_some() {
                // Every delete advances the revision, as every create does. Saturating: a
                // delete must never fail, and an exhausted counter already refuses acquires.
                self.revision = (self.revision + 1).min(Revision::MAX);
                freed.push(resource);
            }
        }
        Outcome::Released {
            revision: self.revision,
        }
    }

    fn advance(&mut self, by: u64) -> Option<u64> {
        let next = self
            .revision
            .checked_add(by)
            .filter(|r| *r <= Revision::MAX)?;
        self.revision = next;
        Some(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acquire(resource: &str, request_id: Option<&str>) -> Command {
        Command::Acquire {
            resource: resource.into(),
            ttl_ms: 1000,
            request_id: request_id.map(Into::into),
            holder: None,
            secret: None,
        }
    }

    fn apply(state: &mut AuthorityState, command: Command) -> Outcome {
        state.apply(&command, &mut Vec::new())
    }

    /// The parts of a restore of `saved` named `restore`, about `max_bytes` each.
    fn parts_of(saved: &AuthorityState, restore: &str, max_bytes: usize) -> Vec<Command> {
        let pieces = saved.pieces(max_bytes);
        let parts = pieces.len() as u32;
        pieces
            .into_iter()
            .enumerate()
            .map(|(index, piece)| Command::RestorePart {
                restore: restore.into(),
                index: index as u32,
                parts,
                piece: Box::new(piece),
                bump: 100,
            })
            .collect()
    }

    /// A state of `n` held locks, half with request ids, and a token key.
    fn saved_state(n: usize) -> AuthorityState {
        let mut saved = AuthorityState::default();
        apply(
            &mut saved,
            Command::AddTokenKey {
                kid: 1,
                secret: "c2VjcmV0".into(),
            },
        );
        for i in 0..n {
            let request = format!("r{i}");
            apply(
                &mut saved,
                acquire(
                    &format!("kept{i}"),
                    (i % 2 == 0).then_some(request.as_str()),
                ),
            );
        }
        saved
    }

    /// States written before the leader refused reusing a request id for another resource:
    /// the index names the later lease. They still restore, and releasing the earlier lease
    /// leaves the later one's index.
    #[test]
    fn a_request_id_taken_by_a_later_lease_keeps_it() {
        let mut s = AuthorityState::default();
        apply(&mut s, acquire("a", Some("x")));
        apply(&mut s, acquire("b", Some("x")));
        assert_eq!(s.requests.get("x"), Some(&2));
        assert_eq!(s.validate(10_000), Ok(()));
        let mut whole = AuthorityState::default();
        for piece in s.pieces(1) {
            whole.merge(&piece);
        }
        assert_eq!(whole.requests, s.requests);
        apply(&mut s, Command::Release { lease_id: 1 });
        assert_eq!(s.requests.get("x"), Some(&2));
        assert!(s.by_request("x", "b").is_some());
        // An index naming a lease that carries another id is not a state this code writes.
        let mut bad = s.clone();
        bad.requests.insert("y".into(), 2);
        assert!(bad.validate(10_000).unwrap_err().contains("request y"));
    }

    #[test]
    fn the_pieces_of_a_state_make_it_whole() {
        for n in [0, 1, 5, 40] {
            let saved = saved_state(n);
            for max_bytes in [1, 600, 128 * 1024] {
                let pieces = saved.pieces(max_bytes);
                assert_eq!(pieces[0].revision, saved.revision);
                assert_eq!(pieces[0].last_lease_id, saved.last_lease_id);
                assert_eq!(pieces[0].token_keys, saved.token_keys);
                let mut whole = pieces[0].clone();
                for piece in &pieces[1..] {
                    let size = serde_json::to_vec(piece).unwrap().len();
                    assert!(
                        piece.leases.len() == 1 || size <= max_bytes + 200,
                        "{size} bytes in a piece of at most {max_bytes}"
                    );
                    whole.merge(piece);
                }
                assert_eq!(whole, saved, "{n} locks in pieces of {max_bytes} bytes");
                if max_bytes == 128 * 1024 {
                    assert_eq!(pieces.len(), 1, "{n} small leases fit in one piece");
                }
            }
        }
    }

    #[test]
    fn a_restore_in_parts_applies_with_its_last_part_only() {
        let saved = saved_state(6);
        let mut live = AuthorityState::default();
        for _ in 0..10 {
            apply(&mut live, acquire("gone", None));
            let lease_id = live.last_lease_id;
            apply(&mut live, Command::Release { lease_id });
        }
        apply(&mut live, acquire("gone", None));
        let parts = parts_of(&saved, "r", 2);
        assert!(parts.len() > 3);
        let (last, first) = parts.split_last().unwrap();
        for part in first {
            assert_eq!(apply(&mut live, part.clone()), Outcome::Nothing);
            assert!(
                live.locks.contains_key("gone"),
                "nothing applied before the last part"
            );
        }
        // A snapshot taken between two parts carries the staged ones.
        let mut resumed: AuthorityState =
            serde_json::from_slice(&serde_json::to_vec(&live).unwrap()).unwrap();
        assert_eq!(resumed, live);
        let mut freed = Vec::new();
        assert_eq!(
            resumed.apply(last, &mut freed),
            Outcome::Bumped { revision: 121 }
        );
        assert_eq!(freed, ["gone"]);
        assert_eq!(resumed.restoring, None);
        assert_eq!(resumed.locks, saved.locks);
        assert_eq!(resumed.leases, saved.leases);
        assert_eq!(resumed.requests, saved.requests);
        assert_eq!(resumed.last_lease_id, saved.last_lease_id);
        assert_eq!(resumed.token_keys, saved.token_keys);
        // Nothing staged is left in what a snapshot file shows.
        assert!(!serde_json::to_string(&resumed)
            .unwrap()
            .contains("restoring"));
    }

    #[test]
    fn a_restore_overtaken_or_out_of_order_applies_nothing() {
        let saved = saved_state(4);
        let mut live = AuthorityState::default();
        apply(&mut live, acquire("live", None));
        let a = parts_of(&saved, "a", 1);
        let b = parts_of(&saved, "b", 1);
        apply(&mut live, a[0].clone());
        apply(&mut live, b[0].clone());
        // A's next part finds B staged: refused, and B goes on.
        assert_eq!(apply(&mut live, a[1].clone()), Outcome::RestoreInterrupted);
        // A part twice, or skipped, is refused.
        assert_eq!(
            apply(&mut live, b[0].clone()),
            Outcome::Nothing,
            "b restarted"
        );
        assert_eq!(apply(&mut live, b[2].clone()), Outcome::RestoreInterrupted);
        for part in &b[1..b.len() - 1] {
            assert_eq!(apply(&mut live, part.clone()), Outcome::Nothing);
        }
        assert!(live.locks.contains_key("live"));
        assert!(matches!(
            apply(&mut live, b[b.len() - 1].clone()),
            Outcome::Bumped { .. }
        ));
        assert!(live.locks.contains_key("kept0") && !live.locks.contains_key("live"));
    }

    #[test]
    fn token_is_the_create_revision_and_deletes_advance_it() {
        let mut s = AuthorityState::default();
        assert_eq!(
            apply(&mut s, acquire("a", None)),
            Outcome::Acquired {
                resource: "a".into(),
                token: 1,
                lease_id: 1,
                ttl_ms: 1000,
                secret: None,
            }
        );
        assert_eq!(
            apply(&mut s, acquire("a", None)),
            Outcome::Held { revision: 1 }
        );
        let mut freed = Vec::new();
        assert_eq!(
            s.apply(&Command::Release { lease_id: 1 }, &mut freed),
            Outcome::Released { revision: 2 }
        );
        assert_eq!(freed, vec!["a".to_string()]);
        assert_eq!(
            apply(&mut s, acquire("a", None)),
            Outcome::Acquired {
                resource: "a".into(),
                token: 3,
                lease_id: 2,
                ttl_ms: 1000,
                secret: None,
            }
        );
        assert_eq!(
            apply(&mut s, Command::Expire { lease_id: 2 }),
            Outcome::Released { revision: 4 }
        );
        assert_eq!(
            apply(&mut s, Command::Expire { lease_id: 2 }),
            Outcome::UnknownLease
        );
        assert_eq!(s.revision, 4);
    }

    #[test]
    fn a_retried_acquire_gets_the_same_lease() {
        let mut s = AuthorityState::default();
        let first = apply(&mut s, acquire("a", Some("r1")));
        assert_eq!(apply(&mut s, acquire("a", Some("r1"))), first);
        assert_eq!(
            apply(&mut s, acquire("a", Some("r2"))),
            Outcome::Held { revision: 1 }
        );
        assert_eq!(s.revision, 1);
        apply(&mut s, Command::Release { lease_id: 1 });
        assert!(
            s.requests.is_empty(),
            "request ids live only as long as their lease"
        );
    }

    #[test]
    fn restore_never_goes_backwards() {
        let mut old = AuthorityState::default();
        apply(&mut old, acquire("a", None));
        let saved = old.clone();
        let mut live = AuthorityState::default();
        for _ in 0..10 {
            apply(&mut live, acquire("b", None));
            let lease_id = live.last_lease_id;
            apply(&mut live, Command::Release { lease_id });
        }
        assert_eq!(live.revision, 20);
        let out = apply(
            &mut live,
            Command::Restore {
                state: Box::new(saved),
                bump: 1_000_000,
            },
        );
        assert_eq!(
            out,
            Outcome::Bumped {
                revision: 1_000_020
            }
        );
        assert!(live.locks.contains_key("a"));
    }

    #[test]
    fn every_command_reads_back_from_the_log() {
        let mut state = AuthorityState::default();
        apply(&mut state, acquire("a", Some("r1")));
        let commands = [
            acquire("a", Some("r1")),
            Command::Release { lease_id: 1 },
            Command::Expire { lease_id: 1 },
            Command::Bump { by: 5 },
            Command::Floor { revision: 7 },
            Command::AddTokenKey {
                kid: 1,
                secret: "c2VjcmV0".into(),
            },
            Command::RetireTokenKey { kid: 1 },
            Command::PromoteTokenKey { kid: 1 },
            Command::Restore {
                state: Box::new(state),
                bump: 1_000_000,
            },
            Command::RestorePart {
                restore: "0f".into(),
                index: 0,
                parts: 2,
                piece: Box::new(saved_state(2)),
                bump: 1_000_000,
            },
        ];
        for command in commands {
            let bytes = serde_json::to_vec(&command).unwrap();
            assert_eq!(serde_json::from_slice::<Command>(&bytes).unwrap(), command);
        }
    }

    #[test]
    fn validation_refuses_inconsistent_snapshots() {
        let mut good = AuthorityState::default();
        apply(&mut good, acquire("a", Some("r1")));
        assert_eq!(good.validate(10_000), Ok(()));
        let mut orphan = good.clone();
        orphan.leases.clear();
        assert!(orphan
            .validate(10_000)
            .unwrap_err()
            .contains("lease 1 is missing"));
        let mut future = good.clone();
        future.locks.get_mut("a").unwrap().token = 99;
        assert!(future.validate(10_000).is_err());
        let mut bad_name = good.clone();
        let lock = bad_name.locks.remove("a").unwrap();
        bad_name.locks.insert("a b".into(), lock);
        assert!(bad_name.validate(10_000).is_err());
        assert!(good.validate(10).unwrap_err().contains("ttl_ms"));
    }

    #[test]
    fn keys_only_grow_and_the_last_active_key_stays() {
        let mut s = AuthorityState::default();
        let add = |kid| Command::AddTokenKey {
            kid,
            secret: "c2VjcmV0".into(),
        };
        assert_eq!(apply(&mut s, add(1)), Outcome::KeyAdded { kid: 1 });
        assert!(
            !s.token_keys[&1].signs,
            "a new key verifies before it signs"
        );
        apply(&mut s, Command::PromoteTokenKey { kid: 1 });
        assert!(s.token_keys[&1].signs);
        assert!(matches!(apply(&mut s, add(1)), Outcome::KeyRefused { .. }));
        assert!(matches!(
            apply(&mut s, Command::RetireTokenKey { kid: 1 }),
            Outcome::KeyRefused { .. }
        ));
        assert_eq!(apply(&mut s, add(2)), Outcome::KeyAdded { kid: 2 });
        apply(&mut s, Command::PromoteTokenKey { kid: 2 });
        assert_eq!(
            apply(&mut s, Command::RetireTokenKey { kid: 1 }),
            Outcome::KeyRetired { kid: 1 }
        );
        assert_eq!(s.newest_key(), Some(2));
    }

    #[test]
    fn floor_raises_and_never_lowers() {
        let mut s = AuthorityState::default();
        apply(&mut s, Command::Floor { revision: 500 });
        assert_eq!(s.revision, 500);
        apply(&mut s, Command::Floor { revision: 10 });
        assert_eq!(s.revision, 500);
        assert!(matches!(
            apply(&mut s, acquire("a", None)),
            Outcome::Acquired { token: 501, .. }
        ));
    }

    #[test]
    fn revision_stops_at_what_stores_can_keep() {
        let mut s = AuthorityState {
            revision: Revision::MAX - 1,
            ..Default::default()
        };
        assert!(
            matches!(apply(&mut s, acquire("a", None)), Outcome::Acquired { token, .. } if token == Revision::MAX)
        );
        assert_eq!(
            apply(&mut s, acquire("b", None)),
            Outcome::RevisionExhausted
        );
        assert_eq!(
            apply(&mut s, Command::Bump { by: 1 }),
            Outcome::RevisionExhausted
        );
        assert_eq!(s.revision, Revision::MAX);
    }
}
