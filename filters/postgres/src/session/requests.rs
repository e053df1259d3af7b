//! The `client -> upstream` loop: each client message is decided (through the pure
//! [`crate::rewrite`]) and forwarded, and what replies it will get is queued for the other loop.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use fencegate_core::{OperationSummary, PollOnWake, RejectReason, Rejection, Token};
use postgres_protocol::message::frontend;
use smallvec::{smallvec, SmallVec};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::copy::CopyFollow;
use super::pending::{Expect, GuardInfo, Role};
use super::Shared;
use crate::classify::{Classified, Kind, MAX_NAME_BYTES};
use crate::classify_cache::RecentShapes;
use crate::error::PostgresError;
use crate::lazy_writer::LazyWriter;
use crate::lexing;
use crate::message::{self, ErrorFields, Frame, FrameReader};
use crate::rewrite::{self, Context, Decision, Part, QueryPlan};
use crate::sqlstate;

/// The most messages that may wait for their answers in one session (checked at least every
/// [`CHECK_EVERY`] messages, each of which queues at most six: the bound may be passed by less
/// than a hundred).
const MAX_PENDING: usize = 262_144;

/// How many messages may be decided between two checks of [`MAX_PENDING`]: a check is a lock,
/// and every Query, Sync and FunctionCall takes it anyway (to note when it was read).
const CHECK_EVERY: u32 = 16;

/// What one client message sends upstream, in order.
enum Outgoing {
    /// The message as it came: nearly every message. A variant of its own, so that the common
    /// case drops nothing (a `SmallVec` ran its drop loop for every message: about 28
    /// instructions each, 112 per `pgbench -M prepared` transaction, issue 18).
    Message,
    /// Nothing (answered locally), a rewritten message, or the gateway's guard or refusal and
    /// then the message. Inline, not a `Vec`: no allocation per message.
    Parts(SmallVec<[Out; 2]>),
}

impl Outgoing {
    /// Nothing goes upstream: the gateway answers the message itself.
    fn nothing() -> Self {
        Outgoing::Parts(SmallVec::new())
    }
}

/// One piece of [`Outgoing`].
enum Out {
    /// The client's message as it came, relayed from the reader's buffer.
    Message,
    /// Bytes of the gateway's own (a rewritten message, a guard, a refusal).
    Bytes(Bytes),
}

