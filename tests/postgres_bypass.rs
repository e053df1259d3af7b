//! Issue 12's numbered bypasses of the PostgreSQL gateway, each against a real PostgreSQL
//! through the real `fencegate serve`. Unless a case says otherwise the tables are *not*
//! protected by the store's triggers, so what is tested is the gateway itself; each write must be
//! refused and the data left unchanged.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use support::postgres_server::{cli, code, connect, PgGateway};
use tokio_postgres::Client;

/// Items 1..=3, a sequence at 1, a function that deletes.
fn setup(gw: &PgGateway) {
    gw.pg.psql_as(
        "postgres",
        "CREATE TABLE items (id int PRIMARY KEY, v int NOT NULL);\
         INSERT INTO items VALUES (1, 1), (2, 2), (3, 3);\
         CREATE SEQUENCE s;\
         CREATE FUNCTION del_items() RETURNS int LANGUAGE sql AS $$ DELETE FROM items RETURNING 1 $$;",
    );
}

async fn items(direct: &Client) -> i64 {
    direct
        .query_one("SELECT count(*) FROM items", &[])
        .await
        .unwrap()
        .get(0)
}

/// Sequence `s`'s last value.
async fn last_value(direct: &Client) -> i64 {
    direct
        .query_one("SELECT last_value FROM s", &[])
        .await
        .unwrap()
        .get(0)
}

/// The SQLSTATE of an ErrorResponse's body.
fn error_code(body: &[u8]) -> String {
    body.split(|b| *b == 0)
        .find(|f| f.first() == Some(&b'C'))
        .map(|f| String::from_utf8_lossy(&f[1..]).into_owned())
        .unwrap_or_default()
}

/// A bare v3 protocol client, for message sequences no driver sends.
struct Raw {
    stream: TcpStream,
    /// Messages held to be written at once ([`Raw::hold`]).
    held: Option<Vec<u8>>,
}

