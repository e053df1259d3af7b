//! The `upstream -> client` loop: each server message is matched against the queue
//! ([`super::pending::on_reply`]) and relayed, swallowed or replaced; the gateway's local
//! answers are sent when they reach the front of the queue; stale refusals are audited.

use std::sync::Arc;

use bytes::Bytes;
use fencegate_core::{Store, UpstreamFailure};
use tokio::io::AsyncWriteExt;

use super::pending::{on_reply, Expect};
use super::Shared;
use crate::error::PostgresError;
use crate::lazy_writer::LazyWriter;
use crate::message::{self, ErrorFields, FrameReader};
use crate::sqlstate;
use crate::tls::ClientWrite;
use crate::upstream::UpstreamRead;

/// upstream -> client.
pub(super) async fn relay_replies(
    shared: Arc<Shared>,
    mut upstream: FrameReader<UpstreamRead>,
    mut client: LazyWriter<ClientWrite>,
) -> Result<(), PostgresError> {
    loop {
        // `biased`: an unbiased select draws a random number per poll to pick its first branch
        // (issue 18's profile: 7 per `pgbench -S -M prepared` transaction). The order does not
        // matter here: a local answer waits in the queue behind the replies before it either way,
        // and the flag stays set until `local_ready` is polled.
        // The message is looked at and relayed where it was read, then dropped from the buffer.
        let frame = tokio::select! {
            biased;
            frame = upstream.next() => frame.inspect_err(|_| {
                shared.gateway.sink.upstream_failed(Store::Postgres, UpstreamFailure::Error);
            })?,
            () = shared.local_ready() => {
                if deliver_local(&shared, &mut client).await? {
                    return Ok(());
                }
                continue;
            }
        };
        let Some(frame) = frame else {
            // The server is gone (or was told to go after a client protocol error): what the
            // gateway still owes the client (that error, say) is sent before closing.
            let owed: Vec<Bytes> = shared
                .lock()
                .pending
                .drain(..)
                .filter_map(|e| match e {
                    Expect::Local { bytes, .. } => Some(bytes),
                    _ => None,
                })
                .collect();
            for bytes in owed {
                let _ = client.write_all(&bytes).await;
            }
            let _ = client.flush().await;
            let _ = client.shutdown().await;
            return Ok(());
        };
        let tag = frame.tag;
        // One lock for the reply and for whether a local answer is next, so the common reply
        // does not take the lock again in `deliver_local`. A local answer queued after this is
        // flagged by `local_queued` and sent on the next turn of the loop.
        let mut outcome;
        let local_next;
        {
            let mut state = shared.lock();
            outcome = on_reply(&mut state, &frame);
            local_next = matches!(state.pending.front(), Some(Expect::Local { .. }));
        }
        if outcome.applied {
            shared.gateway.sink.applied(Store::Postgres);
        }
        if let Some((info, fence)) = outcome.stale.take() {
            let fence = fence.unwrap_or(0);
            let policy = &shared.gateway.policy;
            let target = format!("resource {}", info.token.resource());
            let rejection = policy.stale(&info.token, fence, &target);
            // A fence above every revision the authority issued is not the client's lost lock:
            // the client gets the gateway's wording instead of the guard's.
            if policy.fence_above_issued(fence) {
                outcome.replace = Some(message::error_response(&ErrorFields {
                    severity: "ERROR",
                    code: sqlstate::STALE.to_owned(),
                    message: format!("fencegate: {}", rejection.detail),
                    detail: Some(format!("fence={fence}")),
                }));
            }
            shared
                .audit(&rejection, Some(&info.token), info.summary)
                .await;
        }
        if outcome.forward {
            let bytes = outcome.replace.as_deref().unwrap_or(frame.raw);
            client
                .put(bytes)
                .await
                .map_err(PostgresError::io("writing to the client"))?;
            shared.answered(bytes);
        }
        upstream.consume();
        if local_next && deliver_local(&shared, &mut client).await? {
            return Ok(());
        }
        if tag == b'Z' {
            shared.maybe_settled();
        }
        if !upstream.has_complete_frame() {
            client
                .flush()
                .await
                .map_err(PostgresError::io("writing to the client"))?;
        }
    }
}

/// Sends the local answers at the front of the queue. `true`: the session must end.
async fn deliver_local(
    shared: &Shared,
    client: &mut LazyWriter<ClientWrite>,
) -> Result<bool, PostgresError> {
    let mut out = Vec::new();
    let mut close = false;
    {
        let mut state = shared.lock();
        while let Some(Expect::Local { .. }) = state.pending.front() {
            if let Some(Expect::Local { bytes, close: c }) = state.pending.pop_front() {
                out.push(bytes);
                close |= c;
            }
        }
    }
    for bytes in &out {
        client
            .put(bytes)
            .await
            .map_err(PostgresError::io("writing to the client"))?;
        shared.answered(bytes);
    }
    if !out.is_empty() {
        client
            .flush()
            .await
            .map_err(PostgresError::io("writing to the client"))?;
        // A local answer can be what leaves a draining session idle (a pipelined SET of the
        // token, a refusal answered without the server), as a ReadyForQuery from it can.
        shared.maybe_settled();
    }
    if close {
        let _ = client.shutdown().await;
    }
    Ok(close)
}
