//! PURE: what replies each message sent upstream will get, in order, and what each upstream
//! message means for the session: relay it, swallow it (the guard's own replies), audit a stale
//! refusal, confirm a prepared statement. No I/O here; the two relay loops share a [`State`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use fencegate_core::{OperationSummary, Token};
use smallvec::smallvec;

use super::copy::{CopyPortals, CopyWatch};
use crate::classify::{Classified, Forget, Kind};
use crate::lexing::Lexing;
use crate::message::{self, ErrorFields, Frame};
use crate::sqlstate;

/// Who a reply belongs to.
#[derive(Debug, Clone)]
pub(super) enum Role {
    /// The client's own message: relay the replies.
    Client,
    /// The gateway's guard: swallow the replies, audit a stale refusal.
    Guard(Box<GuardInfo>),
    /// A refusal raised through the server (already audited): relay its error.
    Refusal,
}

#[derive(Debug, Clone)]
pub(super) struct GuardInfo {
    pub(super) token: Token,
    pub(super) summary: OperationSummary,
    /// Only the Execute of the extended guard decides; its Parse/Bind/Close only swallow.
    pub(super) decides: bool,
}

/// The last guard sent, and where in the stream of messages it was sent: the store's pass it
/// leaves lasts exactly as long as the transaction the guard ran in, so a later write in that
/// same transaction needs no guard of its own. Judged when messages are *sent* (replies may
/// still be on their way), so that a pipeline pays one guard; a misjudgment fails closed, as
/// the store's triggers refuse a write whose transaction holds no pass (FG002).
#[derive(Debug, Clone)]
pub(super) struct Pass {
    token: Token,
    /// [`State::epoch`] when the guard was sent: a transaction-control statement since may have
    /// ended its transaction.
    epoch: u64,
    /// [`State::scope`] when the guard was sent.
    scope: u64,
    /// A `BEGIN` was sent earlier in the guard's own scope (no transaction control between): if
    /// the guard ran, so did the `BEGIN`, and the guard's transaction outlives the scope.
    in_block: bool,
}

/// A client's Parse (`parsed: Some`) or Close (`None`) of a statement name. It changes the
/// gateway's statement map only when the server confirms it (ParseComplete, CloseComplete): a
/// Parse or Close the server skipped after an error must not change what a name means here
/// (issue 12, bypass 3).
#[derive(Debug, Clone)]
pub(super) struct StatementChange {
    name: String,
    seq: u64,
    parsed: Option<Arc<Classified>>,
}

/// A sent, not yet confirmed [`StatementChange`].
#[derive(Debug, Clone)]
pub(super) struct Inflight {
    seq: u64,
    /// The Sync segment it was sent in.
    segment: u64,
    parsed: Option<Arc<Classified>>,
}

/// What replies one forwarded (or locally answered) message gets.
#[derive(Debug)]
pub(super) enum Expect {
    Parse(Role, Option<Box<StatementChange>>),
    Bind(Role),
    Describe,
    /// `true`: watched, as it may start a COPY FROM STDIN ([`super::copy`]).
    Execute(Role, bool),
    Close(Role, Option<Box<StatementChange>>),
    /// `epoch`: [`State::epoch`] when it was sent.
    Sync {
        epoch: u64,
    },
    /// A simple Query (or FunctionCall): replies until ReadyForQuery. `parts` lists, in order,
    /// the statements whose replies are told apart (empty: relay everything); `epoch`:
    /// [`State::epoch`] once it was sent; `watched`: it may start a COPY FROM STDIN;
    /// `skippable`: sent inside a Sync segment, where the server skips it after an error.
    Query {
        parts: VecDeque<Role>,
        epoch: u64,
        watched: bool,
        skippable: bool,
    },
    /// A local answer, sent when it reaches the front of the queue.
    Local {
        bytes: Bytes,
        close: bool,
    },
}

impl Expect {
    /// Watched for a COPY FROM STDIN it may start ([`super::copy`]).
    fn watched(&self) -> bool {
        matches!(
            self,
            Self::Execute(_, true) | Self::Query { watched: true, .. }
        )
    }

    pub(super) fn is_extended(&self) -> bool {
        !matches!(
            self,
            Self::Sync { .. } | Self::Query { .. } | Self::Local { .. }
        )
    }
}

