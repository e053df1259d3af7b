//! A fenced write's audit context, kept as the request's own bytes until a refusal needs it.
//!
//! Most fenced writes are applied. Building the full [`Attempt`] for each one (the peer and the
//! request id formatted, the command name and keys copied into strings, the identity and token
//! cloned) was about a dozen allocations per fenced `SET`, a measurable share of the gateway's
//! CPU on that path (issue 18). The record is now built from the draft only when the store
//! refuses the write.

use std::net::SocketAddr;

use bytes::Bytes;
use fencegate_core::{Attempt, OperationSummary, Store, Token};

use crate::text::lossy;

/// What the audit record of one fenced write needs from its request.
#[derive(Debug)]
pub struct AttemptDraft {
    /// The command name as the client sent it.
    command: Bytes,
    /// The keys the command writes.
    keys: Vec<Bytes>,
    /// The number of arguments, the name included.
    args: usize,
    /// The request's size on the wire.
    bytes: usize,
    /// The session's count of requests when this one was read: the request id's second part.
    request: u64,
}

/// The session's side of a record: who sent the write, under which token.
pub struct Sender<'a> {
    /// The session's connection id.
    pub conn: u64,
    /// The client's address.
    pub peer: SocketAddr,
    /// The identity Redis accepted for the connection when the write's reply came back.
    pub identity: Option<String>,
    /// The token the write ran under.
    pub token: &'a Token,
}

impl AttemptDraft {
    /// The draft of the request `args` (name first) of `bytes` wire bytes writing `keys`, the
    /// session's `request`th.
    pub fn new(args: &[Bytes], keys: Vec<Bytes>, bytes: usize, request: u64) -> Self {
        Self {
            command: args.first().cloned().unwrap_or_default(),
            keys,
            args: args.len(),
            bytes,
            request,
        }
    }

    /// The keys the write declared.
    pub fn keys(&self) -> &[Bytes] {
        &self.keys
    }

    /// The audit record's attempt, as [`Attempt`] is built for every other Redis refusal.
    pub fn attempt(&self, sender: Sender<'_>) -> Attempt {
        Attempt {
            store: Store::Redis,
            client_addr: sender.peer.to_string(),
            client_identity: sender.identity,
            token: Some(sender.token.clone()),
            operation: OperationSummary {
                command: String::from_utf8_lossy(&self.command).to_ascii_uppercase(),
                objects: self.keys.iter().take(8).map(|k| lossy(k, 64)).collect(),
                args: self.args,
                bytes: self.bytes,
            },
            request_id: format!("redis-{}-{}", sender.conn, self.request),
        }
    }
}

#[cfg(test)]
mod tests {
    use fencegate_core::{Resource, Revision};

    use super::*;

    #[test]
    fn the_record_is_the_one_the_session_built_before() {
        let token = Token::new(
            Resource::new("billing").expect("resource"),
            Revision::new(7).expect("revision"),
        );
        let long_key = Bytes::from(vec![b'k'; 70]);
        let keys: Vec<Bytes> = std::iter::once(long_key)
            .chain((0..9).map(|i| Bytes::from(format!("key:{i}"))))
            .collect();
        let args = [Bytes::from_static(b"mset"), Bytes::from_static(b"x")];
        let draft = AttemptDraft::new(&args, keys, 123, 41);
        let attempt = draft.attempt(Sender {
            conn: 9,
            peer: "127.0.0.1:5000".parse().expect("addr"),
            identity: Some("alice".into()),
            token: &token,
        });
        assert_eq!(attempt.store, Store::Redis);
        assert_eq!(attempt.client_addr, "127.0.0.1:5000");
        assert_eq!(attempt.client_identity.as_deref(), Some("alice"));
        assert_eq!(attempt.token, Some(token));
        assert_eq!(attempt.operation.command, "MSET");
        assert_eq!(
            attempt.operation.objects.len(),
            8,
            "at most eight keys are named"
        );
        assert_eq!(attempt.operation.objects[0], format!("{}…", "k".repeat(64)));
        assert_eq!(attempt.operation.objects[1], "key:0");
        assert_eq!((attempt.operation.args, attempt.operation.bytes), (2, 123));
        assert_eq!(attempt.request_id, "redis-9-41");
    }
}
