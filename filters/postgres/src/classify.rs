//! Statement classification with the real PostgreSQL parser (`pg_query`, i.e. libpg_query: the
//! server's own grammar compiled as a library), so "is this a write?" and "where does each
//! statement of a multi-statement query start?" are answered as the server itself would.
//!
//! Fail closed: a statement is a read only when the parser proves it; everything else (an
//! unknown statement type, a function call not known to be read-only, a parse error) is a write.

use std::sync::Arc;

use pg_query::protobuf::{self, a_const, node::Node as N, Token as ScanTokenKind};
use pg_query::NodeEnum;
use smallvec::{smallvec, SmallVec};

use crate::carrier;

/// What one statement is, for fencing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Proven read-only: relayed untouched.
    Read,
    /// May change data or schema: fenced on a protected database.
    Write,
    /// `BEGIN`, `COMMIT`, `ROLLBACK`, `SAVEPOINT`, ...: ends or changes the transaction the
    /// guard ran in, so the next write is guarded again.
    TransactionControl,
    /// `SET fencegate.token = '...'` (`Some`) or `RESET fencegate.token` (`None`).
    SetToken(Option<String>),
    /// A statement the gateway must not let run on a protected database, with why: a `SET` that
    /// would make the server lex later SQL differently from the gateway's parser.
    Unfenceable(String),
    /// `DISCARD ALL` or `RESET ALL`: relayed, and the session token is dropped with the rest of
    /// the session's settings.
    SessionReset,
}

/// One statement of a query string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// Byte offset where the statement starts in the query string (a guard goes here).
    pub start: usize,
    /// Byte offset just past its end.
    pub end: usize,
    /// Read, write, ...
    pub kind: Kind,
    /// The command word (`INSERT`, `UPDATE`, `WITH`, ...), for audit summaries. Shared: a
    /// classification reused from the cache hands it out for every query of the same shape.
    pub command: Arc<str>,
    /// Tables the statement writes or alters (schema-qualified when written so).
    pub targets: Vec<String>,
    /// `targets` are all it can write, as named: it calls no function not known to be
    /// read-only, names nothing with a dot inside a name (`"a.b"` is one table, not `b` of
    /// schema `a`), does not reach beyond its targets (`CASCADE`, COPY to or from a file or
    /// program, `CREATE TRIGGER`), and, unless it holds DML, names no other relation. Only such
    /// a write may pass by `unprotected_schemas` (what a table's triggers, rules or defaults do
    /// is for the store's own fence).
    pub targets_exact: bool,
    /// The token of a `/* fencing_token='...' */` comment in or right after the statement.
    pub comment_token: Option<String>,
    /// Not proven to leave the transaction it runs in open (other than as
    /// [`Kind::TransactionControl`]): `CALL` and `DO` may COMMIT, `VACUUM`, `CREATE DATABASE`
    /// and the like commit at once outside a transaction block. True for anything but queries,
    /// DML and session settings, and where unknown; after one, the next write is guarded again.
    pub may_end_transaction: bool,
    /// The session's prepared statements it creates or drops in SQL, outside the protocol's
    /// Parse and Close (whose effect the gateway follows itself).
    pub forgets: Option<Forget>,
    /// May start `COPY ... FROM STDIN` (true where unknown): the server then reads the client's
    /// next messages as the copy's data, and ignores a Sync among them.
    pub copies_in: bool,
}

/// Prepared statements a statement creates or drops in SQL: what the gateway knew of them from
/// the protocol no longer holds (a name deallocated and prepared again in SQL binds something
/// else). Names are the server's: `PREPARE P` prepares `p`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forget {
    /// `PREPARE name` or `DEALLOCATE name`.
    Name(String),
    /// `DEALLOCATE ALL`, `DISCARD ALL`, or a text the gateway's parser cannot read.
    All,
}

/// A message's statements: one inline, the usual case, so a classification reused from the
/// cache allocates no vector (issue 18's profile).
pub type Statements = SmallVec<[Statement; 1]>;

/// A classified query string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    /// Its statements in order (empty for an empty query).
    pub statements: Statements,
    /// The parser's message when the text does not parse (then `statements` holds one write
    /// spanning the whole text: fail closed).
    pub parse_error: Option<String>,
}

impl Classified {
    /// Whether any statement is a write.
    pub fn has_write(&self) -> bool {
        self.statements.iter().any(|s| s.kind == Kind::Write)
    }

    /// What its statements do to the session's prepared statements in SQL, in order.
    pub fn forgets(&self) -> impl Iterator<Item = &Forget> {
        self.statements.iter().filter_map(|s| s.forgets.as_ref())
    }
}