/// What both tasks share.
pub(super) struct State {
    pub(super) pending: VecDeque<Expect>,
    /// The last ReadyForQuery status: `I`, `T` or `E`.
    pub(super) status: u8,
    /// [`State::epoch`] when the request the last ReadyForQuery answers was sent.
    pub(super) status_epoch: u64,
    /// The last guard sent, if nothing since ended what it covers.
    pub(super) pass: Option<Pass>,
    /// Bumped by every transaction-control statement sent.
    pub(super) epoch: u64,
    /// Bumped by every Sync, simple Query and function call sent: each ends the transaction
    /// the messages before it ran in, unless a transaction block is open.
    pub(super) scope: u64,
    /// The scope a `BEGIN` was sent in, when no other transaction control was sent after it.
    pub(super) block_opened_in: Option<u64>,
    pub(super) session_token: Option<String>,
    /// The token from the startup options: what `RESET` goes back to, as for any setting.
    pub(super) startup_token: Option<String>,
    /// Settings that change how the server lexes SQL, as last reported.
    pub(super) lexing: Lexing,
    /// Prepared statements the server confirmed, by name. Shared with the Parse that sent each
    /// and with every Bind of it: a Bind takes a reference, not a copy.
    pub(super) statements: HashMap<String, Arc<Classified>>,
    /// The last name [`State::bound`] found in `statements` with no change of it in flight, and
    /// what it binds: a client binding one statement over and over is answered without hashing
    /// its name twice (issue 18's profile: 259 instructions per `pgbench -S -M prepared`
    /// transaction, 164 of them SipHash). Cleared by every change of `statements`, and not
    /// consulted while any Parse or Close is in flight.
    last_bound: Option<(String, Arc<Classified>)>,
    /// The latest unconfirmed Parse or Close per name.
    pub(super) inflight: HashMap<String, Inflight>,
    /// Names forgotten ([`State::forget`]) while a Parse or Close of them was in flight, with
    /// the number of the last such change: a confirmation of it, coming after the SQL that
    /// forgot the name, must not bring the old meaning back. Dropped once that change is done.
    forgotten: HashMap<String, u64>,
    /// Every change numbered up to this one was sent before a [`Forget::All`].
    forgotten_all: u64,
    /// What the statements bound since the last Sync or Query forget: they run at their
    /// Execute, which may follow a Parse of the same name, so they forget again when the
    /// segment ends ([`State::forget_bound`]). A set: a segment may bind many.
    bound_forgets: HashSet<String>,
    /// A statement bound since the last Sync or Query forgets all names.
    bound_forgets_all: bool,
    /// Bumped by every Sync sent: after an error the server skips messages up to the next Sync.
    pub(super) segment: u64,
    /// Numbers statement changes.
    pub(super) next_seq: u64,
    /// When each simple Query, Sync or FunctionCall was read, oldest first: the ReadyForQuery
    /// that answers it gives the request's latency. Here rather than behind a lock of its own,
    /// as both loops hold this state's lock where they note and take them (two locks per
    /// transaction less).
    pub(super) read_at: VecDeque<Instant>,
    /// The portals an Execute of which may start a COPY FROM STDIN.
    pub(super) copy_portals: CopyPortals,
    /// What the server said of the message watched for a COPY FROM STDIN.
    pub(super) copy: CopyWatch,
    /// An error came for an extended-protocol message and no Sync was sent after it: the
    /// server skips everything the gateway sends until its next Sync.
    skipping: bool,
}

impl State {
    /// A session's state right after its startup.
    pub(super) fn new(status: u8, session_token: Option<String>, lexing: Lexing) -> Self {
        Self {
            pending: VecDeque::new(),
            status,
            status_epoch: 0,
            pass: None,
            epoch: 0,
            scope: 0,
            block_opened_in: None,
            startup_token: session_token.clone(),
            session_token,
            lexing,
            statements: HashMap::new(),
            last_bound: None,
            inflight: HashMap::new(),
            forgotten: HashMap::new(),
            forgotten_all: 0,
            bound_forgets: HashSet::new(),
            bound_forgets_all: false,
            segment: 0,
            next_seq: 0,
            read_at: VecDeque::new(),
            copy_portals: CopyPortals::default(),
            copy: CopyWatch::default(),
            skipping: false,
        }
    }
}

impl State {
    /// Records a client's Parse or Close as sent.
    pub(super) fn change_sent(
        &mut self,
        name: String,
        parsed: Option<Classified>,
    ) -> Box<StatementChange> {
        self.next_seq += 1;
        let seq = self.next_seq;
        let parsed = parsed.map(Arc::new);
        self.inflight.insert(
            name.clone(),
            Inflight {
                seq,
                segment: self.segment,
                parsed: parsed.clone(),
            },
        );
        Box::new(StatementChange { name, seq, parsed })
    }

    /// The server confirmed `change` (`true`) or skipped it (`false`).
    pub(super) fn change_done(&mut self, change: &StatementChange, confirmed: bool) {
        let forgotten = self.forgotten.get(&change.name).copied();
        if forgotten == Some(change.seq) {
            self.forgotten.remove(&change.name);
        }
        let forgotten =
            change.seq <= self.forgotten_all || forgotten.is_some_and(|s| change.seq <= s);
        if confirmed && !forgotten {
            self.last_bound = None;
            match &change.parsed {
                Some(parsed) => {
                    self.statements.insert(change.name.clone(), parsed.clone());
                }
                None => {
                    self.statements.remove(&change.name);
                }
            }
        }
        if self
            .inflight
            .get(&change.name)
            .is_some_and(|i| i.seq == change.seq)
        {
            self.inflight.remove(&change.name);
        }
    }

    /// A statement that creates or drops prepared statements in SQL is sent now: until a Parse
    /// sent after it, the names it touches bind what the gateway cannot see, so a Bind of one
    /// is judged a write ([`unknown_statement`]). A Parse or Close of them still in flight was
    /// sent before it: its confirmation changes nothing here.
    pub(super) fn forget(&mut self, forget: &Forget) {
        self.last_bound = None;
        match forget {
            Forget::All => {
                self.statements.clear();
                self.inflight.clear();
                self.forgotten.clear();
                self.forgotten_all = self.next_seq;
            }
            Forget::Name(name) => {
                self.statements.remove(name);
                if let Some(inflight) = self.inflight.remove(name) {
                    self.forgotten.insert(name.clone(), inflight.seq);
                }
            }
        }
    }

