//! Writes the cluster's token keys into the store, so `fencegate.guard(token)` verifies
//! signatures itself (with any key installed it refuses unsigned tokens, and tokens of unknown or
//! retired keys).

use tokio_postgres::Client;

use crate::error::PostgresError;
use crate::protect::require_schema;

/// Replaces the store's token keys with `keys`: `(kid, secret, retired)`. A retired key stays
/// known but verifies nothing. Run as the fence schema's owner (the only role that may write
/// `fencegate.token_keys`); one transaction, so the guard never sees a partial set.
pub async fn install_token_keys(
    client: &mut Client,
    keys: &[(u32, Vec<u8>, bool)],
) -> Result<(), PostgresError> {
    require_schema(client).await?;
    if let Some((kid, _, _)) = keys.iter().find(|(_, s, _)| s.len() < 32) {
        return Err(PostgresError::Config(format!(
            "token key {kid} is shorter than 32 bytes"
        )));
    }
    let tx = client.transaction().await?;
    let kids: Vec<i64> = keys.iter().map(|(kid, _, _)| i64::from(*kid)).collect();
    tx.execute(
        "DELETE FROM fencegate.token_keys WHERE NOT (kid = ANY($1))",
        &[&kids],
    )
    .await?;
    for (kid, secret, retired) in keys {
        tx.execute(
            "INSERT INTO fencegate.token_keys (kid, secret, retired) VALUES ($1, $2, $3) \
             ON CONFLICT (kid) DO UPDATE SET secret = EXCLUDED.secret, retired = EXCLUDED.retired",
            &[&i64::from(*kid), secret, retired],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(())
}
