//! Keeps the store's copy of the cluster's token keys current, so `fencegate.guard` verifies
//! signatures itself (also for clients that bypass the gateway) without an operator running
//! `fencegate postgres sync-keys` after every rotation.
//!
//! Runs when the `[postgres]` section names an install DSN (`install_dsn_env`): the owner role
//! is the only one that may write `fencegate.token_keys`. The node's key ring is compared once
//! a second with what was last written; a change (a new, promoted or retired key) is written in
//! one transaction. An operator's own key (id 0, from `authority.token_key_env` or
//! `token_key_file`) is written too: it signs the node's tokens, so without it the store would
//! refuse every token the gateway accepts.

use std::time::Duration;

use fencegate_core::{KeyState, SharedKeyRing};

use crate::token_keys::install_token_keys;

/// How often the ring is compared with what the store was given.
const PERIOD: Duration = Duration::from_secs(1);

/// The keys of `ring` as the store keeps them: `(kid, secret, retired)`, the operator's key
/// (id 0) included.
pub fn store_keys(ring: &SharedKeyRing) -> Vec<(u32, Vec<u8>, bool)> {
    ring.read(|ring| {
        let mut keys: Vec<_> = ring
            .keys()
            .map(|(key, state)| (key.id(), key.secret().to_vec(), state == KeyState::Retired))
            .collect();
        keys.sort_by_key(|(kid, _, _)| *kid);
        keys
    })
}

/// Writes `ring`'s keys into the store behind `dsn` whenever they change; never returns.
/// Failures are logged and retried on the next change check.
pub async fn sync_forever(ring: SharedKeyRing, dsn: String) {
    let mut written: Option<Vec<(u32, Vec<u8>, bool)>> = None;
    let mut failing = false;
    loop {
        let keys = store_keys(&ring);
        if !keys.is_empty() && written.as_ref() != Some(&keys) {
            match write(&dsn, &keys).await {
                Ok(()) => {
                    let ids: Vec<String> = keys.iter().map(|(kid, _, _)| kid.to_string()).collect();
                    tracing::info!(keys = %ids.join(","), "token keys written to the PostgreSQL store; the guard verifies signatures");
                    written = Some(keys);
                    failing = false;
                }
                Err(e) if !failing => {
                    tracing::error!(error = %e, "could not write the token keys to the PostgreSQL store; retrying every second (direct connections are judged with the old keys meanwhile)");
                    failing = true;
                }
                Err(_) => {}
            }
        }
        tokio::time::sleep(PERIOD).await;
    }
}

async fn write(dsn: &str, keys: &[(u32, Vec<u8>, bool)]) -> Result<(), crate::PostgresError> {
    let (mut client, connection) = crate::connect::connect(dsn).await?;
    let result = install_token_keys(&mut client, keys).await;
    drop(client);
    connection.abort();
    result
}

#[cfg(test)]
mod tests {
    use fencegate_core::{KeyRing, TokenKey};

    use super::*;

    #[test]
    fn the_store_gets_every_key_with_its_retirement_and_the_operator_key() {
        let mut ring = KeyRing::default();
        ring.insert(TokenKey::new(2, &[2; 32]).unwrap(), KeyState::Signing);
        ring.insert(TokenKey::new(1, &[1; 32]).unwrap(), KeyState::Retired);
        ring.pin(TokenKey::new(0, &[9; 32]).unwrap());
        let keys = store_keys(&SharedKeyRing::new(ring));
        assert_eq!(
            keys,
            vec![
                (0, vec![9; 32], false),
                (1, vec![1; 32], true),
                (2, vec![2; 32], false)
            ]
        );
    }
}
