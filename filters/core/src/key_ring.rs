use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use crate::{TokenError, TokenKey};

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    /// Verifies tokens but signs none yet: a new key is replicated to every node before any
    /// token signed with it can reach their gateways.
    Verifying,
    /// Verifies, and signs when it is the newest signing key.
    Signing,
    /// Verifies nothing: tokens it signed are refused as forged.
    Retired,
}

/// The token keys a node knows: which one signs, which ones still verify.
///
/// The authority fills it from its replicated state (keys made at cluster initialization and by
/// rotation) and every gateway of the node reads it, so verification needs no configuration. A
/// retired key verifies nothing: tokens it signed are refused as forged.
#[derive(Debug, Clone, Default)]
pub struct KeyRing {
    keys: BTreeMap<u32, (TokenKey, KeyState)>,
    /// An operator-supplied key that signs instead of the newest replicated key.
    pinned: Option<u32>,
}

impl KeyRing {
    /// A ring holding `key` alone, which signs.
    pub fn single(key: TokenKey) -> Self {
        let mut ring = Self::default();
        ring.insert(key, KeyState::Signing);
        ring
    }

    /// Adds or replaces a key.
    pub fn insert(&mut self, key: TokenKey, state: KeyState) {
        self.keys.insert(key.id(), (key, state));
    }

    /// Makes `key` the signer whatever newer keys exist (an operator's own key).
    pub fn pin(&mut self, key: TokenKey) {
        self.pinned = Some(key.id());
        self.insert(key, KeyState::Signing);
    }

    /// The key new tokens are signed with: the pinned key, else the newest signing one.
    pub fn signer(&self) -> Option<&TokenKey> {
        if let Some((key, KeyState::Signing)) = self.pinned.and_then(|id| self.keys.get(&id)) {
            return Some(key);
        }
        self.keys
            .values()
            .rev()
            .find(|(_, state)| *state == KeyState::Signing)
            .map(|(key, _)| key)
    }

    /// The key that verifies tokens naming `id`.
    pub fn verifier(&self, id: u32) -> Result<&TokenKey, TokenError> {
        match self.keys.get(&id) {
            Some((_, KeyState::Retired)) => Err(TokenError::RetiredKey(id)),
            Some((key, _)) => Ok(key),
            None => Err(TokenError::UnknownKey(id)),
        }
    }

    /// Whether no key is known yet (a node that has not applied its log).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Every key with its state, oldest first.
    pub fn keys(&self) -> impl Iterator<Item = (&TokenKey, KeyState)> {
        self.keys.values().map(|(key, state)| (key, *state))
    }
}

/// A [`KeyRing`] shared between the authority that updates it and the gateways that read it.
///
/// A handle, not a global: whoever builds a node creates one and passes clones around.
#[derive(Debug, Clone, Default)]
pub struct SharedKeyRing(Arc<RwLock<KeyRing>>);

impl SharedKeyRing {
    /// A handle to `ring`.
    pub fn new(ring: KeyRing) -> Self {
        Self(Arc::new(RwLock::new(ring)))
    }

    /// Runs `f` on the current ring.
    pub fn read<T>(&self, f: impl FnOnce(&KeyRing) -> T) -> T {
        // A writer that panicked left a ring that is still whole (inserts are single calls).
        let ring = self.0.read().unwrap_or_else(|e| e.into_inner());
        f(&ring)
    }

    /// Replaces the ring.
    pub fn replace(&self, ring: KeyRing) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = ring;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: u32) -> TokenKey {
        TokenKey::new(id, &[id as u8; 32]).unwrap()
    }

    #[test]
    fn newest_signing_key_signs_and_retired_keys_verify_nothing() {
        let mut ring = KeyRing::default();
        assert!(ring.signer().is_none());
        ring.insert(key(1), KeyState::Signing);
        ring.insert(key(2), KeyState::Verifying);
        assert_eq!(
            ring.signer().unwrap().id(),
            1,
            "a verifying key does not sign yet"
        );
        assert!(ring.verifier(2).is_ok());
        ring.insert(key(2), KeyState::Signing);
        assert_eq!(ring.signer().unwrap().id(), 2);
        assert!(ring.verifier(1).is_ok());
        ring.insert(key(1), KeyState::Retired);
        assert_eq!(ring.verifier(1).err(), Some(TokenError::RetiredKey(1)));
        assert_eq!(ring.verifier(9).err(), Some(TokenError::UnknownKey(9)));
        ring.insert(key(2), KeyState::Retired);
        assert!(ring.signer().is_none());
    }

    #[test]
    fn a_pinned_key_signs_over_newer_ones() {
        let mut ring = KeyRing::default();
        ring.insert(key(5), KeyState::Signing);
        ring.pin(key(0));
        assert_eq!(ring.signer().unwrap().id(), 0);
        assert!(ring.verifier(5).is_ok());
    }
}
