//! The `upstream -> client` loop: each server message is matched against the queue
//! ([`super::pending::on_reply`]) and relayed, swallowed or replaced; the gateway's local
//! answers are sent when they reach the front of the queue; stale refusals are audited.

use std::sync::Arc;

use bytes::Bytes;
use fencegate_core::{Store, UpstreamFailure};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::pending::{on_reply, Expect, Outcome, Special};
use super::Shared;
use crate::error::PostgresError;
use crate::lazy_writer::LazyWriter;
use crate::message::{self, ErrorFields, Frame, FrameReader};
use crate::sqlstate;

/// upstream -> client. Generic over the two streams only so that a test can hold the client's
/// side still (the session passes [`crate::upstream::UpstreamRead`] and
/// [`crate::tls::ClientWrite`]).
pub(super) async fn relay_replies<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    shared: Arc<Shared>,
    mut upstream: FrameReader<R>,
    mut client: LazyWriter<W>,
) -> Result<(), PostgresError> {
    loop {
        // `biased`: an unbiased select draws a random number per poll to pick its first branch
        // (issue 18's profile: 7 per `pgbench -S -M prepared` transaction). The order does not
        // matter here: a local answer waits in the queue behind the replies before it either way,
        // and the flag stays set until `local_ready` is polled.
        // The messages are looked at and relayed where they were read, then dropped from the
        // buffer.
        let whole = tokio::select! {
            biased;
            frame = upstream.next() => frame.inspect_err(|_| {
                shared.gateway.sink.upstream_failed(Store::Postgres, UpstreamFailure::Error);
            })?.is_some(),
            () = shared.local_ready() => {
                if deliver_local(&shared, &mut client).await? {
                    return Ok(());
                }
                continue;
            }
        };
        if !whole {
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
        }
        // Every whole message already read is judged under one lock. Those relayed as they came
        // make one run, copied to the client and dropped from the buffer at once (issue 18's
        // profile: a poll of the loop, a lock, a copy and a drop per message); the run ends
        // before a message that needs more (a replacement, a swallowed guard reply, an audit)
        // or after one that a local answer must follow. That message is then handled alone. A
        // local answer queued meanwhile is flagged by `local_queued` and sent on the next turn.
        let mut run = Run::default();
        let mut special = None;
        let local_first;
        {
            let mut state = shared.lock();
            // A local answer at the front answers a request sent before the one the next reply
            // answers (the queue was empty when it was queued, and this loop was still writing
            // earlier replies): it goes first. Judged against it, the reply would be matched to
            // nothing, and every later one to the request before its own. Checked once per
            // batch: under this lock only `on_reply` changes the front, and a local answer it
            // uncovers ends the run (`local_next`).
            local_first = matches!(state.pending.front(), Some(Expect::Local { .. }));
            if !local_first {
                while let Some(frame) = upstream.frame_at(run.bytes) {
                    let outcome = on_reply(&mut state, &frame);
                    let local_next = matches!(state.pending.front(), Some(Expect::Local { .. }));
                    if !outcome.plain() || local_next {
                        special = Some((outcome, local_next));
                        break;
                    }
                    run.add(&frame, outcome.applied);
                }
            }
            shared.answered(&mut state, run.ready_for_query);
            if state.copy.changed {
                state.copy.changed = false;
                shared.copy_changed.notify_one();
            }
        }
        if run.bytes > 0 {
            let bytes = upstream.front(run.bytes);
            client
                .put(bytes)
                .await
                .map_err(PostgresError::io("writing to the client"))?;
            upstream.consume_bytes(run.bytes);
            for _ in 0..run.applied {
                shared.gateway.sink.applied(Store::Postgres);
            }
            if run.ready_for_query > 0 {
                shared.maybe_settled();
            }
        }
        if local_first {
            if deliver_local(&shared, &mut client).await? {
                return Ok(());
            }
            continue;
        }
        if let Some((outcome, local_next)) = special {
            if relay_special(&shared, &mut upstream, &mut client, outcome, local_next).await? {
                return Ok(());
            }
        }
        if !upstream.has_complete_frame() {
            client
                .flush()
                .await
                .map_err(PostgresError::io("writing to the client"))?;
        }
    }
}

/// Whole messages at the front of the read buffer, judged and to be relayed as they came.
#[derive(Default)]
struct Run {
    bytes: usize,
    /// How many of them report a write applied.
    applied: u32,
    /// How many of them are ReadyForQuery messages.
    ready_for_query: u32,
}

impl Run {
    fn add(&mut self, frame: &Frame<&[u8]>, applied: bool) {
        self.bytes += frame.raw.len();
        self.applied += u32::from(applied);
        self.ready_for_query += u32::from(frame.tag == b'Z');
    }
}

