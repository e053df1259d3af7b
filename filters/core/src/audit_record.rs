use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The `prev` of the first record of a log: 64 zeros.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// What a filter reports about one refused write. The audit writer adds the sequence number,
/// time, node and hash chain to make an [`AuditRecord`].
///
/// Nothing here holds a data value or a token's signature.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEvent {
    /// The store kind: `redis`, `s3`, `postgres`.
    pub store: String,
    /// The client's address as seen by the gateway.
    pub client_addr: String,
    /// The client's identity where the protocol tells it (a user name), else `None`.
    pub client_identity: Option<String>,
    /// The resource the presented token names, when it could be parsed.
    pub resource: Option<String>,
    /// The presented token without its signature (`fg1~<revision>~<resource>`), when it parsed.
    pub token: Option<String>,
    /// Whether the presented token carried a signature.
    pub token_signed: bool,
    /// The presented token's revision.
    pub revision: Option<u64>,
    /// The fence revision the store held, when the store reported it.
    pub fence: Option<u64>,
    /// The reason label (see [`crate::RejectReason::label`]).
    pub reason: String,
    /// A human-readable detail, safe to show (no data values, no signatures).
    pub detail: String,
    /// What was attempted, without data values.
    pub operation: OperationSummary,
    /// An id that ties the record to the gateway's logs for the same request.
    pub request_id: String,
}

/// A write's shape: command or method, the objects it names, its size. Never data values.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationSummary {
    /// The command or method (`SET`, `PUT`, `UPDATE`); `MULTI/EXEC` for a transaction.
    pub command: String,
    /// Keys, object names or tables written (at most a few, each shortened).
    pub objects: Vec<String>,
    /// How many arguments or statements the operation had.
    pub args: usize,
    /// The request's size in bytes.
    pub bytes: usize,
}

/// One line of the audit log: an [`AuditEvent`] with its place in the hash chain.
///
/// `hash` is the SHA-256 (lowercase hex) of the record serialized as JSON with `hash` set to the
/// empty string; `prev` is the previous record's `hash` ([`GENESIS_HASH`] for the first). Editing,
/// reordering or deleting a line breaks the chain at the next line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Position in the log, from 1, without gaps across rotated files.
    pub seq: u64,
    /// Wall-clock time of the refusal, RFC 3339 UTC with milliseconds.
    pub time: String,
    /// The same instant in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The node id that refused the write.
    pub node: String,
    /// What was refused.
    #[serde(flatten)]
    pub event: AuditEvent,
    /// The previous record's hash.
    pub prev: String,
    /// This record's hash.
    pub hash: String,
}

impl AuditRecord {
    /// A record for `event` at `time_ms`, chained after `prev`, with its hash computed.
    pub fn chain(seq: u64, time_ms: u64, node: &str, event: AuditEvent, prev: &str) -> Self {
        let mut record = Self {
            seq,
            time: rfc3339_millis(time_ms),
            time_ms,
            node: node.to_owned(),
            event,
            prev: prev.to_owned(),
            hash: String::new(),
        };
        record.hash = record.compute_hash();
        record
    }

    /// The hash this record should carry, from its other fields.
    pub fn compute_hash(&self) -> String {
        let mut unhashed = self.clone();
        unhashed.hash = String::new();
        let json = serde_json::to_string(&unhashed).expect("an audit record always serializes");
        let digest = Sha256::digest(json.as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Formats `ms` since the epoch as `YYYY-MM-DDThh:mm:ss.mmmZ`.
pub fn rfc3339_millis(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> AuditEvent {
        AuditEvent {
            store: "redis".into(),
            client_addr: "127.0.0.1:5000".into(),
            client_identity: None,
            resource: Some("job".into()),
            token: Some("fg1~7~job".into()),
            token_signed: false,
            revision: Some(7),
            fence: Some(12),
            reason: "stale".into(),
            detail: "token 7 is below fence 12".into(),
            operation: OperationSummary {
                command: "SET".into(),
                objects: vec!["k".into()],
                args: 3,
                bytes: 30,
            },
            request_id: "r1".into(),
        }
    }

    #[test]
    fn time_formats_as_rfc3339() {
        assert_eq!(rfc3339_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339_millis(1_790_000_000_123),
            "2026-09-21T14:13:20.123Z"
        );
        assert_eq!(rfc3339_millis(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn hash_covers_every_field_and_chains() {
        let a = AuditRecord::chain(1, 1000, "1", event(), GENESIS_HASH);
        assert_eq!(a.hash, a.compute_hash());
        assert_eq!(a.hash.len(), 64);
        let b = AuditRecord::chain(2, 1001, "1", event(), &a.hash);
        assert_ne!(a.hash, b.hash);
        let mut edited = a.clone();
        edited.event.fence = Some(11);
        assert_ne!(edited.compute_hash(), a.hash);
    }
}