    /// A Bind of a statement that forgets (`forget`) is sent now: it forgets now and once more
    /// when the Sync or Query that ends its segment is sent, by which time its Execute (and any
    /// Parse sent before it) has gone out.
    pub(super) fn forget_bound(&mut self, forget: &Forget) {
        self.forget(forget);
        match forget {
            Forget::All => {
                self.bound_forgets_all = true;
                self.bound_forgets.clear();
            }
            Forget::Name(name) if !self.bound_forgets_all => {
                self.bound_forgets.insert(name.clone());
            }
            Forget::Name(_) => {}
        }
    }

    /// The segment ends: the statements bound in it have been executed, if at all.
    fn segment_ended(&mut self) {
        if std::mem::take(&mut self.bound_forgets_all) {
            self.forget(&Forget::All);
        }
        // Checked first: every Sync and Query comes here, and a fresh set costs a key.
        if !self.bound_forgets.is_empty() {
            for name in std::mem::take(&mut self.bound_forgets) {
                self.forget(&Forget::Name(name));
            }
        }
    }

    /// An expected reply that will never come (the server skipped the message).
    pub(super) fn skipped(&mut self, expect: Expect) {
        if let Expect::Parse(_, Some(change)) | Expect::Close(_, Some(change)) = expect {
            self.change_done(&change, false);
        }
    }

    /// Pops the front entry: its message was answered in full, or skipped by the server. A
    /// watched one ends the watch, however its message ended.
    #[inline]
    fn pop(&mut self) -> Option<Expect> {
        let expect = self.pending.pop_front()?;
        if expect.watched() {
            self.copy.ended();
        }
        Some(expect)
    }

    /// Pops the entries at the front whose messages the server skipped, while `skipped` says so.
    fn skip_while(&mut self, skipped: impl Fn(&Expect) -> bool) {
        while self.pending.front().is_some_and(&skipped) {
            if let Some(expect) = self.pop() {
                self.skipped(expect);
            }
        }
    }

    /// What a Bind of `name` sent now will bind, as far as the gateway can tell: a Parse sent in
    /// this Sync segment either succeeds or makes the server skip this Bind too; one from an
    /// earlier segment may have been skipped, so the more dangerous of the two counts. A name
    /// the gateway never saw confirmed (a SQL `PREPARE`, a skipped Parse) or forgot
    /// ([`State::forget`]) is a write.
    pub(super) fn bound(&mut self, name: &str) -> Arc<Classified> {
        // With nothing in flight, what a name binds is what the server confirmed.
        let settled = self.inflight.is_empty();
        if settled {
            if let Some((last, classified)) = &self.last_bound {
                if last == name {
                    return classified.clone();
                }
            }
        }
        let confirmed = self.statements.get(name);
        let inflight = self
            .inflight
            .get(name)
            .and_then(|i| i.parsed.as_ref().map(|p| (i.segment == self.segment, p)));
        match (inflight, confirmed) {
            (Some((true, parsed)), _) | (Some((false, parsed)), None) => parsed.clone(),
            (Some((false, parsed)), Some(old)) if parsed.has_write() || !old.has_write() => {
                parsed.clone()
            }
            (_, Some(old)) => {
                let old = old.clone();
                if settled {
                    // The name's buffer is reused: a client alternating between statements
                    // allocates nothing here.
                    let (last, classified) = self
                        .last_bound
                        .get_or_insert_with(|| (String::new(), old.clone()));
                    last.clear();
                    last.push_str(name);
                    *classified = old.clone();
                }
                old
            }
            (None, None) => Arc::new(unknown_statement(name)),
        }
    }

    /// The token a statement sent now runs covered by (its transaction is the one a guard for
    /// that token was sent in), if any. Between the guard and now no transaction control was
    /// sent, and one of:
    /// - nothing ended the extended protocol's implicit transaction either (same scope): an
    ///   error in it makes the server skip everything up to the Sync, this statement included;
    /// - the guard ran inside a transaction block opened in its own scope;
    /// - the server last reported an open, healthy transaction block (`T`) for a request sent
    ///   after the last transaction control: the guard ran in that block (had it failed, the
    ///   block would be `E`), and the block is still open.
    ///
    /// An error after the guard aborts the block (`E`): every statement fails until ROLLBACK.
    pub(super) fn covered(&self) -> Option<&Token> {
        let pass = self.pass.as_ref()?;
        let block_confirmed = self.status == b'T' && self.status_epoch == self.epoch;
        let same = pass.epoch == self.epoch
            && (pass.scope == self.scope || pass.in_block || block_confirmed);
        same.then_some(&pass.token)
    }

    /// A guard for `token` is sent now.
    pub(super) fn guard_sent(&mut self, token: Token) {
        self.pass = Some(Pass {
            token,
            epoch: self.epoch,
            scope: self.scope,
            in_block: self.block_opened_in == Some(self.scope),
        });
    }

    /// A transaction-control statement is sent now; `begins`: the last one is a `BEGIN` (or
    /// `START TRANSACTION`).
    pub(super) fn control_sent(&mut self, begins: bool) {
        self.epoch += 1;
        self.block_opened_in = begins.then_some(self.scope);
    }

    /// A statement that may end its transaction other than as transaction control (CALL, DO,
    /// VACUUM, ...) is sent now: the next write is guarded again.
    pub(super) fn pass_ended(&mut self) {
        self.pass = None;
    }

    /// A Sync is sent now.
    #[inline]
    pub(super) fn sync_sent(&mut self) {
        self.skipping = false;
        self.segment_ended();
        self.segment += 1;
        self.scope += 1;
        self.pending.push_back(Expect::Sync { epoch: self.epoch });
    }

