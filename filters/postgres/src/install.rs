//! Installs `fence.sql` (schema `fencegate`: the fences, the token and pass keys, the guard, the
//! enforcement trigger function) with tokio-postgres, and with `--enforce c` the C trigger
//! function and guard over fence.sql's plpgsql ones. Idempotent.

use std::time::Duration;

use tokio_postgres::{Client, Transaction};

use crate::connect::connect;
use crate::enforce::{drop_c_write_lock, install_c, Enforce};
use crate::error::PostgresError;

/// The store-side artifact, shipped in the crate as a real file.
pub const FENCE_SQL: &str = include_str!("fence.sql");

/// The guard's default `lock_timeout`: how long a raise waits behind an older holder's open or
/// prepared transaction before answering a retryable error.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// Options of `fencegate postgres install`.
#[derive(Debug, Clone)]
pub struct InstallOptions {
    /// The guard's `lock_timeout`.
    pub lock_timeout: Duration,
    /// Which `fencegate.enforce()` to leave installed; `None` keeps the installed one (the C one
    /// stays C: fence.sql's plpgsql definition would otherwise replace it), plpgsql on a first
    /// install.
    pub enforce: Option<Enforce>,
}

impl Default for InstallOptions {
    fn default() -> Self {
        Self {
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            enforce: None,
        }
    }
}

/// What the install found worth telling the operator.
#[derive(Debug, Clone, Default)]
pub struct InstallReport {
    /// The role that ran the install and owns the schema.
    pub owner: String,
    /// Warnings (e.g. the installer role also owns application tables).
    pub warnings: Vec<String>,
    /// The `fencegate.enforce()` left installed.
    pub enforce: Enforce,
}

/// Connects to `dsn` (libpq key/value or URL form) and runs `fence.sql` in one transaction.
pub async fn install(dsn: &str) -> Result<(), PostgresError> {
    install_with(dsn, &InstallOptions::default())
        .await
        .map(drop)
}

/// [`install`] with options; returns the owner role and warnings.
pub async fn install_with(
    dsn: &str,
    options: &InstallOptions,
) -> Result<InstallReport, PostgresError> {
    let (mut client, task) = connect(dsn).await?;
    let tx = client.transaction().await?;
    let installed = installed_enforce(&tx).await?;
    let enforce = options.enforce.or(installed).unwrap_or_default();
    tx.batch_execute(FENCE_SQL).await?;
    // Before the lock_timeout: the C functions' CREATE OR REPLACE drops SET clauses.
    match enforce {
        Enforce::C => install_c(&tx, options.enforce.is_none()).await?,
        Enforce::Plpgsql => drop_c_write_lock(&tx).await?,
    }
    let millis = options.lock_timeout.as_millis().max(1);
    // On the routines that wait for a fence row or lock: fence.sql's guard_proc (its guard(text)
    // calls it), or with C, take_fence. The C guard never waits itself (its common case skips a
    // fence being written) and hands everything else to take_fence, so its common case skips a
    // SET clause's save and restore of the settings (about 8k instructions per transaction).
    // fence.sql's CREATE OR REPLACE clears take_fence's clause again on every install.
    let waiting: [&str; 2] = match enforce {
        Enforce::Plpgsql => [
            "fencegate.guard_proc(text)",
            "fencegate.guard(text, bigint)",
        ],
        Enforce::C => [
            "fencegate.take_fence(text, bigint)",
            "fencegate.guard(text, bigint)",
        ],
    };
    for signature in waiting {
        tx.batch_execute(&format!(
            "ALTER ROUTINE {signature} SET lock_timeout = '{millis}ms'"
        ))
        .await?;
    }
    tx.commit().await?;
    let report = InstallReport {
        owner: current_user(&client).await?,
        warnings: owner_warnings(&client).await?,
        enforce,
    };
    drop(client);
    let _ = task.await;
    Ok(report)
}

/// The installed `fencegate.enforce()`'s implementation, by its language; `None` before the
/// first install.
async fn installed_enforce(tx: &Transaction<'_>) -> Result<Option<Enforce>, PostgresError> {
    let row = tx
        .query_opt(
            "SELECT l.lanname::text FROM pg_catalog.pg_proc p \
               JOIN pg_catalog.pg_language l ON l.oid = p.prolang \
              WHERE p.oid = pg_catalog.to_regprocedure('fencegate.enforce()')",
            &[],
        )
        .await?;
    Ok(row.map(|r| match r.get::<_, String>(0).as_str() {
        "c" => Enforce::C,
        _ => Enforce::Plpgsql,
    }))
}

async fn current_user(client: &Client) -> Result<String, PostgresError> {
    Ok(client.query_one("SELECT current_user", &[]).await?.get(0))
}

/// The installer role can drop the triggers and read the keys: it must not be the role the
/// application connects as. It cannot know the app's role, so it says what it sees.
pub(crate) async fn owner_warnings(client: &Client) -> Result<Vec<String>, PostgresError> {
    let row = client
        .query_one(
            "SELECT current_user::text, \
                    (SELECT rolsuper FROM pg_roles WHERE rolname = current_user), \
                    (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                      WHERE c.relowner = (SELECT oid FROM pg_roles WHERE rolname = current_user) \
                        AND c.relkind IN ('r', 'p') AND n.nspname NOT IN ('fencegate', 'pg_catalog', 'information_schema') \
                        AND n.nspname NOT LIKE 'pg_toast%')",
            &[],
        )
        .await?;
    let (role, superuser, owned): (String, bool, i64) = (row.get(0), row.get(1), row.get(2));
    let mut warnings = Vec::new();
    if owned > 0 {
        warnings.push(format!(
            "role {role} owns {owned} application table(s): if the application connects as {role}, it can drop \
             fencegate's triggers and read its keys. Install and protect as a separate role, and let the \
             application use another role that owns nothing in protected schemas."
        ));
    }
    if superuser {
        warnings.push(format!(
            "role {role} is a superuser: never let the application connect as it (a superuser bypasses every fence)."
        ));
    }
    Ok(warnings)
}