/// Functions that only read (a `SELECT` calling anything else counts as a write).
const READ_ONLY_FUNCTIONS: &[&str] = &[
    "count",
    "sum",
    "avg",
    "min",
    "max",
    "array_agg",
    "string_agg",
    "json_agg",
    "jsonb_agg",
    "bool_and",
    "bool_or",
    "every",
    "now",
    "current_timestamp",
    "clock_timestamp",
    "statement_timestamp",
    "transaction_timestamp",
    "timeofday",
    "date_trunc",
    "date_part",
    "extract",
    "to_char",
    "to_date",
    "to_timestamp",
    "to_number",
    "age",
    "length",
    "lower",
    "upper",
    "substr",
    "substring",
    "trim",
    "btrim",
    "ltrim",
    "rtrim",
    "concat",
    "concat_ws",
    "format",
    "replace",
    "split_part",
    "position",
    "strpos",
    "left",
    "right",
    "lpad",
    "rpad",
    "md5",
    "abs",
    "ceil",
    "floor",
    "round",
    "trunc",
    "mod",
    "power",
    "sqrt",
    "random",
    "greatest",
    "least",
    "coalesce",
    "nullif",
    "row_number",
    "rank",
    "dense_rank",
    "lag",
    "lead",
    "first_value",
    "last_value",
    "generate_series",
    "unnest",
    "array_length",
    "cardinality",
    "json_build_object",
    "jsonb_build_object",
    "to_json",
    "to_jsonb",
    "version",
    "current_database",
    "current_schema",
    "current_schemas",
    "current_user",
    "session_user",
    "current_setting",
    "pg_backend_pid",
    "txid_current",
    "pg_current_xact_id",
    "pg_is_in_recovery",
    "pg_postmaster_start_time",
    "pg_xact_commit_timestamp",
    "has_table_privilege",
    "has_schema_privilege",
    "format_type",
    "obj_description",
    "col_description",
    "pg_get_userbyid",
    "pg_table_is_visible",
    "pg_type_is_visible",
    "pg_function_is_visible",
    "pg_get_expr",
    "pg_get_indexdef",
    "pg_get_constraintdef",
    "pg_get_viewdef",
    "pg_get_triggerdef",
    "pg_get_functiondef",
    "pg_get_function_arguments",
    "pg_get_function_result",
    "pg_get_function_identity_arguments",
    "pg_get_statisticsobjdef_columns",
    "pg_relation_size",
    "pg_total_relation_size",
    "pg_size_pretty",
    "pg_encoding_to_char",
    "pg_get_partkeydef",
    "pg_get_ruledef",
    "array_to_string",
    "quote_ident",
    "quote_literal",
    "regexp_replace",
    "regexp_matches",
    "encode",
    "decode",
    "exists",
];

/// Classifies `sql`. Never panics; a parse error gives one fail-closed write.
pub fn classify(sql: &str) -> Classified {
    let parsed = match pg_query::parse(sql) {
        Ok(parsed) => parsed,
        Err(e) => {
            return Classified {
                statements: smallvec![Statement {
                    start: 0,
                    end: sql.len(),
                    kind: Kind::Write,
                    command: first_word(sql).into(),
                    targets: Vec::new(),
                    comment_token: comments(sql).into_iter().map(|(_, t)| t).next(),
                    may_end_transaction: true,
                    forgets: Some(Forget::All),
                    copies_in: true,
                    targets_exact: false,
                }],
                parse_error: Some(e.to_string()),
            }
        }
    };
    let comments = comments(sql);
    let raw = &parsed.protobuf.stmts;
    let mut statements = Statements::with_capacity(raw.len());
    for (i, stmt) in raw.iter().enumerate() {
        let start = usize::try_from(stmt.stmt_location)
            .unwrap_or(0)
            .min(sql.len());
        let end = if stmt.stmt_len <= 0 {
            sql.len()
        } else {
            (start + stmt.stmt_len as usize).min(sql.len())
        };
        let next_start = raw.get(i + 1).map_or(sql.len(), |n| {
            usize::try_from(n.stmt_location).unwrap_or(sql.len())
        });
        let text = sql.get(start..end).unwrap_or("");
        let node = stmt.stmt.as_ref().and_then(|n| n.node.as_ref());
        // With one statement, the whole text's parse already describes it.
        let whole = (raw.len() == 1).then_some(&parsed);
        let Judged {
            kind,
            targets,
            exact,
        } = classify_statement(node, text, whole);
        let targets_exact = exact && !targets.is_empty() && !node.is_some_and(reaches_beyond);
        // A comment belongs to the statement it is in, or to the one it follows.
        let comment_token = comments
            .iter()
            .find(|(at, _)| (*at >= start || i == 0) && *at < next_start.max(end))
            .map(|(_, t)| t.clone());
        statements.push(Statement {
            start,
            end,
            kind,
            command: match node {
                Some(NodeEnum::TransactionStmt(t)) => transaction_command(t, text).into(),
                _ => first_word(text).into(),
            },
            targets,
            comment_token,
            may_end_transaction: may_end_transaction(node),
            forgets: forgets(node),
            copies_in: copies_in(node),
            targets_exact,
        });
    }
    Classified {
        statements,
        parse_error: None,
    }
}