    /// A simple Query or function call whose replies are told apart by `parts` is sent now
    /// (transaction control in it already counted); `watched`: it may start a COPY FROM STDIN.
    pub(super) fn query_sent(&mut self, parts: VecDeque<Role>, watched: bool) {
        self.segment_ended();
        self.scope += 1;
        if watched {
            self.copy.watch();
        }
        self.pending.push_back(Expect::Query {
            parts,
            epoch: self.epoch,
            watched,
            skippable: false,
        });
    }

    /// A simple Query is sent now inside a Sync segment (transaction control only, relayed as
    /// it came): the server skips it if an error came in the segment before it. If one did
    /// already, nothing is queued for it; if one comes, the error's skipping pops it.
    pub(super) fn skippable_query_sent(&mut self) {
        self.segment_ended();
        self.scope += 1;
        if !self.skipping {
            self.pending.push_back(Expect::Query {
                parts: VecDeque::new(),
                epoch: self.epoch,
                watched: false,
                skippable: true,
            });
        }
    }

    /// A client's Execute is sent now; `may_copy`: it may start a COPY FROM STDIN. Returns
    /// whether it is watched: not if the server skips it (an error came in this Sync segment
    /// before it, so its answer, the Sync's, is one the request loop would be holding back).
    pub(super) fn execute_sent(&mut self, may_copy: bool) -> bool {
        let watched = may_copy && !self.skipping;
        if watched {
            self.copy.watch();
        }
        self.pending
            .push_back(Expect::Execute(Role::Client, watched));
        watched
    }

    /// A CopyInResponse arrived: whether the message it answers was watched (if not, the
    /// server reads a COPY's data the gateway did not expect).
    fn copy_started(&mut self) -> bool {
        let watched = self.pending.front().is_some_and(Expect::watched);
        if watched {
            self.copy.started();
        }
        watched
    }
}

/// A statement the gateway cannot see: fail closed, as a write.
pub(super) fn unknown_statement(name: &str) -> Classified {
    Classified {
        statements: smallvec![crate::classify::Statement {
            start: 0,
            end: 0,
            kind: Kind::Write,
            command: "EXECUTE".into(),
            targets: Vec::new(),
            comment_token: None,
            may_end_transaction: true,
            forgets: None,
            copies_in: true,
            targets_exact: false,
        }],
        parse_error: Some(format!(
            "prepared statement {name:?} is not known to the gateway"
        )),
    }
}

/// What to do with one upstream message.
pub(super) struct Outcome {
    pub(super) forward: bool,
    pub(super) applied: bool,
    /// Anything more than relaying it: rare, so boxed. An `Outcome` is returned for every
    /// upstream message, and the one of a message relayed as it came has nothing to drop (with
    /// both parts inline, each drop cost about 17 instructions: 85 per `pgbench -S -M prepared`
    /// transaction, issue 18's profile).
    pub(super) special: Option<Box<Special>>,
}

/// The rare part of an [`Outcome`].
#[derive(Default)]
pub(super) struct Special {
    /// The session must end, for this reason, told to the client instead of the message.
    pub(super) end: Option<String>,
    /// Send this instead of the message (the guard's error, explained).
    pub(super) replace: Option<Bytes>,
    /// The guard refused a stale token: what to audit, and the fence its error reported (the
    /// guard's own box, not a copy).
    pub(super) stale: Option<(Box<GuardInfo>, Option<u64>)>,
}

impl Outcome {
    /// Relayed as it came, with nothing else to do than count an applied write.
    pub(super) fn plain(&self) -> bool {
        self.forward && self.special.is_none()
    }

    fn special(&mut self) -> &mut Special {
        self.special.get_or_insert_with(Box::default)
    }
}

