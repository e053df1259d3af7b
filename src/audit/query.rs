//! Selecting and showing records: `audit tail` and `audit query`.

use fencegate_core::AuditRecord;

/// Which records `audit query` shows.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this resource.
    pub resource: Option<String>,
    /// Only this store (`redis`, `s3`, `postgres`).
    pub store: Option<String>,
    /// Only records at or after this time (ms since the epoch).
    pub since_ms: Option<u64>,
}

impl Filter {
    /// Whether `record` passes.
    pub fn accepts(&self, record: &AuditRecord) -> bool {
        self.resource
            .as_ref()
            .is_none_or(|r| record.event.resource.as_deref() == Some(r.as_str()))
            && self.store.as_ref().is_none_or(|s| &record.event.store == s)
            && self.since_ms.is_none_or(|t| record.time_ms >= t)
    }
}

/// One line for people: time, store, reason, resource, token revision, fence, command, client.
pub fn human(record: &AuditRecord) -> String {
    let e = &record.event;
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    format!(
        "{} #{} {} {} resource={} token={} fence={} op={}{} client={}{} req={}",
        record.time,
        record.seq,
        e.store,
        e.reason,
        or_dash(e.resource.clone()),
        or_dash(e.revision.map(|r| r.to_string())),
        or_dash(e.fence.map(|f| f.to_string())),
        e.operation.command,
        if e.operation.objects.is_empty() {
            String::new()
        } else {
            format!("[{}]", e.operation.objects.join(","))
        },
        e.client_addr,
        e.client_identity
            .as_ref()
            .map(|i| format!("({i})"))
            .unwrap_or_default(),
        e.request_id,
    )
}
