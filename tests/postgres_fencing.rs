//! The PostgreSQL gateway against a real PostgreSQL, through the real `fencegate serve` process:
//! logins, fenced writes in autocommit, explicit transactions, the extended protocol, COPY,
//! reads relayed unchanged, pgbench, cancels and garbage.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use support::postgres_server::{
    code, connect, PgGateway, CLEARTEXT_USER, MD5_USER, PASSWORD, SCRAM_USER,
};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

fn tok(revision: u64) -> String {
    format!("fg1~{revision}~job")
}

/// Connects through the gateway with `token` as the startup option.
async fn connect_with_token(gw: &PgGateway, token: &str) -> Client {
    let dsn = format!(
        "{} options='-c fencegate.token={token}'",
        gw.dsn("postgres")
    );
    let (client, connection) = tokio_postgres::connect(&dsn, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {dsn}: {e}; gateway log:\n{}", gw.log_text()));
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

async fn count(direct: &Client, sql: &str) -> i64 {
    direct.query_one(sql, &[]).await.unwrap().get(0)
}

/// Waits (bounded) until new sessions see `log_statement = all` after `pg_reload_conf()`.
async fn wait_for_log_statement_all(gw: &PgGateway) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while gw.pg.psql_as("postgres", "SHOW log_statement") != "all" {
        assert!(
            std::time::Instant::now() < deadline,
            "log_statement did not change"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn setup_table(gw: &PgGateway) {
    gw.pg.psql_as(
        "postgres",
        "CREATE TABLE items (id serial PRIMARY KEY, v int NOT NULL, who text NOT NULL)",
    );
}

fn stale_records(gw: &PgGateway) -> Vec<serde_json::Value> {
    gw.audit_records()
        .into_iter()
        .filter(|r| r["reason"] == "stale")
        .collect()
}

/// Done-means 1: psql and tokio-postgres log in through the gateway with trust, SCRAM-SHA-256,
/// MD5 and cleartext passwords; a wrong password is refused as it is directly.
#[tokio::test(flavor = "multi_thread")]
async fn logins_work_as_they_do_directly() {
    let gw = PgGateway::start("", &[]);
    let (code_, out, err) = gw.psql("postgres", "SELECT current_user", &[]);
    assert_eq!(
        (code_, out.trim()),
        (0, "postgres"),
        "trust via psql: {err}"
    );
    for user in [SCRAM_USER, MD5_USER, CLEARTEXT_USER] {
        let (code_, out, err) = gw.psql(user, "SELECT current_user", &[("PGPASSWORD", PASSWORD)]);
        assert_eq!((code_, out.trim()), (0, user), "{user} via psql: {err}");
        let (code_, _, err) = gw.psql(user, "SELECT 1", &[("PGPASSWORD", "wrong")]);
        assert_ne!(code_, 0, "{user} with a wrong password logged in");
        assert!(err.contains("password authentication failed"), "{err}");
    }
    let trust = connect(&gw.dsn("postgres")).await;
    let row = trust
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "postgres");
    let scram = connect(&format!("{} password={PASSWORD}", gw.dsn(SCRAM_USER))).await;
    let row = scram
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), SCRAM_USER);
    // The server's own SSL refusal path: sslmode=prefer falls back to plain text.
    let (code_, out, err) = gw.psql("postgres", "SELECT 2", &[("PGSSLMODE", "prefer")]);
    assert_eq!((code_, out.trim()), (0, "2"), "{err}");
    let (code_, _, err) = gw.psql("postgres", "SELECT 2", &[("PGSSLMODE", "require")]);
    assert_ne!(code_, 0);
    assert!(err.contains("SSL"), "{err}");
}

/// Done-means 2: autocommit INSERT with the current token commits; after a higher token wrote,
/// the lower token's INSERT, UPDATE and DELETE each fail with FG001, nothing changes, and each
/// leaves one audit record. Missing and malformed tokens get FG002 and FG003.
#[tokio::test(flavor = "multi_thread")]
async fn autocommit_writes_are_fenced() {
    let gw = PgGateway::start("", &[]);
    setup_table(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let a = connect_with_token(&gw, &tok(5)).await;
    a.execute("INSERT INTO items (v, who) VALUES (1, 'a')", &[])
        .await
        .unwrap();
    a.simple_query("INSERT INTO items (v, who) VALUES (2, 'a')")
        .await
        .unwrap();
    assert_eq!(count(&direct, "SELECT count(*) FROM items").await, 2);
    assert_eq!(
        count(
            &direct,
            "SELECT revision FROM fencegate.fences WHERE resource = 'job'"
        )
        .await,
        5
    );

    let b = connect(&gw.dsn("postgres")).await;
    b.simple_query(&format!("SET fencegate.token = '{}'", tok(6)))
        .await
        .unwrap();
    b.simple_query("INSERT INTO items (v, who) VALUES (3, 'b')")
        .await
        .unwrap();
    assert_eq!(
        count(
            &direct,
            "SELECT revision FROM fencegate.fences WHERE resource = 'job'"
        )
        .await,
        6
    );

    let before = count(&direct, "SELECT count(*) FROM items").await;
    let sum_before = count(&direct, "SELECT sum(v)::bigint FROM items").await;
    for sql in [
        "INSERT INTO items (v, who) VALUES (100, 'a')",
        "UPDATE items SET v = v + 1000",
        "DELETE FROM items",
    ] {
        let e = a.simple_query(sql).await.expect_err(sql);
        assert_eq!(code(&e), "FG001", "{sql}: {e}");
        let db = e.as_db_error().unwrap();
        assert!(
            db.message().contains("job")
                && db.message().contains('5')
                && db.message().contains('6'),
            "the message names resource, revision and fence: {}",
            db.message()
        );
    }
    // The extended protocol too.
    let e = a
        .execute("UPDATE items SET v = $1", &[&7i32])
        .await
        .expect_err("extended update");
    assert_eq!(code(&e), "FG001");
    assert_eq!(count(&direct, "SELECT count(*) FROM items").await, before);
    assert_eq!(
        count(&direct, "SELECT sum(v)::bigint FROM items").await,
        sum_before
    );
    let stale = stale_records(&gw);
    assert_eq!(stale.len(), 4, "one audit record per refusal: {stale:#?}");
    for r in &stale {
        assert_eq!(r["store"], "postgres");
        assert_eq!(r["resource"], "job");
        assert_eq!(r["revision"], 5);
        assert_eq!(r["fence"], 6);
    }
    let commands: Vec<&str> = stale
        .iter()
        .map(|r| r["operation"]["command"].as_str().unwrap())
        .collect();
    assert_eq!(commands, ["INSERT", "UPDATE", "DELETE", "UPDATE"]);

    // No token: refused before anything is sent upstream; malformed: FG003.
    let none = connect(&gw.dsn("postgres")).await;
    let e = none
        .simple_query("INSERT INTO items (v, who) VALUES (9, 'none')")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    let e = none
        .execute("INSERT INTO items (v, who) VALUES ($1, 'none')", &[&9i32])
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    let e = none
        .simple_query("INSERT INTO items (v, who) VALUES (9, 'x') /* fencing_token='fg1~zz~job' */")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG003", "{e}");
    // Reads need no token.
    let rows = none.query("SELECT v FROM items", &[]).await.unwrap();
    assert_eq!(rows.len() as i64, before);
    // The statement's comment wins over the session token.
    let e = b
        .simple_query(&format!(
            "INSERT INTO items (v, who) VALUES (9, 'b') /* fencing_token='{}' */",
            tok(5)
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG001");
    a.simple_query(&format!(
        "INSERT INTO items (v, who) VALUES (9, 'a') /* fencing_token='{}' */",
        tok(6)
    ))
    .await
    .unwrap();
    // RESET drops the session token.
    b.simple_query("RESET fencegate.token").await.unwrap();
    let e = b.simple_query("DELETE FROM items").await.unwrap_err();
    assert_eq!(code(&e), "FG002");
    assert_eq!(
        count(&direct, "SELECT count(*) FROM items").await,
        before + 1
    );
    let reasons: Vec<String> = gw
        .audit_records()
        .iter()
        .map(|r| r["reason"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        reasons,
        [
            "stale",
            "stale",
            "stale",
            "stale",
            "missing",
            "missing",
            "malformed",
            "stale",
            "missing"
        ]
    );
    // psql with the startup option and a comment, as an unchanged app would.
    let (c, _, err) = gw.psql(
        "postgres",
        "INSERT INTO items (v, who) VALUES (10, 'psql')",
        &[("PGOPTIONS", &format!("-c fencegate.token={}", tok(6)))],
    );
    assert_eq!(c, 0, "{err}");
    let (c, _, err) = gw.psql(
        "postgres",
        "INSERT INTO items (v, who) VALUES (11, 'psql')",
        &[("PGOPTIONS", &format!("-c fencegate.token={}", tok(5)))],
    );
    assert_ne!(c, 0);
    assert!(err.contains("stale token"), "{err}");
}

/// Done-means 3: `BEGIN; INSERT; INSERT; COMMIT` with a stale token commits nothing, sent
/// statement by statement or as one query string; the current holder's transaction commits
/// and is guarded once.
#[tokio::test(flavor = "multi_thread")]
async fn explicit_transactions_with_a_stale_token_commit_nothing() {
    let gw = PgGateway::start("", &[]);
    setup_table(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let new = connect_with_token(&gw, &tok(8)).await;
    new.simple_query("BEGIN").await.unwrap();
    new.simple_query("INSERT INTO items (v, who) VALUES (1, 'new')")
        .await
        .unwrap();
    new.simple_query("INSERT INTO items (v, who) VALUES (2, 'new')")
        .await
        .unwrap();
    new.simple_query("COMMIT").await.unwrap();
    assert_eq!(count(&direct, "SELECT count(*) FROM items").await, 2);

    let old = connect_with_token(&gw, &tok(7)).await;
    old.simple_query("BEGIN").await.unwrap();
    let e = old
        .simple_query("INSERT INTO items (v, who) VALUES (3, 'old')")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG001");
    let e = old
        .simple_query("INSERT INTO items (v, who) VALUES (4, 'old')")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "25P02", "the transaction is aborted: {e}");
    let done = old.simple_query("COMMIT").await.unwrap();
    assert!(matches!(
        done.last(),
        Some(SimpleQueryMessage::CommandComplete(_))
    ));
    // One query string with the whole transaction.
    let e = old
        .simple_query(
            "BEGIN; INSERT INTO items (v, who) VALUES (5, 'old'); INSERT INTO items (v, who) VALUES (6, 'old'); COMMIT",
        )
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG001");
    old.simple_query("ROLLBACK").await.unwrap();
    // tokio-postgres' own transaction API (extended protocol inside BEGIN/COMMIT).
    let mut old = old;
    let tx = old.transaction().await.unwrap();
    let e = tx
        .execute("INSERT INTO items (v, who) VALUES ($1, 'old')", &[&7i32])
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG001");
    let _ = tx.commit().await;
    assert_eq!(
        count(&direct, "SELECT count(*) FROM items WHERE who = 'old'").await,
        0
    );
    assert_eq!(count(&direct, "SELECT count(*) FROM items").await, 2);
    assert_eq!(stale_records(&gw).len(), 3);
}

/// Done-means 4: named and unnamed prepared statements with the session token are fenced the
/// same way; a pipeline with an error in the middle behaves as it does directly.
#[tokio::test(flavor = "multi_thread")]
async fn extended_protocol_is_fenced_and_pipelines_behave_as_directly() {
    let gw = PgGateway::start("", &[]);
    setup_table(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let new = connect(&gw.dsn("postgres")).await;
    new.batch_execute(&format!("SET fencegate.token = '{}'", tok(3)))
        .await
        .unwrap();
    // Named: prepare once, execute many times.
    let insert = new
        .prepare("INSERT INTO items (v, who) VALUES ($1, 'new')")
        .await
        .unwrap();
    for v in 0..5i32 {
        new.execute(&insert, &[&v]).await.unwrap();
    }
    // Unnamed statements.
    for v in 5..8i32 {
        new.query_typed(
            "INSERT INTO items (v, who) VALUES ($1, 'new')",
            &[(&v, tokio_postgres::types::Type::INT4)],
        )
        .await
        .unwrap();
    }
    assert_eq!(count(&direct, "SELECT count(*) FROM items").await, 8);

    let old = connect(&gw.dsn("postgres")).await;
    old.batch_execute(&format!("SET fencegate.token = '{}'", tok(2)))
        .await
        .unwrap();
    let insert_old = old
        .prepare("INSERT INTO items (v, who) VALUES ($1, 'old')")
        .await
        .unwrap();
    let e = old.execute(&insert_old, &[&1i32]).await.unwrap_err();
    assert_eq!(code(&e), "FG001");
    let e = old
        .query_typed(
            "UPDATE items SET v = $1",
            &[(&1i32, tokio_postgres::types::Type::INT4)],
        )
        .await
        .unwrap_err();
    assert_eq!(code(&e), "FG001");
    // SET through the extended protocol works too, and the value never reaches the server.
    old.execute(&format!("SET fencegate.token = '{}'", tok(3)), &[])
        .await
        .unwrap();
    old.execute(&insert_old, &[&1i32]).await.unwrap();
    old.batch_execute(&format!("SET fencegate.token = '{}'", tok(2)))
        .await
        .unwrap();
    // The session stays usable after a refusal.
    assert_eq!(old.query("SELECT 1", &[]).await.unwrap().len(), 1);
    assert_eq!(count(&direct, "SELECT count(*) FROM items").await, 9);
    assert_eq!(stale_records(&gw).len(), 2);

    // A pipeline with a failing statement in the middle: compare with the server directly.
    direct
        .batch_execute("CREATE TABLE uniq (k int PRIMARY KEY)")
        .await
        .unwrap();
    async fn pipeline(c: &Client, base: i32) -> Vec<Result<u64, String>> {
        let s = c.prepare("INSERT INTO uniq (k) VALUES ($1)").await.unwrap();
        let next = base + 1;
        type Param<'a> = [&'a (dyn tokio_postgres::types::ToSql + Sync); 1];
        let (p1, p2, p3): (Param, Param, Param) = ([&base], [&base], [&next]);
        let (a, b, d) = tokio::join!(c.execute(&s, &p1), c.execute(&s, &p2), c.execute(&s, &p3));
        [a, b, d]
            .into_iter()
            .map(|r| r.map_err(|e| code(&e)))
            .collect()
    }
    let via_direct = pipeline(&direct, 100).await;
    let via_gateway = pipeline(&new, 200).await;
    assert_eq!(via_direct, via_gateway);
    assert_eq!(via_gateway[1], Err("23505".to_owned()));
    assert_eq!(count(&direct, "SELECT count(*) FROM uniq").await, 4);
}

/// Done-means 5: `COPY ... FROM STDIN` with a stale token is refused and copies nothing; with
/// the current token it copies.
#[tokio::test(flavor = "multi_thread")]
async fn copy_from_stdin_is_fenced() {
    use futures_util::SinkExt;
    let gw = PgGateway::start("", &[]);
    setup_table(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    let new = connect_with_token(&gw, &tok(11)).await;
    let sink = new.copy_in("COPY items (v, who) FROM STDIN").await.unwrap();
    let mut sink = Box::pin(sink);
    sink.send(bytes::Bytes::from_static(b"1\tnew\n2\tnew\n"))
        .await
        .unwrap();
    assert_eq!(sink.as_mut().finish().await.unwrap(), 2);

    let old = connect_with_token(&gw, &tok(10)).await;
    let e = match old
        .copy_in::<_, bytes::Bytes>("COPY items (v, who) FROM STDIN")
        .await
    {
        Err(e) => e,
        Ok(sink) => {
            let mut sink = Box::pin(sink);
            let _ = sink.send(bytes::Bytes::from_static(b"3\told\n")).await;
            sink.as_mut().finish().await.unwrap_err()
        }
    };
    assert_eq!(code(&e), "FG001");
    // psql's \copy uses the same COPY FROM STDIN.
    let (c, _, err) = gw.psql(
        "postgres",
        "COPY items (v, who) FROM STDIN",
        &[("PGOPTIONS", &format!("-c fencegate.token={}", tok(10)))],
    );
    assert_ne!(c, 0);
    assert!(err.contains("stale token"), "{err}");
    assert_eq!(count(&direct, "SELECT count(*) FROM items").await, 2);
    assert_eq!(
        count(&direct, "SELECT count(*) FROM items WHERE who = 'old'").await,
        0
    );
    assert_eq!(stale_records(&gw).len(), 2);
    // COPY ... TO STDOUT is a read and streams through without a token.
    use futures_util::TryStreamExt;
    let reader = connect(&gw.dsn("postgres")).await;
    let chunks: Vec<bytes::Bytes> = reader
        .copy_out("COPY (SELECT v, who FROM items ORDER BY v) TO STDOUT")
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert_eq!(chunks.concat(), b"1\tnew\n2\tnew\n");
}

/// Done-means 7: pgbench -S runs through the gateway, and a SELECT reaches the server
/// byte-for-byte as the client sent it.
#[tokio::test(flavor = "multi_thread")]
async fn pgbench_select_only_and_reads_are_relayed_unchanged() {
    let gw = PgGateway::start("", &[]);
    let init = Command::new("pgbench")
        .args(["-i", "-s", "1", "-q", "-h", "127.0.0.1"])
        .args(["-p", &gw.pg.port.to_string(), "-U", "postgres", "postgres"])
        .output()
        .expect("pgbench -i (apt-get install postgresql-contrib / postgresql-client)");
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    let run = Command::new("pgbench")
        .args([
            "-S",
            "-n",
            "-c",
            "4",
            "-j",
            "2",
            "-t",
            "250",
            "-h",
            "127.0.0.1",
        ])
        .args(["-p", &gw.port.to_string(), "-U", "postgres", "postgres"])
        .output()
        .expect("pgbench -S");
    let out = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        out.contains("number of transactions actually processed: 1000/1000"),
        "{out}"
    );
    // Extended (prepared) protocol too.
    let run = Command::new("pgbench")
        .args([
            "-S",
            "-n",
            "-M",
            "prepared",
            "-c",
            "2",
            "-t",
            "100",
            "-h",
            "127.0.0.1",
        ])
        .args(["-p", &gw.port.to_string(), "-U", "postgres", "postgres"])
        .output()
        .expect("pgbench -S -M prepared");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );

    // Byte-for-byte: odd spacing, a comment and a trailing semicolon arrive as sent.
    let direct = connect(&gw.pg.dsn("postgres")).await;
    direct
        .batch_execute("ALTER SYSTEM SET log_statement = 'all'")
        .await
        .unwrap();
    direct
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    wait_for_log_statement_all(&gw).await;
    let marker = "SELECT   42 AS  \"odd\"  /* keep me */ ;";
    let (c, out, err) = gw.psql("postgres", marker, &[]);
    assert_eq!((c, out.trim()), (0, "42"), "{err}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if gw.pg.log_text().contains(&format!("statement: {marker}")) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server log does not show the statement unchanged:\n{}",
            gw.pg.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Done-means 8: garbage gets an error and a closed connection; other sessions keep working.
/// Also: a cancel request reaches the right backend, notices pass through.
#[tokio::test(flavor = "multi_thread")]
async fn garbage_is_refused_and_cancels_reach_the_backend() {
    let gw = PgGateway::start("", &[]);
    let other = connect_with_token(&gw, &tok(1)).await;
    assert_eq!(other.query("SELECT 1", &[]).await.unwrap().len(), 1);

    // Garbage instead of a startup packet.
    let mut s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    assert_eq!(reply.first(), Some(&b'E'), "{reply:?}");
    assert!(String::from_utf8_lossy(&reply).contains("08P01"));

    // Garbage after a good login.
    let mut s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut startup = Vec::new();
    let body = b"\0\x03\0\0user\0postgres\0database\0postgres\0\0";
    startup.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
    startup.extend_from_slice(body);
    s.write_all(&startup).unwrap();
    let mut buf = [0u8; 4096];
    let mut seen = Vec::new();
    while !seen.windows(6).any(|w| w == b"Z\0\0\0\x05I") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before ReadyForQuery");
        seen.extend_from_slice(&buf[..n]);
    }
    s.write_all(&[0xde, 0xad, 0xbe, 0xef, 0x00, 0x11, 0x22, 0x33, 0x44])
        .unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    assert_eq!(reply.first(), Some(&b'E'), "{reply:?}");
    assert!(String::from_utf8_lossy(&reply).contains("08P01"));

    // The other session still works, and can write with its token.
    other
        .batch_execute("CREATE TABLE t (a int); INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    assert_eq!(other.query("SELECT a FROM t", &[]).await.unwrap().len(), 1);

    // Cancel: the request reaches the backend running the query.
    let cancel = other.cancel_token();
    let sleeper = tokio::spawn(async move { other.simple_query("SELECT pg_sleep(30)").await });
    // Cancel once the backend is really running the sleep (bounded wait, no guessing).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while gw.pg.psql_as(
        "postgres",
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%pg_sleep(30)%' AND pid <> pg_backend_pid()",
    ) != "1"
    {
        assert!(std::time::Instant::now() < deadline, "the query never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel_query(NoTls).await.unwrap();
    let result = tokio::time::timeout(Duration::from_secs(10), sleeper)
        .await
        .expect("the cancel reached the backend")
        .unwrap();
    assert_eq!(code(&result.unwrap_err()), "57014");
}

/// With `tls_cert`/`tls_key`, SSLRequest is accepted and TLS terminated with rustls; psql with
/// `sslmode=require` connects, logs in with SCRAM and is fenced as over plain TCP.
#[tokio::test(flavor = "multi_thread")]
async fn tls_is_terminated_when_a_certificate_is_configured() {
    let certs = tempfile::tempdir().unwrap();
    let cert = certs.path().join("cert.pem");
    let key = certs.path().join("key.pem");
    let out = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl (apt-get install openssl) makes the test certificate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let extra = format!(
        "tls_cert = \"{}\"\ntls_key = \"{}\"\n",
        cert.display(),
        key.display()
    );
    let gw = PgGateway::start(&extra, &[]);
    setup_table(&gw);
    let tls = [("PGSSLMODE", "require"), ("PGPASSWORD", PASSWORD)];
    let (c, out, err) = gw.psql(SCRAM_USER, "\\conninfo", &tls);
    assert_eq!(c, 0, "{err}");
    assert!(out.contains("SSL connection"), "{out}");
    let (c, _, err) = gw.psql(
        SCRAM_USER,
        "INSERT INTO items (v, who) VALUES (1, 'tls') /* fencing_token='fg1~2~job' */",
        &tls,
    );
    assert_eq!(c, 0, "{err}");
    let (c, _, err) = gw.psql(
        SCRAM_USER,
        "INSERT INTO items (v, who) VALUES (2, 'tls') /* fencing_token='fg1~1~job' */",
        &tls,
    );
    assert_ne!(c, 0);
    assert!(err.contains("stale token"), "{err}");
    assert_eq!(gw.pg.psql_as("postgres", "SELECT count(*) FROM items"), "1");
    // Plain connections still work next to TLS ones.
    let (c, out, err) = gw.psql("postgres", "SELECT 3", &[("PGSSLMODE", "disable")]);
    assert_eq!((c, out.trim()), (0, "3"), "{err}");
}

/// With a cluster key, only tokens signed with it pass (unsigned or badly signed: FG004); with
/// `resource`, tokens for other resources get FG005; unprotected databases pass without a
/// token; notices and ParameterStatus reach the client.
#[tokio::test(flavor = "multi_thread")]
async fn forged_and_out_of_scope_tokens_and_unprotected_databases() {
    use fencegate_core::{Resource, Revision, Token, TokenKey};
    let secret = "a test secret of 32 or more bytes!!";
    let gw = PgGateway::start(
        "databases = [\"postgres\"]\nresource = \"job\"\n\n[authority]\ntoken_key_env = \"FG_TEST_KEY\"\n",
        &[("FG_TEST_KEY", secret)],
    );
    setup_table(&gw);
    let key = TokenKey::new(0, secret.as_bytes()).unwrap();
    let token = |resource: &str, revision: u64, key: &TokenKey| {
        Token::new(
            Resource::new(resource).unwrap(),
            Revision::new(revision).unwrap(),
        )
        .signed(key)
        .to_string()
    };
    let good = connect_with_token(&gw, &token("job", 4, &key)).await;
    good.simple_query("INSERT INTO items (v, who) VALUES (1, 'signed')")
        .await
        .unwrap();
    let other_key = TokenKey::new(0, b"another cluster's key, 32 bytes!").unwrap();
    for (presented, want) in [
        ("fg1~9~job".to_owned(), "FG004"),
        (token("job", 9, &other_key), "FG004"),
        (token("other", 9, &key), "FG005"),
    ] {
        let c = connect_with_token(&gw, &presented).await;
        let e = c
            .simple_query("INSERT INTO items (v, who) VALUES (2, 'bad')")
            .await
            .unwrap_err();
        assert_eq!(code(&e), want, "{presented}: {e}");
        // The signature never reaches the audit log.
        let signature = presented.rsplit('~').next().unwrap();
        let log = std::fs::read_to_string(gw.node.audit_dir.join("audit.jsonl")).unwrap();
        assert!(presented.matches('~').count() < 3 || !log.contains(signature));
    }
    let reasons: Vec<String> = gw
        .audit_records()
        .iter()
        .map(|r| r["reason"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(reasons, ["forged", "forged", "out_of_scope"]);

    // Another database is not protected: no token needed.
    gw.pg.psql_as("postgres", "CREATE DATABASE scratch");
    let dsn = format!(
        "host=127.0.0.1 port={} user=postgres dbname=scratch",
        gw.port
    );
    let scratch = connect(&dsn).await;
    scratch
        .batch_execute("CREATE TABLE t (a int); INSERT INTO t VALUES (1)")
        .await
        .unwrap();

    // Notices and ParameterStatus pass through (psql prints the notice on stderr).
    let (c, _, err) = gw.psql(
        "postgres",
        "DO $$ BEGIN RAISE NOTICE 'hello from the server'; END $$",
        &[(
            "PGOPTIONS",
            &format!("-c fencegate.token={}", token("job", 4, &key)),
        )],
    );
    assert_eq!(c, 0, "{err}");
    assert!(err.contains("NOTICE:  hello from the server"), "{err}");
    let (c, out, err) = gw.psql(
        "postgres",
        "SET application_name = 'via-gateway'; SHOW application_name",
        &[],
    );
    assert_eq!((c, out.trim()), (0, "via-gateway"), "{err}");
    assert_eq!(gw.audit_records().len(), 3);
}

/// Inside `BEGIN ... COMMIT` the guard runs before the first write only (the server log shows
/// one guard call for three inserts), and again after a new transaction starts.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_is_guarded_once_before_its_first_write() {
    let gw = PgGateway::start("", &[]);
    setup_table(&gw);
    let direct = connect(&gw.pg.dsn("postgres")).await;
    direct
        .batch_execute("ALTER SYSTEM SET log_statement = 'all'")
        .await
        .unwrap();
    direct
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    wait_for_log_statement_all(&gw).await;
    let c = connect_with_token(&gw, &tok(3)).await;
    for sql in [
        "BEGIN",
        "INSERT INTO items (v, who) VALUES (1, 'tx')",
        "INSERT INTO items (v, who) VALUES (2, 'tx')",
        "UPDATE items SET v = v + 1",
        "COMMIT",
        "BEGIN",
        "DELETE FROM items WHERE v = 2",
        "COMMIT",
    ] {
        c.simple_query(sql).await.unwrap();
    }
    assert_eq!(count(&direct, "SELECT count(*) FROM items").await, 1);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let log = gw.pg.log_text();
        if log.contains("DELETE FROM items WHERE v = 2") {
            let guards = log.matches("fencegate.guard_proc(E'fg1~3~job')").count();
            assert_eq!(guards, 2, "one guard per transaction:\n{log}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A raw extended-protocol pipeline with ONE Sync and a failing statement in the middle gets
/// the same replies through the gateway as directly (the guard's replies are invisible, the
/// statements after the error are skipped, the implicit transaction rolls back).
#[tokio::test(flavor = "multi_thread")]
async fn single_sync_pipeline_with_an_error_matches_the_server() {
    use support::postgres_server::{message, pipeline_replies as run, statement};
    let gw = PgGateway::start("", &[]);
    gw.pg
        .psql_as("postgres", "CREATE TABLE uniq (k int PRIMARY KEY)");
    gw.pg.psql_as("postgres", "INSERT INTO uniq VALUES (1)");
    let mut pipeline = statement("INSERT INTO uniq VALUES (10)");
    pipeline.extend(statement("INSERT INTO uniq VALUES (1)"));
    pipeline.extend(statement("INSERT INTO uniq VALUES (11)"));
    pipeline.extend(message(b'S', b""));
    let direct = run(gw.pg.port, "", &pipeline);
    let through = run(
        gw.port,
        &format!("-c fencegate.token={}", tok(1)),
        &pipeline,
    );
    assert_eq!(direct, "12C12E(23505)ZI");
    assert_eq!(through, direct);
    // Nothing of the pipeline committed, either way.
    assert_eq!(gw.pg.psql_as("postgres", "SELECT count(*) FROM uniq"), "1");
    // And a stale token stops the pipeline at its first write, as a server error would.
    gw.pg.psql_as(
        "postgres",
        "INSERT INTO fencegate.fences (resource, revision) VALUES ('job', 5) \
         ON CONFLICT (resource) DO UPDATE SET revision = 5",
    );
    let mut ok_pipeline = statement("INSERT INTO uniq VALUES (20)");
    ok_pipeline.extend(statement("SELECT 1"));
    ok_pipeline.extend(message(b'S', b""));
    let stale = run(
        gw.port,
        &format!("-c fencegate.token={}", tok(1)),
        &ok_pipeline,
    );
    assert_eq!(stale, "1E(FG001)ZI");
    assert_eq!(gw.pg.psql_as("postgres", "SELECT count(*) FROM uniq"), "1");
    assert_eq!(stale_records(&gw).len(), 1);
}

/// Fences cannot be lowered by clients: writes to the `fencegate` schema through the gateway are
/// refused (FG006), and an ordinary role cannot write `fencegate.fences` even directly, while
/// the guard (SECURITY DEFINER) still raises it for that role's fenced writes.
#[tokio::test(flavor = "multi_thread")]
async fn fences_cannot_be_lowered_by_clients() {
    let gw = PgGateway::start("", &[]);
    setup_table(&gw);
    gw.pg.psql_as(
        "postgres",
        "CREATE ROLE app LOGIN; GRANT ALL ON items, items_id_seq TO app",
    );
    let app = connect_with_token(&gw, &tok(9)).await;
    app.simple_query("INSERT INTO items (v, who) VALUES (1, 'app')")
        .await
        .unwrap();
    let app_as_app = connect(&format!(
        "{} options='-c fencegate.token={}'",
        gw.dsn("app"),
        tok(9)
    ))
    .await;
    app_as_app
        .simple_query("INSERT INTO items (v, who) VALUES (2, 'app')")
        .await
        .unwrap();
    for sql in [
        "UPDATE fencegate.fences SET revision = 1",
        "DELETE FROM fencegate.fences",
        "TRUNCATE fencegate.fences",
    ] {
        let e = app.simple_query(sql).await.unwrap_err();
        assert_eq!(code(&e), "FG006", "{sql}: {e}");
    }
    let direct_app = connect(&gw.pg.dsn("app")).await;
    let e = direct_app
        .simple_query("UPDATE fencegate.fences SET revision = 1")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "42501", "{e}");
    assert_eq!(
        gw.pg.psql_as(
            "postgres",
            "SELECT revision FROM fencegate.fences WHERE resource = 'job'"
        ),
        "9"
    );
}

/// `install_on_start` installs fence.sql when the node starts (DSN from the named env var), and
/// `fencegate postgres print-sql` prints the same file.
#[tokio::test(flavor = "multi_thread")]
async fn fence_sql_is_installed_at_startup_when_configured() {
    let pg = support::postgres_server::PgServer::start();
    assert_eq!(
        pg.psql_as(
            "postgres",
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'fencegate'"
        ),
        "0"
    );
    let dsn = pg.dsn("postgres");
    let gw = PgGateway::start_on(
        pg,
        "install_on_start = true\ninstall_dsn_env = \"FG_PG_DSN\"\n",
        &[("FG_PG_DSN", &dsn)],
    );
    setup_table(&gw);
    let c = connect_with_token(&gw, &tok(2)).await;
    c.simple_query("INSERT INTO items (v, who) VALUES (1, 'x')")
        .await
        .unwrap();
    assert_eq!(
        gw.pg.psql_as(
            "postgres",
            "SELECT revision FROM fencegate.fences WHERE resource = 'job'"
        ),
        "2"
    );
    let (code_, out, _) = support::postgres_server::cli(&["postgres", "print-sql"]);
    assert_eq!(code_, 0);
    assert!(out.contains("CREATE OR REPLACE FUNCTION fencegate.guard"));
}

/// `RESET fencegate.token`, `RESET ALL` and `DISCARD ALL` go back to the startup option's token
/// (none without one), as PostgreSQL does for any setting.
#[tokio::test(flavor = "multi_thread")]
async fn reset_goes_back_to_the_startup_token() {
    let gw = PgGateway::start("", &[]);
    setup_table(&gw);
    let with_startup = connect_with_token(&gw, &tok(5)).await;
    let insert = "INSERT INTO items (v, who) VALUES (1, 'x')";
    for reset in ["RESET fencegate.token", "RESET ALL", "DISCARD ALL"] {
        with_startup
            .simple_query("SET fencegate.token = 'fg1~zz~job'")
            .await
            .unwrap();
        let e = with_startup.simple_query(insert).await.unwrap_err();
        assert_eq!(code(&e), "FG003", "{e}");
        with_startup.simple_query(reset).await.unwrap();
        with_startup.simple_query(insert).await.unwrap();
    }
    let without = connect(&gw.dsn("postgres")).await;
    without
        .simple_query(&format!("SET fencegate.token = '{}'", tok(5)))
        .await
        .unwrap();
    without.simple_query(insert).await.unwrap();
    without.simple_query("DISCARD ALL").await.unwrap();
    let e = without.simple_query(insert).await.unwrap_err();
    assert_eq!(code(&e), "FG002", "{e}");
    assert_eq!(gw.pg.psql_as("postgres", "SELECT count(*) FROM items"), "4");
}
