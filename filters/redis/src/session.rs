//! One client connection relayed to one upstream connection: the only I/O of the filter.
//!
//! Two futures of one task share the work. The reader parses client requests, decides each
//! one (relay, rewrite into the fence script call, answer locally, refuse), writes the batch
//! upstream with one write, and queues a *slot* per request, in order, for the writer. Fenced
//! writes under one token that come back to back in one read share one slot and one batch
//! fence call, whose reply the writer splits back into one reply per write. The writer takes
//! slots in order: a local reply is written at once, an upstream slot takes the next upstream
//! reply. So pipelined requests keep their order even when some are answered by the gateway.
//! Client output is flushed once per batch: whenever the writer would wait.
//!
//! A session starts on an upstream connection it shares with other sessions
//! ([`crate::shared_upstream`]) when the gateway has some, and moves to a connection of its own,
//! for good, at its first request that could change a connection's state ([`crate::sharing`]):
//! the reader stops before that request, waits until the writer has every reply from the shared
//! connection, then sends it and everything after on its own connection. So Redis runs the
//! session's requests in order across the move, and no other session ever sees its state.
//!
//! Buffers exist only while there is something in them: a buffer that is empty when its side
//! would wait is given back and taken again (at full capacity) when bytes arrive, so an idle
//! connection holds none of them.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use fencegate_core::{
    Attempt, AuditEvent, IdleTimer, OpenConnection, OperationSummary, PollOnWake, RejectReason,
    Rejection, Store, Tarpit, Token, UpstreamFailure,
};
use tokio::io::{self, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Mutex};
use tokio_util::sync::CancellationToken;

use crate::buffer_keep::BufferKeep;
use crate::classify::{classify_command, Class, Keys};
use crate::command_table::CommandInfo;
use crate::decide::{self, decide, Decision, Inputs};
use crate::error::{FrameError, RedisError};
use crate::fence_batch::{self, Run, Split};
use crate::frame::{self, Args, Frame, Request};
use crate::gateway::Gateway;
use crate::hand_off::{hand_off, Consumer, Producer};
use crate::inbox::{self, Inbox, Outbox, Reply};
use crate::request_parser::RequestParser;
use crate::rewrite::{BatchedWrite, FenceCall, FenceToken, ScriptMode};
use crate::scope;
use crate::shared_upstream::SharedConnection;
use crate::sharing;
use crate::stream::{self, Connection, ReadHalf, WriteHalf};
use crate::text::lossy;
use crate::upstream::{self, UpstreamInfo};

const SLOT_QUEUE: usize = 4096;
/// Command names up to this long are upper-cased on the stack (every Redis command's is).
const NAME_ON_STACK: usize = 32;
/// The capacity of each read and write buffer while it is in use.
const BUFFER: usize = 16 * 1024;

/// The most slots a batch's emptied list keeps for the next batch (a larger one, from a long
/// pipeline, is freed).
const SLOTS_KEPT: usize = 64;

/// Runs one client session to completion; errors are logged, never returned. Once `shutdown`
/// is cancelled the session ends at its next idle point: no transaction open, no partial
/// request, the replies in flight delivered.
pub(crate) async fn run(
    gateway: Arc<Gateway>,
    socket: TcpStream,
    peer: SocketAddr,
    shutdown: CancellationToken,
) {
    let id = gateway.next_connection_id();
    let _open = OpenConnection::new(gateway.sink.clone(), Store::Redis);
    socket.set_nodelay(true).ok();
    let mut client = match &gateway.tls {
        None => Connection::Plain(socket),
        Some(acceptor) => {
            // The handshake is a partial request too: bounded by the same timeout.
            let limit = Duration::from_secs(gateway.config.partial_request_timeout_seconds);
            match tokio::time::timeout(limit, acceptor.accept(socket)).await {
                Ok(Ok(tls)) => Connection::Tls(Box::new(tls)),
                Ok(Err(e)) => {
                    tracing::debug!(conn = id, %peer, error = %e, "client TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(conn = id, %peer, "client TLS handshake timed out");
                    return;
                }
            }
        }
    };
    // Boxed: the connect state is dead once the session runs, so it stays out of the task.
    let ready = Box::pin(async {
        let info = gateway.info().await?;
        let link = if gateway.shares() {
            Link::Shared(gateway.shared_connection().await?)
        } else {
            Link::Own(upstream::connect(&gateway.upstream, &gateway.config).await?)
        };
        Ok::<_, RedisError>((info, link))
    });
    let (info, link) = match ready.await {
        Ok(pair) => pair,
        Err(e) => {
            tracing::warn!(conn = id, %peer, error = %e, "upstream unavailable; closing client");
            gateway
                .sink
                .upstream_failed(Store::Redis, UpstreamFailure::Connect);
            let reply = Frame::error(&format!("ERR fencegate: upstream unavailable: {e}"));
            let _ = client.write_all(&reply.to_bytes()).await;
            return;
        }
    };
    tracing::debug!(conn = id, %peer, "session started");
    let (client_r, client_w) = stream::split(client);
    let sharing = matches!(link, Link::Shared(_));
    let (sink, source) = match link {
        Link::Own(connection) => {
            let (read_half, write_half) = stream::split(connection);
            (Sink::Own(write_half), Source::Own(read_half))
        }
        Link::Shared(connection) => {
            let (outbox, inbox) = inbox::inbox();
            (Sink::Shared { connection, outbox }, Source::Shared(inbox))
        }
    };
    let up_w = Arc::new(Mutex::new(UpstreamWriter { sink, sent: 0 }));
    let resp3 = Arc::new(AtomicBool::new(false));
    let identity = Arc::new(std::sync::Mutex::new(None));
    let (tx, rx) = hand_off(SLOT_QUEUE);
    let read_at = ReadTimes::default();
    let batching = matches!(info.mode, ScriptMode::Function | ScriptMode::Module);
    let hellos_pending = Arc::new(AtomicUsize::new(0));
    let completed = Arc::new(AtomicU64::new(0));
    let reader = Reader {
        gateway: gateway.clone(),
        info,
        id,
        peer,
        client: client_r,
        buf: BytesMut::new(),
        upstream: up_w.clone(),
        slots: tx,
        resp3: resp3.clone(),
        token: None,
        multi: None,
        identity: identity.clone(),
        requests: 0,
        parser: RequestParser::default(),
        keep: BufferKeep::new(),
        room: BytesMut::new(),
        slot_room: Vec::new(),
        held: 0,
        tarpit: Tarpit::new(
            Duration::from_millis(gateway.config.tarpit_initial_ms),
            Duration::from_millis(gateway.config.tarpit_max_ms),
        ),
        wait: None,
        read_at: read_at.clone(),
        config: gateway.live_versioned(),
        shutdown,
        batching,
        hellos_pending: hellos_pending.clone(),
        sharing,
        completed: completed.clone(),
    };
    let sink = gateway.sink.clone();
    let writer = Writer {
        gateway,
        id,
        peer,
        client: client_w,
        out: BytesMut::new(),
        keep: BufferKeep::new(),
        upstream: source,
        ubuf: BytesMut::new(),
        ukeep: BufferKeep::new(),
        upstream_w: up_w,
        stash: VecDeque::new(),
        completed: completed.clone(),
        resp3,
        identity,
        subscriptions: Default::default(),
        speaks_resp3: false,
        hellos_pending,
        slots: rx,
        read_at,
    };
    // Both directions are futures of this one task, not tasks of their own: a connection's
    // work stays on one thread (issue 18's profile: the hand-offs between two tasks cost a
    // context switch per request). The slots go through a queue that wakes no one
    // ([`hand_off`]): `biased`, the reader is polled first and the writer second in every
    // poll, so the writer sees in the same poll whatever the reader queued (a waker would
    // wake this running task, which tokio turns into a wake-up of a parked worker thread per
    // request). When the writer ends first, the reader is dropped with it. The reader is
    // polled only when one of its own wakers fired (a request came, a timer, a wait of its
    // own ended): a wake-up for the writer, one per request, polled its socket, its timers and
    // its drain wait for nothing (issue 18). The writer is polled in every poll, as the slot
    // queue's contract asks.
    let result = {
        let reader = PollOnWake::new(reader.run());
        let writer = writer.run();
        tokio::pin!(reader, writer);
        tokio::select! {
            biased;
            _ = &mut reader => writer.await,
            w = &mut writer => w,
        }
    };
    if let Err(e) = result {
        if upstream_fault(&e) {
            sink.upstream_failed(Store::Redis, UpstreamFailure::Error);
        }
        tracing::debug!(conn = id, %peer, error = %e, "session ended with an error");
    }
    tracing::debug!(conn = id, %peer, "session ended");
}

/// The upstream connection a session starts on.
enum Link {
    Own(Connection),
    Shared(Arc<SharedConnection>),
}

/// Where the session's requests go.
enum Sink {
    Own(WriteHalf),
    Shared {
        connection: Arc<SharedConnection>,
        /// Where the shared connection sends this session's replies.
        outbox: Outbox,
    },
}

/// Where the session's replies come from.
enum Source {
    Own(ReadHalf),
    Shared(Inbox),
}

struct UpstreamWriter {
    sink: Sink,
    /// Requests written so far (for the writer's reload-and-retry bookkeeping).
    sent: u64,
}

impl UpstreamWriter {
    /// Sends `requests` requests encoded in `bytes`.
    async fn send(&mut self, bytes: &[u8], requests: u64) -> Result<(), RedisError> {
        match &mut self.sink {
            Sink::Own(half) => half
                .write_all(bytes)
                .await
                .map_err(RedisError::io("writing to upstream"))?,
            Sink::Shared { connection, outbox } => {
                connection.room().await;
                connection.submit(outbox, bytes, requests)?
            }
        }
        self.sent += requests;
        Ok(())
    }
}

/// A reply from the shared connection, or the error that ends the session.
fn shared_reply(reply: Option<Reply>) -> Result<(Frame, Bytes), RedisError> {
    match reply {
        Some(Ok(reply)) => Ok(reply),
        Some(Err(why)) => Err(RedisError::Upstream(why.to_string())),
        None => Err(RedisError::Upstream("the shared connection is gone".into())),
    }
}

/// What the writer does for one request, in request order.
enum Slot {
    /// Answer with this frame.
    Local(Frame),
    /// Log this refusal (and wait until it is durable), then answer with the frame.
    Refuse(Frame, Box<AuditEvent>),
    /// Take the next upstream reply and handle it as said.
    Upstream(Expect),
    /// Flush and close the client connection.
    Close,
    /// Every reply from the shared connection is in: read replies from this connection of the
    /// session's own from now on, and say so.
    Pin(ReadHalf, oneshot::Sender<()>),
}

impl Slot {
    /// How many client requests this slot answers.
    fn requests(&self) -> usize {
        match self {
            Slot::Upstream(Expect::FencedBatch(ctx)) => ctx.writes.len(),
            Slot::Pin(..) => 0,
            _ => 1,
        }
    }
}

enum Expect {
    /// Relay the reply unchanged.
    Plain,
    /// Read the reply and answer with this frame instead.
    Replace(Frame),
    /// A `HELLO`: when it fails, the protocol stays what it was; when it succeeds with `AUTH`,
    /// the user becomes the audit identity.
    Hello {
        previous: bool,
        /// The protocol asked for (`HELLO 3`: true, `HELLO 2`: false, no version: None).
        version: Option<bool>,
        user: Option<String>,
    },
    /// An `AUTH`: the user becomes the audit identity only if Redis accepts it.
    Auth(String),
    /// A (un)subscribe command of this kind naming `channels` channels (0: all of them): one
    /// confirmation per channel (RESP3: as push frames), or a single error.
    PubSub { kind: SubKind, channels: usize },
    /// `RESET`: the connection leaves every subscription.
    Reset,
    /// A fence script call: audit a `FENCED` refusal, count an applied write, reload the
    /// script if it is missing.
    Fenced(Box<FenceContext>),
    /// The `EXEC` of a fenced transaction: audit a `FENCED` refusal of the transaction.
    Exec(Box<Attempt>),
    /// A batch fence call for several pipelined writes: one reply per write, each handled as
    /// `Fenced` would handle it alone.
    FencedBatch(Box<BatchContext>),
}

struct BatchContext {
    /// The writes, in request order, to audit if the store refuses them.
    writes: Vec<FencedWrite>,
    /// The token they ran under.
    token: Arc<FenceToken>,
    /// How the call was made, to make it again after a reload.
    mode: ScriptMode,
    /// Whether the client speaks RESP3 (how a null reply is written).
    resp3: bool,
}

impl BatchContext {
    /// The call sent, built again (for a resend after a reload).
    fn call(&self) -> Vec<Bytes> {
        let batched: Vec<BatchedWrite> = self.writes.iter().map(FencedWrite::batched).collect();
        FenceCall::batch(&self.mode, &self.token, &batched, self.resp3).args()
    }
}

struct FenceContext {
    /// The write, to audit if the store refuses it.
    write: FencedWrite,
    /// The token it ran under.
    token: Arc<FenceToken>,
    /// How the call was made, to make it again after a reload.
    mode: ScriptMode,
    resp3: bool,
}

impl FenceContext {
    /// The call sent, built again (for a resend after a reload).
    fn call(&self) -> Vec<Bytes> {
        FenceCall::single(&self.mode, &self.token, &self.write.batched(), self.resp3).args()
    }
}

/// What the audit record of a fenced write is built from, should the store refuse it: the
/// request's own parts, moved rather than copied. The record itself ([`Attempt`]: addresses,
/// names and ids formatted into strings) is built only for a refusal, not for every write: it
/// was most of the fenced path's allocations (issue 18).
struct FencedWrite {
    /// The request's number on this connection (the audit record's request id).
    request: u64,
    args: Args,
    keys: Keys,
    /// The request's size on the wire.
    bytes: usize,
}

impl FencedWrite {
    fn batched(&self) -> BatchedWrite<'_> {
        BatchedWrite {
            args: &self.args,
            keys: &self.keys,
        }
    }
}