impl Raw {
    /// Starts up with `params` (name, value pairs, in order, repeats allowed); returns the
    /// SQLSTATE of an error during startup, if any.
    fn start(port: u16, params: &[(&str, &str)]) -> (Self, Option<String>) {
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut body = 196608u32.to_be_bytes().to_vec();
        for (n, v) in params {
            body.extend_from_slice(n.as_bytes());
            body.push(0);
            body.extend_from_slice(v.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut msg = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        msg.extend_from_slice(&body);
        let mut raw = Self { stream, held: None };
        raw.stream.write_all(&msg).unwrap();
        let error = raw.until_ready();
        (raw, error)
    }

    fn send(&mut self, tag: u8, body: &[u8]) {
        let mut msg = vec![tag];
        msg.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        msg.extend_from_slice(body);
        match &mut self.held {
            Some(held) => held.extend_from_slice(&msg),
            None => self.stream.write_all(&msg).unwrap(),
        }
    }

    /// Holds the messages sent from now on until [`Raw::release`] writes them in one go: the
    /// gateway reads them together, before any reply to them can come back.
    fn hold(&mut self) {
        self.held = Some(Vec::new());
    }

    fn release(&mut self) {
        let held = self.held.take().unwrap_or_default();
        self.stream.write_all(&held).unwrap();
    }

    fn parse(&mut self, name: &str, sql: &str) {
        let mut b = Vec::new();
        for s in [name, sql] {
            b.extend_from_slice(s.as_bytes());
            b.push(0);
        }
        b.extend_from_slice(&0i16.to_be_bytes());
        self.send(b'P', &b);
    }

    fn bind(&mut self, portal: &str, statement: &str) {
        let mut b = Vec::new();
        for s in [portal, statement] {
            b.extend_from_slice(s.as_bytes());
            b.push(0);
        }
        b.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        self.send(b'B', &b);
    }

    fn bind_execute(&mut self, portal: &str, statement: &str) {
        self.bind(portal, statement);
        self.execute(portal);
    }

    /// The next message's tag and body; `None` once the connection is closed.
    fn next_message(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut head = [0u8; 5];
        self.stream.read_exact(&mut head).ok()?;
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize - 4;
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).unwrap();
        Some((head[0], body))
    }

    /// Reads until a message tagged `tag` (or the end); returns the tags read, `tag` included.
    fn until_tag(&mut self, tag: u8) -> String {
        let mut tags = String::new();
        while let Some((got, _)) = self.next_message() {
            if !matches!(got, b'N' | b'S') {
                tags.push(char::from(got));
            }
            if got == tag {
                break;
            }
        }
        tags
    }

    fn execute(&mut self, portal: &str) {
        let mut b = portal.as_bytes().to_vec();
        b.push(0);
        b.extend_from_slice(&0i32.to_be_bytes());
        self.send(b'E', &b);
    }

    fn sync(&mut self) {
        self.send(b'S', &[]);
    }

    /// Starts up as `postgres` with token `fg1~5~job` (as the session's startup option).
    fn holder(port: u16) -> Self {
        let (raw, err) = Self::start(
            port,
            &[
                ("user", "postgres"),
                ("database", "postgres"),
                ("fencegate.token", "fg1~5~job"),
            ],
        );
        assert_eq!(err, None);
        raw
    }

    /// Reads until the session is closed; returns the last ErrorResponse's fields, NULs shown
    /// as `|` (`|C08P01|`, `|Mfencegate: ...`).
    fn closing_error(&mut self) -> String {
        let mut last = None;
        while let Some((tag, body)) = self.next_message() {
            if tag == b'E' {
                last = Some(body);
            }
        }
        String::from_utf8_lossy(&last.unwrap_or_default()).replace('\0', "|")
    }

    /// Sends a simple Query.
    fn query(&mut self, sql: &str) {
        self.send(b'Q', format!("{sql}\0").as_bytes());
    }

    /// Reads until ReadyForQuery (or the end); returns the first error's SQLSTATE.
    fn until_ready(&mut self) -> Option<String> {
        let mut first_error = None;
        loop {
            let Some((tag, body)) = self.next_message() else {
                return first_error.or(Some("closed".to_owned()));
            };
            match tag {
                b'Z' => return first_error,
                b'E' if first_error.is_none() => first_error = Some(error_code(&body)),
                _ => {}
            }
        }
    }
}

/// Bypasses 1 and 6: writes hidden behind a CTE of the same name, and function calls where
/// pg_query's summary does not look (LIMIT, OFFSET, VALUES, FILTER, ARRAY[], CASE, IN).
#[tokio::test(flavor = "multi_thread")]
async fn writes_and_function_calls_anywhere_in_the_tree_need_a_token() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let c = connect(&gw.dsn("postgres")).await;
    for sql in [
        "WITH items AS (DELETE FROM items RETURNING *) SELECT count(*) FROM items",
        "SELECT 1 LIMIT del_items()",
        "SELECT 1 OFFSET del_items()",
        "VALUES (del_items())",
        "SELECT count(*) FILTER (WHERE del_items() = 1) FROM (VALUES (1)) v(x)",
        "SELECT ARRAY[del_items()]",
        "SELECT CASE del_items() WHEN 1 THEN 1 END",
        "SELECT del_items() IN (1, 2)",
        "SELECT 1 LIMIT nextval('s')",
        "VALUES (setval('s', 100))",
    ] {
        let e = c.simple_query(sql).await.unwrap_err();
        assert_eq!(code(&e), "FG002", "{sql}: {e}");
        assert_eq!(items(&direct).await, 3, "{sql} wrote");
    }
    let seq: i64 = direct
        .query_one("SELECT last_value FROM s", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(seq, 1, "the sequence moved");
    // Tokenless refusals from one client may be aggregated per second; all ten are counted.
    support::audit::wait_for_refusals(&gw.node.audit_dir, &[("missing", 10)]);
}

/// Bypass 2: DECLARE CURSOR over a writing function, and a SQL-level PREPARE bound with the
/// protocol after the token was reset.
#[tokio::test(flavor = "multi_thread")]
async fn cursors_and_prepared_statements_are_inspected() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let c = connect(&gw.dsn("postgres")).await;
    let e = c
        .batch_execute("BEGIN; DECLARE c CURSOR FOR SELECT del_items(); FETCH ALL FROM c; COMMIT")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    let _ = c.batch_execute("ROLLBACK").await;
    assert_eq!(items(&direct).await, 3);

    let (mut raw, err) = Raw::start(gw.port, &[("user", "postgres"), ("database", "postgres")]);
    assert_eq!(err, None);
    raw.send(b'Q', b"SET fencegate.token = 'fg1~5~job'\0");
    assert_eq!(raw.until_ready(), None);
    raw.send(b'Q', b"PREPARE p AS DELETE FROM items\0");
    assert_eq!(raw.until_ready(), None);
    raw.send(b'Q', b"RESET fencegate.token\0");
    assert_eq!(raw.until_ready(), None);
    raw.bind_execute("", "p");
    raw.sync();
    assert_eq!(raw.until_ready().as_deref(), Some("FG002"));
    assert_eq!(items(&direct).await, 3);
}

