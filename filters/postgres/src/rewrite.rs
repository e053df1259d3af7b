//! PURE: a classified statement plus the session's token state in, the messages to send out.
//!
//! - Simple protocol: the guard `CALL fencegate.guard_proc('<token>');` is spliced into the
//!   client's Query text right before each write, so guard and write run in one Query message
//!   (one implicit transaction, or inside the client's explicit one). Reads are relayed
//!   byte-for-byte. A `CALL` of the procedure, not a `SELECT` of `fencegate.guard(text)`: the
//!   server skips planning and starting an executor for it.
//! - Extended protocol: before the client's `Bind` of a write, the gateway sends the guard as
//!   `Parse`/`Bind`/`Execute`/`Close` in the same pipeline, before the client's `Sync`.
//! - Gateway-side refusals (missing, malformed, forged token) either never reach the server
//!   (simple protocol, no transaction open) or are raised *through* it with
//!   `fencegate.refuse(...)`, so an open transaction or pipeline is aborted exactly as a server
//!   error would abort it. The write itself is never sent.

use bytes::{Bytes, BytesMut};
use fencegate_core::{RejectReason, Rejection, Resource, Token, TokenPolicy, Verdict};
use postgres_protocol::message::frontend;
use postgres_protocol::IsNull;
use smallvec::SmallVec;

use crate::classify::{Classified, Kind, Statement};
use crate::sqlstate;

/// The name of the guard's prepared statement and portal on the upstream connection.
pub const GUARD_NAME: &str = "fencegate_guard";
/// What an extended-protocol `SET fencegate.token = '...'` is prepared as upstream: the same
/// replies, without the token.
pub const SET_TOKEN_PLACEHOLDER: &str = "SET fencegate.token TO DEFAULT";

/// Tables in this schema hold the fences; clients may not write them through the gateway.
pub const FENCE_SCHEMA_PREFIX: &str = "fencegate.";

/// The name of the refusal's prepared statement and portal on the upstream connection.
pub const REFUSE_NAME: &str = "fencegate_refuse";

/// What the gateway knows when it decides about one write.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// Whether this connection's database is protected.
    pub protected: bool,
    /// Schemas whose tables are not protected.
    pub unprotected_schemas: &'a [String],
    /// The resource tokens must name (and plain tokens take), if configured.
    pub route: Option<&'a Resource>,
    /// Which tokens are accepted.
    pub policy: &'a TokenPolicy,
    /// The session token (from `SET` or the startup options), as presented.
    pub session_token: Option<&'a str>,
}

/// The decision for one statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Relay untouched (a read, or a write to an unprotected database or schema).
    Pass,
    /// Run the guard for this token before the statement.
    Guard(Token),
    /// Refuse the statement (and the message it is in).
    Refuse(Rejection),
}

impl Decision {
    /// The verdict this decision amounts to.
    pub fn verdict(&self) -> Verdict {
        match self {
            Self::Refuse(r) => Verdict::Refuse(r.clone()),
            _ => Verdict::Apply,
        }
    }
}

/// Decides about one statement.
pub fn decide(statement: &Statement, ctx: &Context<'_>) -> Decision {
    if let (Kind::Unfenceable(why), true) = (&statement.kind, ctx.protected) {
        return Decision::Refuse(Rejection::new(RejectReason::Unsupported, why.clone()));
    }
    if statement.kind != Kind::Write || !ctx.protected {
        return Decision::Pass;
    }
    if statement
        .targets
        .iter()
        .any(|t| t.starts_with(FENCE_SCHEMA_PREFIX))
    {
        return Decision::Refuse(Rejection::new(
            RejectReason::Unsupported,
            "the fencegate schema is written only by fencegate.guard (a direct write could lower a fence)",
        ));
    }
    if statement.targets_exact
        && statement.targets.iter().all(|t| {
            t.split_once('.')
                .is_some_and(|(schema, _)| ctx.unprotected_schemas.iter().any(|u| u == schema))
        })
    {
        return Decision::Pass;
    }
    let presented = statement.comment_token.as_deref().or(ctx.session_token);
    let Some(presented) = presented else {
        return Decision::Refuse(Rejection::new(
            RejectReason::Missing,
            format!(
                "a {} on a protected database needs a fencing token (comment fencing_token='...', SET fencegate.token, or the startup option)",
                statement.command
            ),
        ));
    };
    match ctx.policy.check(presented, ctx.route) {
        Ok(token) => Decision::Guard(token),
        Err(e) => {
            let reason = RejectReason::from_token_error(&e);
            let mut rejection =
                Rejection::new(reason, format!("the fencing token is refused: {e}"));
            if let Ok(t) = Token::parse(presented) {
                rejection = rejection.with_token(t.resource().clone(), t.revision());
            }
            Decision::Refuse(rejection)
        }
    }
}

