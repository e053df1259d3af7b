//! `fencegate postgres protect`: installs the enforcement triggers on a table or a whole schema,
//! binds them to a resource, and (for a schema) installs the event trigger that protects tables
//! created later there, where the installer may create one.

use tokio_postgres::Client;

use crate::error::PostgresError;
use crate::sqlstate;

/// What to protect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Every table of this schema, now and (with the event trigger) later.
    Schema(String),
    /// One table (`name` or `schema.name`), with its partitions.
    Table(String),
}

/// What `protect` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtectReport {
    /// Tables that now carry the trigger.
    pub tables: u32,
    /// For a schema: whether tables created later are protected, and if not, why.
    pub future_tables: Option<Result<(), String>>,
}

/// The event trigger's name.
pub const EVENT_TRIGGER: &str = "fencegate_protect_new_tables";

/// Protects `target`, bound to `resource` (writes then need a pass for that resource; `None`:
/// any valid pass). Needs fence.sql installed (FG007 otherwise).
pub async fn protect(
    client: &Client,
    target: &Target,
    resource: Option<&str>,
) -> Result<ProtectReport, PostgresError> {
    require_schema(client).await?;
    match target {
        Target::Table(table) => {
            let n: i32 = client
                .query_one(
                    "SELECT fencegate.protect_table($1::text::regclass, $2)",
                    &[table, &resource],
                )
                .await?
                .get(0);
            Ok(ProtectReport {
                tables: n as u32,
                future_tables: None,
            })
        }
        Target::Schema(schema) => {
            let n: i32 = client
                .query_one(
                    "SELECT fencegate.protect_schema($1, $2)",
                    &[schema, &resource],
                )
                .await?
                .get(0);
            Ok(ProtectReport {
                tables: n as u32,
                future_tables: Some(event_trigger(client).await?),
            })
        }
    }
}

/// Installs the event trigger, or says why it cannot.
async fn event_trigger(client: &Client) -> Result<Result<(), String>, PostgresError> {
    let row = client
        .query_one(
            "SELECT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user), \
                    EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = $1), current_user::text",
            &[&EVENT_TRIGGER],
        )
        .await?;
    let (superuser, exists, role): (bool, bool, String) = (row.get(0), row.get(1), row.get(2));
    if exists {
        return Ok(Ok(()));
    }
    if !superuser {
        return Ok(Err(format!(
            "role {role} is not a superuser, and only a superuser can create event triggers: tables \
             created later in this schema are NOT protected until `fencegate postgres protect` runs again"
        )));
    }
    client
        .batch_execute(&format!(
            "CREATE EVENT TRIGGER {EVENT_TRIGGER} ON ddl_command_end \
             WHEN TAG IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO') \
             EXECUTE FUNCTION fencegate.protect_new_tables()"
        ))
        .await?;
    Ok(Ok(()))
}

/// Errors with FG007's message when `fencegate.guard_proc(text)` (what the gateway calls) is
/// missing.
pub(crate) async fn require_schema(client: &Client) -> Result<(), PostgresError> {
    let row = client
        .query_one(
            "SELECT to_regprocedure('fencegate.guard_proc(text)') IS NOT NULL, current_database()::text",
            &[],
        )
        .await?;
    if row.get::<_, bool>(0) {
        Ok(())
    } else {
        let database: String = row.get(1);
        Err(PostgresError::Config(sqlstate::not_installed_message(
            &format!("database {database}"),
        )))
    }
}