/// SQL that drops a statement the protocol prepared (`DEALLOCATE`, `DISCARD ALL`) and prepares
/// its name again for a write, while a token is held: a Bind of that name after the token is
/// gone must be judged by what the server now binds, not by the Parse the gateway saw, also when
/// that Parse is confirmed only after the SQL was sent. The tables have no triggers here: the
/// gateway alone stands between the Bind and the DELETE.
#[tokio::test(flavor = "multi_thread")]
async fn sql_that_prepares_a_name_again_does_not_hide_a_write() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let start = || Raw::start(gw.port, &[("user", "postgres"), ("database", "postgres")]).0;
    let query = |raw: &mut Raw, sql: &str| {
        raw.send(b'Q', format!("{sql}\0").as_bytes());
        raw.until_ready()
    };
    for drop in ["DEALLOCATE p", "DEALLOCATE ALL", "DISCARD ALL"] {
        let mut raw = start();
        raw.parse("p", "SELECT 1");
        raw.bind_execute("", "p");
        raw.sync();
        assert_eq!(raw.until_ready(), None, "a read binds without a token");
        assert_eq!(query(&mut raw, drop), None);
        assert_eq!(query(&mut raw, "SET fencegate.token = 'fg1~5~job'"), None);
        assert_eq!(query(&mut raw, "PREPARE p AS DELETE FROM items"), None);
        assert_eq!(query(&mut raw, "RESET fencegate.token"), None);
        raw.bind_execute("", "p");
        raw.sync();
        assert_eq!(raw.until_ready().as_deref(), Some("FG002"), "after {drop}");
        assert_eq!(items(&direct).await, 3, "after {drop}");
    }
    // The Parse is still unanswered when the SQL that replaces its name goes out.
    let mut raw = start();
    raw.hold();
    raw.send(b'Q', b"SET fencegate.token = 'fg1~5~job'\0");
    raw.parse("q", "SELECT 1");
    raw.sync();
    raw.send(b'Q', b"DEALLOCATE q; PREPARE q AS DELETE FROM items\0");
    raw.send(b'Q', b"RESET fencegate.token\0");
    raw.release();
    for answer in ["SET", "Parse", "DEALLOCATE; PREPARE", "RESET"] {
        assert_eq!(raw.until_ready(), None, "{answer}");
    }
    // Everything above is answered, the Parse's confirmation included.
    raw.bind_execute("", "q");
    raw.sync();
    assert_eq!(raw.until_ready().as_deref(), Some("FG002"));
    assert_eq!(items(&direct).await, 3);
    // The SQL is bound before a Parse of the same name and executed after it: what the Parse
    // made is dropped and replaced when the segment runs.
    let mut raw = start();
    assert_eq!(query(&mut raw, "SET fencegate.token = 'fg1~5~job'"), None);
    raw.parse("s1", "DEALLOCATE r");
    raw.parse("s2", "PREPARE r AS DELETE FROM items");
    raw.bind("a", "s1");
    raw.bind("b", "s2");
    raw.parse("r", "SELECT 1");
    raw.execute("a");
    raw.execute("b");
    raw.sync();
    assert_eq!(raw.until_ready(), None);
    assert_eq!(query(&mut raw, "RESET fencegate.token"), None);
    raw.bind_execute("", "r");
    raw.sync();
    assert_eq!(raw.until_ready().as_deref(), Some("FG002"));
    assert_eq!(items(&direct).await, 3);
    // Names the server cuts to 63 bytes: two the gateway would keep apart are one to the
    // server, so they are refused (the session ends).
    let mut raw = start();
    let long = |c: char| format!("{}{c}", "a".repeat(63));
    raw.parse(&long('1'), "SELECT 1");
    raw.sync();
    assert_eq!(raw.until_ready().as_deref(), Some("08P01"));
    assert_eq!(items(&direct).await, 3);
    support::audit::wait_for_refusals(&gw.node.audit_dir, &[("missing", 5)]);
}

/// Bypass 3: a Parse the server skipped after an error must not change what the unnamed
/// statement means to the gateway.
#[tokio::test(flavor = "multi_thread")]
async fn a_parse_the_server_skipped_does_not_hide_a_write() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let (mut raw, err) = Raw::start(gw.port, &[("user", "postgres"), ("database", "postgres")]);
    assert_eq!(err, None);
    raw.parse("", "DELETE FROM items");
    raw.sync();
    assert_eq!(raw.until_ready(), None);
    // An error (no such portal), then a Parse the server skips up to the Sync.
    raw.execute("no_such_portal");
    raw.parse("", "SELECT 1");
    raw.sync();
    assert_eq!(raw.until_ready().as_deref(), Some("34000"));
    raw.bind_execute("", "");
    raw.sync();
    assert_eq!(raw.until_ready().as_deref(), Some("FG002"));
    assert_eq!(items(&direct).await, 3);
    // A duplicate named Parse the server refused keeps the first meaning.
    raw.parse("d", "DELETE FROM items");
    raw.sync();
    assert_eq!(raw.until_ready(), None);
    raw.parse("d", "SELECT 1");
    raw.sync();
    assert_eq!(raw.until_ready().as_deref(), Some("42P05"));
    raw.bind_execute("", "d");
    raw.sync();
    assert_eq!(raw.until_ready().as_deref(), Some("FG002"));
    assert_eq!(items(&direct).await, 3);
}