/// client -> upstream. Generic over the two streams only so that a test can drive it through
/// in-memory pipes (the session passes [`crate::tls::ClientRead`] and
/// [`crate::upstream::UpstreamWrite`]).
pub(super) async fn relay_requests<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    shared: Arc<Shared>,
    mut client: FrameReader<R>,
    mut upstream: LazyWriter<W>,
) -> Result<(), PostgresError> {
    // One wait for the drain for the whole session, not a new one (and a new waiter in the
    // token's list) per message; polled only when it was woken, not once per message.
    let mut drained = PollOnWake::new(shared.drained());
    let mut recent = RecentShapes::default();
    let mut unchecked = 0;
    // An extended-protocol message was sent since the last Sync or Query: what it did (a
    // setting reset, say) may reach the client before any ReadyForQuery, with Flush, and the
    // server reports settings only before a ReadyForQuery.
    let mut unsynced = false;
    // A Parse, Bind, Describe, Execute or Close was sent since the last Sync: after an error in
    // one the server skips every message up to the next Sync, a simple Query or FunctionCall
    // too, which the queue of expected replies could not follow (it would match the Sync's
    // ReadyForQuery to the skipped Query, and every later reply to the wrong request).
    let mut segment_open = false;
    let mut follow = CopyFollow::default();
    loop {
        // A client that already sent its next message is served first; otherwise a draining
        // session ends as soon as it is idle.
        let pipelined = client.has_complete_frame();
        let read = tokio::select! {
            biased;
            () = &mut drained, if !pipelined => None,
            read = client.next() => Some(read),
        };
        let Some(read) = read else {
            say_goodbye(&shared);
            upstream
                .write_all(&TERMINATE)
                .await
                .map_err(PostgresError::io("writing upstream"))?;
            break;
        };
        match read {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(e) => {
                protocol_error(&shared, &e.to_string());
                let _ = upstream.shutdown().await;
                return Err(e);
            }
        }
        // Every whole message already read is decided about in order, where it was read (no
        // copy of its own). Those forwarded as they came make one run, copied upstream and
        // dropped from the buffer at once (issue 18's profile: a poll of the loop, a copy and a
        // drop per message); a message that sends anything else first sends the run before it.
        let mut run = 0;
        let mut terminate = false;
        // The requests read together were read at one time: one clock read for them all.
        let mut read_now = None;
        while let Some(mut frame) = client.frame_at(run) {
            let tag = frame.tag;
            // After a message that may have started a COPY FROM STDIN, whether the server
            // reads this one as part of it is the server's to say (see `ask_server`).
            let in_copy = if follow.must_ask(tag) {
                let in_copy =
                    ask_server(&shared, &mut client, run, &mut upstream, &mut follow).await?;
                run = 0;
                let Some(again) = client.frame_at(0) else {
                    break;
                };
                frame = again;
                in_copy
            } else {
                false
            };
            // Every message waiting for its answer holds an entry; a client that pipelines
            // without ever reading (the gateway answers some messages itself) must not grow it
            // forever.
            // Each of these gets one ReadyForQuery, which ends the request (a Sync in a COPY
            // gets none).
            let request = !in_copy && matches!(tag, b'Q' | b'S' | b'F');
            unchecked += 1;
            let admitted = if request || unchecked >= CHECK_EVERY {
                unchecked = 0;
                let read_at = request.then(|| *read_now.get_or_insert_with(Instant::now));
                admit(&shared, read_at)
            } else {
                true
            };
            let decided = if !admitted {
                let msg = format!(
                    "more than {MAX_PENDING} messages are waiting for their answers: read the replies"
                );
                Err(PostgresError::Protocol(msg))
            } else if in_copy {
                follow.in_copy(tag).map(|()| Outgoing::nothing())
            } else if segment_open && tag == b'F' {
                Err(inside_segment("a FunctionCall"))
            } else {
                terminate = frame.tag == b'X';
                // Only a Query, a Bind and a FunctionCall may wait (for an audit record), so
                // only they are futures; the rest are decided by a plain function (a future
                // built for every message cost about 130 instructions each, issue 18).
                let decided = match frame.tag {
                    b'Q' => {
                        let at = Position {
                            unsynced,
                            segment_open,
                        };
                        handle_query(&shared, &frame, &mut recent, at, &mut follow).await
                    }
                    b'B' => handle_bind(&shared, &frame).await,
                    b'F' => handle_function_call(&shared, &frame).await,
                    _ => decide_now(&shared, &frame, &mut recent, unsynced, &mut follow),
                };
                match frame.tag {
                    b'S' => (unsynced, segment_open) = (false, false),
                    b'Q' => unsynced = false,
                    b'P' | b'B' | b'D' | b'E' | b'C' => (unsynced, segment_open) = (true, true),
                    b'H' => unsynced = true,
                    b'd' | b'c' | b'f' => follow.relayed(frame.tag),
                    _ => {}
                }
                decided
            };
            let outgoing = match decided {
                Ok(outgoing) => outgoing,
                Err(e) => {
                    protocol_error(&shared, &e.to_string());
                    // What was decided before it still goes, as the client sent it.
                    let _ = upstream.put(client.front(run)).await;
                    let _ = upstream.shutdown().await;
                    return Err(e);
                }
            };
            match outgoing {
                Outgoing::Message => run += frame.raw.len(),
                Outgoing::Parts(parts) => {
                    let size = frame.raw.len();
                    upstream
                        .put(client.front(run))
                        .await
                        .map_err(PostgresError::io("writing upstream"))?;
                    for out in &parts {
                        let bytes = match out {
                            Out::Message => frame.raw,
                            Out::Bytes(bytes) => bytes,
                        };
                        upstream
                            .put(bytes)
                            .await
                            .map_err(PostgresError::io("writing upstream"))?;
                    }
                    client.consume_bytes(run + size);
                    run = 0;
                }
            }
            if terminate {
                break;
            }
        }
        upstream
            .put(client.front(run))
            .await
            .map_err(PostgresError::io("writing upstream"))?;
        client.consume_bytes(run);
        if terminate {
            break;
        }
        if !client.has_complete_frame() {
            upstream
                .flush()
                .await
                .map_err(PostgresError::io("writing upstream"))?;
        }
    }
    upstream
        .flush()
        .await
        .map_err(PostgresError::io("writing upstream"))?;
    let _ = upstream.shutdown().await;
    Ok(())
}