fn classify_statement(
    node: Option<&NodeEnum>,
    text: &str,
    whole: Option<&pg_query::ParseResult>,
) -> Judged {
    let Some(node) = node else {
        return Judged::of(Kind::Write);
    };
    match node {
        NodeEnum::TransactionStmt(_) => Judged::of(Kind::TransactionControl),
        NodeEnum::VariableSetStmt(set)
            if set.name.eq_ignore_ascii_case(carrier::SETTING) && set.is_local =>
        {
            // It would have to end with the transaction; the gateway keeps session tokens only.
            Judged::of(Kind::Unfenceable(
                "SET LOCAL fencegate.token is not supported: use SET fencegate.token, or a fencing_token comment on each statement".to_owned(),
            ))
        }
        NodeEnum::VariableSetStmt(set) if set.name.eq_ignore_ascii_case(carrier::SETTING) => {
            if set.kind == protobuf::VariableSetKind::VarSetValue as i32 {
                Judged::of(Kind::SetToken(set_value(&set.args)))
            } else {
                Judged::of(Kind::SetToken(None))
            }
        }
        NodeEnum::VariableSetStmt(set) if lexing_hazard(set).is_some() => {
            Judged::of(Kind::Unfenceable(lexing_hazard(set).unwrap_or_default()))
        }
        NodeEnum::VariableSetStmt(set)
            if set.kind == protobuf::VariableSetKind::VarResetAll as i32 =>
        {
            Judged::of(Kind::SessionReset)
        }
        NodeEnum::DiscardStmt(d) if d.target == protobuf::DiscardMode::DiscardAll as i32 => {
            Judged::of(Kind::SessionReset)
        }
        NodeEnum::VariableSetStmt(_)
        | NodeEnum::DiscardStmt(_)
        | NodeEnum::VariableShowStmt(_)
        | NodeEnum::DeallocateStmt(_)
        | NodeEnum::FetchStmt(_)
        | NodeEnum::ClosePortalStmt(_)
        | NodeEnum::ListenStmt(_)
        | NodeEnum::UnlistenStmt(_) => Judged::of(Kind::Read),
        NodeEnum::SelectStmt(select) if select.into_clause.is_none() => read_unless(text, whole),
        // Without ANALYZE nothing runs but what planning runs: an `EXECUTE`'s parameters and
        // the functions the planner folds (a user's IMMUTABLE function may write). So the whole
        // tree is walked, and an explained write counts as one.
        // `EXPLAIN EXECUTE p` plans a statement this text does not show (its planning folds
        // the statement's functions): a write, as `EXECUTE p` is.
        NodeEnum::ExplainStmt(explain)
            if !explain_analyzes(&explain.options) && !explains_execute(explain) =>
        {
            read_unless(text, whole)
        }
        NodeEnum::DeclareCursorStmt(_) | NodeEnum::PrepareStmt(_) => read_unless(text, whole),
        // Only `TO STDOUT` is a read: `TO 'file'` writes a file and `TO PROGRAM` runs a command
        // on the server (either could reach the data by another way).
        NodeEnum::CopyStmt(copy)
            if copy.is_from || copy.is_program || !copy.filename.is_empty() =>
        {
            written(text, whole)
        }
        NodeEnum::CopyStmt(copy) if copy.relation.is_some() => Judged::of(Kind::Read),
        NodeEnum::CopyStmt(_) => read_unless(text, whole),
        _ => written(text, whole),
    }
}

/// A transaction-control statement's command word, from the parse tree (`BEGIN` and `START`
/// only for statements that open a transaction block: the gateway relies on it).
fn transaction_command(t: &protobuf::TransactionStmt, text: &str) -> String {
    use protobuf::TransactionStmtKind as K;
    match K::try_from(t.kind) {
        Ok(K::TransStmtBegin) => "BEGIN".to_owned(),
        Ok(K::TransStmtStart) => "START".to_owned(),
        _ => match first_word(text).as_str() {
            "BEGIN" | "START" => "TRANSACTION".to_owned(),
            word => word.to_owned(),
        },
    }
}

fn explains_execute(explain: &protobuf::ExplainStmt) -> bool {
    matches!(
        explain.query.as_ref().and_then(|q| q.node.as_ref()),
        Some(NodeEnum::ExecuteStmt(_))
    )
}

/// The longest name the server tells apart: it compares only the first `NAMEDATALEN - 1` bytes
/// of a prepared statement's name.
pub const MAX_NAME_BYTES: usize = 63;

/// See [`Statement::forgets`]. `DO` and `CALL` run code that may prepare or deallocate in
/// dynamic SQL (`EXECUTE 'DEALLOCATE p'`): all names. A name the server may have cut to
/// [`MAX_NAME_BYTES`] (at a character, for SQL identifiers) could stand for several: all names.
fn forgets(node: Option<&NodeEnum>) -> Option<Forget> {
    let name = |n: &str| {
        if n.len() >= MAX_NAME_BYTES {
            Forget::All
        } else {
            Forget::Name(n.to_owned())
        }
    };
    match node? {
        NodeEnum::DoStmt(_) | NodeEnum::CallStmt(_) => Some(Forget::All),
        NodeEnum::PrepareStmt(p) => Some(name(&p.name)),
        NodeEnum::DeallocateStmt(d) if d.isall || d.name.is_empty() => Some(Forget::All),
        NodeEnum::DeallocateStmt(d) => Some(name(&d.name)),
        NodeEnum::DiscardStmt(d) if d.target == protobuf::DiscardMode::DiscardAll as i32 => {
            Some(Forget::All)
        }
        _ => None,
    }
}

/// The statement reaches beyond its targets: `CASCADE` (`TRUNCATE scratch.t CASCADE` empties
/// the tables whose foreign keys reference it), `COPY` to or from a file or a program (which
/// can reach the data another way), `CREATE TRIGGER` (its function runs at every later write).
fn reaches_beyond(node: &NodeEnum) -> bool {
    let cascade = protobuf::DropBehavior::DropCascade as i32;
    match node {
        NodeEnum::CopyStmt(copy) => copy.is_program || !copy.filename.is_empty(),
        NodeEnum::CreateTrigStmt(_) => true,
        NodeEnum::TruncateStmt(t) => t.behavior == cascade,
        NodeEnum::DropStmt(d) => d.behavior == cascade,
        NodeEnum::AlterTableStmt(a) => a
            .cmds
            .iter()
            .any(|c| matches!(&c.node, Some(N::AlterTableCmd(cmd)) if cmd.behavior == cascade)),
        _ => false,
    }
}