/// Bypass 4: with standard_conforming_strings off the server splits `'a\' , '` differently.
#[tokio::test(flavor = "multi_thread")]
async fn settings_that_change_lexing_are_refused() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let trick = r"SELECT 'a\' , ' ; DELETE FROM items; -- '";
    let c = connect(&gw.dsn("postgres")).await;
    let set = c
        .simple_query("SET standard_conforming_strings = off")
        .await;
    let after = c.simple_query(trick).await;
    assert!(set.is_err() || after.is_err(), "both relayed");
    assert_eq!(items(&direct).await, 3);
    // The same as a startup option (the server reports it in ParameterStatus).
    let c = connect(&format!(
        "{} options='-c standard_conforming_strings=off'",
        gw.dsn("postgres")
    ))
    .await;
    let e = c.simple_query(trick).await.unwrap_err();
    assert_eq!(code(&e), "FG006", "{e}");
    assert_eq!(items(&direct).await, 3);
    // The way back is accepted, and then reads work again.
    c.simple_query("SET standard_conforming_strings = on")
        .await
        .unwrap();
    c.simple_query("SELECT 1").await.unwrap();
    // SJIS as a role default (a raw client: drivers send client_encoding=UTF8 themselves).
    gw.pg.psql_as(
        "postgres",
        "CREATE ROLE sjis_user LOGIN SUPERUSER; ALTER ROLE sjis_user SET client_encoding = 'SJIS'",
    );
    let (mut raw, err) = Raw::start(gw.port, &[("user", "sjis_user"), ("database", "postgres")]);
    assert_eq!(err, None);
    raw.send(b'Q', b"SELECT 1\0");
    assert_eq!(raw.until_ready().as_deref(), Some("FG006"));
    // The setting named in Unicode escapes, which no word search of the text finds: the shape
    // cache gave `TO 'off'` the answer it had for `TO 'on'`, and the trick pipelined right
    // behind it was judged before the server reported the new setting.
    let (mut raw, err) = Raw::start(gw.port, &[("user", "postgres"), ("database", "postgres")]);
    assert_eq!(err, None);
    let set = r#"SET U&"\0073tandard_conforming_strings" TO "#;
    raw.send(b'Q', format!("{set}'on'\0").as_bytes());
    assert_eq!(raw.until_ready(), None, "the way back is accepted");
    raw.hold();
    raw.send(b'Q', format!("{set}'off'\0").as_bytes());
    raw.send(b'Q', format!("{trick}\0").as_bytes());
    raw.release();
    assert_eq!(raw.until_ready().as_deref(), Some("FG006"));
    assert_eq!(
        raw.until_ready(),
        None,
        "the trick, read as the server still reads it"
    );
    assert_eq!(items(&direct).await, 3);
    // A session that started with the setting off and took the way back: RESET goes back to
    // the start, and the trick pipelined behind it was judged before the server said so.
    let way_back = || {
        let (mut raw, err) = Raw::start(
            gw.port,
            &[
                ("user", "postgres"),
                ("database", "postgres"),
                ("options", "-c standard_conforming_strings=off"),
            ],
        );
        assert_eq!(err, None);
        raw.send(b'Q', b"SET standard_conforming_strings = on\0");
        assert_eq!(raw.until_ready(), None);
        raw
    };
    let mut raw = way_back();
    raw.send(b'Q', b"SELECT 1\0");
    assert_eq!(raw.until_ready(), None, "on again: statements are judged");
    raw.hold();
    raw.send(b'Q', b"RESET standard_conforming_strings\0");
    raw.send(b'Q', format!("{trick}\0").as_bytes());
    raw.release();
    assert_eq!(raw.until_ready(), None, "RESET");
    assert_eq!(
        raw.until_ready().as_deref(),
        Some("FG006"),
        "judged before the answer"
    );
    assert_eq!(items(&direct).await, 3);
    // The same RESET in the extended protocol with a Flush: its CommandComplete comes back and
    // nothing is waiting for an answer, but the setting is reported only at the next
    // ReadyForQuery.
    let mut raw = way_back();
    raw.parse("", "RESET standard_conforming_strings");
    raw.bind_execute("", "");
    raw.send(b'H', b"");
    assert_eq!(raw.until_tag(b'C'), "12C");
    // A simple Query inside the Sync segment ends the session (the server would skip it after
    // an error there: see what_the_server_skips_never_puts_replies_out_of_step).
    raw.send(b'Q', format!("{trick}\0").as_bytes());
    assert_eq!(raw.until_ready().as_deref(), Some("08P01"), "after a Flush");
    assert_eq!(items(&direct).await, 3);
}