/// One statement of a rewritten Query, in the order the server answers them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// The gateway's guard: its replies are swallowed.
    Guard(Token),
    /// The client's statement: its replies are relayed.
    Client,
}

/// What to do with a simple-protocol Query message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryPlan {
    /// Relay the message byte-for-byte.
    Forward,
    /// Send this SQL instead; the server answers `parts` in order.
    Rewrite {
        /// The client's text with guards spliced in.
        sql: String,
        /// Guard and client statements in order.
        parts: Vec<Part>,
    },
    /// Answer `SET`/`RESET fencegate.token` locally.
    SetToken(Option<String>),
    /// Refuse the whole message; nothing of it is sent.
    Refuse(Rejection),
}

/// Plans a Query message. `guarded` is the token already guarded in the open transaction (a
/// later write with the same token needs no second guard until a transaction-control statement).
pub fn plan_query(
    sql: &str,
    classified: &Classified,
    ctx: &Context<'_>,
    guarded: Option<&Token>,
) -> QueryPlan {
    let statements = &classified.statements;
    if let [only] = statements.as_slice() {
        if let Kind::SetToken(value) = &only.kind {
            return QueryPlan::SetToken(value.clone());
        }
    }
    if statements
        .iter()
        .any(|s| matches!(s.kind, Kind::SetToken(_)))
    {
        return QueryPlan::Refuse(Rejection::new(
            RejectReason::Unsupported,
            "SET fencegate.token must be sent as a query of its own",
        ));
    }
    // Inline for the usual one or two statements: a relayed query allocates nothing here.
    let mut decisions: SmallVec<[Decision; 2]> = SmallVec::with_capacity(statements.len());
    for statement in statements {
        let decision = decide(statement, ctx);
        if let Decision::Refuse(rejection) = decision {
            return QueryPlan::Refuse(rejection);
        }
        decisions.push(decision);
    }
    if !decisions.iter().any(|d| matches!(d, Decision::Guard(_))) {
        return QueryPlan::Forward;
    }
    let mut out = String::with_capacity(sql.len() + 64 * decisions.len());
    let mut parts = Vec::new();
    let mut copied = 0;
    let mut current = guarded.cloned();
    for (statement, decision) in statements.iter().zip(decisions) {
        if statement.kind == Kind::TransactionControl {
            current = None;
        }
        if let Decision::Guard(token) = decision {
            if current.as_ref() != Some(&token) {
                out.push_str(&sql[copied..statement.start]);
                copied = statement.start;
                out.push_str(&guard_sql(&token));
                parts.push(Part::Guard(token.clone()));
                current = Some(token);
            }
        }
        parts.push(Part::Client);
    }
    out.push_str(&sql[copied..]);
    if !parts.iter().any(|p| matches!(p, Part::Guard(_))) {
        return QueryPlan::Forward;
    }
    QueryPlan::Rewrite { sql: out, parts }
}

/// The guard call as one SQL statement, `;` included. The store verifies the token itself
/// (signature, resource, fence), so it gets the token as issued, signature included.
pub fn guard_sql(token: &Token) -> String {
    format!(
        "CALL fencegate.guard_proc({});",
        quote_literal(&token.to_string())
    )
}

/// The guard as extended-protocol messages (the token as issued, as in [`guard_sql`]): Close
/// portal, Close statement, Parse, Bind, Execute. The server answers CloseComplete,
/// CloseComplete, ParseComplete, BindComplete, CommandComplete.
pub fn guard_messages(token: &Token) -> Bytes {
    call_messages(
        GUARD_NAME,
        "CALL fencegate.guard_proc($1::text)",
        &[&token.to_string()],
    )
}

/// A refusal raised through the server in the extended protocol (the same five messages; a
/// `SELECT`, so its Execute is answered with a DataRow before CommandComplete).
pub fn refusal_messages(rejection: &Rejection) -> Bytes {
    call_messages(
        REFUSE_NAME,
        "SELECT fencegate.refuse($1::text, $2::text)",
        &[
            sqlstate::for_reason(&rejection.reason),
            &refusal_message(rejection),
        ],
    )
}