/// Sends what was decided (the first `run` bytes of the client's buffer) and a Flush of the
/// gateway's own, as the server holds an Execute's last reply (the COPY's CommandComplete, say)
/// until a Flush or Sync (a Flush gets no reply, and a COPY ignores it); then waits for the
/// server's word on the watched message ([`CopyFollow::ask`]). Out of the loop's body: rare,
/// and the loop is the hot path.
#[inline(never)]
async fn ask_server<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    shared: &Shared,
    client: &mut FrameReader<R>,
    run: usize,
    upstream: &mut LazyWriter<W>,
    follow: &mut CopyFollow,
) -> Result<bool, PostgresError> {
    upstream
        .put(client.front(run))
        .await
        .map_err(PostgresError::io("writing upstream"))?;
    client.consume_bytes(run);
    upstream
        .put(&FLUSH)
        .await
        .map_err(PostgresError::io("writing upstream"))?;
    upstream
        .flush()
        .await
        .map_err(PostgresError::io("writing upstream"))?;
    follow.ask(shared).await
}

/// Whether fewer than [`MAX_PENDING`] answers are waiting; if so, notes when a request (a
/// Query, Sync or FunctionCall) was read, under the same lock.
fn admit(shared: &Shared, read_at: Option<Instant>) -> bool {
    let mut state = shared.lock();
    if state.pending.len() >= MAX_PENDING {
        return false;
    }
    state.read_at.extend(read_at);
    true
}

/// A frontend Flush message: the server sends what it holds.
const FLUSH: [u8; 5] = [b'H', 0, 0, 0, 4];

/// A frontend Terminate message: the server ends the backend cleanly.
const TERMINATE: [u8; 5] = [b'X', 0, 0, 0, 4];

/// Queues what a server says when an administrator shuts it down (FATAL 57P01), and the end of
/// the session: clients and poolers know to reconnect elsewhere.
fn say_goodbye(shared: &Shared) {
    tracing::debug!(conn = shared.conn, "draining: closing the idle session");
    fatal(
        shared,
        sqlstate::ADMIN_SHUTDOWN,
        "fencegate: the gateway is shutting down; reconnect".to_owned(),
    );
}

/// Queues a FATAL 08P01 for the client and the end of the session.
fn protocol_error(shared: &Shared, message: &str) {
    fatal(
        shared,
        sqlstate::PROTOCOL_VIOLATION,
        format!("fencegate: {message}"),
    );
}

/// Queues a FATAL error with `code` for the client, then the end of the session.
fn fatal(shared: &Shared, code: &str, message: String) {
    let bytes = message::error_response(&ErrorFields {
        severity: "FATAL",
        code: code.to_owned(),
        message,
        detail: None,
    });
    shared
        .lock()
        .pending
        .push_back(Expect::Local { bytes, close: true });
    shared.local_queued();
}

/// Decides about one client message that never waits (all but a Query, a Bind and a
/// FunctionCall, which the loop hands to their own functions); returns the bytes to send
/// upstream, in order.
fn decide_now(
    shared: &Shared,
    frame: &Frame<&[u8]>,
    recent: &mut RecentShapes,
    unsynced: bool,
    follow: &mut CopyFollow,
) -> Result<Outgoing, PostgresError> {
    let bad = |e: message::FrameError| PostgresError::Protocol(e.to_string());
    match frame.tag {
        b'P' => {
            let (name, sql) = message::parse_fields(frame).map_err(bad)?;
            name_fits(shared, &name)?;
            let classified = classify_now(shared, recent, &sql, unsynced);
            // `SET fencegate.token = '...'` is prepared without its value: the server answers
            // the same messages, and the token stays in the gateway (applied at Bind).
            let outgoing = match classified.statements.as_slice() {
                [only] if matches!(only.kind, Kind::SetToken(Some(_))) => {
                    let mut buf = BytesMut::new();
                    frontend::parse(
                        &name,
                        rewrite::SET_TOKEN_PLACEHOLDER,
                        std::iter::empty(),
                        &mut buf,
                    )
                    .map_err(|e| PostgresError::Protocol(format!("statement name: {e}")))?;
                    Outgoing::Parts(smallvec![Out::Bytes(buf.freeze())])
                }
                _ => Outgoing::Message,
            };
            let mut state = shared.lock();
            let change = state.change_sent(name, Some(classified));
            state
                .pending
                .push_back(Expect::Parse(Role::Client, Some(change)));
            Ok(outgoing)
        }
        b'D' => {
            shared.lock().pending.push_back(Expect::Describe);
            Ok(Outgoing::Message)
        }
        b'E' => {
            let mut state = shared.lock();
            // The portal's name is read only once some portal may copy in.
            let watched = !state.copy_portals.none()
                && state
                    .copy_portals
                    .may_copy(message::execute_portal(frame).map_err(bad)?);
            if state.execute_sent(watched) {
                follow.watching(true);
            }
            Ok(Outgoing::Message)
        }
        b'C' => {
            let (kind, name) = message::target_fields(frame).map_err(bad)?;
            if kind == b'S' {
                name_fits(shared, &name)?;
            }
            let mut state = shared.lock();
            let change = (kind == b'S').then(|| state.change_sent(name, None));
            state.pending.push_back(Expect::Close(Role::Client, change));
            Ok(Outgoing::Message)
        }
        b'S' => {
            shared.lock().sync_sent();
            Ok(Outgoing::Message)
        }
        b'H' | b'd' | b'c' | b'f' | b'X' => Ok(Outgoing::Message),
        other => Err(PostgresError::Protocol(format!(
            "unexpected message type {:?}",
            char::from(other)
        ))),
    }
}