/// See [`Statement::copies_in`]: only the COPY statement itself reads from the client (a
/// function cannot, nor can `EXECUTE`, as COPY cannot be prepared in SQL).
fn copies_in(node: Option<&NodeEnum>) -> bool {
    match node {
        Some(NodeEnum::CopyStmt(copy)) => {
            copy.is_from && !copy.is_program && copy.filename.is_empty()
        }
        Some(_) => false,
        None => true,
    }
}

/// See [`Statement::may_end_transaction`]. Functions cannot end a transaction, so what a query or
/// a DML statement calls does not matter; only procedures (`CALL`) and `DO` blocks can.
fn may_end_transaction(node: Option<&NodeEnum>) -> bool {
    !matches!(
        node,
        Some(
            NodeEnum::SelectStmt(_)
                | NodeEnum::InsertStmt(_)
                | NodeEnum::UpdateStmt(_)
                | NodeEnum::DeleteStmt(_)
                | NodeEnum::MergeStmt(_)
                | NodeEnum::CopyStmt(_)
                | NodeEnum::TruncateStmt(_)
                | NodeEnum::LockStmt(_)
                | NodeEnum::ExplainStmt(_)
                | NodeEnum::DeclareCursorStmt(_)
                | NodeEnum::FetchStmt(_)
                | NodeEnum::ClosePortalStmt(_)
                | NodeEnum::PrepareStmt(_)
                | NodeEnum::ExecuteStmt(_)
                | NodeEnum::DeallocateStmt(_)
                | NodeEnum::VariableSetStmt(_)
                | NodeEnum::VariableShowStmt(_)
                | NodeEnum::TransactionStmt(_)
        )
    )
}

/// What [`classify_statement`] found: the statement's kind, the tables it writes, and whether
/// those tables are all it can write ([`Statement::targets_exact`]).
struct Judged {
    kind: Kind,
    targets: Vec<String>,
    exact: bool,
}

impl Judged {
    /// A statement that names no table it writes.
    fn of(kind: Kind) -> Self {
        Self {
            kind,
            targets: Vec::new(),
            exact: false,
        }
    }

    /// A write of `parsed`'s tables. Its targets are exact if it calls nothing unknown and
    /// names nothing with a dot, and, unless it holds DML (an INSERT, UPDATE, DELETE or MERGE
    /// anywhere, whose other relations are only read), every relation it names is a target (`ATTACH PARTITION public.items`, `INHERITS`,
    /// `PARTITION OF`, `REFERENCES` and `LIKE` name relations DDL changes or ties to).
    fn write(parsed: &pg_query::ParseResult, tree: &TreeFacts) -> Self {
        let targets = written_tables(parsed, tree);
        let named_are_targets = tree.writes || tree.relations.iter().all(|r| targets.contains(r));
        Self {
            kind: Kind::Write,
            exact: !tree.calls_unknown() && !tree.dotted && named_are_targets,
            targets,
        }
    }
}

/// A statement whose shape is read-only is still a write if it modifies tables (a
/// data-modifying CTE) or calls a function not known to be read-only.
fn read_unless(text: &str, whole: Option<&pg_query::ParseResult>) -> Judged {
    with_parse(text, whole, read_unless_parsed).unwrap_or(Judged::of(Kind::Write))
}

fn read_unless_parsed(parsed: &pg_query::ParseResult) -> Judged {
    let tree = TreeFacts::of(parsed);
    if !tree.writes && !tree.calls_unknown() && parsed.ddl_tables().is_empty() {
        Judged::of(Kind::Read)
    } else {
        Judged::write(parsed, &tree)
    }
}

/// A statement that is a write by its kind.
fn written(text: &str, whole: Option<&pg_query::ParseResult>) -> Judged {
    with_parse(text, whole, |p| Judged::write(p, &TreeFacts::of(p)))
        .unwrap_or(Judged::of(Kind::Write))
}

/// The tables a statement writes: the targets of every INSERT/UPDATE/DELETE/MERGE node found by
/// the full walk (a CTE of the same name never hides one: PostgreSQL never resolves a write
/// target to a CTE), plus pg_query's DML and DDL tables (TRUNCATE, COPY, ALTER, ...).
fn written_tables(parsed: &pg_query::ParseResult, tree: &TreeFacts) -> Vec<String> {
    let mut out = tree.targets.clone();
    for t in parsed.dml_tables().into_iter().chain(parsed.ddl_tables()) {
        if !out.contains(&t) {
            out.push(t);
        }
    }
    out
}

/// What a complete walk of the parse tree finds. pg_query's own summary (`tables`,
/// `functions`) visits only some fields and drops write targets named like a CTE; this walk
/// visits every node of the serialized tree.
#[derive(Debug, Default)]
struct TreeFacts {
    /// Any INSERT, UPDATE, DELETE or MERGE node, at any depth.
    writes: bool,
    /// Their target relations, `schema.name` or `name`.
    targets: Vec<String>,
    /// Every function called, `schema.name` or `name`.
    functions: Vec<String>,
    /// A name holds a dot (a quoted identifier, `"scratch.t"`: one table of the search path,
    /// which its `schema.name` rendering cannot tell from table `t` of schema `scratch`).
    dotted: bool,
    /// Every relation named anywhere, `schema.name` or `name`.
    relations: Vec<String>,
}

