//! An operator's reset of one resource's fence (`fencegate fence reset`): a compare-and-set on
//! `fencegate.fences` in one transaction. The row lock waits for guarded transactions of the
//! resource in flight (they hold it `FOR SHARE`; with the C guard, the fence lock, which the
//! trigger `fence_write_lock` takes before the row changes), so none of them straddles the reset.

use fencegate_core::{FenceReset, Resource};
use tokio_postgres::Client;

use crate::error::PostgresError;
use crate::protect::require_schema;

/// Sets `resource`'s fence to `to` (0: removes it) if it is `current` (0: none) now. Run as
/// the fence schema's owner, the only role that may write `fencegate.fences`.
pub async fn reset_fence(
    client: &mut Client,
    resource: &Resource,
    current: u64,
    to: u64,
) -> Result<FenceReset, PostgresError> {
    require_schema(client).await?;
    let as_bigint = |n: u64| {
        i64::try_from(n)
            .map_err(|_| PostgresError::Config(format!("fence {n} is above PostgreSQL's bigint")))
    };
    let (current_i, to_i) = (as_bigint(current)?, as_bigint(to)?);
    let tx = client.transaction().await?;
    tx.batch_execute("SET LOCAL lock_timeout = '5s'").await?;
    let actual: i64 = tx
        .query_opt(
            "SELECT revision FROM fencegate.fences WHERE resource = $1 FOR UPDATE",
            &[&resource.as_str()],
        )
        .await?
        .map_or(0, |row| row.get(0));
    if actual != current_i {
        return Ok(FenceReset::Mismatch {
            actual: actual.max(0) as u64,
        });
    }
    if to_i == 0 {
        tx.execute(
            "DELETE FROM fencegate.fences WHERE resource = $1",
            &[&resource.as_str()],
        )
        .await?;
    } else {
        tx.execute(
            "INSERT INTO fencegate.fences (resource, revision) VALUES ($1, $2) \
             ON CONFLICT (resource) DO UPDATE SET revision = EXCLUDED.revision, updated_at = now()",
            &[&resource.as_str(), &to_i],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(FenceReset::Done { from: current, to })
}