/// A fast-path function call: relayed on an unprotected database, refused on a protected one.
async fn handle_function_call(
    shared: &Shared,
    frame: &Frame<&[u8]>,
) -> Result<Outgoing, PostgresError> {
    // Fast-path function calls name no statement the parser could prove read-only.
    if !shared.protected {
        shared.lock().query_sent(VecDeque::new(), false);
        return Ok(Outgoing::Message);
    }
    let rejection = Rejection::new(
        RejectReason::Unsupported,
        "fast-path function calls cannot be fenced",
    );
    let summary = OperationSummary {
        command: "FUNCTION CALL".into(),
        objects: Vec::new(),
        args: 1,
        bytes: frame.raw.len(),
    };
    shared.audit(&rejection, None, summary).await;
    Ok(refuse_simple(shared, &rejection))
}

/// A prepared statement's name the gateway can follow: the server tells names apart only by
/// their first [`MAX_NAME_BYTES`] bytes, so two longer names the gateway keeps apart could be one
/// statement to the server (a read parsed under one, a write under the other).
fn name_fits(shared: &Shared, name: &str) -> Result<(), PostgresError> {
    if shared.protected && name.len() > MAX_NAME_BYTES {
        return Err(PostgresError::Protocol(format!(
            "a prepared statement's name is {} bytes; the server compares only the first {MAX_NAME_BYTES}, so names this long are refused on a protected database: use shorter names",
            name.len()
        )));
    }
    Ok(())
}

/// Classifies `sql`, unless the session's settings make the server lex it differently from the
/// gateway's parser: then, on a protected database, it is one statement that is refused.
/// `unsynced`: an extended-protocol message was sent since the last Sync or Query.
fn classify_now(
    shared: &Shared,
    recent: &mut RecentShapes,
    sql: &str,
    unsynced: bool,
) -> Classified {
    let hazard = if shared.protected {
        let state = shared.lock();
        state
            .lexing
            .hazard_now(state.pending.is_empty() && !unsynced)
    } else {
        None
    };
    match hazard {
        Some(why) if !lexing::is_way_back(sql) => Classified {
            statements: smallvec![crate::classify::Statement {
                start: 0,
                end: sql.len(),
                kind: Kind::Unfenceable(why),
                command: "".into(),
                targets: Vec::new(),
                comment_token: None,
                may_end_transaction: true,
                forgets: None,
                copies_in: true,
                targets_exact: false,
            }],
            parse_error: None,
        },
        _ => shared.gateway.classified.classify_recent(sql, recent),
    }
}

fn context<'a>(shared: &'a Shared, session_token: Option<&'a str>) -> Context<'a> {
    Context {
        protected: shared.protected,
        unprotected_schemas: &shared.gateway.config.unprotected_schemas,
        route: shared.gateway.route.as_ref(),
        policy: &shared.gateway.policy,
        session_token,
    }
}