/// Statements that look like reads to a parse but write, lock or run something on the server,
/// each sent without a token: refused, nothing changed, each audited.
#[tokio::test(flavor = "multi_thread")]
async fn what_only_looks_like_a_read_is_refused() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let c = connect(&gw.dsn("postgres")).await;
    // `/*/` opens a second comment level: the shape cache closed the comment there, so the
    // write had the shape of the read before it.
    c.simple_query("SELECT 1 /*/*/ 'x' */ */").await.unwrap();
    let e = c
        .simple_query("SELECT 1 /*/*/ '*/ */; DELETE FROM items --' */ */")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    // EXPLAIN without ANALYZE still evaluates an EXECUTE's parameters.
    c.simple_query("PREPARE p(bigint) AS SELECT $1")
        .await
        .unwrap();
    let e = c
        .simple_query("EXPLAIN EXECUTE p(setval('s', 1000))")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    // COPY to a program runs it on the server (the test's role is a superuser).
    let marker = std::env::temp_dir().join(format!("fencegate-copy-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let copy = format!("COPY (SELECT 1) TO PROGRAM 'touch {}'", marker.display());
    let e = c.simple_query(&copy).await.unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    // Row locks are written, and would block the lock's next holder.
    let e = c
        .simple_query("SELECT * FROM items FOR UPDATE")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    assert_eq!(items(&direct).await, 3);
    assert_eq!(last_value(&direct).await, 1);
    assert!(!marker.exists(), "the program ran");
    support::audit::wait_for_refusals(&gw.node.audit_dir, &[("missing", 4)]);
}

/// A read, then a write whose text the shape cache before f576d60 gave the read's shape: the
/// cache ended `--` comments at `\n` only, and masked the `UESCAPE` character as a literal.
/// What PostgreSQL runs: `SELECT 1 AS a, '\n, ' AS b; DELETE FROM items ...; SELECT ' -- '`.
const CR_READ: &str = "SELECT 1 AS a -- \r, '\n, ' AS b, ' -- '";
const CR_DELETE: &str =
    "SELECT 1 AS a -- \r, '\n, ' AS b; DELETE FROM items WHERE id = 1; SELECT ' -- '";
/// `U&"!0070ublic" UESCAPE '#'` is the schema `!0070ublic` (unprotected in the config below);
/// with `UESCAPE '!'` it is `public`.
const UESCAPE_UNPROTECTED: &str =
    "UPDATE U&\"!0070ublic\" UESCAPE '#'.items SET v = 0 WHERE id = 1";
const UESCAPE_PROTECTED: &str = "UPDATE U&\"!0070ublic\" UESCAPE '!'.items SET v = 0 WHERE id = 2";

/// Sends both pairs tokenless through `gw` (with `public` protected by the store's triggers if
/// `protect`) and checks that each write is refused (FG002) and `public.items` is unchanged.
async fn cached_shapes_never_cover_a_write(gw: &PgGateway, protect: bool) {
    setup(gw);
    gw.pg.psql_as(
        "postgres",
        "CREATE SCHEMA \"!0070ublic\"; CREATE TABLE \"!0070ublic\".items (id int, v int);\
         INSERT INTO \"!0070ublic\".items VALUES (1, 1), (2, 2);",
    );
    let direct = connect(&gw.pg.dsn("postgres")).await;
    if protect {
        let (c, out, err) = cli(&[
            "postgres",
            "protect",
            "--dsn",
            &gw.pg.dsn("postgres"),
            "--schema",
            "public",
        ]);
        assert_eq!(c, 0, "{out}{err}");
    }
    let c = connect(&gw.dsn("postgres")).await;
    // Bypass 5a: `--` ends at `\r` for PostgreSQL.
    c.simple_query(CR_READ).await.unwrap();
    let e = c.simple_query(CR_DELETE).await.unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    assert_eq!(public_items(&direct).await, vec![(1, 1), (2, 2), (3, 3)]);
    // Bypass 5b: the UESCAPE character decides which schema the name is in.
    c.simple_query(UESCAPE_UNPROTECTED).await.unwrap();
    let e = c.simple_query(UESCAPE_PROTECTED).await.unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    assert_eq!(public_items(&direct).await, vec![(1, 1), (2, 2), (3, 3)]);
}

async fn public_items(direct: &Client) -> Vec<(i32, i32)> {
    direct
        .query("SELECT id, v FROM public.items ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Bypass 5, the gateway alone (no triggers): a write never reuses a read's cached shape.
#[tokio::test(flavor = "multi_thread")]
async fn the_shape_cache_never_gives_a_write_the_shape_of_a_read() {
    let gw = PgGateway::start("unprotected_schemas = [\"!0070ublic\"]", &[]);
    cached_shapes_never_cover_a_write(&gw, false).await;
    // The gateway refused both writes itself, each audited.
    support::audit::wait_for_refusals(&gw.node.audit_dir, &[("missing", 2)]);
}

/// Bypass 5 with `public` protected by the store's triggers: refused even if the gateway
/// let the write through.
#[tokio::test(flavor = "multi_thread")]
async fn the_shape_cache_differentials_are_refused_by_the_store_too() {
    let gw = PgGateway::start("unprotected_schemas = [\"!0070ublic\"]", &[]);
    cached_shapes_never_cover_a_write(&gw, true).await;
}

/// Bypass 7: a procedure that COMMITs, called with the extended protocol under a guard, writes
/// after its first COMMIT without a pass: the store's trigger refuses that write.
#[tokio::test(flavor = "multi_thread")]
async fn a_procedure_that_commits_is_refused_after_its_first_commit() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    gw.pg.psql_as(
        "postgres",
        "CREATE TABLE log (id int);\
         CREATE PROCEDURE two_batches() LANGUAGE plpgsql AS $$ \
           BEGIN INSERT INTO items VALUES (10, 0); COMMIT; INSERT INTO items VALUES (11, 0); END $$;",
    );
    let (c, out, err) = cli(&[
        "postgres",
        "protect",
        "--dsn",
        &gw.pg.dsn("postgres"),
        "--table",
        "items",
    ]);
    assert_eq!(c, 0, "{out}{err}");
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let holder = connect(&format!(
        "{} options='-c fencegate.token=fg1~5~job'",
        gw.dsn("postgres")
    ))
    .await;
    let e = holder.execute("CALL two_batches()", &[]).await.unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    let ids: Vec<i32> = direct
        .query("SELECT id FROM items WHERE id >= 10 ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, vec![10], "only the batch before the COMMIT may land");
}

/// Bypass 8: repeated startup parameters, and unprotected_schemas reaching a protected table
/// through a view (the store's trigger refuses it).
#[tokio::test(flavor = "multi_thread")]
async fn repeated_startup_parameters_and_views_into_protected_tables() {
    let gw = PgGateway::start(
        "databases = [\"postgres\"]\nunprotected_schemas = [\"scratch\"]",
        &[],
    );
    setup(&gw);
    gw.pg.psql_as(
        "postgres",
        "CREATE SCHEMA scratch; CREATE VIEW scratch.items_v AS SELECT * FROM public.items;",
    );
    gw.pg.psql_as("postgres", "CREATE DATABASE other");
    let (_raw, err) = Raw::start(
        gw.port,
        &[
            ("user", "postgres"),
            ("database", "other"),
            ("database", "postgres"),
        ],
    );
    assert_eq!(err.as_deref(), Some("08P01"));
    let (_raw, err) = Raw::start(
        gw.port,
        &[
            ("user", "postgres"),
            ("database", "postgres"),
            ("fencegate.token", "fg1~5~job"),
        ],
    );
    assert_eq!(err, None, "a top-level token is taken, not relayed");

    let (c, out, err) = cli(&[
        "postgres",
        "protect",
        "--dsn",
        &gw.pg.dsn("postgres"),
        "--schema",
        "public",
    ]);
    assert_eq!(c, 0, "{out}{err}");
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let c = connect(&gw.dsn("postgres")).await;
    let e = c
        .simple_query("DELETE FROM scratch.items_v")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    assert_eq!(items(&direct).await, 3);
}

/// While the server reads a COPY FROM STDIN's data it ignores Sync and Flush (libpq and
/// tokio-postgres send a Sync right after the COPY's Execute): had the gateway queued a reply for
/// such a Sync, every later reply would be matched to the wrong request (the guard's replies shown
/// to the client, a client's own FG001 audited as a stale refusal). A COPY that fails before it
/// reads data ends at that Sync, and one that fails in its data at the next.
#[tokio::test(flavor = "multi_thread")]
async fn copy_from_stdin_keeps_every_reply_matched_to_its_request() {
    use futures_util::SinkExt;
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let v = |id: i32| {
        let direct = &direct;
        async move {
            let row = direct
                .query_one("SELECT v FROM items WHERE id = $1", &[&id])
                .await
                .unwrap();
            row.get::<_, i32>(0)
        }
    };

    // The driver's own COPY, then a guarded write and a read on the same connection.
    let holder = connect(&format!(
        "{} options='-c fencegate.token=fg1~5~job'",
        gw.dsn("postgres")
    ))
    .await;
    // Bounded: a reply held back or lost would leave the driver waiting.
    let driver = async {
        let sink = holder.copy_in("COPY items FROM STDIN").await.unwrap();
        let mut sink = Box::pin(sink);
        sink.send(bytes::Bytes::from_static(b"4\t4\n"))
            .await
            .unwrap();
        assert_eq!(sink.as_mut().finish().await.unwrap(), 1);
        assert_eq!(
            holder
                .execute("UPDATE items SET v = 40 WHERE id = 4", &[])
                .await
                .unwrap(),
            1
        );
        let n: i64 = holder
            .query_one("SELECT count(*) FROM items", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 4);
    };
    tokio::time::timeout(Duration::from_secs(30), driver)
        .await
        .expect("the driver's COPY and the requests after it are answered");
    assert_eq!(v(4).await, 40);

    let mut raw = Raw::holder(gw.port);
    // Extended, a Flush inside the data (a Sync there ends the session: see
    // what_the_server_skips_never_puts_replies_out_of_step).
    raw.hold();
    raw.parse("", "COPY items FROM STDIN");
    raw.bind_execute("", "");
    raw.sync();
    raw.release();
    assert_eq!(raw.until_tag(b'G'), "12G");
    raw.hold();
    raw.send(b'd', b"5\t5\n");
    raw.send(b'H', &[]);
    raw.send(b'd', b"6\t6\n");
    raw.send(b'c', &[]);
    raw.sync();
    raw.release();
    assert_eq!(raw.until_tag(b'Z'), "CZ");
    assert_eq!(items(&direct).await, 6);
    // Simple protocol, a Sync inside the data.
    raw.query("COPY items FROM STDIN");
    assert_eq!(raw.until_tag(b'G'), "G");
    raw.hold();
    raw.sync();
    raw.send(b'd', b"7\t7\n");
    raw.send(b'c', &[]);
    raw.release();
    assert_eq!(raw.until_tag(b'Z'), "CZ");
    assert_eq!(items(&direct).await, 7);
    // A COPY that fails before it reads data: its Sync is answered.
    raw.hold();
    raw.parse("", "COPY no_such_table FROM STDIN");
    raw.bind_execute("", "");
    raw.sync();
    raw.release();
    assert_eq!(raw.until_ready().as_deref(), Some("42P01"));
    // A COPY that fails in its data: the Sync after its CopyDone is answered.
    raw.hold();
    raw.parse("", "COPY items FROM STDIN");
    raw.bind_execute("", "");
    raw.sync();
    raw.release();
    assert_eq!(raw.until_tag(b'G'), "12G");
    raw.hold();
    raw.send(b'd', b"x\tx\n");
    raw.send(b'c', &[]);
    raw.sync();
    raw.release();
    assert_eq!(raw.until_ready().as_deref(), Some("22P02"));
    assert_eq!(items(&direct).await, 7);

    // Every reply still answers its own request: a guard's replies stay the gateway's...
    raw.query("UPDATE items SET v = 10 WHERE id = 1");
    assert_eq!(raw.until_tag(b'Z'), "CZ");
    assert_eq!(v(1).await, 10);
    // ...a client's own error with the stale token's SQLSTATE is not a refusal...
    raw.query("DO $$ BEGIN RAISE EXCEPTION 'mine' USING ERRCODE = 'FG001'; END $$");
    assert_eq!(raw.until_ready().as_deref(), Some("FG001"));
    // ...and a stale token is refused, audited once, and changes nothing.
    raw.query("SET fencegate.token = 'fg1~9~job'");
    assert_eq!(raw.until_ready(), None);
    raw.query("UPDATE items SET v = 90 WHERE id = 2");
    assert_eq!(raw.until_ready(), None);
    raw.query("SET fencegate.token = 'fg1~5~job'");
    assert_eq!(raw.until_ready(), None);
    raw.query("UPDATE items SET v = 50 WHERE id = 2");
    assert_eq!(raw.until_ready().as_deref(), Some("FG001"));
    assert_eq!(v(2).await, 90);
    support::audit::wait_for_refusals(&gw.node.audit_dir, &[("stale", 1)]);
}

/// Anything but copy data, Flush and Sync sent during a COPY FROM STDIN ends the session: the
/// server would read it as a broken copy and answer it with nothing of its own.
#[tokio::test(flavor = "multi_thread")]
async fn a_query_sent_during_a_copy_ends_the_session() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let mut raw = Raw::holder(gw.port);
    raw.hold();
    raw.query("COPY items FROM STDIN");
    raw.query("DELETE FROM items");
    raw.release();
    assert_eq!(raw.until_tag(b'G'), "G");
    // The server's own error for the COPY cut short may come first; the gateway's is last.
    let last = raw.closing_error();
    assert!(last.contains("|C08P01|"), "{last}");
    assert!(
        last.contains("|Mfencegate: ") && last.contains("'Q' was sent during COPY FROM STDIN"),
        "{last}"
    );
    assert_eq!(items(&direct).await, 3);
}

/// `unprotected_schemas` lets a write pass without a token only where the tables it names are
/// all it can write: not through a function it calls, a quoted name holding a dot (a table of
/// the search path), or a CASCADE. The store's triggers are not installed: the gateway alone
/// must refuse each, and leave the protected table as it was.
#[tokio::test(flavor = "multi_thread")]
async fn unprotected_schemas_pass_only_writes_that_stay_there() {
    let gw = PgGateway::start("unprotected_schemas = [\"scratch\"]", &[]);
    setup(&gw);
    gw.pg.psql_as(
        "postgres",
        "CREATE SCHEMA scratch; CREATE TABLE scratch.t (id int PRIMARY KEY);\
         CREATE TABLE \"scratch.t\" (id int);\
         CREATE TABLE scratch.parent (id int PRIMARY KEY);\
         INSERT INTO scratch.parent VALUES (1), (2), (3);\
         ALTER TABLE items ADD FOREIGN KEY (id) REFERENCES scratch.parent (id);",
    );
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let c = connect(&gw.dsn("postgres")).await;
    // What stays in scratch passes.
    c.simple_query("INSERT INTO scratch.t VALUES (1)")
        .await
        .unwrap();
    for sql in [
        "INSERT INTO scratch.t SELECT del_items()",
        "INSERT INTO scratch.t SELECT setval('s', 100)",
        "INSERT INTO \"scratch.t\" VALUES (1)",
        "TRUNCATE scratch.parent CASCADE",
        "SELECT ('s'::regclass).nextval",
        "ALTER TABLE scratch.parent ATTACH PARTITION public.items DEFAULT",
        "CREATE TABLE scratch.child () INHERITS (public.items)",
    ] {
        let e = c.simple_query(sql).await.unwrap_err();
        assert_eq!(code(&e), "FG002", "{sql}: {e}");
    }
    assert_eq!(items(&direct).await, 3);
    let n: i64 = direct
        .query_one("SELECT count(*) FROM public.\"scratch.t\"", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    assert_eq!(last_value(&direct).await, 1);
    support::audit::wait_for_refusals(&gw.node.audit_dir, &[("missing", 7)]);
}

/// After an error in a Sync segment the server skips every message up to the next Sync, a
/// simple Query included; and a COPY's data may end in an error the gateway has not seen yet.
/// None of these may leave the queue of expected replies out of step, or hang the session.
#[tokio::test(flavor = "multi_thread")]
async fn what_the_server_skips_never_puts_replies_out_of_step() {
    let gw = PgGateway::start("", &[]);
    setup(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let start = || Raw::holder(gw.port);

    // A COPY statement bound after an error in its segment is skipped: its Sync is answered.
    let mut raw = start();
    raw.parse("c", "COPY items FROM STDIN");
    raw.sync();
    assert_eq!(raw.until_ready(), None);
    raw.parse("x", "SELEC");
    raw.send(b'H', &[]);
    assert_eq!(raw.until_tag(b'E'), "E");
    raw.bind_execute("", "c");
    raw.sync();
    assert_eq!(raw.until_ready(), None, "answered, not held");
    raw.query("SELECT 1");
    assert_eq!(raw.until_tag(b'Z'), "TDCZ");

    // JDBC's autosave: an extended BEGIN, a simple SAVEPOINT inside the segment, then a write.
    // Followed, with the server running it or (after an error before it) skipping it.
    let mut raw = start();
    raw.hold();
    raw.parse("", "BEGIN");
    raw.bind_execute("", "");
    raw.query("SAVEPOINT autosave");
    raw.parse("", "UPDATE items SET v = 7 WHERE id = 1");
    raw.bind_execute("", "");
    raw.sync();
    raw.release();
    assert_eq!(raw.until_tag(b'Z'), "12CCZ", "SAVEPOINT");
    assert_eq!(raw.until_tag(b'Z'), "12CZ", "the write");
    raw.query("COMMIT");
    assert_eq!(raw.until_ready(), None);
    raw.hold();
    raw.parse("", "SELEC");
    raw.query("SAVEPOINT autosave");
    raw.sync();
    raw.release();
    assert_eq!(raw.until_ready().as_deref(), Some("42601"));
    raw.query("UPDATE items SET v = 8 WHERE id = 1");
    assert_eq!(
        raw.until_tag(b'Z'),
        "CZ",
        "in step after the skipped SAVEPOINT"
    );
    let v: i32 = direct
        .query_one("SELECT v FROM items WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, 8);

    // Any other simple Query inside a Sync segment is refused: the session ends.
    let mut raw = start();
    raw.hold();
    raw.parse("", "SELEC");
    raw.query("DELETE FROM items");
    raw.sync();
    raw.release();
    let last = raw.closing_error();
    assert!(
        last.contains("|C08P01|") && last.contains("send Sync first"),
        "{last}"
    );
    assert_eq!(items(&direct).await, 3);

    // A Sync among an extended COPY's data: the data may already have failed, and the server
    // would answer this Sync. It ends the session; nothing is copied.
    let mut raw = start();
    raw.hold();
    raw.parse("", "COPY items FROM STDIN");
    raw.bind_execute("", "");
    raw.sync();
    raw.release();
    assert_eq!(raw.until_tag(b'G'), "12G");
    raw.hold();
    raw.send(b'd', b"x\tx\n");
    raw.sync();
    raw.query("SELECT 1");
    raw.release();
    let last = raw.closing_error();
    assert!(
        last.contains("|C08P01|") && last.contains("a Sync was sent among the data"),
        "{last}"
    );
    assert_eq!(items(&direct).await, 3);
}