/// Relays (or swallows, or replaces) the message at the front of the buffer, already judged
/// by [`on_reply`] as `outcome`, auditing a stale refusal, and sends the local answers that
/// follow it (`local_next`). `true`: the session must end.
async fn relay_special<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    shared: &Shared,
    upstream: &mut FrameReader<R>,
    client: &mut LazyWriter<W>,
    mut outcome: Outcome,
    local_next: bool,
) -> Result<bool, PostgresError> {
    // Lent until it is relayed; nothing else reads or drops it meanwhile.
    let Some(frame) = upstream.frame_at(0) else {
        return Err(PostgresError::Protocol(
            "a judged message left the read buffer".to_owned(),
        ));
    };
    let tag = frame.tag;
    if outcome.applied {
        shared.gateway.sink.applied(Store::Postgres);
    }
    let Special {
        end,
        mut replace,
        stale,
    } = outcome.special.take().map(|s| *s).unwrap_or_default();
    if let Some(reason) = end {
        let message = format!("fencegate: {reason}");
        super::startup::fatal(client, sqlstate::PROTOCOL_VIOLATION, &message).await;
        let _ = client.shutdown().await;
        return Err(PostgresError::Protocol(reason));
    }
    if let Some((info, fence)) = stale {
        let fence = fence.unwrap_or(0);
        let policy = &shared.gateway.policy;
        let target = format!("resource {}", info.token.resource());
        let rejection = policy.stale(&info.token, fence, &target);
        // A fence above every revision the authority issued is not the client's lost lock:
        // the client gets the gateway's wording instead of the guard's.
        if policy.fence_above_issued(fence) {
            replace = Some(message::error_response(&ErrorFields {
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
        let bytes = replace.as_deref().unwrap_or(frame.raw);
        client
            .put(bytes)
            .await
            .map_err(PostgresError::io("writing to the client"))?;
        shared.answered(&mut shared.lock(), message::ready_for_query_count(bytes));
    }
    upstream.consume();
    if local_next && deliver_local(shared, client).await? {
        return Ok(true);
    }
    if tag == b'Z' {
        shared.maybe_settled();
    }
    Ok(false)
}

/// Sends the local answers at the front of the queue. `true`: the session must end.
async fn deliver_local<W: AsyncWrite + Unpin>(
    shared: &Shared,
    client: &mut LazyWriter<W>,
) -> Result<bool, PostgresError> {
    let mut out = Vec::new();
    let mut close = false;
    {
        let mut state = shared.lock();
        let mut ready = 0;
        while let Some(Expect::Local { .. }) = state.pending.front() {
            if let Some(Expect::Local { bytes, close: c }) = state.pending.pop_front() {
                ready += message::ready_for_query_count(&bytes);
                out.push(bytes);
                close |= c;
            }
        }
        shared.answered(&mut state, ready);
    }
    for bytes in &out {
        client
            .put(bytes)
            .await
            .map_err(PostgresError::io("writing to the client"))?;
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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::time::Duration;

    use bytes::BytesMut;
    use tokio::io::{AsyncReadExt, DuplexStream};

    use super::*;

    /// A simple Query's whole answer: a row of `row` bytes, its CommandComplete and a
    /// ReadyForQuery.
    fn answer(row: usize) -> Vec<u8> {
        let mut out = vec![b'D'];
        out.extend_from_slice(&(4 + 2 + 4 + row as u32).to_be_bytes());
        out.extend_from_slice(&1u16.to_be_bytes());
        out.extend_from_slice(&(row as u32).to_be_bytes());
        out.resize(out.len() + row, b'x');
        out.extend_from_slice(&message::command_complete("SELECT 1"));
        out.extend_from_slice(&message::ready_for_query(b'I'));
        out
    }

    /// Runs the reply loop with a client that reads nothing until told: the loop blocks on
    /// its first write of more than 64 bytes.
    fn start(shared: &Arc<Shared>) -> (DuplexStream, DuplexStream) {
        let (server, upstream) = tokio::io::duplex(64 * 1024);
        let (client_side, client) = tokio::io::duplex(64);
        tokio::spawn(relay_replies(
            shared.clone(),
            FrameReader::new(upstream, 1 << 20),
            LazyWriter::new(client_side),
        ));
        (server, client)
    }

    /// The race of 50437e6: a local answer queued while the queue is empty but the loop is
    /// still writing earlier replies to a slow client, and the next request's replies already
    /// read. The local answer must go first, and the replies after it must be matched to their
    /// own request (judged against the local answer, the first would be matched to nothing).
    #[tokio::test]
    async fn a_local_answer_queued_while_the_loop_writes_goes_before_later_replies() {
        let shared = Shared::for_test();
        let (mut server, mut client) = start(&shared);
        shared.lock().query_sent(VecDeque::new(), false);
        let first = answer(1000);
        server.write_all(&first).await.expect("the server's answer");
        // The loop judges the whole answer (the queue empties), then waits on the client: on
        // this one-thread runtime it runs only while this task yields.
        let mut turns = 0;
        while !shared.lock().pending.is_empty() {
            assert!(turns < 1000, "the reply loop never judged the first answer");
            turns += 1;
            tokio::task::yield_now().await;
        }
        // Meanwhile the request loop answers a `SET fencegate.token` locally and forwards the
        // next Query, whose answer arrives before the loop looks again.
        let mut local = BytesMut::from(&message::command_complete("SET")[..]);
        local.extend_from_slice(&message::ready_for_query(b'I'));
        {
            let mut state = shared.lock();
            state.pending.push_back(Expect::Local {
                bytes: local.clone().freeze(),
                close: false,
            });
            state.query_sent(VecDeque::new(), false);
        }
        shared.local_queued();
        let second = answer(10);
        server
            .write_all(&second)
            .await
            .expect("the server's answer");

        let mut expected = first;
        expected.extend_from_slice(&local);
        expected.extend_from_slice(&second);
        let mut seen = vec![0; expected.len()];
        tokio::time::timeout(Duration::from_secs(10), client.read_exact(&mut seen))
            .await
            .expect("every answer within 10 s")
            .expect("every answer before the session ended");
        assert!(seen == expected, "the answers came out of order");
        assert!(shared.lock().pending.is_empty());
    }
}