fn summary_of(classified: &Classified, bytes: usize) -> OperationSummary {
    let first_write = classified
        .statements
        .iter()
        .find(|s| s.kind == Kind::Write)
        .or(classified.statements.first());
    OperationSummary {
        command: first_write.map_or_else(String::new, |s| s.command.to_string()),
        objects: first_write
            .map(|s| s.targets.iter().take(4).map(|t| shorten(t)).collect())
            .unwrap_or_default(),
        args: classified.statements.len(),
        bytes,
    }
}

fn shorten(name: &str) -> String {
    name.chars().take(64).collect()
}

/// Where in the session's stream a simple Query comes.
#[derive(Clone, Copy)]
struct Position {
    /// An extended-protocol message was sent since the last Sync or Query.
    unsynced: bool,
    /// A Parse, Bind, Describe, Execute or Close was sent since the last Sync.
    segment_open: bool,
}

/// The error that ends a session whose client sent `what` inside a Sync segment.
fn inside_segment(what: &str) -> PostgresError {
    PostgresError::Protocol(format!(
        "{what} was sent after extended-protocol messages with no Sync between them: after an error there the server skips it, which the gateway cannot follow; send Sync first"
    ))
}

async fn handle_query(
    shared: &Shared,
    frame: &Frame<&[u8]>,
    recent: &mut RecentShapes,
    at: Position,
    follow: &mut CopyFollow,
) -> Result<Outgoing, PostgresError> {
    let sql = message::query_text(frame).map_err(|e| PostgresError::Protocol(e.to_string()))?;
    let classified = classify_now(shared, recent, sql, at.unsynced);
    // Inside a Sync segment only transaction control other than BEGIN may come (JDBC's
    // autosave sends `SAVEPOINT` there): whether the server ran or skipped it, it only makes the
    // gateway guard the next write again. The server's skipping is followed for it alone.
    let skippable = at.segment_open;
    if skippable
        && (classified.statements.is_empty()
            || !classified
                .statements
                .iter()
                .all(|s| s.kind == Kind::TransactionControl && !begins(s)))
    {
        return Err(inside_segment(
            "a simple Query other than transaction control (BEGIN aside)",
        ));
    }
    // Only refusals and guards quote the summary: a relayed read does not build it.
    let summary = || summary_of(&classified, frame.raw.len());
    let plan = {
        let state = shared.lock();
        let ctx = context(shared, state.session_token.as_deref());
        rewrite::plan_query(sql, &classified, &ctx, state.covered())
    };
    if let QueryPlan::Refuse(rejection) = &plan {
        let session_token = shared.lock().session_token.clone();
        let token = classified
            .statements
            .iter()
            .find_map(|s| s.comment_token.clone())
            .or(session_token)
            .and_then(|t| Token::parse(&t).ok());
        shared.audit(rejection, token.as_ref(), summary()).await;
        return Ok(refuse_simple(shared, rejection));
    }
    let last_control = classified
        .statements
        .iter()
        .rfind(|s| s.kind == Kind::TransactionControl);
    let mut state = shared.lock();
    for forget in classified.forgets() {
        state.forget(forget);
    }
    if let Some(control) = last_control {
        state.control_sent(begins(control));
    }
    if classified
        .statements
        .iter()
        .any(|s| s.kind == Kind::SessionReset)
        && !matches!(plan, QueryPlan::Refuse(_))
    {
        state.session_token = state.startup_token.clone();
        state.pass_ended();
    }
    let ends = |state: &mut super::pending::State| {
        if classified.statements.iter().any(|s| s.may_end_transaction) {
            state.pass_ended();
        }
    };
    let watched = classified.statements.iter().any(|s| s.copies_in);
    if watched && matches!(plan, QueryPlan::Forward | QueryPlan::Rewrite { .. }) {
        follow.watching(false);
    }
    match plan {
        QueryPlan::Forward if skippable => {
            ends(&mut state);
            state.skippable_query_sent();
            Ok(Outgoing::Message)
        }
        _ if skippable => Err(inside_segment(
            "a simple Query that is not forwarded as it came",
        )),
        QueryPlan::Forward => {
            ends(&mut state);
            state.query_sent(VecDeque::new(), watched);
            Ok(Outgoing::Message)
        }
        QueryPlan::Rewrite { sql: out, parts } => {
            let summary = summary();
            let mut roles = VecDeque::with_capacity(parts.len());
            let mut last_guard = None;
            for (i, part) in parts.iter().enumerate() {
                roles.push_back(match part {
                    Part::Client => Role::Client,
                    Part::Guard(token) => {
                        last_guard = Some((i, token));
                        Role::Guard(Box::new(GuardInfo {
                            token: token.clone(),
                            summary: summary.clone(),
                            decides: true,
                        }))
                    }
                });
            }
            // The last guard covers what follows it in this transaction, unless a
            // transaction-control statement after it ends that (then it was counted above).
            if let Some((i, token)) = last_guard {
                let next = statement_index(&parts, i);
                if !classified.statements[next..]
                    .iter()
                    .any(|s| s.kind == Kind::TransactionControl)
                {
                    state.guard_sent(token.clone());
                }
            }
            ends(&mut state);
            state.query_sent(roles, watched);
            let mut buf = BytesMut::new();
            frontend::query(&out, &mut buf)
                .map_err(|e| PostgresError::Protocol(format!("query text: {e}")))?;
            Ok(Outgoing::Parts(smallvec![Out::Bytes(buf.freeze())]))
        }
        QueryPlan::SetToken(value) => {
            let tag = if value.is_some() { "SET" } else { "RESET" };
            state.session_token = value.or_else(|| state.startup_token.clone());
            state.pass_ended();
            let mut bytes = BytesMut::from(&message::command_complete(tag)[..]);
            bytes.extend_from_slice(&message::ready_for_query(state.status));
            state.pending.push_back(Expect::Local {
                bytes: bytes.freeze(),
                close: false,
            });
            drop(state);
            shared.local_queued();
            Ok(Outgoing::nothing())
        }
        // Audited and answered above; refusing again here keeps this arm fail-closed.
        QueryPlan::Refuse(rejection) => {
            drop(state);
            Ok(refuse_simple(shared, &rejection))
        }
    }
}

