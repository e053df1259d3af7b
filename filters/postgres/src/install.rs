//! Installs `fence.sql` (schema `fencegate`, table `fencegate.fences`, `fencegate.guard` and
//! `fencegate.refuse`) with tokio-postgres. Idempotent.

use tokio_postgres::NoTls;

use crate::error::PostgresError;

/// The store-side artifact, shipped in the crate as a real file.
pub const FENCE_SQL: &str = include_str!("fence.sql");

/// Connects to `dsn` (libpq key/value or URL form) and runs `fence.sql` in one transaction.
pub async fn install(dsn: &str) -> Result<(), PostgresError> {
    let (mut client, connection) = tokio_postgres::connect(dsn, NoTls).await?;
    let task = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "install connection ended with an error");
        }
    });
    let tx = client.transaction().await?;
    tx.batch_execute(FENCE_SQL).await?;
    tx.commit().await?;
    drop(client);
    let _ = task.await;
    Ok(())
}