/// A refusal raised through the server in the simple protocol, as a Query message.
pub fn refusal_query(rejection: &Rejection) -> Bytes {
    let sql = format!(
        "SELECT fencegate.refuse({}, {})",
        quote_literal(sqlstate::for_reason(&rejection.reason)),
        quote_literal(&refusal_message(rejection))
    );
    let mut buf = BytesMut::new();
    frontend::query(&sql, &mut buf).expect("no NUL in generated SQL");
    buf.freeze()
}

/// The message text of a refusal: names the resource, the presented revision and the reason.
pub fn refusal_message(rejection: &Rejection) -> String {
    let who = match (&rejection.resource, &rejection.revision) {
        (Some(resource), Some(revision)) => {
            format!(" (resource {resource}, presented revision {revision})")
        }
        _ => String::new(),
    };
    format!(
        "fencegate: {} token{who}: {}",
        rejection.reason.label(),
        rejection.detail
    )
}

fn call_messages(name: &str, sql: &str, params: &[&str]) -> Bytes {
    let mut buf = BytesMut::new();
    // Close first: a guard that failed earlier was skipped before its own Close, and closing a
    // name that does not exist is not an error.
    frontend::close(b'P', name, &mut buf).expect("no NUL in a fixed name");
    frontend::close(b'S', name, &mut buf).expect("no NUL in a fixed name");
    frontend::parse(name, sql, std::iter::empty(), &mut buf).expect("no NUL in generated SQL");
    frontend::bind(
        name,
        name,
        std::iter::once(0i16),
        params.iter(),
        |p, buf| {
            buf.extend_from_slice(p.as_bytes());
            Ok(IsNull::No)
        },
        std::iter::once(0i16),
        &mut buf,
    )
    .map_err(|_| ())
    .expect("two text parameters always encode");
    frontend::execute(name, 0, &mut buf).expect("no NUL in a fixed name");
    buf.freeze()
}

