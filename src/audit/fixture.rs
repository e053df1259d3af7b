//! A refusal to write in the audit module's unit tests: one definition, so that the writer's and
//! prune's tests write the same records.

use fencegate_core::{AuditEvent, OperationSummary};

/// The `n`th stale refusal of a `SET` on `k`; `n` makes its detail and request id unique.
pub(crate) fn event(n: usize) -> AuditEvent {
    AuditEvent {
        store: "redis".into(),
        client_addr: "127.0.0.1:1".into(),
        client_identity: None,
        resource: Some("job".into()),
        token: Some("fg1~3~job".into()),
        token_signed: false,
        revision: Some(3),
        fence: Some(5),
        reason: "stale".into(),
        detail: format!("refusal {n}"),
        operation: OperationSummary {
            command: "SET".into(),
            objects: vec!["k".into()],
            args: 3,
            bytes: 20,
        },
        request_id: format!("r{n}"),
    }
}