/// The index among the message's statements of the statement right after `parts[i]`.
fn statement_index(parts: &[Part], i: usize) -> usize {
    parts[..i]
        .iter()
        .filter(|p| matches!(p, Part::Client))
        .count()
}

/// A simple-protocol refusal: answered locally when no transaction is open and nothing is in
/// flight (nothing reaches the server), else raised through the server so that the open
/// transaction is aborted as by any error.
fn refuse_simple(shared: &Shared, rejection: &Rejection) -> Outgoing {
    let mut state = shared.lock();
    if state.status == b'I' && state.pending.is_empty() {
        let mut bytes = BytesMut::from(
            &message::error_response(&ErrorFields {
                severity: "ERROR",
                code: sqlstate::for_reason(&rejection.reason).to_owned(),
                message: rewrite::refusal_message(rejection),
                detail: None,
            })[..],
        );
        bytes.extend_from_slice(&message::ready_for_query(b'I'));
        state.pending.push_back(Expect::Local {
            bytes: bytes.freeze(),
            close: false,
        });
        drop(state);
        shared.local_queued();
        return Outgoing::nothing();
    }
    state.query_sent(VecDeque::from([Role::Refusal]), false);
    Outgoing::Parts(smallvec![Out::Bytes(rewrite::refusal_query(rejection))])
}