struct Multi {
    /// The token in force at `MULTI`: every queued command then runs under the fence.
    token: Option<Arc<FenceToken>>,
    /// A queued command was refused: `EXEC` becomes `DISCARD` and answers `EXECABORT`.
    dirty: bool,
    /// Commands queued, for the audit summary.
    commands: Vec<String>,
    objects: Vec<String>,
    bytes: usize,
}

struct Reader {
    gateway: Arc<Gateway>,
    info: Arc<UpstreamInfo>,
    id: u64,
    peer: SocketAddr,
    client: ReadHalf,
    buf: BytesMut,
    upstream: Arc<Mutex<UpstreamWriter>>,
    slots: Producer<Slot>,
    resp3: Arc<AtomicBool>,
    /// The token `FENCE` set; shared (not copied) with each fenced write in flight.
    token: Option<Arc<FenceToken>>,
    multi: Option<Multi>,
    /// The user of the last successful `AUTH`/`HELLO ... AUTH` (set by the writer, which sees
    /// the reply).
    identity: Identity,
    requests: u64,
    /// Parse state of the request at the front of `buf`, kept across reads.
    parser: RequestParser,
    /// When an empty `buf` is given back (see [`read`]).
    keep: BufferKeep,
    /// The buffer the last batch was written into, emptied, for the next one.
    room: BytesMut,
    /// The last batch's slot list, emptied, for the next one (given back with `room`).
    slot_room: Vec<Slot>,
    /// Bytes this connection counts in the gateway's `buffered` total.
    held: usize,
    /// Refusals over the gateway's budget since this connection's last accepted write.
    tarpit: Tarpit,
    /// How long to wait before the next request, after a refusal over the budget.
    wait: Option<Duration>,
    read_at: ReadTimes,
    /// The gateway's protect rules as of version `.0` (see [`Gateway::live_versioned`]).
    config: (u64, Arc<crate::config::RedisConfig>),
    /// The node is draining: end the session at the next idle point.
    shutdown: CancellationToken,
    /// Whether pipelined fenced writes may share one batch fence call: off on servers without
    /// Functions (a script that wrote nothing yet escapes `maxmemory`), and for good once the
    /// client authenticates (`AUTH`, `HELLO ... AUTH`: a user's per-key ACL would refuse a whole
    /// call for one key).
    batching: bool,
    /// `HELLO`s sent whose reply the writer has not yet seen: until then the protocol `resp3`
    /// assumes may be wrong (a failed `HELLO 3`), and a batch's reply would be misread.
    hellos_pending: Arc<AtomicUsize>,
    /// The session is still on a shared upstream connection.
    sharing: bool,
    /// Upstream replies the writer has taken (see [`Writer::completed`]).
    completed: Arc<AtomicU64>,
}

/// When each slot's request was read, in slot order: the reader pushes, the writer pops once
/// the reply is written (the latency metric). Kept beside the slot queue rather than in it so
/// the slots stay what the writer does.
type ReadTimes = Arc<std::sync::Mutex<VecDeque<std::time::Instant>>>;

/// Whether a session's error was the upstream's (as opposed to the client's).
fn upstream_fault(e: &RedisError) -> bool {
    match e {
        RedisError::Upstream(_) => true,
        RedisError::Io { context, .. } => context.contains("upstream"),
        RedisError::Frame { context, .. } => context.contains("upstream"),
        _ => false,
    }
}

type Identity = Arc<std::sync::Mutex<Option<String>>>;

/// What every Redis audit record says of the client: its address, the identity Redis accepted
/// for the connection, the token, and the request id (`redis-<conn>-<request>`).
fn client_attempt(
    peer: SocketAddr,
    identity: &Identity,
    conn: u64,
    request: u64,
    token: Option<&Token>,
) -> Attempt {
    Attempt {
        store: Store::Redis,
        client_addr: peer.to_string(),
        client_identity: identity.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        token: token.cloned(),
        operation: OperationSummary::default(),
        request_id: format!("redis-{conn}-{request}"),
    }
}

