//! The store enforces the fence (issue 12), on direct connections to a real PostgreSQL (no
//! gateway): protected tables refuse every write in a transaction that did not call
//! `fencegate.guard(token)` with a current signed token, whatever path the write takes.
//! Every case that writes through the triggers runs against both implementations of
//! `fencegate.enforce()`: fence.sql's plpgsql (module `plpgsql`) and the C library of
//! filters/postgres/ext (`install --enforce c`, module `c`).

mod support;

use fencegate_postgres::Enforce;
use fencegate_testkit::enforce_library::enforce_library_conf;
use support::postgres_server::{
    cli, code, connect, function_language, install_enforce, PgGateway, PgServer,
};
use tokio_postgres::Client;

const APP: &str = "app_user";
const KID: u32 = 3;
const SECRET: [u8; 32] = [0xab; 32];

/// A PostgreSQL with fence.sql, an application role that owns nothing, schema `app` protected
/// for resource `job`, and the cluster key `KID` installed.
struct Store {
    pg: PgServer,
    admin: Client,
}

/// A server that can load the C `fencegate.enforce()` when `enforce` is C.
fn server_for(enforce: Enforce) -> PgServer {
    match enforce {
        Enforce::Plpgsql => PgServer::start(),
        Enforce::C => PgServer::start_with_conf(&enforce_library_conf()),
    }
}

/// The language of the installed `fencegate.enforce()`.
fn enforce_language(pg: &PgServer) -> String {
    function_language(pg, "fencegate.enforce()")
}

/// The language of the installed `fencegate.guard(text)`.
fn guard_language(pg: &PgServer) -> String {
    function_language(pg, "fencegate.guard(text)")
}

impl Store {
    async fn start(enforce: Enforce) -> Self {
        let pg = server_for(enforce);
        let (c, out, err) = install_enforce(&pg.dsn("postgres"), &enforce.to_string());
        assert_eq!(c, 0, "install: {out}{err}");
        assert!(out.contains(&format!("enforce() in {enforce}")), "{out}");
        assert_eq!(enforce_language(&pg), enforce.to_string());
        assert_eq!(guard_language(&pg), enforce.to_string());
        assert!(
            err.contains("warning: role postgres is a superuser"),
            "install must warn about its role: {err}"
        );
        pg.psql_as(
            "postgres",
            &format!(
                "CREATE EXTENSION pgcrypto;\
                 CREATE ROLE {APP} LOGIN;\
                 CREATE SCHEMA app; CREATE SCHEMA scratch;\
                 CREATE TABLE app.items (id int PRIMARY KEY, v int NOT NULL);\
                 INSERT INTO app.items VALUES (1, 1), (2, 2);\
                 CREATE TABLE app.parted (id int, v int) PARTITION BY RANGE (id);\
                 CREATE TABLE app.parted_1 PARTITION OF app.parted FOR VALUES FROM (0) TO (1000);\
                 CREATE VIEW scratch.items_v AS SELECT * FROM app.items;\
                 CREATE TABLE scratch.notes (id int);\
                 CREATE RULE notes_copy AS ON INSERT TO scratch.notes DO ALSO INSERT INTO app.items VALUES (NEW.id, 0);\
                 CREATE FUNCTION scratch.write_items(i int) RETURNS void LANGUAGE sql AS $$ INSERT INTO app.items VALUES (i, 0) $$;\
                 CREATE PROCEDURE scratch.commit_then_write(i int) LANGUAGE plpgsql AS $$ \
                   BEGIN INSERT INTO scratch.notes_plain VALUES (i); COMMIT; INSERT INTO app.items VALUES (i, 0); END $$;\
                 CREATE TABLE scratch.notes_plain (id int);\
                 GRANT USAGE ON SCHEMA app, scratch TO {APP};\
                 GRANT ALL ON ALL TABLES IN SCHEMA app, scratch TO {APP};"
            ),
        );
        let (c, out, err) = cli(&[
            "postgres",
            "protect",
            "--dsn",
            &pg.dsn("postgres"),
            "--schema",
            "app",
            "--resource",
            "job",
        ]);
        assert_eq!(c, 0, "protect: {out}{err}");
        assert!(out.contains("protected 3 table(s), resource job"), "{out}");
        assert!(out.contains("event trigger"), "{out}");
        let mut admin = connect(&pg.dsn("postgres")).await;
        fencegate_postgres::install_token_keys(&mut admin, &[(KID, SECRET.to_vec(), false)])
            .await
            .unwrap();
        Self { pg, admin }
    }

    /// A token signed with `kid`'s secret by pgcrypto's HMAC (independent of fence.sql's own).
    async fn sign(&self, kid: u32, secret: &[u8], revision: u64, resource: &str) -> String {
        let unsigned = format!("fg1~{revision}~{resource}");
        let sig: String = self
            .admin
            .query_one(
                "SELECT translate(rtrim(encode(hmac($1::text::bytea, $2, 'sha256'), 'base64'), '='), '+/', '-_')",
                &[&unsigned, &secret],
            )
            .await
            .unwrap()
            .get(0);
        format!("{unsigned}~{kid}.{sig}")
    }

    async fn token(&self, revision: u64) -> String {
        self.sign(KID, &SECRET, revision, "job").await
    }

    /// Commits `job`'s fence at `revision` (a guard in a transaction of its own); its token.
    async fn fence_at(&self, revision: u64) -> String {
        let token = self.token(revision).await;
        self.app()
            .await
            .batch_execute(&format!("SELECT fencegate.guard('{token}')"))
            .await
            .unwrap();
        token
    }

    async fn app(&self) -> Client {
        connect(&self.pg.dsn(APP)).await
    }