/// A SQL string literal for `text` (standard_conforming_strings on or off: `E''` form).
pub fn quote_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 4);
    out.push_str("E'");
    for c in text.chars() {
        match c {
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            '\0' => {}
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

#[cfg(test)]
mod tests {
    use fencegate_core::Revision;

    use super::*;
    use crate::classify::classify;

    fn token(rev: u64) -> Token {
        Token::new(Resource::new("job").unwrap(), Revision::new(rev).unwrap())
    }

    fn ctx<'a>(
        policy: &'a TokenPolicy,
        session: Option<&'a str>,
        schemas: &'a [String],
    ) -> Context<'a> {
        Context {
            protected: true,
            unprotected_schemas: schemas,
            route: None,
            policy,
            session_token: session,
        }
    }

    #[test]
    fn reads_are_forwarded_unchanged() {
        let policy = TokenPolicy::unsigned();
        let sql = "SELECT abalance FROM pgbench_accounts WHERE aid = 7;";
        assert_eq!(
            plan_query(sql, &classify(sql), &ctx(&policy, None, &[]), None),
            QueryPlan::Forward
        );
    }

    #[test]
    fn golden_simple_write() {
        let policy = TokenPolicy::unsigned();
        let sql = "INSERT INTO t VALUES (1)";
        let plan = plan_query(
            sql,
            &classify(sql),
            &ctx(&policy, Some("fg1~7~job"), &[]),
            None,
        );
        assert_eq!(
            plan,
            QueryPlan::Rewrite {
                sql: "CALL fencegate.guard_proc(E'fg1~7~job');INSERT INTO t VALUES (1)".into(),
                parts: vec![Part::Guard(token(7)), Part::Client],
            }
        );
    }

    #[test]
    fn golden_comment_wins_and_transaction_boundaries_guard_again() {
        let policy = TokenPolicy::unsigned();
        let sql = "BEGIN; INSERT INTO t VALUES (1) /* fencing_token='fg1~9~job' */; INSERT INTO t VALUES (2); COMMIT; DELETE FROM t";
        let plan = plan_query(
            sql,
            &classify(sql),
            &ctx(&policy, Some("fg1~7~job"), &[]),
            None,
        );
        let QueryPlan::Rewrite { sql: out, parts } = plan else {
            panic!("{plan:?}")
        };
        assert_eq!(
            out,
            "BEGIN;CALL fencegate.guard_proc(E'fg1~9~job'); INSERT INTO t VALUES (1) /* fencing_token='fg1~9~job' */;CALL fencegate.guard_proc(E'fg1~7~job'); INSERT INTO t VALUES (2); COMMIT;CALL fencegate.guard_proc(E'fg1~7~job'); DELETE FROM t"
        );
        assert_eq!(
            parts,
            vec![
                Part::Client,
                Part::Guard(token(9)),
                Part::Client,
                Part::Guard(token(7)),
                Part::Client,
                Part::Client,
                Part::Guard(token(7)),
                Part::Client
            ]
        );
    }

    #[test]
    fn already_guarded_transaction_needs_no_second_guard() {
        let policy = TokenPolicy::unsigned();
        let sql = "UPDATE t SET a = 2";
        let plan = plan_query(
            sql,
            &classify(sql),
            &ctx(&policy, Some("fg1~7~job"), &[]),
            Some(&token(7)),
        );
        assert_eq!(plan, QueryPlan::Forward);
    }

    #[test]
    fn refusals_name_the_reason() {
        let policy = TokenPolicy::unsigned();
        let sql = "DELETE FROM t";
        let QueryPlan::Refuse(r) = plan_query(sql, &classify(sql), &ctx(&policy, None, &[]), None)
        else {
            panic!()
        };
        assert_eq!(r.reason, RejectReason::Missing);
        let QueryPlan::Refuse(r) = plan_query(
            sql,
            &classify(sql),
            &ctx(&policy, Some("fg1~x~job"), &[]),
            None,
        ) else {
            panic!()
        };
        assert_eq!(r.reason, RejectReason::Malformed);
        let signed = TokenPolicy::with_key(fencegate_core::TokenKey::new(1, &[1u8; 32]).unwrap());
        let QueryPlan::Refuse(r) = plan_query(
            sql,
            &classify(sql),
            &ctx(&signed, Some("fg1~7~job"), &[]),
            None,
        ) else {
            panic!()
        };
        assert_eq!(r.reason, RejectReason::Forged);
        assert_eq!(r.revision.map(|r| r.get()), Some(7));
        assert!(
            refusal_message(&r).contains("resource job, presented revision 7"),
            "{}",
            refusal_message(&r)
        );
    }

    #[test]
    fn unprotected_schema_and_set_token() {
        let policy = TokenPolicy::unsigned();
        let schemas = vec!["scratch".to_owned()];
        let sql = "DELETE FROM scratch.t";
        assert_eq!(
            plan_query(sql, &classify(sql), &ctx(&policy, None, &schemas), None),
            QueryPlan::Forward
        );
        // Nor may what names only scratch tables but may write elsewhere: a function call, a
        // quoted name (one table of the search path), a cascade.
        for sql in [
            "INSERT INTO scratch.t SELECT setval('public.s', 1)",
            "INSERT INTO \"scratch.t\" VALUES (1)",
            "TRUNCATE scratch.t CASCADE",
        ] {
            assert!(
                matches!(
                    plan_query(sql, &classify(sql), &ctx(&policy, None, &schemas), None),
                    QueryPlan::Refuse(_)
                ),
                "{sql}"
            );
        }
        let sql = "DELETE FROM scratch.t; DELETE FROM t";
        assert!(matches!(
            plan_query(sql, &classify(sql), &ctx(&policy, None, &schemas), None),
            QueryPlan::Refuse(_)
        ));
        let sql = "UPDATE fencegate.fences SET revision = 1";
        let QueryPlan::Refuse(r) = plan_query(
            sql,
            &classify(sql),
            &ctx(&policy, Some("fg1~7~job"), &schemas),
            None,
        ) else {
            panic!()
        };
        assert_eq!(r.reason, RejectReason::Unsupported);
        let sql = "SET fencegate.token = 'fg1~7~job'";
        assert_eq!(
            plan_query(sql, &classify(sql), &ctx(&policy, None, &schemas), None),
            QueryPlan::SetToken(Some("fg1~7~job".into()))
        );
    }

    #[test]
    fn guard_messages_close_then_call() {
        let bytes = guard_messages(&token(7));
        let mut buf = BytesMut::from(&bytes[..]);
        let mut tags = Vec::new();
        while let Some(f) = crate::message::parse_frame(&mut buf, 1 << 16).unwrap() {
            tags.push(f.tag);
        }
        assert_eq!(tags, b"CCPBE".to_vec());
        assert_eq!(quote_literal("a'b\\c"), "E'a''b\\\\c'");
    }
}