async fn handle_bind(shared: &Shared, frame: &Frame<&[u8]>) -> Result<Outgoing, PostgresError> {
    let (portal, statement) =
        message::bind_fields(frame).map_err(|e| PostgresError::Protocol(e.to_string()))?;
    name_fits(shared, statement)?;
    let (decision, classified, token_hint) = {
        let mut state = shared.lock();
        let classified = state.bound(statement);
        state.copy_portals.bound(portal, &classified);
        let mut decision = Decision::Pass;
        for forget in classified.forgets() {
            state.forget_bound(forget);
        }
        for s in &classified.statements {
            match &s.kind {
                Kind::SetToken(value) => {
                    state.session_token = value.clone().or_else(|| state.startup_token.clone());
                    state.pass_ended();
                }
                Kind::TransactionControl => state.control_sent(begins(s)),
                Kind::SessionReset => {
                    state.session_token = state.startup_token.clone();
                    state.pass_ended();
                }
                _ => {}
            }
            let ctx = context(shared, state.session_token.as_deref());
            let d = rewrite::decide(s, &ctx);
            if !matches!(d, Decision::Pass) {
                decision = d;
                break;
            }
        }
        // One guard per transaction: a write in the transaction a guard for the same token was
        // already sent in (pipelined, possibly unanswered) is covered by its pass.
        let decision = match decision {
            Decision::Guard(token) if state.covered() == Some(&token) => Decision::Pass,
            Decision::Guard(token) => {
                state.guard_sent(token.clone());
                Decision::Guard(token)
            }
            other => other,
        };
        if classified.statements.iter().any(|s| s.may_end_transaction) {
            state.pass_ended();
        }
        if matches!(decision, Decision::Pass) {
            state.pending.push_back(Expect::Bind(Role::Client));
        }
        // Only a refusal quotes the token presented (as the session had it when it was sent).
        let hint = matches!(decision, Decision::Refuse(_)).then(|| {
            classified
                .statements
                .iter()
                .find_map(|s| s.comment_token.clone())
                .or_else(|| state.session_token.clone())
        });
        (decision, classified, hint.flatten())
    };
    // Only guards and refusals quote the summary: a relayed Bind does not build it.
    let summary = || summary_of(&classified, frame.raw.len());
    match decision {
        // Queued under the decision's lock.
        Decision::Pass => Ok(Outgoing::Message),
        Decision::Guard(token) => {
            let info = GuardInfo {
                token: token.clone(),
                summary: summary(),
                decides: false,
            };
            let swallow = || Role::Guard(Box::new(info.clone()));
            let decides = Role::Guard(Box::new(GuardInfo {
                decides: true,
                ..info.clone()
            }));
            shared.lock().pending.extend([
                Expect::Close(swallow(), None),
                Expect::Close(swallow(), None),
                Expect::Parse(swallow(), None),
                Expect::Bind(swallow()),
                Expect::Execute(decides, false),
                Expect::Bind(Role::Client),
            ]);
            Ok(Outgoing::Parts(smallvec![
                Out::Bytes(rewrite::guard_messages(&token)),
                Out::Message
            ]))
        }
        Decision::Refuse(rejection) => {
            let token = token_hint.and_then(|t| Token::parse(&t).ok());
            shared.audit(&rejection, token.as_ref(), summary()).await;
            let mut state = shared.lock();
            state.pending.extend([
                Expect::Close(Role::Refusal, None),
                Expect::Close(Role::Refusal, None),
                Expect::Parse(Role::Refusal, None),
                Expect::Bind(Role::Refusal),
                Expect::Execute(Role::Refusal, false),
                Expect::Bind(Role::Client),
            ]);
            // The server raises the refusal and then skips everything up to the client's Sync,
            // the client's Bind included.
            Ok(Outgoing::Parts(smallvec![
                Out::Bytes(rewrite::refusal_messages(&rejection)),
                Out::Message
            ]))
        }
    }
}

/// Whether a transaction-control statement opens a transaction block.
fn begins(statement: &crate::classify::Statement) -> bool {
    matches!(&*statement.command, "BEGIN" | "START")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncReadExt;

    use super::*;

    /// A client that pipelines without ever reading its answers is cut off once
    /// [`MAX_PENDING`] of them wait: the session ends with a FATAL 08P01 saying so, and the
    /// queue holds no more than the bound and that FATAL.
    #[tokio::test]
    async fn a_client_that_never_reads_is_cut_off_at_max_pending() {
        let shared = Shared::for_test();
        let (mut client, client_side) = tokio::io::duplex(1 << 20);
        let (upstream_side, mut server) = tokio::io::duplex(1 << 20);
        // The server reads everything and answers nothing (no reply loop pops the queue).
        tokio::spawn(async move {
            let mut sink = vec![0; 1 << 16];
            while server.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        let relay = tokio::spawn(relay_requests(
            shared.clone(),
            FrameReader::new(client_side, 1 << 20),
            LazyWriter::new(upstream_side),
        ));
        let syncs: Vec<u8> = [b'S', 0, 0, 0, 4].repeat(MAX_PENDING + 1_000);
        // Cut off before the last of them: the write then fails.
        let _ = client.write_all(&syncs).await;
        let ended = tokio::time::timeout(Duration::from_secs(60), relay)
            .await
            .expect("the session ends within 60 s")
            .expect("the request loop");
        let error = ended.expect_err("the session is cut off").to_string();
        assert!(error.contains("read the replies"), "{error}");
        let state = shared.lock();
        assert_eq!(state.pending.len(), MAX_PENDING + 1);
        let Some(Expect::Local { bytes, close: true }) = state.pending.back() else {
            panic!("the last entry is not the closing FATAL");
        };
        assert!(String::from_utf8_lossy(bytes).contains("08P01"));
    }
}
