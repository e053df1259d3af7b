//! `fencegate postgres status`: protected tables, their resources, whether their trigger is in
//! place, and the fences.

use std::fmt;

use tokio_postgres::Client;

use crate::error::PostgresError;
use crate::protect::{require_schema, EVENT_TRIGGER};

/// One protected table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtectedTable {
    /// `schema.table`.
    pub name: String,
    /// The resource it is bound to (`None`: any).
    pub resource: Option<String>,
    /// Whether its trigger exists and fires always (someone with ownership may have dropped or
    /// disabled it).
    pub enforced: bool,
}

/// The store's fencing state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// Protected tables.
    pub tables: Vec<ProtectedTable>,
    /// Protected schemas and their resources.
    pub schemas: Vec<(String, Option<String>)>,
    /// Whether the event trigger for new tables is installed.
    pub event_trigger: bool,
    /// `(resource, revision)` of every fence.
    pub fences: Vec<(String, i64)>,
    /// Token keys `(kid, retired)` (never their secrets).
    pub keys: Vec<(i64, bool)>,
}

/// Reads the status.
pub async fn status(client: &Client) -> Result<Status, PostgresError> {
    require_schema(client).await?;
    let tables = client
        .query(
            "SELECT format('%I.%I', p.schema_name, p.table_name), p.resource, \
                    EXISTS (SELECT 1 FROM pg_trigger t \
                             WHERE t.tgrelid = to_regclass(format('%I.%I', p.schema_name, p.table_name)) \
                               AND t.tgname = 'fencegate_enforce' AND t.tgenabled = 'A') \
               FROM fencegate.protected_tables p ORDER BY 1",
            &[],
        )
        .await?
        .into_iter()
        .map(|r| ProtectedTable {
            name: r.get(0),
            resource: r.get(1),
            enforced: r.get(2),
        })
        .collect();
    let schemas = client
        .query(
            "SELECT schema_name, resource FROM fencegate.protected_schemas ORDER BY 1",
            &[],
        )
        .await?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let event_trigger = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = $1 AND evtenabled <> 'D')",
            &[&EVENT_TRIGGER],
        )
        .await?
        .get(0);
    let fences = client
        .query(
            "SELECT resource, revision FROM fencegate.fences ORDER BY 1",
            &[],
        )
        .await?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // Readable by the owner role only; a status run by another role shows no keys.
    let keys = client
        .query(
            "SELECT kid, retired FROM fencegate.token_keys \
              WHERE has_table_privilege('fencegate.token_keys', 'SELECT') ORDER BY 1",
            &[],
        )
        .await
        .map(|rows| rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
        .unwrap_or_default();
    Ok(Status {
        tables,
        schemas,
        event_trigger,
        fences,
        keys,
    })
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "protected tables:")?;
        if self.tables.is_empty() {
            writeln!(f, "  (none: run `fencegate postgres protect`)")?;
        }
        for t in &self.tables {
            writeln!(
                f,
                "  {:<40} resource {:<24} {}",
                t.name,
                t.resource.as_deref().unwrap_or("(any)"),
                if t.enforced {
                    "trigger enforced"
                } else {
                    "TRIGGER MISSING OR DISABLED: writes are not fenced by the store"
                }
            )?;
        }
        for (schema, resource) in &self.schemas {
            writeln!(
                f,
                "schema {schema} (resource {}): new tables {}",
                resource.as_deref().unwrap_or("(any)"),
                if self.event_trigger {
                    "protected by the event trigger"
                } else {
                    "NOT protected (no event trigger)"
                }
            )?;
        }
        writeln!(f, "fences:")?;
        if self.fences.is_empty() {
            writeln!(f, "  (none yet)")?;
        }
        for (resource, revision) in &self.fences {
            writeln!(f, "  {resource:<40} {revision}")?;
        }
        let keys: Vec<String> = self
            .keys
            .iter()
            .map(|(kid, retired)| format!("{kid}{}", if *retired { " (retired)" } else { "" }))
            .collect();
        writeln!(
            f,
            "token keys: {}",
            if keys.is_empty() {
                "none visible (unsigned tokens are accepted when none is installed)".to_owned()
            } else {
                keys.join(", ")
            }
        )
    }
}