/// Matches one upstream message against the queue of expected replies. `#[inline]`: called
/// once per reply from one place, and left out of line without the hint once it grew (issue 18).
#[inline]
pub(super) fn on_reply<B: AsRef<[u8]>>(state: &mut State, frame: &Frame<B>) -> Outcome {
    let mut outcome = Outcome {
        forward: true,
        applied: false,
        special: None,
    };
    if frame.tag == b'G' && !state.copy_started() {
        outcome.special().end = Some(
            "the server started a COPY FROM STDIN where the gateway expected none; the session is closed, as the gateway can no longer tell which reply answers which request".to_owned(),
        );
    }
    match frame.tag {
        // Asynchronous: notices, parameter changes, notifications.
        b'S' => state.lexing.observe(frame.body()),
        b'N' | b'A' => {}
        b'E' => {
            let failed_role = match state.pending.front_mut() {
                Some(Expect::Query { parts, .. }) => {
                    let role = parts.pop_front();
                    parts.clear();
                    role
                }
                Some(e) if e.is_extended() => {
                    let role = match state.pop() {
                        Some(Expect::Bind(r) | Expect::Execute(r, _)) => Some(r),
                        Some(Expect::Parse(r, change) | Expect::Close(r, change)) => {
                            if let Some(change) = change {
                                state.change_done(&change, false);
                            }
                            Some(r)
                        }
                        _ => None,
                    };
                    // The server skips everything up to the next Sync, and what is sent before
                    // the gateway's next one.
                    state.skip_while(|e| {
                        e.is_extended()
                            || matches!(
                                e,
                                Expect::Query {
                                    skippable: true,
                                    ..
                                }
                            )
                    });
                    state.skipping = !matches!(state.pending.front(), Some(Expect::Sync { .. }));
                    role
                }
                _ => None,
            };
            let code = message::error_code_and_detail(frame).map(|(code, _)| code);
            if matches!(failed_role, Some(Role::Guard(_) | Role::Refusal))
                && matches!(code.as_deref(), Some("3F000" | "42883"))
            {
                outcome.special().replace = Some(message::error_response(&ErrorFields {
                    severity: "ERROR",
                    code: sqlstate::NOT_INSTALLED.to_owned(),
                    message: format!(
                        "{}; nothing was written",
                        sqlstate::not_installed_message("this database")
                    ),
                    detail: None,
                }));
            }
            if let Some(Role::Guard(info)) = failed_role {
                if let Some((code, detail)) = message::error_code_and_detail(frame) {
                    if code == sqlstate::STALE {
                        let fence = detail.as_deref().and_then(fence_from_detail);
                        outcome.special().stale = Some((info, fence));
                    }
                }
            }
        }
        b'Z' => {
            // Messages the server skipped after an error get no reply of their own.
            state.skip_while(Expect::is_extended);
            if let Some(Expect::Sync { epoch } | Expect::Query { epoch, .. }) =
                state.pending.front()
            {
                state.status_epoch = *epoch;
                state.pop();
            }
            state.status = frame.body().first().copied().unwrap_or(b'I');
        }
        tag => {
            let terminal_query = matches!(tag, b'C' | b'I');
            let mut done = None;
            match state.pending.front_mut() {
                Some(Expect::Query { parts, .. }) => {
                    if let Some(role) = parts.front() {
                        outcome.forward = matches!(role, Role::Client);
                        if terminal_query {
                            done = parts.pop_front();
                        }
                    }
                }
                Some(expect) => {
                    let (terminal, role) = match expect {
                        Expect::Parse(r, _) => (tag == b'1', Some(&*r)),
                        Expect::Bind(r) => (tag == b'2', Some(&*r)),
                        Expect::Close(r, _) => (tag == b'3', Some(&*r)),
                        Expect::Describe => (matches!(tag, b'T' | b'n'), None),
                        Expect::Execute(r, _) => (matches!(tag, b'C' | b'I' | b's'), Some(&*r)),
                        Expect::Sync { .. } | Expect::Query { .. } | Expect::Local { .. } => {
                            (false, None)
                        }
                    };
                    if let Some(role) = role {
                        outcome.forward = matches!(role, Role::Client);
                    }
                    if terminal {
                        done = match state.pop() {
                            Some(Expect::Execute(r, _)) => Some(r),
                            Some(
                                Expect::Parse(_, Some(change)) | Expect::Close(_, Some(change)),
                            ) => {
                                state.change_done(&change, true);
                                None
                            }
                            _ => None,
                        };
                    }
                }
                None => {}
            }
            if let Some(Role::Guard(info)) = done {
                if tag == b'C' && info.decides {
                    outcome.applied = true;
                }
            }
        }
    }
    outcome
}

