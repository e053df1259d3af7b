//! Floods of tokenless or malformed requests become one record per client, kind and second
//! (DESIGN rule 7 allows it): the first [`WRITTEN_PER_SECOND`] refusals of a second are written
//! as they are (a few mistakes stay fully visible), the identical ones after them in that
//! second are counted and written as one aggregate record when the second is over. Stale, forged and out-of-scope refusals are always written one by one: they
//! come from a client that holds (or forged) a token, and each is evidence.

use std::collections::HashMap;

use fencegate_core::AuditEvent;

/// Refusal reasons that are aggregated.
const AGGREGATED: &[&str] = &["missing", "malformed"];

/// Refusals of one client and kind written one by one per second before counting starts.
pub const WRITTEN_PER_SECOND: u32 = 10;

/// At most this many (client, kind) windows are tracked; beyond that every refusal is written
/// on its own (the size budget still bounds the disk).
const MAX_WINDOWS: usize = 10_000;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    store: String,
    client: String,
    reason: String,
    command: String,
}

struct Window {
    second: u64,
    /// Refusals written one by one in this second.
    written: u32,
    /// Refusals counted but not written in this second.
    suppressed: u64,
    /// The first refusal of the second (the aggregate record repeats its shape).
    first: AuditEvent,
}

/// What to do with one refusal.
#[derive(Debug, PartialEq)]
pub enum Admit {
    /// Write it (the first of its kind from this client in this second, or not aggregated).
    Write,
    /// Counted into this second's aggregate; nothing to write now.
    Counted,
}

/// The per-client windows.
#[derive(Default)]
pub struct Aggregator {
    windows: HashMap<Key, Window>,
}

/// The client's address without its port: a flood uses many connections.
fn client_of(addr: &str) -> String {
    match addr.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host.to_owned(),
        _ => addr.to_owned(),
    }
}

impl Aggregator {
    /// Admits `event` refused during unix second `second`; also returns the aggregate records
    /// of windows that are over.
    pub fn admit(&mut self, event: &AuditEvent, second: u64) -> (Admit, Vec<AuditEvent>) {
        let mut due = self.take_due(second);
        if !AGGREGATED.contains(&event.reason.as_str()) {
            return (Admit::Write, due);
        }
        let key = Key {
            store: event.store.clone(),
            client: client_of(&event.client_addr),
            reason: event.reason.clone(),
            command: event.operation.command.clone(),
        };
        match self.windows.get_mut(&key) {
            Some(w) if w.second == second && w.written < WRITTEN_PER_SECOND => {
                w.written += 1;
                (Admit::Write, due)
            }
            Some(w) if w.second == second => {
                w.suppressed += 1;
                (Admit::Counted, due)
            }
            Some(w) => {
                due.extend(aggregate(&key, w));
                *w = Window {
                    second,
                    written: 1,
                    suppressed: 0,
                    first: event.clone(),
                };
                (Admit::Write, due)
            }
            None => {
                if self.windows.len() < MAX_WINDOWS {
                    self.windows.insert(
                        key,
                        Window {
                            second,
                            written: 1,
                            suppressed: 0,
                            first: event.clone(),
                        },
                    );
                }
                (Admit::Write, due)
            }
        }
    }

    /// The aggregate records of every window before `second`; those windows are forgotten.
    pub fn take_due(&mut self, second: u64) -> Vec<AuditEvent> {
        let mut due = Vec::new();
        self.windows.retain(|key, w| {
            if w.second >= second {
                return true;
            }
            due.extend(aggregate(key, w));
            false
        });
        due
    }
}

fn aggregate(key: &Key, w: &Window) -> Option<AuditEvent> {
    if w.suppressed == 0 {
        return None;
    }
    let mut event = w.first.clone();
    event.client_addr = key.client.clone();
    event.detail = format!(
        "aggregate: {} more refusals like the {} before (reason {}, command {}) from {} in the second starting at unix time {}; recorded as one",
        w.suppressed, w.written, key.reason, key.command, key.client, w.second
    );
    event.request_id = format!("aggregate-{}-{}", w.second, w.first.request_id);
    Some(event)
}

#[cfg(test)]
mod tests {
    use fencegate_core::OperationSummary;

    use super::*;

    fn event(reason: &str, addr: &str) -> AuditEvent {
        AuditEvent {
            store: "redis".into(),
            client_addr: addr.into(),
            client_identity: None,
            resource: None,
            token: None,
            token_signed: false,
            revision: None,
            fence: None,
            reason: reason.into(),
            detail: "no token".into(),
            operation: OperationSummary {
                command: "SET".into(),
                ..OperationSummary::default()
            },
            request_id: "redis-1-1".into(),
        }
    }

    #[test]
    fn one_record_plus_one_aggregate_per_client_and_second() {
        let mut a = Aggregator::default();
        for port in 4990..5000 {
            let addr = format!("10.0.0.1:{port}");
            assert_eq!(a.admit(&event("missing", &addr), 100).0, Admit::Write);
        }
        for port in 5000..5999 {
            let (admit, due) = a.admit(&event("missing", &format!("10.0.0.1:{port}")), 100);
            assert_eq!(admit, Admit::Counted);
            assert!(due.is_empty());
        }
        // Another client, and a stale refusal, are not counted into it.
        assert_eq!(
            a.admit(&event("missing", "10.0.0.2:1"), 100).0,
            Admit::Write
        );
        assert_eq!(a.admit(&event("stale", "10.0.0.1:1"), 100).0, Admit::Write);
        assert_eq!(a.admit(&event("stale", "10.0.0.1:1"), 100).0, Admit::Write);
        // The next second: the first is written again, and second 100's aggregate is due.
        let (admit, due) = a.admit(&event("missing", "10.0.0.1:7000"), 101);
        assert_eq!(admit, Admit::Write);
        assert_eq!(due.len(), 1, "{due:?}");
        assert!(
            due[0].detail.starts_with("aggregate: 999 more refusals"),
            "{}",
            due[0].detail
        );
        assert_eq!(due[0].client_addr, "10.0.0.1");
        assert_eq!(due[0].reason, "missing");
        assert!(
            a.take_due(102).is_empty(),
            "nothing was counted in second 101"
        );
    }
}