impl TreeFacts {
    /// Whether it calls a function not known to be read-only (which may write anything).
    fn calls_unknown(&self) -> bool {
        self.functions.iter().any(|name| {
            let base = name.rsplit('.').next().unwrap_or(name);
            let in_catalog = name.starts_with("pg_catalog.") || !name.contains('.');
            !(in_catalog && READ_ONLY_FUNCTIONS.contains(&base.to_ascii_lowercase().as_str()))
        })
    }

    fn of(parsed: &pg_query::ParseResult) -> Self {
        let mut facts = Self::default();
        match serde_json::to_value(&parsed.protobuf) {
            Ok(tree) => facts.visit(&tree),
            // Cannot happen for these types; fail closed if it ever does.
            Err(_) => facts.writes = true,
        }
        facts
    }

    fn visit(&mut self, value: &serde_json::Value) {
        match value {
            serde_json::Value::Object(map) => {
                // A relation (a `RangeVar`, bare where a field holds one, not a node).
                if map.contains_key("relname") {
                    self.dotted |= ["catalogname", "schemaname", "relname"]
                        .iter()
                        .filter_map(|f| map.get(*f).and_then(|v| v.as_str()))
                        .any(|n| n.contains('.'));
                    self.relations.extend(range_var_name(value));
                }
                for (key, child) in map {
                    match key.as_str() {
                        "InsertStmt" | "UpdateStmt" | "DeleteStmt" | "MergeStmt" => {
                            self.writes = true;
                            if let Some(target) = child.get("relation").and_then(range_var_name) {
                                self.targets.push(target);
                            }
                        }
                        // `FOR UPDATE`/`FOR SHARE` at any depth locks rows: written to the rows
                        // and the WAL, and a fenced-out holder's locks block the new holder
                        // (PostgreSQL refuses them in a read-only transaction too).
                        "LockingClause" => self.writes = true,
                        // `(expr).name` is a call of `name(expr)` when `expr` has no such field
                        // (`('s'::regclass).nextval`): a call of a function not known.
                        "AIndirection" => {
                            let selects_field = child
                                .get("indirection")
                                .and_then(|i| i.as_array())
                                .is_some_and(|i| {
                                    i.iter().any(|n| n.pointer("/node/String").is_some())
                                });
                            if selects_field {
                                self.functions.push("(attribute notation)".to_owned());
                            }
                        }
                        // The names of what DDL drops or alters (relations: below).
                        "String" => {
                            self.dotted |= child
                                .get("sval")
                                .and_then(|v| v.as_str())
                                .is_some_and(|n| n.contains('.'));
                        }
                        "FuncCall" => {
                            let name = child
                                .get("funcname")
                                .and_then(|n| n.as_array())
                                .map(|parts| {
                                    parts
                                        .iter()
                                        .filter_map(|p| p.pointer("/node/String/sval"))
                                        .filter_map(|s| s.as_str())
                                        .collect::<Vec<_>>()
                                        .join(".")
                                })
                                .unwrap_or_default();
                            self.functions.push(name);
                        }
                        _ => {}
                    }
                    self.visit(child);
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|i| self.visit(i)),
            _ => {}
        }
    }
}

fn range_var_name(range_var: &serde_json::Value) -> Option<String> {
    let name = range_var.get("relname")?.as_str()?;
    match range_var.get("schemaname").and_then(|s| s.as_str()) {
        Some(schema) if !schema.is_empty() => Some(format!("{schema}.{name}")),
        _ => Some(name.to_owned()),
    }
}

/// Runs `f` on `whole` if given, else on a parse of `text` (`None` if it does not parse).
fn with_parse<T>(
    text: &str,
    whole: Option<&pg_query::ParseResult>,
    f: impl FnOnce(&pg_query::ParseResult) -> T,
) -> Option<T> {
    match whole {
        Some(parsed) => Some(f(parsed)),
        None => pg_query::parse(text).ok().map(|p| f(&p)),
    }
}

/// `SET standard_conforming_strings = off` or `SET client_encoding`/`SET NAMES` to an encoding
/// the gateway cannot lex (see [`crate::lexing`]); a value that is not a constant counts too.
fn lexing_hazard(set: &protobuf::VariableSetStmt) -> Option<String> {
    let name = set.name.to_ascii_lowercase();
    if name != "standard_conforming_strings" && name != "client_encoding" {
        return None;
    }
    if set.kind != protobuf::VariableSetKind::VarSetValue as i32 {
        // RESET / DEFAULT go back to the session's start, which the server already reported.
        return None;
    }
    let value = set_value(&set.args);
    let hazardous = match (&value, name.as_str()) {
        (Some(v), "standard_conforming_strings") => !crate::lexing::conforming(v),
        (Some(v), _) => crate::lexing::unsafe_encoding(v),
        (None, _) => true,
    };
    hazardous.then(|| {
        format!(
            "SET {name} to {} would make the server read SQL differently from the gateway",
            value.as_deref().unwrap_or("a non-constant value")
        )
    })
}

fn explain_analyzes(options: &[protobuf::Node]) -> bool {
    options.iter().any(|o| match &o.node {
        Some(N::DefElem(d)) => d.defname.eq_ignore_ascii_case("analyze"),
        _ => false,
    })
}

fn set_value(args: &[protobuf::Node]) -> Option<String> {
    match args.first().and_then(|a| a.node.as_ref()) {
        Some(N::AConst(c)) => match &c.val {
            Some(a_const::Val::Sval(s)) => Some(s.sval.clone()),
            Some(a_const::Val::Ival(i)) => Some(i.ival.to_string()),
            Some(a_const::Val::Fval(f)) => Some(f.fval.clone()),
            _ => None,
        },
        _ => None,
    }
}

/// `(offset, token)` for each C-style comment that carries a token.
fn comments(sql: &str) -> Vec<(usize, String)> {
    if !sql.contains(carrier::COMMENT_KEY) {
        return Vec::new();
    }
    let Ok(scan) = pg_query::scan(sql) else {
        return Vec::new();
    };
    scan.tokens
        .iter()
        .filter(|t| t.token == ScanTokenKind::CComment as i32)
        .filter_map(|t| {
            let (start, end) = (t.start as usize, t.end as usize);
            let text = sql.get(start..end)?;
            carrier::comment_token(text).map(|token| (start, token))
        })
        .collect()
}

fn first_word(text: &str) -> String {
    let mut rest = text.trim_start();
    // Skip leading comments.
    loop {
        if let Some(r) = rest.strip_prefix("/*") {
            rest = r.split_once("*/").map_or("", |(_, r)| r).trim_start();
        } else if let Some(r) = rest.strip_prefix("--") {
            rest = r.split_once('\n').map_or("", |(_, r)| r).trim_start();
        } else {
            break;
        }
    }
    rest.split(|c: char| !c.is_ascii_alphabetic())
        .next()
        .unwrap_or("")
        .to_ascii_uppercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(sql: &str) -> Vec<Kind> {
        classify(sql)
            .statements
            .into_iter()
            .map(|s| s.kind)
            .collect()
    }

    /// `(expr).name` may call `name(expr)`: not a read.
    #[test]
    fn attribute_notation_is_a_call() {
        assert_eq!(
            kinds("SELECT ('public.s'::regclass).nextval"),
            vec![Kind::Write]
        );
        assert_eq!(kinds("SELECT (x).y FROM t"), vec![Kind::Write]);
        assert_eq!(kinds("SELECT a[1] FROM t"), vec![Kind::Read]);
    }

    /// Only a write whose named tables are all it can write has exact targets.
    #[test]
    fn targets_are_exact_only_when_they_are_all_it_can_write() {
        let exact = |sql: &str| -> Vec<bool> {
            classify(sql)
                .statements
                .iter()
                .map(|s| s.targets_exact)
                .collect()
        };
        for sql in [
            "DELETE FROM scratch.t",
            "INSERT INTO scratch.t SELECT count(*) FROM public.items",
            "TRUNCATE scratch.t",
            "ALTER TABLE scratch.t ADD COLUMN c int",
            "COPY scratch.t FROM STDIN",
            "DELETE FROM scratch.\"t\"",
            "INSERT INTO scratch.t VALUES ('has \"quotes\"')",
            "/* \"a.b\" */ INSERT INTO scratch.t VALUES ('a.b')",
            "DROP TABLE scratch.t",
            "CREATE TABLE scratch.n (id int PRIMARY KEY)",
            "INSERT INTO scratch.t SELECT id FROM public.items",
        ] {
            assert_eq!(exact(sql), vec![true], "{sql}");
        }
        for sql in [
            "INSERT INTO scratch.t SELECT setval('public.s', 1)",
            "INSERT INTO scratch.t VALUES (public.del_items())",
            "UPDATE scratch.t SET a = nextval('s')",
            "INSERT INTO \"scratch.t\" VALUES (1)",
            "INSERT INTO scratch.\"a.b\" VALUES (1)",
            "DROP TABLE \"scratch.t\"",
            "ALTER TABLE \"scratch.t\" ADD COLUMN c int",
            "TRUNCATE scratch.t CASCADE",
            "DROP TABLE scratch.t CASCADE",
            "ALTER TABLE scratch.t DROP COLUMN c CASCADE",
            "COPY scratch.t FROM PROGRAM 'cat'",
            "COPY scratch.t TO '/tmp/x'",
            "CREATE TRIGGER x AFTER INSERT ON scratch.t EXECUTE FUNCTION public.f()",
            "ALTER TABLE scratch.p ATTACH PARTITION public.items DEFAULT",
            "CREATE TABLE scratch.c PARTITION OF public.items DEFAULT",
            "CREATE TABLE scratch.c () INHERITS (public.items)",
            "ALTER TABLE scratch.t INHERIT public.items",
            "CREATE TABLE scratch.t (id int REFERENCES public.items (id))",
            "CREATE TABLE scratch.p (LIKE public.items)",
            "INSERT INTO scratch.t SELECT (('s'::regclass).nextval)",
            "SELECT del_items()",
            "SELECT 1",
            "DELETE FROM scratch.t WHERE (",
        ] {
            assert!(exact(sql).iter().all(|e| !e), "{sql}");
        }
    }

    /// Only `COPY ... FROM STDIN` reads the client's messages as data; what does not parse
    /// might.
    #[test]
    fn copies_in_only_from_stdin() {
        let copies = |sql: &str| -> Vec<bool> {
            classify(sql)
                .statements
                .iter()
                .map(|s| s.copies_in)
                .collect()
        };
        assert_eq!(copies("COPY t FROM STDIN"), vec![true]);
        assert_eq!(
            copies("copy t (a, b) from stdin with (format csv)"),
            vec![true]
        );
        assert_eq!(copies("SELECT 1; COPY t FROM STDIN"), vec![false, true]);
        assert_eq!(copies("COPY t TO STDOUT"), vec![false]);
        assert_eq!(copies("COPY t FROM '/tmp/x'"), vec![false]);
        assert_eq!(copies("COPY t FROM PROGRAM 'cat'"), vec![false]);
        assert_eq!(copies("INSERT INTO t VALUES (1)"), vec![false]);
        assert_eq!(copies("/* /* */ COPY */ COPY t FROM STDIN"), vec![true]);
        assert_eq!(copies("COPY t FROM STDIN garbage"), vec![true]);
    }

    /// The statements that create or drop prepared statements in SQL, with the server's
    /// names (folded unless quoted); a text the parser cannot read may be any of them.
    #[test]
    fn sql_that_changes_prepared_statements_is_recognized() {
        let forgets = |sql: &str| -> Vec<Option<Forget>> {
            classify(sql)
                .statements
                .into_iter()
                .map(|s| s.forgets)
                .collect()
        };
        let name = |n: &str| Some(Forget::Name(n.to_owned()));
        assert_eq!(forgets("PREPARE P AS SELECT 1"), [name("p")]);
        assert_eq!(
            forgets("PREPARE \"P\"(int) AS DELETE FROM t WHERE id = $1"),
            [name("P")]
        );
        assert_eq!(forgets("DEALLOCATE p"), [name("p")]);
        assert_eq!(forgets("DEALLOCATE PREPARE \"x y\""), [name("x y")]);
        assert_eq!(forgets("DEALLOCATE ALL"), [Some(Forget::All)]);
        assert_eq!(forgets("DEALLOCATE PREPARE ALL"), [Some(Forget::All)]);
        assert_eq!(forgets("DISCARD ALL"), [Some(Forget::All)]);
        assert_eq!(
            forgets("SELECT 1; DEALLOCATE a; DISCARD PLANS"),
            [None, name("a"), None]
        );
        assert_eq!(
            forgets("DISCARD TEMP; EXECUTE p; SELECT 'DEALLOCATE ALL'"),
            [None, None, None]
        );
        assert_eq!(
            forgets("DEALLOCATE ALL ALL"),
            [Some(Forget::All)],
            "does not parse"
        );
        assert_eq!(
            forgets("DO $$ BEGIN EXECUTE 'DEALLOCATE p'; END $$"),
            [Some(Forget::All)]
        );
        assert_eq!(forgets("CALL proc()"), [Some(Forget::All)]);
        let long = "p".repeat(MAX_NAME_BYTES);
        assert_eq!(
            forgets(&format!("DEALLOCATE {long}")),
            [Some(Forget::All)],
            "may be cut"
        );
        assert_eq!(
            forgets(&format!("DEALLOCATE {}", &long[1..])),
            [name(&long[1..])]
        );
    }

    #[test]
    fn reads_are_proven() {
        assert_eq!(
            kinds("SELECT abalance FROM pgbench_accounts WHERE aid = $1"),
            vec![Kind::Read]
        );
        assert_eq!(kinds("select count(*) from t"), vec![Kind::Read]);
        assert_eq!(kinds("SHOW search_path"), vec![Kind::Read]);
        assert_eq!(kinds("EXPLAIN SELECT lower(a) FROM t"), vec![Kind::Read]);
        assert_eq!(kinds("COPY t TO STDOUT"), vec![Kind::Read]);
        assert_eq!(kinds("COPY (SELECT 1) TO STDOUT"), vec![Kind::Read]);
        assert_eq!(kinds("SET work_mem = '4MB'"), vec![Kind::Read]);
    }

    #[test]
    fn writes_fail_closed() {
        for sql in [
            "INSERT INTO t VALUES (1)",
            "UPDATE t SET a = 1",
            "DELETE FROM t",
            "MERGE INTO t USING s ON t.id = s.id WHEN MATCHED THEN DELETE",
            "COPY t FROM STDIN",
            "TRUNCATE t",
            "CREATE TABLE x (a int)",
            "CALL p()",
            "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
            "SELECT * INTO newt FROM t",
            "SELECT my_func()",
            "SELECT nextval('s')",
            "EXPLAIN ANALYZE DELETE FROM t",
            // Planning runs an EXECUTE's parameters and folds functions; an explained write
            // fails closed.
            "EXPLAIN EXECUTE p(setval('s', 1000))",
            "EXPLAIN EXECUTE p(7)",
            "EXPLAIN (COSTS OFF) EXECUTE p",
            "EXPLAIN SELECT my_func()",
            "EXPLAIN DELETE FROM t",
            // A file written or a program run by the server.
            "COPY t TO '/tmp/x'",
            "COPY (SELECT 1) TO PROGRAM 'touch /tmp/x'",
            "COPY t TO PROGRAM 'cat > /dev/null'",
            // Row locks, at any depth.
            "SELECT * FROM t FOR UPDATE",
            "SELECT * FROM t FOR NO KEY UPDATE SKIP LOCKED",
            "SELECT * FROM (SELECT * FROM t FOR SHARE) s",
            "WITH l AS (SELECT * FROM t FOR KEY SHARE) SELECT 1",
            "DECLARE c CURSOR FOR SELECT * FROM t FOR UPDATE",
            "DO $$ BEGIN END $$",
            "this is not sql",
        ] {
            assert_eq!(kinds(sql), vec![Kind::Write], "{sql}");
        }
    }

    /// Issue 12, bypasses 1, 2 and 6: writes and function calls anywhere in the tree.
    #[test]
    fn the_full_tree_is_walked() {
        for sql in [
            "WITH t AS (DELETE FROM t RETURNING *) SELECT * FROM t",
            "WITH items AS (UPDATE items SET v = 1 RETURNING 1) SELECT 1",
            "DECLARE c CURSOR FOR SELECT my_writer()",
            "PREPARE p AS INSERT INTO t VALUES (1)",
            "PREPARE p AS WITH t AS (DELETE FROM t RETURNING 1) SELECT 1",
            "SELECT 1 LIMIT nextval('s')",
            "SELECT 1 OFFSET setval('s', 1)",
            "VALUES (nextval('s'))",
            "SELECT count(*) FILTER (WHERE lo_unlink(1) = 1) FROM t",
            "SELECT ARRAY[my_writer()]",
            "SELECT CASE my_writer() WHEN 1 THEN 1 END",
            "SELECT my_writer() IN (1, 2)",
            "SELECT * FROM t WHERE a IN (SELECT my_writer())",
        ] {
            assert_eq!(kinds(sql), vec![Kind::Write], "{sql}");
        }
        let c = classify("WITH t AS (DELETE FROM t RETURNING *) SELECT * FROM t");
        assert_eq!(c.statements[0].targets, vec!["t".to_owned()]);
        assert_eq!(
            kinds("SELECT count(*) FILTER (WHERE a > 1) FROM t LIMIT 3"),
            vec![Kind::Read]
        );
    }

    #[test]
    fn statements_split_with_offsets_and_comment_tokens() {
        let sql = "BEGIN; INSERT INTO t VALUES (1) /* fencing_token='fg1~7~job' */; SELECT 1;";
        let c = classify(sql);
        let k: Vec<_> = c.statements.iter().map(|s| s.kind.clone()).collect();
        assert_eq!(k, vec![Kind::TransactionControl, Kind::Write, Kind::Read]);
        assert_eq!(c.statements[1].comment_token.as_deref(), Some("fg1~7~job"));
        assert_eq!(c.statements[0].comment_token, None);
        assert_eq!(c.statements[2].comment_token, None);
        assert_eq!(&*c.statements[1].command, "INSERT");
        assert_eq!(c.statements[1].targets, vec!["t".to_owned()]);
        assert!(sql[c.statements[1].start..]
            .trim_start()
            .starts_with("INSERT"));
    }

    #[test]
    fn targets_name_the_written_tables() {
        for sql in [
            "TRUNCATE fencegate.fences",
            "DROP TABLE fencegate.fences",
            "ALTER TABLE fencegate.fences ADD COLUMN x int",
            "DELETE FROM fencegate.fences",
            "INSERT INTO fencegate.fences SELECT * FROM other",
            "COPY fencegate.fences FROM STDIN",
            "WITH d AS (DELETE FROM fencegate.fences RETURNING 1) SELECT * FROM d",
        ] {
            let c = classify(sql);
            assert!(
                c.statements[0]
                    .targets
                    .contains(&"fencegate.fences".to_owned()),
                "{sql}: {:?}",
                c.statements[0].targets
            );
        }
    }

    #[test]
    fn set_token_is_recognized() {
        assert_eq!(
            kinds("SET fencegate.token = 'fg1~7~job'"),
            vec![Kind::SetToken(Some("fg1~7~job".into()))]
        );
        assert_eq!(
            kinds("SET fencegate.token TO 'x'"),
            vec![Kind::SetToken(Some("x".into()))]
        );
        assert_eq!(kinds("RESET fencegate.token"), vec![Kind::SetToken(None)]);
        assert_eq!(kinds("DISCARD ALL"), vec![Kind::SessionReset]);
        assert_eq!(kinds("RESET ALL"), vec![Kind::SessionReset]);
        assert_eq!(kinds("DISCARD PLANS"), vec![Kind::Read]);
        // Issue 12, bypass 4: settings that change lexing are not relayed on a protected database.
        for sql in [
            "SET standard_conforming_strings = off",
            "SET LOCAL standard_conforming_strings TO false",
            "SET client_encoding = 'SJIS'",
            "SET NAMES 'big5'",
        ] {
            assert!(matches!(kinds(sql)[0], Kind::Unfenceable(_)), "{sql}");
        }
        assert_eq!(
            kinds("SET standard_conforming_strings = on"),
            vec![Kind::Read]
        );
        assert_eq!(kinds("SET client_encoding = 'UTF8'"), vec![Kind::Read]);
        assert_eq!(
            kinds("SET SESSION fencegate.token = DEFAULT"),
            vec![Kind::SetToken(None)]
        );
    }
}