    async fn items(&self) -> Vec<(i32, i32)> {
        self.admin
            .query("SELECT id, v FROM app.items ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }
}

const INITIAL: [(i32, i32); 2] = [(1, 1), (2, 2)];

/// The server process of `client`'s session (for pg_locks and pg_stat_activity).
async fn backend_pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

async fn tokenless_writes_are_refused_by_the_store_whatever_their_path(enforce: Enforce) {
    use futures_util::SinkExt;
    let store = Store::start(enforce).await;
    let app = store.app().await;
    for sql in [
        "INSERT INTO app.items VALUES (10, 0)",
        "UPDATE app.items SET v = v + 1",
        "DELETE FROM app.items",
        "TRUNCATE app.items",
        "MERGE INTO app.items t USING (SELECT 1 AS id) s ON t.id = s.id WHEN MATCHED THEN DELETE",
        "WITH d AS (DELETE FROM app.items RETURNING *) SELECT count(*) FROM d",
        "INSERT INTO scratch.items_v VALUES (11, 0)",
        "UPDATE scratch.items_v SET v = 9",
        "INSERT INTO scratch.notes VALUES (12)",
        "SELECT scratch.write_items(13)",
        "DO $$ BEGIN INSERT INTO app.items VALUES (14, 0); END $$",
        "CALL scratch.commit_then_write(15)",
        "INSERT INTO app.parted VALUES (1, 1)",
        "INSERT INTO app.parted_1 VALUES (2, 2)",
        // A guard in an earlier transaction does not carry over.
        "BEGIN; SELECT 1; COMMIT; INSERT INTO app.items VALUES (16, 0)",
    ] {
        let e = app.batch_execute(sql).await.unwrap_err();
        assert_eq!(code(&e), "FG002", "{sql}: {e:?}");
        assert_eq!(store.items().await, INITIAL, "{sql} changed the data");
    }
    // The procedure's first transaction committed, its write after COMMIT was refused.
    let notes: i64 = store
        .admin
        .query_one("SELECT count(*) FROM scratch.notes_plain", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(notes, 1);
    // A guarded transaction, then a procedure that commits: refused after its first COMMIT.
    let token = store.token(5).await;
    let e = app
        .batch_execute(&format!(
            "SELECT fencegate.guard('{token}'); CALL scratch.commit_then_write(17)"
        ))
        .await
        .unwrap_err();
    assert!(["FG002", "2D000"].contains(&code(&e).as_str()), "{e:?}");
    // COPY FROM STDIN.
    let refused = match app
        .copy_in::<_, bytes::Bytes>("COPY app.items FROM STDIN")
        .await
    {
        Err(e) => e,
        Ok(sink) => {
            let mut sink = Box::pin(sink);
            let _ = sink.send(bytes::Bytes::from_static(b"20\t0\n")).await;
            sink.as_mut().finish().await.unwrap_err()
        }
    };
    assert_eq!(code(&refused), "FG002");
    assert_eq!(store.items().await, INITIAL);
    let parted: i64 = store
        .admin
        .query_one("SELECT count(*) FROM app.parted", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(parted, 0);
}

async fn a_current_signed_token_lets_writes_commit_and_the_guard_refuses_the_rest(
    enforce: Enforce,
) {
    use futures_util::SinkExt;
    let store = Store::start(enforce).await;
    let app = store.app().await;
    let t5 = store.token(5).await;
    // Simple query: guard and write in one implicit transaction.
    app.batch_execute(&format!(
        "SELECT fencegate.guard('{t5}'); INSERT INTO app.items VALUES (3, 3)"
    ))
    .await
    .unwrap();
    // Explicit transaction, extended protocol, through a view, a function and COPY.
    let mut app = app;
    let tx = app.transaction().await.unwrap();
    tx.execute("SELECT fencegate.guard($1)", &[&t5])
        .await
        .unwrap();
    tx.execute("UPDATE scratch.items_v SET v = 30 WHERE id = 3", &[])
        .await
        .unwrap();
    tx.execute("SELECT scratch.write_items(4)", &[])
        .await
        .unwrap();
    let sink = tx.copy_in("COPY app.items FROM STDIN").await.unwrap();
    let mut sink = Box::pin(sink);
    sink.send(bytes::Bytes::from_static(b"5\t5\n"))
        .await
        .unwrap();
    assert_eq!(sink.as_mut().finish().await.unwrap(), 1);
    tx.commit().await.unwrap();
    let expected = vec![(1, 1), (2, 2), (3, 30), (4, 0), (5, 5)];
    assert_eq!(store.items().await, expected);

    let t4 = store.token(4).await;
    let other = store.sign(KID, &SECRET, 9, "other").await;
    let unknown_key = store.sign(KID + 1, &SECRET, 9, "job").await;
    let forged = format!("{}A", &t5[..t5.len() - 1]);
    let forged = if forged == t5 {
        format!("{}B", &t5[..t5.len() - 1])
    } else {
        forged
    };
    for (token, want, why) in [
        ("fg1~9~job".to_owned(), "FG004", "unsigned"),
        (forged, "FG004", "forged signature"),
        (unknown_key, "FG004", "unknown key"),
        (t4, "FG001", "stale"),
        ("fg1~x~job".to_owned(), "FG003", "malformed"),
        (
            other,
            "FG005",
            "another resource: the guard passes, the table is bound to job",
        ),
    ] {
        let e = app
            .batch_execute(&format!(
                "SELECT fencegate.guard('{token}'); DELETE FROM app.items"
            ))
            .await
            .unwrap_err();
        assert_eq!(code(&e), want, "{why}: {e:?}");
        assert_eq!(store.items().await, expected, "{why}");
    }
    // The unsigned legacy form is refused once keys are installed, unless the transaction
    // already holds a pass for the same resource and revision.
    let e = app
        .batch_execute("SELECT fencegate.guard('job', 5); DELETE FROM app.items")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG004");
    app.batch_execute(&format!(
        "SELECT fencegate.guard('{t5}'); SELECT fencegate.guard('job', 5); DELETE FROM app.items WHERE id = 5"
    ))
    .await
    .unwrap();
    // A retired key verifies nothing.
    fencegate_postgres::install_token_keys(
        &mut store_admin(&store).await,
        &[(KID, SECRET.to_vec(), true)],
    )
    .await
    .unwrap();
    let e = app
        .batch_execute(&format!("SELECT fencegate.guard('{t5}')"))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG004");
    assert!(e.to_string().contains("retired") || format!("{e:?}").contains("retired"));
    assert_eq!(store.items().await.len(), 4);
}

async fn store_admin(store: &Store) -> Client {
    connect(&store.pg.dsn("postgres")).await
}

async fn the_app_role_cannot_read_the_secrets_nor_forge_a_pass(enforce: Enforce) {
    let store = Store::start(enforce).await;
    let app = store.app().await;
    for sql in [
        "SELECT * FROM fencegate.pass_key",
        "SELECT * FROM fencegate.token_keys",
        "SELECT fencegate.set_pass('job', 99)",
        "SELECT fencegate.check_fence('job', 99)",
        "SELECT fencegate.take_fence('job', 99)",
        "UPDATE fencegate.fences SET revision = 1",
        "DROP TRIGGER fencegate_enforce ON app.items",
        "ALTER TABLE app.items DISABLE TRIGGER fencegate_enforce",
        "INSERT INTO fencegate.token_keys (kid, secret) VALUES (9, '\\x00')",
    ] {
        let e = app.batch_execute(sql).await.unwrap_err();
        assert!(["42501"].contains(&code(&e).as_str()), "{sql}: {e:?}");
    }
    // A pass copied from an earlier transaction, replayed at session level.
    let t5 = store.token(5).await;
    let row = app
        .query_one(
            &format!("SELECT fencegate.guard('{t5}')::text, current_setting('fencegate.pass')"),
            &[],
        )
        .await
        .unwrap();
    let old: String = row.get(1);
    app.batch_execute(&format!("SET fencegate.pass = '{old}'"))
        .await
        .unwrap();
    let e = app
        .batch_execute("DELETE FROM app.items")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002");
    // A pass for this very transaction with a made-up MAC.
    let e = app
        .batch_execute(
            "BEGIN; \
             SELECT set_config('fencegate.pass', format('99:job:%s', repeat('a', 64)), true); \
             DELETE FROM app.items; COMMIT",
        )
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002");
    let _ = app.batch_execute("ROLLBACK").await;
    assert_eq!(store.items().await, INITIAL);
}

/// The pass's MAC binds it to the transaction that made it: a pass taken from another backend's
/// open transaction, with a valid MAC, is refused in this one.
async fn a_pass_from_another_backends_transaction_is_refused(enforce: Enforce) {
    let store = Store::start(enforce).await;
    let holder = store.app().await;
    let thief = store.app().await;
    let t5 = store.token(5).await;
    holder.batch_execute("BEGIN").await.unwrap();
    let pass: String = holder
        .query_one(
            &format!("SELECT fencegate.guard('{t5}')::text, current_setting('fencegate.pass')"),
            &[],
        )
        .await
        .unwrap()
        .get(1);
    assert_eq!(pass.len(), "5:job:".len() + 64, "{pass}");
    let e = thief
        .batch_execute(&format!(
            "BEGIN; SELECT set_config('fencegate.pass', '{pass}', true); DELETE FROM app.items; COMMIT"
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002");
    assert!(
        format!("{e:?}").contains("not made by fencegate.guard"),
        "{e:?}"
    );
    let _ = thief.batch_execute("ROLLBACK").await;
    // The holder's own transaction still writes with it.
    holder
        .batch_execute("DELETE FROM app.items WHERE id = 2; COMMIT")
        .await
        .unwrap();
    assert_eq!(store.items().await, vec![(1, 1)]);
}

/// fencegate.enforce() runs with its owner's rights and without a `SET search_path` of its own:
/// whatever the caller puts first in its search_path (operators and functions that would make a
/// forged pass verify or hide the fence) or in pg_temp (tables named like fencegate's), the
/// trigger resolves none of it.
async fn shadowing_objects_in_the_search_path_do_not_subvert_the_trigger(enforce: Enforce) {
    let store = Store::start(enforce).await;
    store.pg.psql_as(
        "postgres",
        &format!("CREATE SCHEMA evil AUTHORIZATION {APP}"),
    );
    let app = store.app().await;
    app.batch_execute(
        "CREATE FUNCTION evil.yes(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
         CREATE FUNCTION evil.no(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT false';
         CREATE FUNCTION evil.no8(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT false';
         CREATE FUNCTION evil.cat(text, text) RETURNS text LANGUAGE sql AS 'SELECT ''x''';
         CREATE FUNCTION evil.bcat(bytea, bytea) RETURNS bytea LANGUAGE sql AS 'SELECT ''\\x00''::bytea';
         CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.yes);
         CREATE OPERATOR evil.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.no);
         CREATE OPERATOR evil.> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.no8);
         CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.cat);
         CREATE OPERATOR evil.|| (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = evil.bcat);
         CREATE FUNCTION evil.encode(bytea, text) RETURNS text LANGUAGE sql AS 'SELECT ''x''';
         CREATE FUNCTION evil.right(text, integer) RETURNS text LANGUAGE sql AS 'SELECT ''x''';
         CREATE FUNCTION evil.sha256(bytea) RETURNS bytea LANGUAGE sql AS 'SELECT ''\\x00''::bytea';
         CREATE FUNCTION evil.current_setting(text, boolean) RETURNS text LANGUAGE sql AS 'SELECT ''1:job:x''';
         CREATE FUNCTION evil.split_part(text, text, integer) RETURNS text LANGUAGE sql AS 'SELECT ''99''';
         CREATE TEMP TABLE pass_key (id boolean, ipad bytea, opad bytea);
         CREATE TEMP TABLE fences (resource text, revision bigint);",
    )
    .await
    .unwrap();
    app.batch_execute("SET search_path = pg_temp, evil, pg_catalog")
        .await
        .unwrap();
    // The stand-ins are live for unqualified names in this session.
    let row = app
        .query_one("SELECT 'a' = 'b', 'a' <> 'a', right('abc', 1)", &[])
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, bool>(0),
            row.get::<_, bool>(1),
            row.get::<_, String>(2)
        ),
        (true, false, "x".to_string())
    );
    for pass in [
        "99:job:x".to_string(),
        format!("99:job:{}", "0".repeat(64)),
        "1:job:x".to_string(),
    ] {
        let e = app
            .batch_execute(&format!(
                "BEGIN; SELECT pg_catalog.set_config('fencegate.pass', '{pass}', true); \
                 DELETE FROM app.items; COMMIT"
            ))
            .await
            .unwrap_err();
        assert_eq!(code(&e), "FG002", "{pass}: {e:?}");
        let _ = app.batch_execute("ROLLBACK").await;
    }
    // The resource binding holds too: a pass for another resource is refused on the bound table.
    let other = store.sign(KID, &SECRET, 9, "other").await;
    let e = app
        .batch_execute(&format!(
            "BEGIN; SELECT fencegate.guard('{other}'); DELETE FROM app.items; COMMIT"
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG005");
    let _ = app.batch_execute("ROLLBACK").await;
    assert_eq!(store.items().await, INITIAL);
    // And a current token still writes under this search_path.
    let t7 = store.token(7).await;
    app.batch_execute(&format!(
        "BEGIN; SELECT fencegate.guard('{t7}'); \
         DELETE FROM app.items WHERE id OPERATOR(pg_catalog.=) 2; COMMIT"
    ))
    .await
    .unwrap();
    assert_eq!(store.items().await, vec![(1, 1)]);
}

/// The trigger's own stale check (defence in depth behind the guard's row lock): a fence raised
/// inside the pass holder's transaction by the schema owner makes the next write FG001.
async fn the_trigger_refuses_a_pass_below_the_fence(enforce: Enforce) {
    let store = Store::start(enforce).await;
    let owner = store_admin(&store).await;
    let t5 = store.token(5).await;
    let e = owner
        .batch_execute(&format!(
            "BEGIN; SELECT fencegate.guard('{t5}'); \
             UPDATE fencegate.fences SET revision = 6 WHERE resource = 'job'; \
             DELETE FROM app.items; COMMIT"
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG001", "{e:?}");
    assert!(format!("{e:?}").contains("below the fence 6"), "{e:?}");
    let _ = owner.batch_execute("ROLLBACK").await;
    assert_eq!(store.items().await, INITIAL);
}

async fn tables_created_later_are_protected_and_status_lists_them(enforce: Enforce) {
    let store = Store::start(enforce).await;
    store.pg.psql_as(
        "postgres",
        &format!("CREATE TABLE app.later (id int); GRANT ALL ON app.later TO {APP}"),
    );
    let app = store.app().await;
    let e = app
        .batch_execute("INSERT INTO app.later VALUES (1)")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002");
    let (c, out, err) = cli(&["postgres", "status", "--dsn", &store.pg.dsn("postgres")]);
    assert_eq!(c, 0, "{out}{err}");
    for line in [
        "app.items",
        "app.later",
        "app.parted_1",
        "schema app (resource job): new tables protected by the event trigger",
        "token keys: 3",
    ] {
        assert!(out.contains(line), "{line} missing from:\n{out}");
    }
    assert!(out.contains("trigger enforced"), "{out}");
    // protect --table on an unprotected table, bound to another resource.
    let (c, out, err) = cli(&[
        "postgres",
        "protect",
        "--dsn",
        &store.pg.dsn("postgres"),
        "--table",
        "scratch.notes_plain",
        "--resource",
        "other",
    ]);
    assert_eq!(c, 0, "{out}{err}");
    let t = store.token(5).await;
    let e = app
        .batch_execute(&format!(
            "SELECT fencegate.guard('{t}'); INSERT INTO scratch.notes_plain VALUES (1)"
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG005");
}

#[tokio::test(flavor = "multi_thread")]
async fn protect_without_an_installed_schema_names_the_install_command() {
    let pg = PgServer::start();
    let (c, out, err) = cli(&[
        "postgres",
        "protect",
        "--dsn",
        &pg.dsn("postgres"),
        "--schema",
        "public",
    ]);
    assert_ne!(c, 0, "{out}");
    assert!(err.contains("fencegate postgres install"), "{err}");
}

/// A raise behind an older holder's open transaction (or a prepared one) never waits forever:
/// the guard's lock_timeout ends it with a retryable 55P03 that says what to do.
async fn a_raise_behind_an_open_transaction_times_out_with_a_retryable_error(enforce: Enforce) {
    let pg = server_for(enforce);
    let (c, out, err) = cli(&[
        "postgres",
        "install",
        "--dsn",
        &pg.dsn("postgres"),
        "--lock-timeout-ms",
        "300",
        "--enforce",
        &enforce.to_string(),
    ]);
    assert_eq!(c, 0, "{out}{err}");
    assert!(out.contains("lock_timeout 300 ms"), "{out}");
    assert_eq!(guard_language(&pg), enforce.to_string());
    let old = connect(&pg.dsn("postgres")).await;
    let new = connect(&pg.dsn("postgres")).await;
    old.batch_execute("BEGIN; SELECT fencegate.guard('fg1~5~job')")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let e = new
        .batch_execute("SELECT fencegate.guard('fg1~6~job')")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "55P03", "{e:?}");
    let text = format!("{e:?}");
    assert!(text.contains("locked by another transaction"), "{text}");
    assert!(
        text.contains("idle_in_transaction_session_timeout"),
        "{text}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    old.batch_execute("COMMIT").await.unwrap();
    new.batch_execute("SELECT fencegate.guard('fg1~6~job')")
        .await
        .unwrap();
}

/// Through a gateway on `gw` with a session token: a simple-protocol and an extended-protocol
/// write to table `t` both answer FG007 naming the install command, and nothing is written.
async fn writes_are_fg007_naming_the_install(gw: &PgGateway) -> Client {
    let dsn = format!(
        "{} options='-c fencegate.token=fg1~5~job'",
        gw.dsn("postgres")
    );
    let c = connect(&dsn).await;
    let e = c
        .simple_query("INSERT INTO t VALUES (1)")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG007", "{e:?}");
    let text = format!("{e:?}");
    assert!(text.contains("fencegate postgres install"), "{text}");
    assert!(text.contains("older than this gateway"), "{text}");
    let e = c
        .execute("INSERT INTO t VALUES (2)", &[])
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG007", "{e:?}");
    assert_eq!(gw.pg.psql_as("postgres", "SELECT count(*) FROM t"), "0");
    c
}

/// A schema installed by an older fencegate (no `fencegate.guard_proc`, which this gateway
/// calls) answers FG007 naming the install command, and nothing is written; after `install`
/// the same connection's write goes through.
#[tokio::test(flavor = "multi_thread")]
async fn an_older_fence_schema_is_fg007_until_installed_again() {
    let pg = PgServer::start();
    let (c, out, err) = install_enforce(&pg.dsn("postgres"), "plpgsql");
    assert_eq!(c, 0, "{out}{err}");
    pg.psql_as(
        "postgres",
        "CREATE TABLE t (a int); DROP PROCEDURE fencegate.guard_proc(text)",
    );
    let gw = PgGateway::start_on(pg, "", &[]);
    let c = writes_are_fg007_naming_the_install(&gw).await;
    let (code_, out, err) = install_enforce(&gw.pg.dsn("postgres"), "plpgsql");
    assert_eq!(code_, 0, "{out}{err}");
    c.simple_query("INSERT INTO t VALUES (3)").await.unwrap();
    assert_eq!(gw.pg.psql_as("postgres", "SELECT a FROM t"), "3");
}

/// A database without the fence schema answers FG007 naming the install command.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_fence_schema_is_fg007_through_the_gateway() {
    let pg = PgServer::start();
    pg.psql_as("postgres", "CREATE TABLE t (a int)");
    let gw = PgGateway::start_on(pg, "", &[]);
    writes_are_fg007_naming_the_install(&gw).await;
}

/// Key id 0 is an operator's own key (authority.token_key_env or token_key_file): the store
/// takes it, and `postgres install` widens the key check of a schema installed before, which
/// took ids 1 and up only. Tokens it signs then pass the guard; a wrong secret does not.
async fn the_operator_key_is_accepted_also_after_installing_over_an_old_schema(enforce: Enforce) {
    const OPERATOR: [u8; 32] = [0x5a; 32];
    let mut store = Store::start(enforce).await;
    // The key check as schemas installed before this change have it.
    store.pg.psql_as(
        "postgres",
        "ALTER TABLE fencegate.token_keys DROP CONSTRAINT token_keys_kid_check, \
         ADD CONSTRAINT token_keys_kid_check CHECK (kid BETWEEN 1 AND 4294967295)",
    );
    let keys = [(0, OPERATOR.to_vec(), false), (KID, SECRET.to_vec(), false)];
    let e = fencegate_postgres::install_token_keys(&mut store.admin, &keys)
        .await
        .unwrap_err();
    assert!(format!("{e:?}").contains("token_keys_kid_check"), "{e:?}");
    let (c, out, err) = install_enforce(&store.pg.dsn("postgres"), &enforce.to_string());
    assert_eq!(c, 0, "reinstall: {out}{err}");
    fencegate_postgres::install_token_keys(&mut store.admin, &keys)
        .await
        .unwrap();
    let stored = store.pg.psql_as(
        "postgres",
        "SELECT string_agg(kid::text, ',' ORDER BY kid) FROM fencegate.token_keys",
    );
    assert_eq!(stored, format!("0,{KID}"));
    // Installing again leaves the widened check as it is.
    let (c, out, err) = install_enforce(&store.pg.dsn("postgres"), &enforce.to_string());
    assert_eq!(c, 0, "third install: {out}{err}");
    assert_eq!(enforce_language(&store.pg), enforce.to_string());

    let app = store.app().await;
    let by_operator = store.sign(0, &OPERATOR, 5, "job").await;
    app.batch_execute(&format!(
        "SELECT fencegate.guard('{by_operator}'); INSERT INTO app.items VALUES (3, 3)"
    ))
    .await
    .unwrap();
    let wrong_secret = store.sign(0, &SECRET, 6, "job").await;
    let e = app
        .batch_execute(&format!(
            "SELECT fencegate.guard('{wrong_secret}'); INSERT INTO app.items VALUES (4, 4)"
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG004", "{e:?}");
    assert_eq!(store.items().await, vec![(1, 1), (2, 2), (3, 3)]);
}

/// Rolling back to a savepoint releases the guard's lock (the row's, or in C the fence lock), and
/// the client can put the pass string back with set_config: the trigger takes the lock again on
/// every protected statement, so a newer holder's raise (committed or not) refuses the stale
/// write.
async fn a_pass_restored_after_a_savepoint_rollback_cannot_write_past_a_newer_holder(
    enforce: Enforce,
) {
    for isolation in ["REPEATABLE READ", "READ COMMITTED"] {
        let store = Store::start(enforce).await;
        let t10 = store.token(10).await;
        let t11 = store.token(11).await;
        let old = store.app().await;
        let new = store.app().await;
        // The fence stands at 10, held by `old`.
        old.batch_execute(&format!("SELECT fencegate.guard('{t10}')"))
            .await
            .unwrap();
        old.batch_execute(&format!("BEGIN ISOLATION LEVEL {isolation}; SAVEPOINT s"))
            .await
            .unwrap();
        let pass: String = old
            .query_one(
                &format!(
                    "SELECT fencegate.guard('{t10}')::text, current_setting('fencegate.pass')"
                ),
                &[],
            )
            .await
            .unwrap()
            .get(1);
        old.batch_execute("ROLLBACK TO s").await.unwrap();
        old.query_one("SELECT set_config('fencegate.pass', $1, true)", &[&pass])
            .await
            .unwrap();
        let old_pid = backend_pid(&old).await;
        // The newer holder raises the fence (not blocked: the savepoint's lock is gone) and writes.
        new.batch_execute(&format!(
            "BEGIN; SELECT fencegate.guard('{t11}'); INSERT INTO app.items VALUES (101, 11)"
        ))
        .await
        .unwrap();
        if isolation == "REPEATABLE READ" {
            new.batch_execute("COMMIT").await.unwrap();
        }
        let stale = tokio::spawn(async move {
            old.batch_execute("INSERT INTO app.items VALUES (100, 10); COMMIT")
                .await
        });
        if isolation == "READ COMMITTED" {
            // Commit the raise once the stale write waits for it (or has already finished).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let waiting: bool = store
                    .admin
                    .query_one(
                        "SELECT count(*) > 0 FROM pg_stat_activity \
                         WHERE pid = $1 AND wait_event_type = 'Lock'",
                        &[&old_pid],
                    )
                    .await
                    .unwrap()
                    .get(0);
                if waiting || stale.is_finished() {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the stale write neither waited nor finished"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            new.batch_execute("COMMIT").await.unwrap();
        }
        let result = tokio::time::timeout(std::time::Duration::from_secs(10), stale)
            .await
            .expect("the stale write did not finish")
            .unwrap();
        let e = result.expect_err(&format!("{isolation}: the stale write committed"));
        // plpgsql, repeatable read: the fence row changed after the snapshot (serialization
        // failure). Read committed, or C (the fence read under a snapshot taken after its lock):
        // no fence at revision 10 any more.
        let want = if isolation == "REPEATABLE READ" && enforce == Enforce::Plpgsql {
            "40001"
        } else {
            "FG001"
        };
        assert_eq!(code(&e), want, "{isolation}: {e:?}");
        if want == "FG001" {
            assert!(format!("{e:?}").contains("below the fence 11"), "{e:?}");
        }
        assert_eq!(
            store.items().await,
            vec![(1, 1), (2, 2), (101, 11)],
            "{isolation}: only the newer holder's row"
        );
    }
}

/// The trigger locks the fence row only once the pass verifies: a forged pass is refused at
/// once (FG002), not queued behind a holder's open raise.
async fn a_forged_pass_is_refused_without_waiting_for_the_fence_row(enforce: Enforce) {
    let store = Store::start(enforce).await;
    let holder = store.app().await;
    let thief = store.app().await;
    let t5 = store.token(5).await;
    let t6 = store.token(6).await;
    holder
        .batch_execute(&format!("SELECT fencegate.guard('{t5}')"))
        .await
        .unwrap();
    // An open raise: the fence row stays locked until this transaction ends.
    holder
        .batch_execute(&format!("BEGIN; SELECT fencegate.guard('{t6}')"))
        .await
        .unwrap();
    let e = thief
        .batch_execute(&format!(
            "SET lock_timeout = '3s'; BEGIN; \
             SELECT set_config('fencegate.pass', '5:job:{}', true); DELETE FROM app.items; COMMIT",
            "a".repeat(64)
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e:?}");
    let _ = thief.batch_execute("ROLLBACK").await;
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(store.items().await, INITIAL);
}

/// A client sets `fencegate.pass` to anything: no length or content makes the trigger accept it
/// (or crash the server): empty, shorter and longer than a pass, multibyte and control
/// characters, and a real pass of this very transaction altered by one byte or in its framing.
async fn forged_passes_of_any_length_and_content_are_refused(enforce: Enforce) {
    let store = Store::start(enforce).await;
    let mut app = store.app().await;
    let t5 = store.token(5).await;
    // A pass the guard made in an earlier transaction of this backend: its MAC is real but
    // bound to that transaction.
    let old: String = app
        .query_one(
            &format!("SELECT fencegate.guard('{t5}')::text, current_setting('fencegate.pass')"),
            &[],
        )
        .await
        .unwrap()
        .get(1);
    let mac = &old[old.len() - 64..];
    let mut forged: Vec<String> = vec![
        "x".into(),
        ":".repeat(65),
        "a".repeat(63),
        "a".repeat(64),
        "a".repeat(65),
        "a".repeat(66),
        format!("5:job:{}", "a".repeat(64)),
        format!("5:job:{}", mac.to_uppercase()),
        format!("5:job{mac}"),
        format!("5:job:{mac}"),
        format!(":{mac}"),
        mac.to_string(),
        "é".into(),
        "é".repeat(33),
        "é".repeat(65),
        format!("5:job:{}", "é".repeat(64)),
        format!("5:jobé{mac}"),
        "\x01\t\n\\'\"".repeat(20),
        "9".repeat(100_000),
    ];
    for len in [1, 63, 64, 65, 66, 67, 68, 69, 70] {
        forged.push(old.chars().take(len).collect());
    }
    let tx = app.transaction().await.unwrap();
    // This transaction's own pass, to alter: each variant below is refused.
    tx.execute("SELECT fencegate.guard($1)", &[&t5])
        .await
        .unwrap();
    let own: String = tx
        .query_one("SELECT current_setting('fencegate.pass')", &[])
        .await
        .unwrap()
        .get(0);
    tx.rollback().await.unwrap();
    let flip = |s: &str, i: usize| {
        let mut b = s.as_bytes().to_vec();
        b[i] = if b[i] == b'0' { b'1' } else { b'0' };
        String::from_utf8(b).unwrap()
    };
    forged.extend([
        flip(&own, own.len() - 1),
        flip(&own, own.len() - 64),
        flip(&own, 0),
        format!("{own}0"),
        own[..own.len() - 1].to_string(),
        format!("0{own}"),
    ]);
    for pass in &forged {
        let shown = pass.chars().take(80).collect::<String>();
        let tx = app.transaction().await.unwrap();
        tx.query_one("SELECT set_config('fencegate.pass', $1, true)", &[pass])
            .await
            .unwrap();
        let e = tx.execute("DELETE FROM app.items", &[]).await.unwrap_err();
        assert_eq!(code(&e), "FG002", "{shown:?}: {e:?}");
        assert!(
            format!("{e:?}").contains("not made by fencegate.guard"),
            "{shown:?}: {e:?}"
        );
        drop(tx);
    }
    // An empty pass is no pass.
    let tx = app.transaction().await.unwrap();
    tx.execute("SELECT set_config('fencegate.pass', '', true)", &[])
        .await
        .unwrap();
    let e = tx.execute("DELETE FROM app.items", &[]).await.unwrap_err();
    assert_eq!(code(&e), "FG002", "{e:?}");
    assert!(format!("{e:?}").contains("needs a fencing token"), "{e:?}");
    drop(tx);
    assert_eq!(store.items().await, INITIAL);
    // The same backend still writes with a pass the guard makes.
    app.batch_execute(&format!(
        "SELECT fencegate.guard('{t5}'); DELETE FROM app.items WHERE id = 2"
    ))
    .await
    .unwrap();
    assert_eq!(store.items().await, vec![(1, 1)]);
}

/// The C trigger's install refuses, naming the fix, where it cannot work (the library missing
/// on the server, a role that is not a superuser), leaving the database as it was; an install
/// without `--enforce` keeps the installed one, `--enforce plpgsql` switches back.
#[tokio::test(flavor = "multi_thread")]
async fn enforce_c_install_names_the_fix_and_an_install_keeps_it() {
    let plain = PgServer::start();
    let (c, out, err) = install_enforce(&plain.dsn("postgres"), "c");
    assert_ne!(c, 0, "{out}");
    assert!(err.contains("fencegate_enforce"), "{err}");
    assert!(
        err.contains("make -C filters/postgres/ext install")
            && err.contains("dynamic_library_path"),
        "{err}"
    );
    // One transaction: nothing of fence.sql stayed either.
    assert_eq!(
        plain.psql_as("postgres", "SELECT to_regclass('fencegate.fences') IS NULL"),
        "t"
    );

    let pg = server_for(Enforce::C);
    pg.psql_as(
        "postgres",
        "CREATE ROLE installer LOGIN; GRANT CREATE ON DATABASE postgres TO installer",
    );
    let (c, out, err) = install_enforce(&pg.dsn("installer"), "c");
    assert_ne!(c, 0, "{out}");
    assert!(err.contains("role installer is not a superuser"), "{err}");
    assert!(err.contains("as a superuser"), "{err}");
    assert_eq!(
        pg.psql_as("postgres", "SELECT to_regclass('fencegate.fences') IS NULL"),
        "t"
    );
    // The same role installs the portable trigger.
    let (c, out, err) = cli(&["postgres", "install", "--dsn", &pg.dsn("installer")]);
    assert_eq!(c, 0, "{out}{err}");
    assert_eq!(enforce_language(&pg), "plpgsql");
    // A superuser switches to C and back; the C function has no SET clause of its own.
    for (flag, language, config) in [
        ("c", "c", ""),
        ("plpgsql", "plpgsql", "{plan_cache_mode=force_generic_plan}"),
        ("c", "c", ""),
    ] {
        let (c, out, err) = install_enforce(&pg.dsn("postgres"), flag);
        assert_eq!(c, 0, "{out}{err}");
        assert_eq!(enforce_language(&pg), language);
        assert_eq!(
            pg.psql_as(
                "postgres",
                "SELECT proconfig FROM pg_proc WHERE oid = 'fencegate.enforce()'::regprocedure"
            ),
            config
        );
        // The guard follows enforce(); the install's lock_timeout is where the guard waits (the
        // C guard waits only in the take_fence it calls); the C fence lock's trigger comes and
        // goes with them.
        assert_eq!(guard_language(&pg), language);
        let trigger = if language == "c" { "O+fn" } else { "" };
        assert_eq!(write_lock_trigger(&pg), trigger);
        let config = |signature: &str| {
            pg.psql_as(
                "postgres",
                &format!(
                    "SELECT coalesce(proconfig::text, '') FROM pg_proc WHERE oid = '{signature}'::regprocedure"
                ),
            )
        };
        let (waits, plain) = if language == "c" {
            (
                "fencegate.take_fence(text,bigint)",
                "fencegate.guard_proc(text)",
            )
        } else {
            (
                "fencegate.guard_proc(text)",
                "fencegate.take_fence(text,bigint)",
            )
        };
        assert!(
            config(waits).contains("lock_timeout=5000ms"),
            "{waits}: {}",
            config(waits)
        );
        assert!(
            !config(plain).contains("lock_timeout"),
            "{plain}: {}",
            config(plain)
        );
        assert_eq!(
            config("fencegate.guard(text)"),
            "",
            "it calls guard_proc or is C"
        );
        assert_eq!(
            function_language(&pg, "fencegate.guard_proc(text)"),
            language
        );
        assert!(config("fencegate.guard(text,bigint)").contains("lock_timeout=5000ms"));
    }
    // An install without --enforce keeps the C one (a node's install_on_start too) ...
    let (c, out, err) = cli(&["postgres", "install", "--dsn", &pg.dsn("postgres")]);
    assert_eq!(c, 0, "{out}{err}");
    assert!(out.contains("enforce() in c"), "{out}");
    assert_eq!(enforce_language(&pg), "c");
    // ... or refuses where it cannot, rather than quietly going back to plpgsql.
    let (c, out, err) = cli(&["postgres", "install", "--dsn", &pg.dsn("installer")]);
    assert_ne!(c, 0, "{out}");
    assert!(err.contains("--enforce plpgsql"), "{err}");
    assert_eq!(enforce_language(&pg), "c");
    let (c, out, err) = install_enforce(&pg.dsn("installer"), "plpgsql");
    assert_eq!(c, 0, "{out}{err}");
    assert_eq!(enforce_language(&pg), "plpgsql");
    assert_eq!(
        write_lock_trigger(&pg),
        "",
        "the C fence lock's trigger went with it"
    );
}

/// `tgenabled` of the C fence lock's trigger on `fencegate.fences`, "" when there is none.
fn write_lock_trigger(pg: &PgServer) -> String {
    pg.psql_as(
        "postgres",
        "SELECT coalesce((SELECT tgenabled::text FROM pg_trigger \
          WHERE tgrelid = 'fencegate.fences'::regclass AND tgname = 'fence_write_lock'), '') \
             || CASE WHEN to_regprocedure('fencegate.fence_write_lock()') IS NULL THEN '' ELSE '+fn' END",
    )
}

/// The C guard holds a resource's fence lock, not its row (filters/postgres/ext/fence_lock.c):
/// nothing is written to the fence row, and every writer of the row, a raise or an owner's
/// hand-written UPDATE or DELETE alike, waits for the guarded transaction through the trigger
/// `fence_write_lock`. Without that trigger the C guard refuses rather than pass on a lock no
/// writer takes, and an install puts it back.
#[tokio::test(flavor = "multi_thread")]
async fn every_writer_of_a_fence_row_waits_for_the_c_guards_holders() {
    let store = Store::start(Enforce::C).await;
    assert_eq!(write_lock_trigger(&store.pg), "O+fn");
    let (c, out, err) = cli(&[
        "postgres",
        "install",
        "--dsn",
        &store.pg.dsn("postgres"),
        "--lock-timeout-ms",
        "200",
    ]);
    assert_eq!(c, 0, "{out}{err}");
    let t5 = store.token(5).await;
    let t6 = store.token(6).await;
    let holder = store.app().await;
    holder
        .batch_execute(&format!("SELECT fencegate.guard('{t5}')"))
        .await
        .unwrap();
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT fencegate.guard('{t5}'); INSERT INTO app.items VALUES (5, 5)"
        ))
        .await
        .unwrap();
    let pid = backend_pid(&holder).await;
    let locks: Vec<(String, String, bool)> = store
        .admin
        .query(
            "SELECT locktype, mode, granted FROM pg_locks WHERE pid = $1 \
               AND (locktype = 'tuple' OR locktype = 'object' AND classid = 'fencegate.fences'::regclass)",
            &[&pid],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(locks, [("object".into(), "ShareLock".into(), true)]);
    let xmax: String = store
        .admin
        .query_one(
            "SELECT xmax::text FROM fencegate.fences WHERE resource = 'job'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(xmax, "0", "the guard wrote no row lock");
    for sql in [
        "UPDATE fencegate.fences SET revision = 6 WHERE resource = 'job'",
        "DELETE FROM fencegate.fences WHERE resource = 'job'",
    ] {
        let e = store
            .admin
            .batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = '200ms'; {sql}"))
            .await
            .unwrap_err();
        assert_eq!(code(&e), "55P03", "{sql}: {e:?}");
        store.admin.batch_execute("ROLLBACK").await.unwrap();
    }
    // A newer holder's raise, under the guard's lock_timeout.
    let e = store
        .app()
        .await
        .batch_execute(&format!("SELECT fencegate.guard('{t6}')"))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "55P03", "{e:?}");
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(store.items().await, vec![(1, 1), (2, 2), (5, 5)]);

    store
        .admin
        .batch_execute("ALTER TABLE fencegate.fences DISABLE TRIGGER fence_write_lock")
        .await
        .unwrap();
    let e = holder
        .batch_execute(&format!("SELECT fencegate.guard('{t5}')"))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "55000", "{e:?}");
    let db = e.as_db_error().unwrap();
    assert!(db.message().contains("fence_write_lock"), "{db:?}");
    assert!(
        db.hint()
            .unwrap_or("")
            .contains("fencegate postgres install"),
        "{db:?}"
    );
    let (c, out, err) = install_enforce(&store.pg.dsn("postgres"), "c");
    assert_eq!(c, 0, "{out}{err}");
    assert_eq!(write_lock_trigger(&store.pg), "O+fn");
    holder
        .batch_execute(&format!(
            "BEGIN; SELECT fencegate.guard('{t5}'); INSERT INTO app.items VALUES (6, 5); COMMIT"
        ))
        .await
        .unwrap();
    assert_eq!(store.items().await, vec![(1, 1), (2, 2), (5, 5), (6, 5)]);
}

/// What one guard call answered: the pass's `revision:resource` and whether a protected write
/// then committed, or the refusal as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum GuardAnswer {
    Passed {
        held: String,
        write: Result<(), String>,
    },
    Refused {
        code: String,
        message: String,
        detail: Option<String>,
        hint: Option<String>,
    },
}

/// The two ways to run the guard: the function, or the procedure the gateway calls.
const GUARD_CALLS: [&str; 2] = [
    "SELECT fencegate.guard($1)",
    "CALL fencegate.guard_proc($1)",
];

/// Runs the guard for `token` with `call` (one of [`GUARD_CALLS`]) in a transaction of the app
/// role (read-only if `read_only`), tries a protected write, and rolls back (the fences stay as
/// they were for the next token).
async fn guard_answer(
    app: &mut Client,
    call: &str,
    token: Option<&str>,
    read_only: bool,
) -> GuardAnswer {
    let tx = app.transaction().await.unwrap();
    if read_only {
        tx.batch_execute("SET TRANSACTION READ ONLY").await.unwrap();
    }
    if let Err(e) = tx.execute(call, &[&token]).await {
        let db = e
            .as_db_error()
            .unwrap_or_else(|| panic!("{token:?}: {e:?}"));
        return GuardAnswer::Refused {
            code: db.code().code().to_owned(),
            message: db.message().to_owned(),
            detail: db.detail().map(str::to_owned),
            hint: db.hint().map(str::to_owned),
        };
    }
    let pass: String = tx
        .query_one("SELECT current_setting('fencegate.pass')", &[])
        .await
        .unwrap()
        .get(0);
    let held = pass
        .rsplit_once(':')
        .map_or_else(|| pass.clone(), |(held, _mac)| held.to_owned());
    let write = tx
        .execute("INSERT INTO app.items VALUES (1000, 0)", &[])
        .await
        .map(drop)
        .map_err(|e| code(&e));
    tx.rollback().await.unwrap();
    GuardAnswer::Passed { held, write }
}

/// How many of the corpus' tokens come first and are written by hand (NULL included).
const FIXED_TOKENS: usize = 44;

/// Tokens for the differential test: the signed token at each edge of each field, and
/// deterministic mutations of it (a fixed xorshift, so a failure names a token that repeats).
fn guard_corpus(signed: &str, sig: &str) -> Vec<Option<String>> {
    let mut corpus: Vec<Option<String>> = vec![None];
    let fixed = [
        signed.to_owned(),
        format!("fg1~5~job~{KID:04}.{sig}"),
        format!("fg1~5~job~{sig}"),
        format!("fg1~5~job~{}.{sig}", KID + 1),
        format!("fg1~5~job~{KID}.{sig}.x"),
        format!("fg1~5~job~{KID}~{sig}"),
        format!("fg1~5~job~.{sig}"),
        format!("fg1~5~job~{KID}."),
        format!("fg1~5~job~12345678901.{sig}"),
        format!("fg1~5~job~1234567890.{sig}"),
        format!("fg1~5~job~{KID}.{}", &sig[1..]),
        format!("fg1~5~job~{KID}.{sig}A"),
        format!("fg1~5~job~{KID}.{}+", &sig[1..]),
        format!("fg1~5~job~{KID}.{}=", &sig[1..]),
        format!("fg1~4~job~{KID}.{sig}"),
        "fg1~5~job".into(),
        "fg1~4~job".into(),
        "fg1~6~job".into(),
        "fg1~5~other".into(),
        "fg1~9223372036854775807~job".into(),
        "fg1~9223372036854775808~job".into(),
        "fg1~99999999999999999999~job".into(),
        "fg1~0~job".into(),
        "fg1~05~job".into(),
        "fg1~+5~job".into(),
        "fg1~-5~job".into(),
        "fg1~ 5~job".into(),
        "fg1~5~".into(),
        "fg1~5~job~".into(),
        "fg1~~job".into(),
        "fg1~5".into(),
        "fg1".into(),
        String::new(),
        "~".into(),
        "FG1~5~job".into(),
        "fg2~5~job".into(),
        "fg1~5~jo b".into(),
        "fg1~5~jo\u{e9}".into(),
        "fg1~5~!}|\"'".into(),
        "fg1~5~jo\u{7f}".into(),
        format!("fg1~5~{}", "r".repeat(256)),
        format!("fg1~5~{}", "r".repeat(257)),
        format!("fg1~5~\u{e9}{}", "r".repeat(255)),
    ];
    corpus.extend(fixed.into_iter().map(Some));
    assert_eq!(corpus.len(), FIXED_TOKENS);
    let alphabet: Vec<char> = "fg1~.0123456789jobAZaz_-+/= }!\u{e9}\u{7f}"
        .chars()
        .collect();
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |bound: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % bound as u64) as usize
    };
    for _ in 0..300 {
        let mut chars: Vec<char> = signed.chars().collect();
        for _ in 0..=next(2) {
            let at = next(chars.len() + 1);
            match next(3) {
                0 if at < chars.len() => chars[at] = alphabet[next(alphabet.len())],
                1 if at < chars.len() => {
                    chars.remove(at);
                }
                _ => chars.insert(at, alphabet[next(alphabet.len())]),
            }
        }
        corpus.push(Some(chars.into_iter().collect()));
    }
    corpus
}

/// The C guard and fence.sql's plpgsql guard give every token the same answer (SQLSTATE,
/// message, detail and hint, or the same pass), with the cluster's keys installed and without:
/// a differential test against the server itself, not a list of cases written for one of them.
#[tokio::test(flavor = "multi_thread")]
async fn the_c_guard_answers_every_token_as_the_plpgsql_guard_does() {
    let store = Store::start(Enforce::C).await;
    // The fence of `job` at 5, committed: lower tokens are stale, higher ones raise it.
    let t5 = store.fence_at(5).await;
    let sig = t5.rsplit_once('.').unwrap().1.to_owned();
    let corpus = guard_corpus(&t5, &sig);
    let mut answers = Vec::new();
    for enforce in [Enforce::C, Enforce::Plpgsql] {
        let (c, out, err) = install_enforce(&store.pg.dsn("postgres"), &enforce.to_string());
        assert_eq!(c, 0, "{out}{err}");
        assert_eq!(guard_language(&store.pg), enforce.to_string());
        let mut admin = store_admin(&store).await;
        let mut app = store.app().await;
        let mut these = [Vec::new(), Vec::new()];
        for keys in [true, false] {
            if keys {
                fencegate_postgres::install_token_keys(
                    &mut admin,
                    &[(KID, SECRET.to_vec(), false)],
                )
                .await
                .unwrap();
            } else {
                admin
                    .batch_execute("DELETE FROM fencegate.token_keys")
                    .await
                    .unwrap();
            }
            for token in &corpus {
                let answer = guard_answer(&mut app, GUARD_CALLS[0], token.as_deref(), false).await;
                these[0].push((keys, false, token.clone(), answer));
                let answer = guard_answer(&mut app, GUARD_CALLS[1], token.as_deref(), false).await;
                these[1].push((keys, false, token.clone(), answer));
            }
            // A read-only transaction: refused where the token is, else where the fence row
            // would be locked (`SELECT ... FOR SHARE`), as PostgreSQL refuses it.
            for token in corpus.iter().take(FIXED_TOKENS) {
                for (call, these) in GUARD_CALLS.iter().zip(these.iter_mut()) {
                    let answer = guard_answer(&mut app, call, token.as_deref(), true).await;
                    these.push((keys, true, token.clone(), answer));
                }
            }
        }
        answers.extend(these);
    }
    // C function, C procedure, plpgsql function, plpgsql procedure: one answer each time.
    let c = &answers[0];
    for (other, name) in answers[1..].iter().zip([
        "the C procedure",
        "the plpgsql function",
        "the plpgsql procedure",
    ]) {
        for (c, other) in c.iter().zip(other) {
            assert_eq!(
                c, other,
                "the C function (left) and {name} (right) disagree"
            );
        }
        assert_eq!(c.len(), other.len());
    }
    // The corpus reaches every answer, so agreeing is not agreeing on one refusal.
    let seen = |want: &str| {
        c.iter().any(|(_, _, _, a)| match a {
            GuardAnswer::Passed { write, .. } => want == "passed" && write.is_ok(),
            GuardAnswer::Refused { code, .. } => code == want,
        })
    };
    for want in ["passed", "FG001", "FG003", "FG004", "25006"] {
        assert!(seen(want), "no token of the corpus got {want}");
    }
    let nulls: Vec<_> = c
        .iter()
        .filter(|(_, _, token, _)| token.is_none())
        .collect();
    assert_eq!(
        nulls.len(),
        4,
        "NULL, with and without keys, read-write and read-only"
    );
    for (_, _, _, answer) in nulls {
        assert!(
            matches!(answer, GuardAnswer::Refused { code, .. } if code == "FG003"),
            "a NULL token is malformed: {answer:?}"
        );
    }
    // The gateway and the store read a token alike: whatever the gateway's parser accepts, the
    // store (without keys, so no signature decides) passes with the same revision and resource,
    // or refuses as stale; never as malformed.
    let mut accepted = 0;
    for (_, _, token, answer) in c
        .iter()
        .filter(|(keys, read_only, _, _)| !keys && !read_only)
    {
        let Some(Ok(parsed)) = token.as_deref().map(fencegate_core::Token::parse) else {
            continue;
        };
        accepted += 1;
        let held = format!("{}:{}", parsed.revision(), parsed.resource());
        match answer {
            GuardAnswer::Passed { held: stored, .. } => {
                assert_eq!(stored, &held, "{token:?}: the store read other fields")
            }
            GuardAnswer::Refused { code, .. } => assert_eq!(code, "FG001", "{token:?}: {answer:?}"),
        }
    }
    assert!(
        accepted >= 10,
        "only {accepted} tokens of the corpus parse for the gateway"
    );
    assert!(
        c.iter().any(|(keys, _, token, a)| *keys
            && token.as_deref() == Some(t5.as_str())
            && *a
                == GuardAnswer::Passed {
                    held: "5:job".into(),
                    write: Ok(())
                }),
        "the signed token passes and its write commits"
    );
    assert_eq!(store.items().await, INITIAL, "every write was rolled back");
}

/// On a hot standby every transaction is read-only: the guard refuses a well-formed token,
/// current, higher or lower, as PostgreSQL refuses `SELECT ... FOR SHARE` there (25006), after
/// judging the token itself (malformed FG003, forged FG004), whichever way it is called; a write
/// with a forged pass is refused too, and the standby's fence stays the primary's.
async fn the_guard_refuses_on_a_hot_standby(enforce: Enforce) {
    let store = Store::start(enforce).await;
    store.fence_at(5).await;
    let standby = store.pg.standby();
    store.pg.wait_replayed(&standby);
    let forged = store.sign(KID, b"not the secret", 5, "job").await;
    let mut tokens = Vec::new();
    for revision in [5, 6, 4] {
        tokens.push((store.token(revision).await, "25006"));
    }
    tokens.push(("fg1~5".to_owned(), "FG003"));
    tokens.push((forged, "FG004"));
    let app = connect(&standby.dsn(APP)).await;
    for call in GUARD_CALLS {
        for (token, want) in &tokens {
            let e = app.execute(call, &[token]).await.unwrap_err();
            assert_eq!(code(&e), *want, "{call} {token}: {e:?}");
            if *want == "25006" {
                let message = e.as_db_error().unwrap().message();
                assert_eq!(
                    message, "cannot execute SELECT FOR SHARE in a read-only transaction",
                    "{call} {token}"
                );
            }
        }
    }
    let e = app
        .batch_execute(&format!(
            "BEGIN; SELECT set_config('fencegate.pass', '5:job:{}', true); \
             INSERT INTO app.items VALUES (9, 9); COMMIT",
            "a".repeat(64)
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "25006", "{e:?}");
    assert_eq!(
        standby.psql_as(
            "postgres",
            "SELECT revision FROM fencegate.fences WHERE resource = 'job'"
        ),
        "5"
    );
}

/// Runs each case above as `plpgsql::<case>` and `c::<case>`.
macro_rules! with_each_enforce {
    ($($case:ident),* $(,)?) => {
        mod plpgsql {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $case() {
                    super::$case(super::Enforce::Plpgsql).await
                }
            )*
        }
        mod c {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $case() {
                    super::$case(super::Enforce::C).await
                }
            )*
        }
    };
}

with_each_enforce!(
    a_raise_behind_an_open_transaction_times_out_with_a_retryable_error,
    tokenless_writes_are_refused_by_the_store_whatever_their_path,
    a_current_signed_token_lets_writes_commit_and_the_guard_refuses_the_rest,
    the_app_role_cannot_read_the_secrets_nor_forge_a_pass,
    a_pass_from_another_backends_transaction_is_refused,
    shadowing_objects_in_the_search_path_do_not_subvert_the_trigger,
    the_trigger_refuses_a_pass_below_the_fence,
    tables_created_later_are_protected_and_status_lists_them,
    the_operator_key_is_accepted_also_after_installing_over_an_old_schema,
    a_pass_restored_after_a_savepoint_rollback_cannot_write_past_a_newer_holder,
    a_forged_pass_is_refused_without_waiting_for_the_fence_row,
    forged_passes_of_any_length_and_content_are_refused,
    the_guard_refuses_on_a_hot_standby,
);