/// The fence from the guard's DETAIL `resource=... revision=... fence=N`.
pub(super) fn fence_from_detail(detail: &str) -> Option<u64> {
    detail
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("fence="))
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use fencegate_core::{Resource, Revision};

    use super::*;

    fn frame(tag: u8, body: &[u8]) -> Frame {
        let mut raw = vec![tag];
        raw.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        raw.extend_from_slice(body);
        Frame {
            tag,
            raw: Bytes::from(raw),
        }
    }

    fn state() -> State {
        State::new(b'I', None, Lexing::default())
    }

    fn guard(decides: bool) -> Role {
        Role::Guard(Box::new(GuardInfo {
            token: token(),
            summary: OperationSummary::default(),
            decides,
        }))
    }

    fn stale_error() -> Frame {
        let bytes = message::error_response(&ErrorFields {
            severity: "ERROR",
            code: sqlstate::STALE.to_owned(),
            message: "stale".to_owned(),
            detail: Some("resource=job revision=7 fence=9".to_owned()),
        });
        frame(b'E', &bytes[5..])
    }

    /// Feeds frames; returns the tags relayed to the client.
    fn relay(state: &mut State, frames: &[Frame]) -> (String, Vec<Option<u64>>) {
        let mut out = String::new();
        let mut stale = Vec::new();
        for f in frames {
            let o = on_reply(state, f);
            if o.forward {
                out.push(char::from(f.tag));
            }
            if let Some((_, fence)) = o.special.and_then(|s| s.stale) {
                stale.push(fence);
            }
        }
        (out, stale)
    }

    #[test]
    fn simple_query_guard_replies_are_swallowed() {
        let mut s = state();
        s.pending.push_back(Expect::Query {
            parts: VecDeque::from([guard(true), Role::Client]),
            epoch: 0,
            watched: false,
            skippable: false,
        });
        let frames = [
            frame(b'T', b""),
            frame(b'D', b""),
            frame(b'C', b"SELECT 1\0"),
            frame(b'C', b"INSERT 0 1\0"),
            frame(b'Z', b"I"),
        ];
        assert_eq!(relay(&mut s, &frames), ("CZ".to_owned(), vec![]));
        assert!(s.pending.is_empty());
    }

    #[test]
    fn a_stale_guard_is_reported_once_and_its_error_relayed() {
        let mut s = state();
        s.pending.push_back(Expect::Query {
            parts: VecDeque::from([guard(true), Role::Client]),
            epoch: 0,
            watched: false,
            skippable: false,
        });
        let frames = [stale_error(), frame(b'Z', b"I")];
        assert_eq!(relay(&mut s, &frames), ("EZ".to_owned(), vec![Some(9)]));
    }

    #[test]
    fn extended_guard_replies_are_invisible() {
        let mut s = state();
        s.status = b'T';
        s.pending.extend([
            Expect::Close(guard(false), None),
            Expect::Close(guard(false), None),
            Expect::Parse(guard(false), None),
            Expect::Bind(guard(false)),
            Expect::Execute(guard(true), false),
            Expect::Bind(Role::Client),
            Expect::Execute(Role::Client, false),
            Expect::Sync { epoch: 0 },
        ]);
        let frames = [
            frame(b'3', b""),
            frame(b'3', b""),
            frame(b'1', b""),
            frame(b'2', b""),
            frame(b'D', b""),
            frame(b'C', b"SELECT 1\0"),
            frame(b'2', b""),
            frame(b'C', b"INSERT 0 1\0"),
            frame(b'Z', b"T"),
        ];
        assert_eq!(relay(&mut s, &frames), ("2CZ".to_owned(), vec![]));
        assert!(s.pending.is_empty());
    }

    #[test]
    fn an_error_skips_to_sync_like_the_server() {
        let mut s = state();
        s.pending.extend([
            Expect::Parse(Role::Client, None),
            Expect::Close(guard(false), None),
            Expect::Close(guard(false), None),
            Expect::Parse(guard(false), None),
            Expect::Bind(guard(false)),
            Expect::Execute(guard(true), false),
            Expect::Bind(Role::Client),
            Expect::Execute(Role::Client, false),
        ]);
        // The client's Sync arrives after the error: the skipped messages get no replies.
        let frames = [
            frame(b'1', b""),
            frame(b'3', b""),
            frame(b'3', b""),
            frame(b'1', b""),
            frame(b'2', b""),
            stale_error(),
        ];
        assert_eq!(relay(&mut s, &frames), ("1E".to_owned(), vec![Some(9)]));
        s.pending.push_back(Expect::Sync { epoch: 0 });
        assert_eq!(relay(&mut s, &[frame(b'Z', b"I")]).0, "Z");
        assert!(s.pending.is_empty());
    }

    /// Issue 12, bypass 3: the statement map follows the server's confirmations.
    #[test]
    fn statements_change_only_when_the_server_confirms() {
        use crate::classify::classify;
        let mut s = state();
        // Parse("", DELETE) confirmed.
        let change = s.change_sent(String::new(), Some(classify("DELETE FROM t")));
        s.pending
            .push_back(Expect::Parse(Role::Client, Some(change)));
        relay(&mut s, &[frame(b'1', b"")]);
        assert!(s.bound("").has_write());
        // An error, then Parse("", SELECT) which the server skips, then Sync.
        s.segment += 1;
        let change = s.change_sent(String::new(), Some(classify("SELECT 1")));
        s.pending.push_back(Expect::Execute(Role::Client, false));
        s.pending
            .push_back(Expect::Parse(Role::Client, Some(change)));
        s.pending.push_back(Expect::Sync { epoch: 0 });
        relay(&mut s, &[stale_error(), frame(b'Z', b"I")]);
        s.segment += 1;
        assert!(
            s.bound("").has_write(),
            "a skipped Parse must not replace a write"
        );
        // A Parse in flight from an earlier segment: the more dangerous meaning counts.
        let change = s.change_sent(String::new(), Some(classify("SELECT 1")));
        s.segment += 1;
        assert!(s.bound("").has_write());
        s.pending
            .push_back(Expect::Parse(Role::Client, Some(change)));
        relay(&mut s, &[frame(b'1', b"")]);
        assert!(!s.bound("").has_write());
        // Never seen (a SQL PREPARE): a write.
        assert!(s.bound("p").has_write());
        // A Close the server skipped keeps the statement.
        let change = s.change_sent(String::new(), None);
        s.skipped(Expect::Close(Role::Client, Some(change)));
        assert!(s.statements.contains_key(""));
    }

    /// Issue 18: the last statement bound is remembered, never past a change of what it means.
    #[test]
    fn a_remembered_bind_follows_every_change_of_its_statement() {
        use crate::classify::classify;
        let mut s = state();
        let confirm = |s: &mut State, name: &str, sql: Option<&str>| {
            let change = s.change_sent(name.to_owned(), sql.map(classify));
            let expect = match sql {
                Some(_) => Expect::Parse(Role::Client, Some(change)),
                None => Expect::Close(Role::Client, Some(change)),
            };
            s.pending.push_back(expect);
            let reply = if sql.is_some() { b'1' } else { b'3' };
            relay(s, &[frame(reply, b"")]);
        };
        confirm(&mut s, "a", Some("SELECT 1"));
        confirm(&mut s, "b", Some("DELETE FROM t"));
        for _ in 0..2 {
            assert!(!s.bound("a").has_write());
            assert!(!s.bound("a").has_write(), "remembered");
            assert!(s.bound("b").has_write(), "another name is looked up");
            assert!(s.bound("bb").has_write(), "never seen: a write");
        }
        assert!(!s.bound("a").has_write());
        // A Parse of the remembered name in flight: what it may bind counts, not what was
        // remembered.
        let change = s.change_sent("a".to_owned(), Some(classify("DELETE FROM t")));
        assert!(
            s.bound("a").has_write(),
            "a Parse in flight in this segment"
        );
        s.pending
            .push_back(Expect::Parse(Role::Client, Some(change)));
        relay(&mut s, &[frame(b'1', b"")]);
        assert!(s.bound("a").has_write(), "confirmed");
        assert!(s.bound("a").has_write(), "remembered");
        // Closed: no longer known to the gateway, so a write.
        confirm(&mut s, "a", Some("SELECT 1"));
        assert!(!s.bound("a").has_write());
        confirm(&mut s, "a", None);
        assert!(s.bound("a").has_write(), "closed");
        // A Close the server skipped changes nothing.
        confirm(&mut s, "a", Some("SELECT 1"));
        assert!(!s.bound("a").has_write());
        let change = s.change_sent("a".to_owned(), None);
        s.skipped(Expect::Close(Role::Client, Some(change)));
        assert!(!s.bound("a").has_write());
    }

    /// SQL that drops or creates prepared statements: their names bind what the gateway cannot
    /// see, and a Parse or Close of them still in flight cannot bring the old meaning back.
    #[test]
    fn names_forgotten_in_sql_are_writes_until_parsed_again() {
        use crate::classify::{classify, Forget};
        let mut s = state();
        let parse = |s: &mut State, name: &str, sql: &str| {
            let change = s.change_sent(name.to_owned(), Some(classify(sql)));
            s.pending
                .push_back(Expect::Parse(Role::Client, Some(change)));
        };
        let confirmed = |s: &mut State| relay(s, &[frame(b'1', b"")]);
        parse(&mut s, "a", "SELECT 1");
        parse(&mut s, "b", "SELECT 1");
        confirmed(&mut s);
        confirmed(&mut s);
        assert!(!s.bound("a").has_write());
        s.forget(&Forget::Name("a".to_owned()));
        assert!(
            s.bound("a").has_write(),
            "deallocated and maybe prepared again"
        );
        assert!(!s.bound("b").has_write(), "another name is untouched");
        // Parsed again after the SQL: known again once confirmed.
        parse(&mut s, "a", "SELECT 1");
        confirmed(&mut s);
        assert!(!s.bound("a").has_write());

        // A Parse in flight when the SQL is sent: its confirmation comes later and changes
        // nothing, for one name and for all of them.
        parse(&mut s, "a", "SELECT 2");
        parse(&mut s, "a", "SELECT 3");
        s.forget(&Forget::Name("a".to_owned()));
        confirmed(&mut s);
        confirmed(&mut s);
        assert!(
            s.bound("a").has_write(),
            "confirmed after the SQL that forgot it"
        );
        assert!(
            s.forgotten.is_empty(),
            "kept only while its changes are in flight"
        );
        parse(&mut s, "b", "SELECT 2");
        s.forget(&Forget::All);
        parse(&mut s, "c", "SELECT 1");
        confirmed(&mut s);
        confirmed(&mut s);
        assert!(s.bound("b").has_write(), "in flight before DISCARD ALL");
        assert!(!s.bound("c").has_write(), "parsed after it");
        // A remembered Bind is forgotten too.
        assert!(!s.bound("c").has_write());
        s.forget(&Forget::Name("c".to_owned()));
        assert!(s.bound("c").has_write());
    }

    /// What a segment's Binds forget is kept as a set (a segment may bind many: a list was
    /// searched once per Bind) and forgotten again when the segment ends.
    #[test]
    fn a_segment_forgets_again_at_its_end() {
        use crate::classify::{classify, Forget};
        let mut s = state();
        for i in 0..10_000 {
            s.forget_bound(&Forget::Name(format!("n{}", i % 5_000)));
        }
        assert_eq!(s.bound_forgets.len(), 5_000);
        // A Parse of a forgotten name sent after its Bind: voided when the segment ends.
        let change = s.change_sent("n1".to_owned(), Some(classify("SELECT 1")));
        s.pending
            .push_back(Expect::Parse(Role::Client, Some(change)));
        s.sync_sent();
        assert!(s.bound_forgets.is_empty());
        relay(&mut s, &[frame(b'1', b"")]);
        assert!(s.bound("n1").has_write(), "voided at the Sync");
        s.forget_bound(&Forget::All);
        s.forget_bound(&Forget::Name("x".to_owned()));
        assert!(s.bound_forgets_all && s.bound_forgets.is_empty());
        s.query_sent(VecDeque::new(), false);
        assert!(!s.bound_forgets_all);
    }

    fn token() -> Token {
        Token::new(Resource::new("job").unwrap(), Revision::new(7).unwrap())
    }

    /// Issue 18: one guard per transaction, judged when messages are sent.
    #[test]
    fn a_pass_covers_its_implicit_transaction_until_the_sync() {
        let mut s = state();
        s.guard_sent(token());
        assert_eq!(s.covered(), Some(&token()), "same Sync segment");
        s.sync_sent();
        assert_eq!(s.covered(), None, "the Sync ended the implicit transaction");
        s.guard_sent(token());
        s.query_sent(VecDeque::new(), false);
        assert_eq!(s.covered(), None, "a simple Query ends it too");
    }

    #[test]
    fn a_pass_ends_with_transaction_control_or_a_statement_that_may_commit() {
        let mut s = state();
        s.guard_sent(token());
        s.control_sent(false);
        assert_eq!(s.covered(), None, "COMMIT or ROLLBACK");
        s.guard_sent(token());
        s.pass_ended();
        assert_eq!(s.covered(), None, "CALL, DO, VACUUM, ...");
        // A block opened and guarded in one pipeline lasts across its Syncs...
        s.control_sent(true);
        s.guard_sent(token());
        s.sync_sent();
        s.sync_sent();
        assert_eq!(s.covered(), Some(&token()));
        // ... until its COMMIT.
        s.control_sent(false);
        assert_eq!(s.covered(), None);
        // A BEGIN in an earlier Sync segment may have been skipped after an error there.
        s.control_sent(true);
        s.sync_sent();
        s.guard_sent(token());
        s.sync_sent();
        assert_eq!(s.covered(), None);
    }

    #[test]
    fn a_block_the_server_reported_open_keeps_the_pass_across_syncs() {
        let mut s = state();
        // BEGIN, answered `T`.
        s.control_sent(true);
        s.query_sent(VecDeque::new(), false);
        relay(&mut s, &[frame(b'Z', b"T")]);
        s.guard_sent(token());
        s.sync_sent();
        assert_eq!(s.covered(), Some(&token()));
        // An answer to a request sent before a later COMMIT says nothing about after it.
        s.control_sent(false);
        s.sync_sent();
        relay(&mut s, &[frame(b'Z', b"T")]);
        s.guard_sent(token());
        s.sync_sent();
        assert_eq!(s.covered(), None);
        // A failed block (`E`) does not count as open.
        let mut s = state();
        s.control_sent(true);
        s.query_sent(VecDeque::new(), false);
        relay(&mut s, &[frame(b'Z', b"E")]);
        s.guard_sent(token());
        s.sync_sent();
        assert_eq!(s.covered(), None);
    }

    #[test]
    fn fence_is_read_from_the_guard_detail() {
        assert_eq!(
            fence_from_detail("resource=job revision=7 fence=12"),
            Some(12)
        );
        assert_eq!(fence_from_detail("nothing"), None);
    }

    /// A watched Execute: its CopyInResponse is counted, its CommandComplete ends the watch.
    #[test]
    fn a_watched_execute_reports_its_copy_and_its_end() {
        let mut s = state();
        assert!(s.execute_sent(true));
        s.sync_sent();
        let o = on_reply(&mut s, &frame(b'G', b"\0\0\0"));
        assert!(o.plain(), "relayed");
        assert_eq!(
            (s.copy.started, s.copy.done, s.copy.changed),
            (1, false, true)
        );
        s.copy.changed = false;
        assert_eq!(relay(&mut s, &[frame(b'C', b"COPY 2\0")]).0, "C");
        assert_eq!(
            (s.copy.started, s.copy.done, s.copy.changed),
            (1, true, true)
        );
        assert!(matches!(s.pending.front(), Some(Expect::Sync { .. })));
    }

    /// A COPY the gateway did not expect ends the session.
    #[test]
    fn an_unexpected_copy_ends_the_session() {
        let mut s = state();
        assert!(!s.execute_sent(false));
        let o = on_reply(&mut s, &frame(b'G', b"\0\0\0"));
        assert!(o.special.is_some_and(|s| s.end.is_some()));
        assert_eq!(s.copy.started, 0);
        // Nor may a simple Query that was not watched start one.
        let mut s = state();
        s.query_sent(VecDeque::new(), false);
        let o = on_reply(&mut s, &frame(b'G', b"\0\0\0"));
        assert!(o.special.is_some_and(|s| s.end.is_some()));
    }

    /// A watched Query ends at its ReadyForQuery, after an error in its COPY too; a watched
    /// Execute skipped after an earlier error ends the watch as well.
    #[test]
    fn a_watch_ends_however_the_message_ends() {
        let mut s = state();
        s.query_sent(VecDeque::new(), true);
        let frames = [
            frame(b'G', b"\0\0\0"),
            frame(b'E', b"SERROR\0C22P02\0Mbad\0\0"),
            frame(b'Z', b"I"),
        ];
        assert_eq!(relay(&mut s, &frames).0, "GEZ");
        assert_eq!((s.copy.started, s.copy.done), (1, true));
        assert!(s.pending.is_empty());

        let mut s = state();
        s.pending.push_back(Expect::Bind(Role::Client));
        assert!(s.execute_sent(true));
        s.sync_sent();
        let frames = [
            frame(b'E', b"SERROR\0C42P01\0Mno table\0\0"),
            frame(b'Z', b"I"),
        ];
        assert_eq!(relay(&mut s, &frames).0, "EZ");
        assert_eq!((s.copy.started, s.copy.done), (0, true));
        assert!(s.pending.is_empty());
    }

    /// After an error in a Sync segment the server skips what follows up to the next Sync: an
    /// Execute sent then is not watched (its answer would be the Sync's), until a Sync is sent.
    #[test]
    fn an_execute_the_server_skips_is_not_watched() {
        let mut s = state();
        s.pending.push_back(Expect::Parse(Role::Client, None));
        on_reply(&mut s, &frame(b'E', b"SERROR\0C42601\0Msyntax\0\0"));
        assert!(!s.execute_sent(true), "skipped by the server");
        s.sync_sent();
        assert!(s.execute_sent(true), "after the Sync");
        // An error whose segment's Sync is already queued ends the skipping there.
        let mut s = state();
        s.pending.push_back(Expect::Parse(Role::Client, None));
        s.sync_sent();
        on_reply(&mut s, &frame(b'E', b"SERROR\0C42601\0Msyntax\0\0"));
        assert!(s.execute_sent(true));
    }
}
