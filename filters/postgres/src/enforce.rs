//! Which `fencegate.enforce()` and `fencegate.guard(text)` the install leaves: fence.sql's plpgsql
//! (the portable default, runs on managed PostgreSQL) or the C library of `filters/postgres/ext`
//! (a fraction of the per-transaction cost; needs a superuser and the library on the database
//! server).

use std::fmt;

use tokio_postgres::error::SqlState;
use tokio_postgres::Transaction;

use crate::error::PostgresError;

/// Replaces fence.sql's plpgsql `fencegate.enforce()` and `fencegate.guard(text)` with the C ones.
pub const ENFORCE_C_SQL: &str = include_str!("enforce_c.sql");

/// The implementation of `fencegate.enforce()` (`install --enforce`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Enforce {
    /// fence.sql's plpgsql function.
    #[default]
    Plpgsql,
    /// `LANGUAGE C`, from the library `fencegate_enforce`.
    C,
}

impl fmt::Display for Enforce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Plpgsql => "plpgsql",
            Self::C => "c",
        })
    }
}

/// Creates the C `fencegate.enforce()` and `fencegate.guard(text)` in `tx` (after fence.sql);
/// `kept`: not asked for, but installed before. Refuses, naming the fix, when the role is not a
/// superuser or the server cannot load the library.
pub(crate) async fn install_c(tx: &Transaction<'_>, kept: bool) -> Result<(), PostgresError> {
    let row = tx
        .query_one(
            "SELECT current_user::text, \
                    (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = current_user)",
            &[],
        )
        .await?;
    let (role, superuser): (String, bool) = (row.get(0), row.get(1));
    if !superuser && kept {
        return Err(PostgresError::EnforceC(format!(
            "fencegate.enforce() is the C one here (installed with --enforce c), and role {role} is \
             not a superuser, so it cannot create it again after fence.sql. Run the install as a \
             superuser, or pass --enforce plpgsql to switch to the portable plpgsql enforce()"
        )));
    }
    if !superuser {
        return Err(PostgresError::EnforceC(format!(
            "role {role} is not a superuser, and only a superuser may create a LANGUAGE C function. \
             Run `fencegate postgres install --enforce c` as a superuser, or install without \
             --enforce c to keep the portable plpgsql enforce()"
        )));
    }
    match tx.batch_execute(ENFORCE_C_SQL).await {
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_FILE) => {
            let detail = e
                .as_db_error()
                .map_or_else(|| e.to_string(), |db| db.message().to_owned());
            Err(PostgresError::EnforceC(format!(
                "the server cannot load the library fencegate_enforce ({detail}). Build and install it \
                 on the database server with `make -C filters/postgres/ext install` (PGXS; needs \
                 postgresql-server-dev for the server's major version), or add the directory that \
                 holds fencegate_enforce.so to the server's dynamic_library_path"
            )))
        }
        result => Ok(result?),
    }
}

/// `--enforce plpgsql` over a C install: drops the fence lock's trigger and its C function
/// (enforce_c.sql), which fence.sql's plpgsql guard does not need. DROP TRIGGER waits for every
/// transaction that has `fencegate.fences` open, those that passed the C guard included, so
/// none of them outlives the trigger; a C guard still running afterwards finds the trigger
/// gone and refuses (fence_lock.c). Nothing is locked when there is nothing to drop.
pub(crate) async fn drop_c_write_lock(tx: &Transaction<'_>) -> Result<(), PostgresError> {
    let present = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t \
              WHERE t.tgrelid = 'fencegate.fences'::pg_catalog.regclass AND t.tgname = 'fence_write_lock'), \
                    pg_catalog.to_regprocedure('fencegate.fence_write_lock()') IS NOT NULL",
            &[],
        )
        .await?;
    if present.get::<_, bool>(0) {
        tx.batch_execute("DROP TRIGGER fence_write_lock ON fencegate.fences")
            .await?;
    }
    if present.get::<_, bool>(1) {
        tx.batch_execute("DROP FUNCTION fencegate.fence_write_lock()")
            .await?;
    }
    Ok(())
}