/// What an audit record says of a command (`args`, name first) of `bytes` wire bytes writing
/// `keys`: its name, at most eight keys (each cut to 64 bytes), its size; never a value.
fn operation(args: &[Bytes], keys: &[Bytes], bytes: usize) -> OperationSummary {
    OperationSummary {
        command: frame::command_name(args),
        objects: keys.iter().take(8).map(|k| lossy(k, 64)).collect(),
        args: args.len(),
        bytes,
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.gateway
            .buffered
            .fetch_sub(self.held, Ordering::Relaxed);
        if self.tarpit.active() {
            self.gateway.tarpitted.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// One batch of work from one read: bytes for the upstream and slots for the writer.
///
/// Fenced writes under one token that come back to back are held in `run` and sent as one call
/// of the batch fence script (one write alone: the plain fence call). Anything else that goes
/// upstream or into the slots first closes the run, so requests keep their order by construction.
#[derive(Default)]
struct Batch {
    upstream: BytesMut,
    requests: u64,
    slots: Vec<Slot>,
    run: Option<(ScriptMode, Run<FencedWrite>)>,
}

impl Batch {
    /// A batch for `input` bytes of requests, written into `room` (the last batch's buffer,
    /// emptied). It is made large enough at once to hold the requests rewritten (a fence call
    /// adds about a hundred bytes to its write), instead of grown write by write.
    fn new(mut room: BytesMut, slots: Vec<Slot>, input: usize) -> Self {
        room.reserve(input.saturating_mul(2).min(input + BUFFER) + 256);
        Self {
            upstream: room,
            slots,
            ..Self::default()
        }
    }

    fn forward(&mut self, args: &[Bytes]) {
        self.close_run();
        self.send(args);
    }

    /// Like [`Batch::forward`] for a request whose wire bytes are its canonical encoding.
    fn forward_wire(&mut self, wire: &[u8]) {
        self.close_run();
        self.upstream.extend_from_slice(wire);
        self.requests += 1;
    }

    fn push(&mut self, slot: Slot) {
        self.close_run();
        self.slots.push(slot);
    }

    fn send(&mut self, args: &[Bytes]) {
        frame::encode_command(args, &mut self.upstream);
        self.requests += 1;
    }

    fn send_call(&mut self, call: &FenceCall) {
        call.encode(&mut self.upstream);
        self.requests += 1;
    }

    /// Adds a fenced write to the run, closing the run first when the write cannot join it.
    fn fenced(
        &mut self,
        mode: &ScriptMode,
        token: &Arc<FenceToken>,
        resp3: bool,
        write: FencedWrite,
    ) {
        let size = write.args.len() + write.keys.len();
        let bytes = write.bytes;
        if self
            .run
            .as_ref()
            .is_some_and(|(_, run)| !run.admits(token, resp3, size, bytes))
        {
            self.close_run();
        }
        self.run
            .get_or_insert_with(|| (mode.clone(), Run::new(token.clone(), resp3)))
            .1
            .push(write, size, bytes);
    }

    /// Sends one fenced write as the plain fence call, after anything before it.
    fn fenced_alone(
        &mut self,
        mode: &ScriptMode,
        token: Arc<FenceToken>,
        write: FencedWrite,
        resp3: bool,
    ) {
        self.close_run();
        self.send_call(&FenceCall::single(mode, &token, &write.batched(), resp3));
        self.slots
            .push(Slot::Upstream(Expect::Fenced(Box::new(FenceContext {
                write,
                token,
                mode: mode.clone(),
                resp3,
            }))));
    }

    /// Sends the run: one write as the plain fence call, several as one batch fence call.
    fn close_run(&mut self) {
        let Some((mode, run)) = self.run.take() else {
            return;
        };
        let (token, resp3, mut writes) = run.into_parts();
        if writes.len() == 1 {
            let write = writes.pop().expect("one write");
            self.fenced_alone(&mode, token, write, resp3);
            return;
        }
        let batched: Vec<BatchedWrite> = writes.iter().map(FencedWrite::batched).collect();
        self.send_call(&FenceCall::batch(&mode, &token, &batched, resp3));
        self.slots.push(Slot::Upstream(Expect::FencedBatch(Box::new(
            BatchContext {
                // Several writes: already on the heap, taken as they are.
                writes: writes.into_vec(),
                token,
                mode,
                resp3,
            },
        ))));
    }
}

impl Reader {
    async fn run(mut self) -> Result<(), RedisError> {
        let config = &self.gateway.config;
        let partial = Duration::from_secs(config.partial_request_timeout_seconds);
        let idle = Duration::from_secs(config.idle_timeout_seconds);
        // One timer per session, moved only when it fires (not a timer per request).
        let mut idle_timer = (!idle.is_zero()).then(|| IdleTimer::new(idle));
        let mut started = tokio::time::Instant::now();
        // After a tarpit wait, requests already buffered are handled before reading more.
        let mut resume = false;
        // One wait for the drain per session, polled only when the token woke it: not a token
        // clone and a waiter registered per request.
        let mut drained = PollOnWake::new(self.shutdown.clone().cancelled_owned());
        // The command table, held here so each request's entry is looked up once and lent to
        // every step that needs it (two lookups per request were 5 % of a fenced write's
        // instructions, issue 18).
        let info = Arc::clone(&self.info);
        loop {
            // The bytes left in `buf` after this turn began to arrive in it (see `started`).
            let mut began = false;
            if !std::mem::take(&mut resume) {
                // A partial request must be complete `partial` after its first byte arrived (a
                // deadline, not a per-read timeout: a byte every few seconds must not keep it).
                let read_result = if !self.buf.is_empty() {
                    tokio::time::timeout_at(
                        started + partial,
                        read(&mut self.client, &mut self.buf, &mut self.keep),
                    )
                    .await
                    .ok()
                } else {
                    // Between requests and outside a transaction, a draining session ends
                    // here: the writer delivers the replies in flight, then closes.
                    let closable = self.multi.is_none();
                    let next = async {
                        // A quiet connection gives back its read buffer and, with it, what the
                        // batches keep: their byte buffer, slot list and argument block.
                        let read = read_giving_back(
                            &mut self.client,
                            &mut self.buf,
                            &mut self.keep,
                            || {
                                self.room = BytesMut::new();
                                self.slot_room = Vec::new();
                                self.parser.release();
                            },
                        );
                        match idle_timer.as_mut() {
                            None => Some(read.await),
                            Some(timer) => {
                                timer.start();
                                tokio::select! {
                                    biased;
                                    r = read => Some(r),
                                    () = timer.expired() => None,
                                }
                            }
                        }
                    };
                    let next = tokio::select! {
                        biased;
                        () = &mut drained, if closable => None,
                        r = next => Some(r),
                    };
                    match next {
                        Some(r) => r,
                        None => {
                            tracing::debug!(conn = self.id, peer = %self.peer, "draining: closing the idle session");
                            let _ = self.slots.send(Slot::Close).await;
                            return Ok(());
                        }
                    }
                };
                let Some(n) = read_result else {
                    let text = if self.buf.is_empty() {
                        format!(
                            "ERR fencegate: no request for {}s; closing the connection",
                            idle.as_secs()
                        )
                    } else {
                        format!("ERR fencegate: a request was still incomplete {}s after it began; closing the connection", partial.as_secs())
                    };
                    tracing::info!(conn = self.id, peer = %self.peer, buffered = self.buf.len(), "{text}");
                    let _ = self.slots.send(Slot::Local(Frame::error(&text))).await;
                    let _ = self.slots.send(Slot::Close).await;
                    return Ok(());
                };
                let was_empty = self.buf.len() == n.as_ref().map_or(0, |n| *n);
                let n = n.map_err(RedisError::io("reading from client"))?;
                if n == 0 {
                    return Ok(());
                }
                began = was_empty;
            }
            let mut batch = Batch::new(
                std::mem::take(&mut self.room),
                std::mem::take(&mut self.slot_room),
                self.buf.len(),
            );
            let read_at = std::time::Instant::now();
            let mut fatal = None;
            let mut pin = false;
            loop {
                let next = self.parser.next(&self.buf, &self.gateway.limits);
                let command = match &next {
                    Ok(Some(request)) => info.table.lookup(&request.args),
                    _ => None,
                };
                match next {
                    Ok(Some(request)) if self.sharing && Self::pins(&request, command) => {
                        // Stays in `buf`, parsed again once the session has its own connection.
                        pin = true;
                        break;
                    }
                    Ok(Some(request)) => {
                        began = true;
                        let len = request.wire_len;
                        // The request's bytes stay in `buf` until it is handled: a relayed
                        // request is copied upstream from there.
                        self.handle(request, command, &mut batch);
                        self.buf.advance(len);
                        if self.wait.is_some() {
                            // Refused over the budget: answer what came so far, then wait.
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        fatal = Some(e);
                        break;
                    }
                }
            }
            batch.close_run();
            if began && !self.buf.is_empty() {
                // What is left (a partial request, or requests held back) began after the
                // last request handled, or in this read into an empty buffer: its deadline
                // counts from now. The clock is read only then, not per request.
                started = tokio::time::Instant::now();
            }
            if !batch.upstream.is_empty() {
                // Not contended but while the writer retries a write: no waiter queued per
                // batch (issue 18).
                let mut up = match self.upstream.try_lock() {
                    Ok(up) => up,
                    Err(_) => self.upstream.lock().await,
                };
                let sent = up.sent;
                if let Sink::Shared { connection, .. } = &mut up.sink {
                    // Gone while nothing of this session was in flight (Redis restarted, or
                    // closed it as idle): take the pool's next one; nothing can be reordered.
                    if connection.is_closed() && self.completed.load(Ordering::Acquire) == sent {
                        *connection = self.gateway.shared_connection().await?;
                    }
                }
                up.send(&batch.upstream, batch.requests).await?;
            }
            // Kept for the next batch (a buffer of a kilobyte or more taken per batch costs
            // glibc a heap consolidation each time), unless a large batch grew it; given back
            // with the read buffer once the connection is quiet.
            if batch.upstream.capacity() <= BUFFER {
                batch.upstream.clear();
                self.room = std::mem::take(&mut batch.upstream);
            }
            let mut slots = std::mem::take(&mut batch.slots);
            for slot in slots.drain(..) {
                self.read_at
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(std::iter::repeat_n(read_at, slot.requests()));
                if self.slots.send(slot).await.is_err() {
                    return Ok(());
                }
            }
            // Kept like `room` (a list per batch was an allocation per request, issue 18).
            if slots.capacity() <= SLOTS_KEPT {
                self.slot_room = slots;
            }
            if fatal.is_none() && !self.account_buffered() {
                let text = format!(
                    "ERR fencegate: the gateway's budget for partial requests (max_buffered_bytes = {}) is used up; closing this connection, which holds {} bytes of an incomplete request",
                    self.gateway.config.max_buffered_bytes,
                    self.buf.len()
                );
                tracing::warn!(conn = self.id, peer = %self.peer, buffered = self.buf.len(), "partial-request budget exhausted; closing the connection");
                let _ = self.slots.send(Slot::Local(Frame::error(&text))).await;
                let _ = self.slots.send(Slot::Close).await;
                return Ok(());
            }
            if let Some(e) = fatal {
                tracing::info!(conn = self.id, peer = %self.peer, error = %e, "client broke the protocol; closing");
                let text = match e {
                    FrameError::TooLarge { .. } => format!("ERR fencegate: {e}"),
                    _ => format!("ERR Protocol error: {e}"),
                };
                let _ = self.slots.send(Slot::Local(Frame::error(&text))).await;
                let _ = self.slots.send(Slot::Close).await;
                return Err(RedisError::Frame {
                    context: "client request",
                    source: e,
                });
            }
            if let Some(wait) = self.wait.take() {
                // The tarpit: this connection pays for its refusals in time, nobody else does.
                self.gateway.tarpit_waits.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(wait).await;
                resume = true;
            }
            if pin {
                if !self.pin().await {
                    return Ok(());
                }
                resume = true;
            }
        }
    }

    /// Whether the session must leave its shared connection before `request` goes upstream:
    /// a request that is not shareable ([`crate::sharing`]) or too large for one
    /// ([`sharing::LARGEST_SHARED_REQUEST`]). A command missing from the table pins too,
    /// unless the gateway answers it itself (`FENCE`, an empty request): without an enforce
    /// rule it is relayed, and the server may know it after all (`rename-command SELECT
    /// xselect` lists `select` and runs `xselect`; a module loaded after the table was learned).
    /// `command`: the request's entry in the table.
    fn pins(request: &Request, command: Option<&CommandInfo>) -> bool {
        if request.wire_len > sharing::LARGEST_SHARED_REQUEST {
            return true;
        }
        match command {
            Some(info) => !info.shareable,
            None => request
                .args
                .first()
                .is_some_and(|name| !name.eq_ignore_ascii_case(b"FENCE")),
        }
    }

    /// Moves the session to an upstream connection of its own: opens it, lets the writer take
    /// every reply still due from the shared connection, then sends from here on through the
    /// new one. `false`: the upstream could not be reached; the client was told and the
    /// session ends.
    async fn pin(&mut self) -> bool {
        let connection = match upstream::connect(&self.gateway.upstream, &self.gateway.config).await
        {
            Ok(connection) => connection,
            Err(e) => {
                tracing::warn!(conn = self.id, peer = %self.peer, error = %e, "upstream unavailable for a connection of the session's own; closing client");
                self.gateway
                    .sink
                    .upstream_failed(Store::Redis, UpstreamFailure::Connect);
                let text = format!("ERR fencegate: upstream unavailable: {e}");
                let _ = self.slots.send(Slot::Local(Frame::error(&text))).await;
                let _ = self.slots.send(Slot::Close).await;
                return false;
            }
        };
        let (read_half, write_half) = stream::split(connection);
        let (switched, done) = oneshot::channel();
        if self
            .slots
            .send(Slot::Pin(read_half, switched))
            .await
            .is_err()
            || done.await.is_err()
        {
            return false;
        }
        self.upstream.lock().await.sink = Sink::Own(write_half);
        self.sharing = false;
        tracing::debug!(conn = self.id, peer = %self.peer, "the session moved to an upstream connection of its own");
        true
    }

    /// Counts this connection's buffered bytes in the gateway's total; `false` when the total
    /// is over budget and this connection holds a partial request.
    fn account_buffered(&mut self) -> bool {
        let now = self.buf.len();
        if now == 0 && self.held == 0 {
            // The common case after a whole request: no shared counter written (every session
            // writing it bounced its cache line between the cores, issue 18).
            return true;
        }
        let buffered = &self.gateway.buffered;
        let total = if now >= self.held {
            buffered.fetch_add(now - self.held, Ordering::Relaxed) + (now - self.held)
        } else {
            buffered.fetch_sub(self.held - now, Ordering::Relaxed) - (self.held - now)
        };
        self.held = now;
        now == 0 || total <= self.gateway.config.max_buffered_bytes
    }

    /// Charges a refusal of a client without a valid token to the gateway's budget; over it,
    /// the connection goes into (or deeper into) the tarpit. Returns whether the refusal was
    /// within the budget (beyond it, refusals are logged once per period, not one by one).
    fn charge_refusal(&mut self) -> bool {
        let charge = self.gateway.charge_refusal();
        let was_in = self.tarpit.active();
        self.wait = self.tarpit.refused(charge.within);
        if !was_in && self.tarpit.active() {
            self.gateway.tarpitted.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(over) = charge.report {
            tracing::warn!(
                over_budget = over,
                tarpitted = self.gateway.tarpitted_connections(),
                refusals_per_second = self.gateway.config.refusals_per_second,
                "refusals of clients without a valid token went over the gateway's budget since the last report; the connections causing them are slowed down (tarpit), fenced writes are not"
            );
        }
        charge.within
    }

    /// Takes the gateway's protect rules again if a reload changed them since this session last
    /// looked: one atomic load per request instead of a lock and a reference count shared by
    /// every session (issue 18).
    fn refresh_config(&mut self) {
        if self.gateway.live_version() != self.config.0 {
            self.config = self.gateway.live_versioned();
        }
    }

    /// A write was accepted under a valid token: the connection leaves the tarpit.
    fn accepted(&mut self) {
        if self.tarpit.accepted() {
            self.gateway.tarpitted.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Handles one request, whose bytes are at the front of `buf`; `command`: its entry in the
    /// command table (`None`: not in it).
    fn handle(&mut self, request: Request, command: Option<&CommandInfo>, batch: &mut Batch) {
        if request.args.is_empty() {
            return;
        }
        self.requests += 1;
        let mut name_buf = [0u8; NAME_ON_STACK];
        let name = upper(&request.args[0], &mut name_buf);
        let args = &request.args;
        match &*name {
            "FENCE" => return self.fence(&request, batch),
            // Redis refuses it and stays outside a transaction; the gateway must not enter one.
            "MULTI" if args.len() > 1 => {
                let text = "ERR wrong number of arguments for 'multi' command";
                batch.push(Slot::Local(Frame::error(text)));
                return;
            }
            "MULTI" if self.multi.is_none() => {
                self.multi = Some(Multi {
                    token: self.token.clone(),
                    dirty: false,
                    commands: Vec::new(),
                    objects: Vec::new(),
                    bytes: 0,
                });
                return self.pass(args, batch);
            }
            "EXEC" if self.multi.is_some() => return self.exec(batch),
            "DISCARD" => {
                self.multi = None;
                return self.pass(args, batch);
            }
            "RESET" => {
                self.multi = None;
                self.token = None;
                self.resp3.store(false, Ordering::Relaxed);
                batch.forward(args);
                batch.push(Slot::Upstream(Expect::Reset));
                return;
            }
            "AUTH" if self.multi.is_none() => {
                self.batching = false;
                let user = if args.len() >= 3 {
                    lossy(&args[1], 64)
                } else {
                    "default".to_owned()
                };
                batch.forward(args);
                batch.push(Slot::Upstream(Expect::Auth(user)));
                return;
            }
            "HELLO" if self.multi.is_none() => {
                self.hellos_pending.fetch_add(1, Ordering::AcqRel);
                let previous = self.resp3.load(Ordering::Relaxed);
                let version = match args.get(1).map(|v| v.as_ref()) {
                    Some(b"3") => Some(true),
                    Some(b"2") => Some(false),
                    _ => None,
                };
                if let Some(v) = version {
                    self.resp3.store(v, Ordering::Relaxed);
                }
                let user = args
                    .iter()
                    .position(|a| a.eq_ignore_ascii_case(b"AUTH"))
                    .and_then(|i| args.get(i + 1))
                    .map(|u| lossy(u, 64));
                if user.is_some() {
                    self.batching = false;
                }
                batch.forward(args);
                batch.push(Slot::Upstream(Expect::Hello {
                    previous,
                    version,
                    user,
                }));
                return;
            }
            // Replies are matched to requests in order; a server that stops replying would
            // shift every later reply onto the wrong request.
            "CLIENT"
                if args
                    .get(1)
                    .is_some_and(|a| a.eq_ignore_ascii_case(b"REPLY")) =>
            {
                let text = "ERR fencegate: CLIENT REPLY is not supported through the gateway";
                batch.push(Slot::Local(Frame::error(text)));
                return;
            }
            // These answer with a stream that is not one reply per request.
            "MONITOR" | "SYNC" | "PSYNC" | "REPLCONF" => {
                let text = format!("ERR fencegate: {name} is not supported through the gateway; connect to Redis directly");
                batch.push(Slot::Local(Frame::error(&text)));
                return;
            }
            _ if SubKind::of(&name).is_some() => {
                if let Some(multi) = &mut self.multi {
                    // Inside EXEC the confirmations would arrive as one array, and the
                    // connection would change mode mid-transaction: not worth the risk.
                    multi.dirty = true;
                    let text = format!("ERR fencegate: {name} inside MULTI is not supported; subscribe outside the transaction");
                    batch.push(Slot::Local(Frame::error(&text)));
                    return;
                }
                let kind = SubKind::of(&name).expect("checked");
                batch.forward(args);
                batch.push(Slot::Upstream(Expect::PubSub {
                    kind,
                    channels: args.len() - 1,
                }));
                return;
            }
            _ => {}
        }
        if let Some(multi) = &mut self.multi {
            multi.commands.push(name.clone().into_owned());
            multi.bytes += request.wire_len;
            if multi.token.is_some() && !matches!(&*name, "MULTI" | "WATCH") {
                self.refresh_config();
                let class = classify_command(command, &self.config.1, args);
                return self.queue_fenced(&request, command, class, batch);
            }
        }
        let risk = self
            .gateway
            .fences_at_risk()
            .then(|| self.gateway.health().err().unwrap_or_default());
        self.refresh_config();
        let inputs = Inputs {
            command,
            config: &self.config.1,
            token: self.token.as_deref().map(FenceToken::token),
            fences_at_risk: risk.as_deref(),
        };
        match decide(&inputs, args) {
            // Its bytes are exactly what encoding its arguments would write: copied from
            // there (checked only here, not for every request: issue 18).
            Decision::Pass if canonical(&self.buf[..request.wire_len], &request.args) => {
                batch.forward_wire(&self.buf[..request.wire_len]);
                batch.push(Slot::Upstream(Expect::Plain));
            }
            Decision::Pass => self.pass(args, batch),
            Decision::Unknown => self.unknown(&request, batch),
            Decision::Refuse { reason, detail } => self.refuse(&request, reason, &detail, batch),
            Decision::Fence { keys } => {
                self.accepted();
                let token = self
                    .token
                    .as_ref()
                    .expect("decide fences only under a token");
                // Read before `resp3`: the writer settles the protocol, then counts the reply.
                let settled = self.hellos_pending.load(Ordering::Acquire) == 0;
                let resp3 = self.resp3.load(Ordering::Relaxed);
                let write = FencedWrite {
                    request: self.requests,
                    args: request.args,
                    keys,
                    bytes: request.wire_len,
                };
                if self.multi.is_none() && self.batching && settled {
                    // Joins the batch's run of fenced writes (sent when the run closes).
                    batch.fenced(&self.info.mode, token, resp3, write);
                } else {
                    batch.fenced_alone(&self.info.mode, token.clone(), write, resp3);
                }
            }
        }
    }

    /// A command inside a transaction that began with a token: it runs inside the fence script
    /// whatever it is, so the whole `EXEC` applies under the fence or not at all.
    fn queue_fenced(
        &mut self,
        request: &Request,
        command: Option<&CommandInfo>,
        class: Class,
        batch: &mut Batch,
    ) {
        let args = &request.args;
        match class {
            Class::Refuse { reason, detail } => {
                return self.refuse(request, reason, &detail, batch)
            }
            Class::Unknown => return self.unknown(request, batch),
            _ => {}
        }
        let Some(info) = command else {
            return self.pass(args, batch);
        };
        if !info.arity_ok(args.len()) {
            // Redis refuses it at queue time and aborts the transaction itself.
            return self.pass(args, batch);
        }
        if info.noscript {
            let detail = format!(
                "{} cannot run under the fence inside a fenced transaction",
                request.name()
            );
            return self.refuse(request, RejectReason::Unsupported, &detail, batch);
        }
        let keys: Keys = info
            .keys(args)
            .map(|k| k.into_iter().cloned().collect())
            .unwrap_or_default();
        if let Some(multi) = &mut self.multi {
            for key in keys.iter().take(4) {
                if multi.objects.len() < 8 {
                    multi.objects.push(lossy(key, 64));
                }
            }
        }
        let token = self
            .multi
            .as_ref()
            .and_then(|m| m.token.clone())
            .expect("fenced transaction has a token");
        if let Err(detail) = scope::check(&self.config.1, &token, &keys) {
            return self.refuse(request, RejectReason::OutOfScope, &detail, batch);
        }
        if self.gateway.fences_at_risk() {
            let detail = decide::at_risk(&self.gateway.health().err().unwrap_or_default());
            return self.refuse(request, RejectReason::Unsupported, &detail, batch);
        }
        self.accepted();
        let write = BatchedWrite { args, keys: &keys };
        let resp3 = self.resp3.load(Ordering::Relaxed);
        batch.close_run();
        batch.send_call(&FenceCall::single(&self.info.mode, &token, &write, resp3));
        batch.push(Slot::Upstream(Expect::Plain));
    }

    fn exec(&mut self, batch: &mut Batch) {
        let multi = self.multi.take().expect("checked by the caller");
        if multi.dirty {
            batch.forward(&[Bytes::from_static(b"DISCARD")]);
            let abort = Frame::error("EXECABORT Transaction discarded because of previous errors.");
            batch.push(Slot::Upstream(Expect::Replace(abort)));
            return;
        }
        batch.forward(&[Bytes::from_static(b"EXEC")]);
        match &multi.token {
            None => batch.push(Slot::Upstream(Expect::Plain)),
            Some(token) => {
                let mut attempt = self.base_attempt(Some(token));
                attempt.operation = OperationSummary {
                    command: format!("MULTI/EXEC({})", multi.commands.join(",")),
                    objects: multi.objects,
                    args: multi.commands.len(),
                    bytes: multi.bytes,
                };
                batch.push(Slot::Upstream(Expect::Exec(Box::new(attempt))));
            }
        }
    }

    fn fence(&mut self, request: &Request, batch: &mut Batch) {
        let args = &request.args;
        let reply = if self.multi.is_some() {
            Frame::error("ERR fencegate: FENCE is not allowed inside MULTI; send it before MULTI")
        } else if args.len() == 1 {
            self.token = None;
            Frame::simple("OK")
        } else if args.len() > 2 {
            Frame::error("ERR wrong number of arguments for 'fence' command; use FENCE <token>, or FENCE alone to clear")
        } else {
            let text = String::from_utf8_lossy(&args[1]);
            match self.gateway.policy.check(&text, None) {
                Ok(token) => {
                    tracing::debug!(conn = self.id, resource = %token.resource(), revision = %token.revision(), "token set");
                    self.token = Some(Arc::new(FenceToken::new(token)));
                    Frame::simple("OK")
                }
                Err(e) => {
                    let reason = RejectReason::from_token_error(&e);
                    // A token that is not valid is refused traffic, whatever the connection
                    // held before.
                    let within = self.charge_refusal();
                    let presented = Token::parse(&text).ok();
                    let event = self
                        .attempt(request, &[], presented.as_ref())
                        .refused(&Rejection::new(reason, e.to_string()));
                    if within {
                        tracing::info!(conn = self.id, peer = %self.peer, reason = %reason, "FENCE refused: {e}");
                    } else {
                        tracing::debug!(conn = self.id, peer = %self.peer, reason = %reason, "FENCE refused: {e}");
                    }
                    batch.push(Slot::Refuse(
                        Frame::error(&decide::refusal_text(&reason, &e.to_string())),
                        Box::new(event),
                    ));
                    return;
                }
            }
        };
        batch.push(Slot::Local(reply));
    }

    /// A command the upstream did not list: answered like Redis answers an unknown command. Not
    /// a refused write, so not audited; inside `MULTI` it aborts the transaction, as in Redis.
    fn unknown(&mut self, request: &Request, batch: &mut Batch) {
        if let Some(multi) = &mut self.multi {
            multi.dirty = true;
        }
        let name = lossy(request.args.first().map_or(&[][..], |a| a.as_ref()), 64);
        let sub = request
            .args
            .get(1)
            .map(|a| lossy(a, 64))
            .unwrap_or_default();
        let text = format!(
            "ERR unknown command '{name} {sub}' (fencegate relays only commands the upstream listed in COMMAND)"
        );
        batch.push(Slot::Local(Frame::error(&text)));
    }

    fn pass(&mut self, args: &[Bytes], batch: &mut Batch) {
        batch.forward(args);
        batch.push(Slot::Upstream(Expect::Plain));
    }

    fn refuse(&mut self, request: &Request, reason: RejectReason, detail: &str, batch: &mut Batch) {
        if let Some(multi) = &mut self.multi {
            multi.dirty = true;
        }
        // A connection with a valid token is never slowed down: its refusals (out of scope,
        // unfenceable) are its holder's mistakes, not a flood of strangers.
        let within = self.token.is_some() || self.charge_refusal();
        let keys = self
            .info
            .table
            .lookup(&request.args)
            .and_then(|i| i.keys(&request.args).ok())
            .map(|k| k.into_iter().cloned().collect::<Vec<_>>())
            .unwrap_or_default();
        let token = self.token.clone();
        let event = self
            .attempt(request, &keys, token.as_deref().map(FenceToken::token))
            .refused(&Rejection::new(reason, detail));

        if within {
            tracing::info!(conn = self.id, peer = %self.peer, reason = %reason, command = %request.name(), "write refused: {detail}");
        } else {
            tracing::debug!(conn = self.id, peer = %self.peer, reason = %reason, command = %request.name(), "write refused: {detail}");
        }
        batch.push(Slot::Refuse(
            Frame::error(&decide::refusal_text(&reason, detail)),
            Box::new(event),
        ));
    }

    fn base_attempt(&self, token: Option<&Token>) -> Attempt {
        client_attempt(self.peer, &self.identity, self.id, self.requests, token)
    }

    fn attempt(&self, request: &Request, keys: &[Bytes], token: Option<&Token>) -> Attempt {
        Attempt {
            operation: operation(&request.args, keys, request.wire_len),
            ..self.base_attempt(token)
        }
    }
}

struct Writer {
    gateway: Arc<Gateway>,
    id: u64,
    peer: SocketAddr,
    client: WriteHalf,
    out: BytesMut,
    /// When an empty `out` (and `ubuf`, while waiting for a request) is given back (see
    /// [`keeping`]).
    keep: BufferKeep,
    upstream: Source,
    /// Replies read from the session's own connection, not yet parsed.
    ubuf: BytesMut,
    /// When an empty `ubuf` is given back (see [`read`]).
    ukeep: BufferKeep,
    upstream_w: Arc<Mutex<UpstreamWriter>>,
    /// Replies read ahead during a reload-and-retry, delivered before anything newer.
    stash: VecDeque<(Frame, Bytes)>,
    /// Upstream replies taken so far: equal to the requests sent when nothing is in flight
    /// (the reload-and-retry bookkeeping, and when the reader may replace a shared connection).
    completed: Arc<AtomicU64>,
    resp3: Arc<AtomicBool>,
    identity: Identity,
    /// Channels, patterns and shard channels this connection is subscribed to, as Redis
    /// confirmed them: tells how many confirmations an argument-less unsubscribe gets, and
    /// whether a RESP2 `message` array is a message or a reply.
    subscriptions: [std::collections::HashSet<Bytes>; 3],
    /// The protocol Redis speaks on this connection, as its replies confirmed it (the reader's
    /// `resp3` changes when a `HELLO` is sent, before Redis has accepted it).
    speaks_resp3: bool,
    /// Shared with the reader: counted down once a `HELLO`'s reply has settled the protocol.
    hellos_pending: Arc<AtomicUsize>,
    slots: Consumer<Slot>,
    read_at: ReadTimes,
}

/// The three kinds of subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SubKind {
    Channel = 0,
    Pattern = 1,
    Shard = 2,
}

impl SubKind {
    /// The kind a (un)subscribe command or confirmation name is about (any case; compared in
    /// place: this runs for every request, issue 18).
    fn of(name: &str) -> Option<Self> {
        const KINDS: [(&str, SubKind); 6] = [
            ("subscribe", SubKind::Channel),
            ("unsubscribe", SubKind::Channel),
            ("psubscribe", SubKind::Pattern),
            ("punsubscribe", SubKind::Pattern),
            ("ssubscribe", SubKind::Shard),
            ("sunsubscribe", SubKind::Shard),
        ];
        KINDS
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, kind)| *kind)
    }
}

impl Writer {
    async fn run(mut self) -> Result<(), RedisError> {
        let result = self.work().await;
        let _ = self.flush().await;
        let _ = self.client.shutdown().await;
        result
    }

    async fn work(&mut self) -> Result<(), RedisError> {
        loop {
            let slot = match self.slots.try_recv() {
                Poll::Ready(Some(slot)) => slot,
                Poll::Ready(None) => return Ok(()),
                Poll::Pending => {
                    self.flush().await?;
                    if self.listening() {
                        match self.relay_until_slot().await? {
                            Some(slot) => slot,
                            None => return Ok(()),
                        }
                    } else {
                        let idle = [&mut self.out, &mut self.ubuf];
                        match keeping(&mut self.keep, idle, self.slots.recv()).await {
                            Some(slot) => slot,
                            None => return Ok(()),
                        }
                    }
                }
            };
            let requests = slot.requests();
            match slot {
                Slot::Local(frame) => frame.encode(self.out()),
                Slot::Refuse(frame, event) => {
                    self.audit(*event).await;
                    frame.encode(self.out());
                }
                Slot::Close => return Ok(()),
                Slot::Pin(half, switched) => {
                    // Every slot before this one took its reply: nothing more is due from the
                    // shared connection.
                    self.upstream = Source::Own(half);
                    let _ = switched.send(());
                }
                Slot::Upstream(expect) => {
                    let reply = self.next_reply().await?;
                    self.deliver(expect, reply).await?;
                    self.completed.fetch_add(1, Ordering::Release);
                }
            }
            // One lock and one clock read for every request the slot answered (a batch call
            // answers a whole pipeline: a clock read each was 90 instructions per write).
            {
                let mut times = self.read_at.lock().unwrap_or_else(|p| p.into_inner());
                let answered = requests.min(times.len());
                if answered > 0 {
                    let now = std::time::Instant::now();
                    for read_at in times.drain(..answered) {
                        self.gateway
                            .sink
                            .request_done(Store::Redis, now.saturating_duration_since(read_at));
                    }
                }
            }
        }
    }

    /// Whether upstream frames can arrive unasked (subscribed, or RESP3 push frames).
    fn listening(&self) -> bool {
        self.resp3.load(Ordering::Relaxed) || self.subscriptions.iter().any(|s| !s.is_empty())
    }

    /// Whether an upstream frame is out of band (a pub/sub message, an invalidation), not the
    /// reply to a request: RESP3 push frames other than (un)subscribe confirmations, and in
    /// RESP2 (as Redis confirmed it) while subscribed, `message`/`pmessage`/`smessage` arrays.
    fn out_of_band(&self, frame: &Frame) -> bool {
        let kind = |items: &[Frame]| match items.first() {
            Some(Frame::Bulk(k)) | Some(Frame::Simple(k)) => {
                String::from_utf8_lossy(k).to_ascii_lowercase()
            }
            _ => String::new(),
        };
        match frame {
            Frame::Push(items) => SubKind::of(&kind(items)).is_none(),
            // In RESP3 messages are push frames: an array is always a reply.
            Frame::Array(items)
                if !self.speaks_resp3 && self.subscriptions.iter().any(|s| !s.is_empty()) =>
            {
                matches!(kind(items).as_str(), "message" | "pmessage" | "smessage")
            }
            _ => false,
        }
    }

    /// Applies a (un)subscribe confirmation to the subscription sets.
    fn confirmed(&mut self, frame: &Frame) {
        let (Frame::Push(items) | Frame::Array(items)) = frame else {
            return;
        };
        let (Some(Frame::Bulk(kind) | Frame::Simple(kind)), Some(channel)) =
            (items.first(), items.get(1))
        else {
            return;
        };
        let kind = String::from_utf8_lossy(kind).to_ascii_lowercase();
        let Some(sub) = SubKind::of(&kind) else {
            return;
        };
        let Frame::Bulk(channel) = channel else {
            return;
        };
        let set = &mut self.subscriptions[sub as usize];
        if kind.contains("unsubscribe") {
            set.remove(channel);
        } else {
            // A copy: the reply's strings are slices of the read buffer, which a channel kept
            // for as long as it is subscribed would hold whole.
            set.insert(Bytes::copy_from_slice(channel));
        }
    }

    /// While subscribed or in RESP3: forward out-of-band frames as they come, keep replies
    /// for their slots, until a slot arrives.
    async fn relay_until_slot(&mut self) -> Result<Option<Slot>, RedisError> {
        loop {
            while let Some(reply) = self.parse_upstream()? {
                self.relay_or_stash(reply);
            }
            self.flush().await?;
            // Subscribed or RESP3: the wait may last; the buffer is given back before it.
            self.out = BytesMut::new();
            // A shared connection sends nothing unasked (a session that subscribes or speaks
            // RESP3 has its own).
            let Source::Own(upstream) = &mut self.upstream else {
                return Ok(self.slots.recv().await);
            };
            // `biased` (no random draw per wait, issue 18): a slot's own replies are read while
            // it is served, so reading upstream second starves nothing.
            tokio::select! {
                biased;
                slot = self.slots.recv() => return Ok(slot),
                n = read(upstream, &mut self.ubuf, &mut self.ukeep) => {
                    if n.map_err(RedisError::io("reading from upstream"))? == 0 {
                        return Err(RedisError::Upstream("closed the connection".into()));
                    }
                }
            }
        }
    }

    async fn deliver(
        &mut self,
        expect: Expect,
        (frame, raw): (Frame, Bytes),
    ) -> Result<(), RedisError> {
        match expect {
            Expect::Plain => self.out().extend_from_slice(&raw),
            Expect::Replace(replacement) => replacement.encode(self.out()),
            Expect::Hello {
                previous,
                version,
                user,
            } => {
                if frame.as_error().is_some() {
                    self.resp3.store(previous, Ordering::Relaxed);
                } else {
                    if let Some(v) = version {
                        self.speaks_resp3 = v;
                    }
                    if let Some(user) = user {
                        *self.identity.lock().unwrap_or_else(|p| p.into_inner()) = Some(user);
                    }
                }
                self.hellos_pending.fetch_sub(1, Ordering::AcqRel);
                self.out().extend_from_slice(&raw);
            }
            Expect::Auth(user) => {
                if frame.as_error().is_none() {
                    *self.identity.lock().unwrap_or_else(|p| p.into_inner()) = Some(user);
                }
                self.out().extend_from_slice(&raw);
            }
            Expect::PubSub { kind, channels } => {
                let expected = match channels {
                    0 => self.subscriptions[kind as usize].len().max(1),
                    n => n,
                };
                let mut next = Some((frame, raw));
                for i in 0..expected {
                    let (frame, raw) = match next.take() {
                        Some(reply) => reply,
                        None => self.next_reply().await?,
                    };
                    self.out().extend_from_slice(&raw);
                    if frame.as_error().is_some() && i == 0 {
                        break;
                    }
                    self.confirmed(&frame);
                }
            }
            Expect::Reset => {
                self.speaks_resp3 = false;
                for set in &mut self.subscriptions {
                    set.clear();
                }
                self.out().extend_from_slice(&raw);
            }
            Expect::Fenced(ctx) => {
                let (frame, raw) = self.retried_if_missing(|| ctx.call(), (frame, raw)).await?;
                self.fenced_reply(&ctx.write, &ctx.token, &frame, &raw)
                    .await;
            }
            Expect::FencedBatch(ctx) => {
                let (frame, raw) = self.retried_if_missing(|| ctx.call(), (frame, raw)).await?;
                match fence_batch::split(frame, &raw, ctx.writes.len(), ctx.resp3) {
                    Ok(Split::Each(replies)) => {
                        for (write, (frame, raw)) in ctx.writes.iter().zip(&replies) {
                            self.fenced_reply(write, &ctx.token, frame, raw).await;
                        }
                    }
                    // A stale fence refuses every write of the batch, each audited.
                    Ok(Split::Whole(frame)) => {
                        for write in &ctx.writes {
                            self.fenced_reply(write, &ctx.token, &frame, &raw).await;
                        }
                    }
                    // Which writes applied is unknown: the client must not guess either.
                    Err(why) => return Err(RedisError::Upstream(why)),
                }
            }
            Expect::Exec(attempt) => {
                let mut restated = None;
                if let Frame::Array(items) = &frame {
                    let errors = items.iter().filter_map(Frame::as_error);
                    if let Some(fence) = errors.clone().find_map(stale_fence) {
                        restated = self.audit_stale(&attempt, fence).await;
                    } else if errors.clone().any(is_missing_script) {
                        // The transaction did not apply (every command in it runs under the
                        // fence); reload so the client's retry works.
                        if let Err(e) = self.gateway.reload_fence().await {
                            tracing::error!(conn = self.id, error = %e, "reloading the fence script failed");
                        }
                    } else {
                        self.gateway.sink.applied(Store::Redis);
                    }
                }
                match restated {
                    Some(frame) => frame.encode(self.out()),
                    None => self.out().extend_from_slice(&raw),
                }
            }
        }
        Ok(())
    }

    /// Answers one fenced write with the store's reply: a `FENCED` refusal is audited (and
    /// restated when the fence is above every issued revision), anything else but a missing
    /// function counts as applied.
    async fn fenced_reply(
        &mut self,
        write: &FencedWrite,
        token: &Token,
        frame: &Frame,
        raw: &Bytes,
    ) {
        let mut restated = None;
        match frame.as_error() {
            Some(e) if stale_fence(e).is_some() => {
                let fence = stale_fence(e).expect("checked");
                let attempt = self.attempt(write, token);
                restated = self.audit_stale(&attempt, fence).await;
            }
            Some(e) if e.starts_with(b"TRYAGAIN") || is_missing_script(e) => {}
            _ => self.gateway.sink.applied(Store::Redis),
        }
        match restated {
            Some(frame) => frame.encode(self.out()),
            None => self.out().extend_from_slice(raw),
        }
    }

    /// The reply to a fence call, or, when the function was missing upstream, the reply to the
    /// call sent again after reloading it (see [`Writer::retry`]).
    async fn retried_if_missing(
        &mut self,
        call: impl FnOnce() -> Vec<Bytes>,
        (frame, raw): (Frame, Bytes),
    ) -> Result<(Frame, Bytes), RedisError> {
        if frame.as_error().is_some_and(is_missing_script) {
            self.retry(&call()).await
        } else {
            Ok((frame, raw))
        }
    }

    /// The fence script was missing (flush or restart): load it again and, when nothing else of
    /// this connection is in flight, resend the call (transparent for a client that waits for
    /// each reply). When later requests were already sent, resending would run this write after
    /// them, so it is answered `-TRYAGAIN` instead (not applied; order kept).
    async fn retry(&mut self, call: &[Bytes]) -> Result<(Frame, Bytes), RedisError> {
        self.gateway.reload_fence().await?;
        self.flush().await?;
        let upstream_w = self.upstream_w.clone();
        // The reader may hold the lock while its write waits for Redis, which may be waiting
        // for us to read replies: keep reading (into the stash) until the lock is ours.
        let mut up = loop {
            // The reader holds the lock of a shared connection only to queue bytes.
            let Source::Own(upstream) = &mut self.upstream else {
                break upstream_w.lock().await;
            };
            tokio::select! {
                guard = upstream_w.lock() => break guard,
                n = read(upstream, &mut self.ubuf, &mut self.ukeep) => {
                    if n.map_err(RedisError::io("reading from upstream"))? == 0 {
                        return Err(RedisError::Upstream("closed the connection".into()));
                    }
                    while let Some(reply) = self.parse_upstream()? {
                        self.relay_or_stash(reply);
                    }
                }
            }
        };
        // This slot is the (completed + 1)th: anything sent after it is still in flight.
        let completed = self.completed.load(Ordering::Acquire);
        if completed + 1 < up.sent || !self.stash.is_empty() {
            tracing::warn!(
                conn = self.id,
                sent = up.sent,
                completed,
                stashed = self.stash.len(),
                "a pipelined fenced write met a missing fence function; answered TRYAGAIN"
            );
            drop(up);
            let frame = Frame::error(
                "TRYAGAIN fencegate: the fence function was missing upstream (flush or restart) and is loaded again; this write was not applied, send it again",
            );
            let raw = frame.to_bytes();
            return Ok((frame, raw));
        }
        up.send(&Frame::command(call.iter().cloned()).to_bytes(), 1)
            .await?;
        drop(up);
        let reply = self.read_reply().await?;
        // Two replies taken for this slot: the refusal and the answer to the call sent again.
        self.completed.fetch_add(1, Ordering::Release);
        Ok(reply)
    }

    /// Audits the store's stale refusal of `attempt`. Returns the reply to send instead of the
    /// store's when the fence is above every revision the authority issued: that is an
    /// authority reset, not the client's lost lock, and the client is told so.
    async fn audit_stale(&mut self, attempt: &Attempt, fence: u64) -> Option<Frame> {
        let policy = &self.gateway.policy;
        // Fenced calls always carry the token; the refusal is audited even if one did not.
        let rejection = match &attempt.token {
            Some(token) => policy.stale(token, fence, &format!("resource {}", token.resource())),
            None => Rejection::new(RejectReason::Stale { fence }, "below the store's fence"),
        };
        let restated = policy
            .fence_above_issued(fence)
            .then(|| Frame::error(&decide::refusal_text(&rejection.reason, &rejection.detail)));
        tracing::info!(conn = self.id, resource = ?rejection.resource, revision = ?rejection.revision, fence, command = %attempt.operation.command, "stale write refused by the store");
        self.audit(attempt.refused(&rejection)).await;
        restated
    }

    /// The audit record of a fenced write, built once the store refused it. The identity is the
    /// one in force when the reply came: replies come in request order, so that is the last
    /// accepted `AUTH` before the write.
    fn attempt(&self, write: &FencedWrite, token: &Token) -> Attempt {
        Attempt {
            operation: operation(&write.args, &write.keys, write.bytes),
            ..client_attempt(
                self.peer,
                &self.identity,
                self.id,
                write.request,
                Some(token),
            )
        }
    }

    async fn audit(&mut self, event: AuditEvent) {
        // The refusal stands whether or not it could be logged; a failure is loud.
        if let Err(e) = self.gateway.sink.refused(event).await {
            tracing::error!(conn = self.id, error = %e, "could not write an audit record for a refusal");
        }
    }

    async fn next_reply(&mut self) -> Result<(Frame, Bytes), RedisError> {
        while let Some((frame, raw)) = self.stash.pop_front() {
            // Judged now, after the replies before it were delivered (a RESP2 `message` is
            // out of band only once its subscription's confirmation has been applied).
            if self.out_of_band(&frame) {
                self.out().extend_from_slice(&raw);
                continue;
            }
            return Ok((frame, raw));
        }
        self.read_reply().await
    }

    /// A frame read while no slot waits for it: an out-of-band one goes to the client at once
    /// when nothing is stashed; anything else, and everything behind a stashed reply, waits
    /// in the stash so the client gets them in the order Redis sent them.
    fn relay_or_stash(&mut self, (frame, raw): (Frame, Bytes)) {
        if self.stash.is_empty() && self.out_of_band(&frame) {
            self.out().extend_from_slice(&raw);
        } else {
            self.stash.push_back((frame, raw));
        }
    }

    /// The next upstream reply; out-of-band frames met on the way go straight to the client.
    async fn read_reply(&mut self) -> Result<(Frame, Bytes), RedisError> {
        loop {
            if let Source::Shared(inbox) = &mut self.upstream {
                match inbox.try_recv() {
                    Ok(reply) => return shared_reply(Some(reply)),
                    Err(inbox::Empty::Forever) => return shared_reply(None),
                    Err(inbox::Empty::Now) => {}
                }
            } else {
                while let Some((frame, raw)) = self.parse_upstream()? {
                    if self.out_of_band(&frame) {
                        self.out().extend_from_slice(&raw);
                        continue;
                    }
                    return Ok((frame, raw));
                }
            }
            self.flush().await?;
            match &mut self.upstream {
                Source::Shared(inbox) => {
                    return shared_reply(
                        keeping(&mut self.keep, [&mut self.out], inbox.recv()).await,
                    )
                }
                Source::Own(half) => {
                    let read = read(half, &mut self.ubuf, &mut self.ukeep);
                    let n = keeping(&mut self.keep, [&mut self.out], read)
                        .await
                        .map_err(RedisError::io("reading from upstream"))?;
                    if n == 0 {
                        return Err(RedisError::Upstream("closed the connection".into()));
                    }
                }
            }
        }
    }

    fn parse_upstream(&mut self) -> Result<Option<(Frame, Bytes)>, RedisError> {
        frame::split_frame(&mut self.ubuf, &frame::Limits::UPSTREAM).map_err(|source| {
            RedisError::Frame {
                context: "upstream reply",
                source,
            }
        })
    }

    /// The client output buffer, taken at full capacity when the first reply of a batch goes in.
    fn out(&mut self) -> &mut BytesMut {
        if self.out.capacity() == 0 {
            self.out = BytesMut::with_capacity(BUFFER);
        }
        &mut self.out
    }

    /// Writes the batch to the client. The output buffer is kept for the next batch (the
    /// writer's waits give it back when they last, see [`keeping`]), unless a large reply grew
    /// it past its size.
    async fn flush(&mut self) -> Result<(), RedisError> {
        if !self.out.is_empty() {
            self.client
                .write_all(&self.out)
                .await
                .map_err(RedisError::io("writing to client"))?;
            self.keep.used();
        }
        if self.out.capacity() > BUFFER {
            self.out = BytesMut::new();
        } else {
            self.out.clear();
        }
        Ok(())
    }
}

/// Reads what `stream` has into `buf`, like `read_buf`; `Ok(0)` only at end of stream.
///
/// A buffer holding part of a frame is read into as it is. An empty buffer is given back
/// before waiting for the socket, and a fresh one of `BUFFER` bytes taken once it is readable;
/// on a busy connection it is kept through the wait instead, until the wait has lasted the
/// keep ([`BufferKeep`]): its next message usually follows within microseconds. Cancel safe:
/// bytes are only read once a wait is over, and what the buffer holds is never dropped.
///
/// A TLS stream has no readiness to wait for without reading (rustls buffers records itself),
/// so it reads into a buffer of `BUFFER` bytes taken before the wait.
async fn read(
    stream: &mut ReadHalf,
    buf: &mut BytesMut,
    keep: &mut BufferKeep,
) -> io::Result<usize> {
    read_giving_back(stream, buf, keep, || {}).await
}

/// [`read`], calling `give_back` when the kept buffer is given back (for buffers kept with it).
async fn read_giving_back(
    stream: &mut ReadHalf,
    buf: &mut BytesMut,
    keep: &mut BufferKeep,
    give_back: impl FnOnce(),
) -> io::Result<usize> {
    let stream = match stream {
        ReadHalf::Plain(stream) => stream,
        ReadHalf::Tls(stream) => {
            if buf.capacity() == buf.len() {
                buf.reserve(BUFFER);
            }
            return stream.read_buf(buf).await;
        }
    };
    if !buf.is_empty() {
        return stream.read_buf(buf).await;
    }
    if buf.capacity() > 0 && keep.begin() {
        if buf.capacity() < BUFFER / 2 {
            // The room consumed at the front is taken back: no allocation while nothing else
            // holds part of the buffer (a reply split off and still queued).
            buf.reserve(BUFFER);
        }
        tokio::select! {
            biased;
            n = stream.read_buf(buf) => {
                keep.used();
                return n;
            }
            () = keep.expired() => {}
        }
    }
    *buf = BytesMut::new();
    give_back();
    stream.readable().await?;
    // Never read into no room: that would return 0 and look like end of stream.
    *buf = BytesMut::with_capacity(BUFFER);
    keep.used();
    // `read_buf` (not `try_read_buf`): a read that does not fill the buffer tells tokio the
    // socket is drained, so the next wait sleeps at once instead of first reading `EAGAIN`
    // (about one wasted `recvfrom` per request in issue 18's profile).
    stream.read_buf(buf).await
}

/// Awaits `wait`, giving back those of the writer's buffers `held` that are empty: at once, or,
/// on a busy connection, once the wait has lasted the keep ([`BufferKeep`]). The output buffer
/// is kept only at up to `BUFFER` bytes ([`Writer::flush`]).
async fn keeping<F: std::future::Future, const N: usize>(
    keep: &mut BufferKeep,
    held: [&mut BytesMut; N],
    wait: F,
) -> F::Output {
    tokio::pin!(wait);
    if held.iter().any(|buf| buf.capacity() > 0) {
        if keep.begin() {
            tokio::select! {
                biased;
                done = &mut wait => return done,
                () = keep.expired() => {}
            }
        }
        for buf in held {
            if buf.is_empty() {
                *buf = BytesMut::new();
            }
        }
    }
    wait.await
}

/// A command name upper-cased: in `buf` when it is short ASCII, as every command name is (no
/// allocation per request, issue 18); lossy and allocated otherwise.
fn upper<'a>(name: &[u8], buf: &'a mut [u8; NAME_ON_STACK]) -> std::borrow::Cow<'a, str> {
    if name.len() <= buf.len() && name.is_ascii() {
        let out = &mut buf[..name.len()];
        out.copy_from_slice(name);
        out.make_ascii_uppercase();
        if let Ok(text) = std::str::from_utf8(out) {
            return std::borrow::Cow::Borrowed(text);
        }
    }
    std::borrow::Cow::Owned(String::from_utf8_lossy(name).to_ascii_uppercase())
}

/// Whether `wire`, a request the parser accepted with these `args`, is byte for byte the RESP
/// array [`Frame::command`] encodes from them. Every length the parser accepted in another
/// spelling (`+3`, `03`) is longer than its canonical form, so equal sizes mean equal bytes:
/// relaying such a request as it came sends exactly what was decided on. Inline commands are
/// re-encoded.
fn canonical(wire: &[u8], args: &[Bytes]) -> bool {
    fn digits(n: usize) -> usize {
        n.checked_ilog10().map_or(1, |d| d as usize + 1)
    }
    let encoded = 1
        + digits(args.len())
        + 2
        + args
            .iter()
            .map(|a| 1 + digits(a.len()) + 2 + a.len() + 2)
            .sum::<usize>();
    wire.first() == Some(&b'*') && wire.len() == encoded
}

fn is_missing_script(error: &[u8]) -> bool {
    error.starts_with(b"NOSCRIPT") || error.starts_with(b"ERR Function not found")
}

/// The fence from `FENCED <resource> token <n> is below fence <m>`.
fn stale_fence(error: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(error).ok()?;
    let rest = text.strip_prefix("FENCED ")?;
    rest.rsplit_once(" is below fence ")?.1.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Longer than any keep (lax: at most twice [`IdleTimer::KEEP_BUFFER`]).
    const QUIET: Duration = Duration::from_secs(1);

    #[tokio::test(start_paused = true)]
    async fn a_waiting_read_keeps_its_buffer_only_while_busy() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (mut half, _w) = stream::split(Connection::Plain(server));
        let mut keep = BufferKeep::new();
        let mut buf = BytesMut::new();
        let gave_back = std::cell::Cell::new(0);
        macro_rules! read_next {
            () => {
                read_giving_back(&mut half, &mut buf, &mut keep, || {
                    gave_back.set(gave_back.get() + 1)
                })
            };
        }

        client.write_all(b"one").await.unwrap();
        assert_eq!(read_next!().await.unwrap(), 3);
        assert_eq!(gave_back.get(), 1, "the first read takes a buffer");
        buf.advance(3);
        // After one request the buffer goes back before the wait (an idle connection holds
        // none), and a fresh one is taken.
        client.write_all(b"two").await.unwrap();
        assert_eq!(read_next!().await.unwrap(), 3);
        assert_eq!(gave_back.get(), 2);
        let second = buf.as_ptr();
        buf.advance(3);
        // Busy from the second request: the next one is read into the same buffer.
        client.write_all(b"three").await.unwrap();
        assert_eq!(read_next!().await.unwrap(), 5);
        assert_eq!(&buf[..], b"three");
        assert_eq!(buf.as_ptr(), second.wrapping_add(3));
        assert_eq!(gave_back.get(), 2, "kept: nothing given back");
        buf.advance(5);

        // Quiet for longer than the keep: the buffer and the ones kept with it go back.
        {
            let wait = read_next!();
            tokio::pin!(wait);
            tokio::select! {
                biased;
                _ = &mut wait => panic!("nothing was sent"),
                () = tokio::time::sleep(QUIET) => {}
            }
        }
        assert_eq!(gave_back.get(), 3);
        assert_eq!(buf.capacity(), 0, "a quiet connection holds no buffer");
        client.write_all(b"four").await.unwrap();
        assert_eq!(read_next!().await.unwrap(), 4);
        assert_eq!(&buf[..], b"four");
    }

    #[tokio::test(start_paused = true)]
    async fn the_output_buffer_is_kept_only_while_busy() {
        let mut keep = BufferKeep::new();
        let mut out = BytesMut::with_capacity(BUFFER);
        keep.used();
        assert_eq!(keeping(&mut keep, [&mut out], async { 7 }).await, 7);
        assert_eq!(out.capacity(), 0, "after one reply: given back at once");
        keep.used();
        out = BytesMut::with_capacity(BUFFER);
        assert_eq!(keeping(&mut keep, [&mut out], async { 7 }).await, 7);
        assert_eq!(out.capacity(), BUFFER, "busy: kept across a short wait");
        // Of the buffers kept with it, only the empty ones are given back.
        let mut partial = BytesMut::from(&b"+PON"[..]);
        let late = tokio::time::sleep(QUIET);
        keeping(&mut keep, [&mut out, &mut partial], late).await;
        assert_eq!(out.capacity(), 0, "given back during a long wait");
        assert_eq!(&partial[..], b"+PON");
    }

    #[test]
    fn only_the_canonical_spelling_is_relayed_as_it_came() {
        let args = [Bytes::from_static(b"GET"), Bytes::from_static(b"k")];
        assert!(canonical(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n", &args));
        assert!(!canonical(b"*2\r\n$03\r\nGET\r\n$1\r\nk\r\n", &args));
        assert!(!canonical(b"*+2\r\n$3\r\nGET\r\n$1\r\nk\r\n", &args));
        assert!(!canonical(b"GET k\r\n", &args));
    }

    proptest! {
        /// Whatever the parser accepts and `canonical` passes is exactly the re-encoding.
        #[test]
        fn canonical_means_identical_bytes(
            args in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..12), 1..5),
            spellings in prop::collection::vec(0usize..3, 6),
        ) {
            let spell = |n: usize, i: usize| match spellings[i % spellings.len()] {
                0 => n.to_string(),
                1 => format!("0{n}"),
                _ => format!("+{n}"),
            };
            let mut wire = format!("*{}\r\n", spell(args.len(), 0)).into_bytes();
            for (i, a) in args.iter().enumerate() {
                wire.extend_from_slice(format!("${}\r\n", spell(a.len(), i + 1)).as_bytes());
                wire.extend_from_slice(a);
                wire.extend_from_slice(b"\r\n");
            }
            let request = crate::frame::parse_request(&wire, &crate::frame::Limits::default())
                .unwrap()
                .unwrap();
            let encoded = Frame::command(request.args.iter().cloned()).to_bytes();
            prop_assert_eq!(canonical(&wire, &request.args), wire[..] == encoded[..]);
        }
    }

    #[test]
    fn reads_the_fence_from_the_script_error() {
        assert_eq!(
            stale_fence(b"FENCED job token 7 is below fence 12"),
            Some(12)
        );
        assert_eq!(stale_fence(b"ERR other"), None);
        assert!(is_missing_script(
            b"NOSCRIPT No matching script. Please use EVAL."
        ));
        assert!(is_missing_script(b"ERR Function not found"));
    }
}
