//! Pipelined extended-protocol writes through the gateway pay the guard once per transaction
//! (issue 18), against a real PostgreSQL whose table is protected by the store's triggers: a
//! pipeline of writes in one implicit transaction (one Sync) or one transaction block is guarded
//! once, and a write after anything that may have ended the guard's transaction (a Sync, COMMIT,
//! ROLLBACK, an error, a procedure that commits) is guarded again. Where the gateway must guard
//! again, the same pipeline sent directly with one guard shows that the store refuses it.
//!
//! Guards are counted in the server's statement log (`log_statement = all`, set per session).

mod support;

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use support::postgres_server::{cli, code, message, pipeline_replies as run, statement, PgGateway};
use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, NoTls, Statement};

const TOKEN: &str = "fg1~1~job";

fn sync() -> Vec<u8> {
    message(b'S', b"")
}

/// A pipeline of statements, `|` standing for a Sync.
fn pipeline(parts: &[&str]) -> Vec<u8> {
    parts
        .iter()
        .flat_map(|p| if *p == "|" { sync() } else { statement(p) })
        .collect()
}

/// A gateway in front of a PostgreSQL with table `items` protected for resource `job`, and a
/// procedure that commits.
fn start() -> PgGateway {
    let gw = PgGateway::start("", &[]);
    gw.pg.psql_as(
        "postgres",
        "CREATE TABLE items (k int PRIMARY KEY);\
         CREATE PROCEDURE commit_now() LANGUAGE plpgsql AS $$ BEGIN COMMIT; END $$;",
    );
    let (c, out, err) = cli(&[
        "postgres",
        "protect",
        "--dsn",
        &gw.pg.dsn("postgres"),
        "--table",
        "public.items",
        "--resource",
        "job",
    ]);
    assert_eq!(c, 0, "protect: {out}{err}");
    gw
}

/// Statement-log options for a session through the gateway (with the token) or direct.
fn options(token: bool) -> String {
    if token {
        format!("-c log_statement=all -c fencegate.token={TOKEN}")
    } else {
        "-c log_statement=all".to_owned()
    }
}

/// How many guards the server ran so far: waits (bounded) until a marker logged after
/// everything before it is in the log.
fn guards(gw: &PgGateway, marker: &str) -> usize {
    // RAISE LOG reaches the server log whatever the session's settings.
    gw.pg.psql_as(
        "postgres",
        &format!("DO $$ BEGIN RAISE LOG '{marker}'; END $$"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = gw.pg.log_text();
        if log.contains(marker) {
            return log
                .lines()
                .filter(|l| l.contains("LOG:") && l.contains("fencegate.guard_proc("))
                .count();
        }
        assert!(Instant::now() < deadline, "no {marker} in the log:\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn rows(gw: &PgGateway) -> String {
    gw.pg.psql_as(
        "postgres",
        "SELECT coalesce(string_agg(k::text, ',' ORDER BY k), '') FROM items",
    )
}

/// Runs `parts` through the gateway; returns the reply tags and how many guards it cost.
fn through(gw: &PgGateway, parts: &[&str], case: &str) -> (String, usize) {
    let before = guards(gw, &format!("before-{case}"));
    let tags = run(gw.port, &options(true), &pipeline(parts));
    (tags, guards(gw, &format!("after-{case}")) - before)
}

#[test]
fn one_guard_per_transaction_in_a_pipeline() {
    let gw = start();
    let insert = |k: i32| format!("INSERT INTO items VALUES ({k})");
    let (i1, i2, i3) = (insert(1), insert(2), insert(3));

    // N writes, one Sync: one implicit transaction, one guard.
    let (tags, n) = through(&gw, &[&i1, &i2, &i3, "|"], "one-sync");
    assert_eq!(tags, "12C12C12CZI");
    assert_eq!(n, 1, "one Sync");
    assert_eq!(rows(&gw), "1,2,3");

    // Two Syncs: two transactions, two guards.
    let (tags, n) = through(&gw, &[&insert(4), &insert(5), "|", &insert(6), "|"], "two");
    assert_eq!(tags, "12C12CZI12CZI");
    assert_eq!(n, 2, "two Syncs");
    assert_eq!(rows(&gw), "1,2,3,4,5,6");

    // A transaction block across Syncs, all pipelined: one guard.
    let (tags, n) = through(
        &gw,
        &[
            "BEGIN",
            &insert(7),
            "|",
            &insert(8),
            "|",
            &insert(9),
            "COMMIT",
            "|",
        ],
        "block",
    );
    assert_eq!(tags, "12C12CZT12CZT12C12CZI");
    assert_eq!(n, 1, "one transaction block");
    assert_eq!(rows(&gw), "1,2,3,4,5,6,7,8,9");

    // An error ends the implicit transaction: the write after the next Sync is guarded again.
    let (tags, n) = through(
        &gw,
        &[&insert(10), &insert(1), &insert(11), "|", &insert(12), "|"],
        "error",
    );
    assert_eq!(tags, "12C12E(23505)ZI12CZI");
    assert_eq!(n, 2, "a guard after the error");
    assert_eq!(rows(&gw), "1,2,3,4,5,6,7,8,9,12");

    // ROLLBACK in the same pipeline: the write after it is guarded again, and commits.
    let (tags, n) = through(
        &gw,
        &["BEGIN", &insert(13), "ROLLBACK", &insert(14), "|"],
        "rollback",
    );
    assert_eq!(tags, "12C12C12C12CZI");
    assert_eq!(n, 2, "a guard after ROLLBACK");
    assert_eq!(rows(&gw), "1,2,3,4,5,6,7,8,9,12,14");
}

/// Messages pipelined in one write are judged and relayed in runs (issue 18): a message the
/// gateway answers itself, or rewrites, or sends a refusal for, must still get its answer in
/// its place among the server's replies to the others.
#[test]
fn answers_keep_their_place_in_a_pipeline() {
    let gw = start();
    let q = |sql: &str| message(b'Q', format!("{sql}\0").as_bytes());
    let set_token = format!("SET fencegate.token = '{TOKEN}'");

    // Simple queries with the token set in between: the gateway keeps the token and answers
    // that query itself, between the server's replies to the others, as the server would.
    let bytes = [q("SELECT 1"), q(&set_token), q("SELECT 2"), sync()].concat();
    let direct = run(gw.pg.port, "", &bytes);
    assert_eq!(direct, "TDCZICZITDCZIZI");
    assert_eq!(run(gw.port, "", &bytes), direct);

    // The same with extended-protocol messages, a write guarded after the token.
    let bytes = [
        statement("SELECT 1"),
        sync(),
        statement(&set_token),
        sync(),
        statement("INSERT INTO items VALUES (1)"),
        sync(),
        statement("SELECT 2"),
        sync(),
    ]
    .concat();
    assert_eq!(run(gw.port, "", &bytes), "12DCZI12CZI12CZI12DCZI");
    assert_eq!(rows(&gw), "1");

    // Without a token, a write in the middle is refused in its place, and so is its twin
    // sent while the session is idle (answered by the gateway alone); nothing is written.
    let insert = q("INSERT INTO items VALUES (2)");
    let bytes = [q("SELECT 1"), insert.clone(), q("SELECT 2"), sync()].concat();
    assert_eq!(run(gw.port, "", &bytes), "TDCZIE(FG002)ZITDCZIZI");
    let bytes = [insert, q("SELECT 2"), sync()].concat();
    assert_eq!(run(gw.port, "", &bytes), "E(FG002)ZITDCZIZI");
    assert_eq!(rows(&gw), "1");
}

/// COMMIT or a procedure that commits inside one Sync ends the guard's transaction: the gateway
/// guards the next write again, and a client that does not (sent directly, one guard) is
/// refused by the store (FG002): skipping that guard would fail closed.
#[test]
fn a_write_after_a_commit_in_the_same_pipeline_is_guarded_again() {
    let gw = start();
    let guard = format!("SELECT fencegate.guard('{TOKEN}')");
    for (case, end) in [("commit", "COMMIT"), ("call", "CALL commit_now()")] {
        gw.pg
            .psql_as("postgres", &format!("{guard}; TRUNCATE items"));
        let (tags, n) = through(
            &gw,
            &[
                "INSERT INTO items VALUES (1)",
                end,
                "INSERT INTO items VALUES (2)",
                "|",
            ],
            case,
        );
        assert_eq!(tags, "12C12C12CZI", "{case}");
        assert_eq!(n, 2, "{case}: a guard after it");
        assert_eq!(rows(&gw), "1,2", "{case}");

        gw.pg
            .psql_as("postgres", &format!("{guard}; TRUNCATE items"));
        let direct = run(
            gw.pg.port,
            &options(false),
            &pipeline(&[
                &guard,
                "INSERT INTO items VALUES (1)",
                end,
                "INSERT INTO items VALUES (2)",
                "|",
            ]),
        );
        assert_eq!(direct, "12DC12C12C12E(FG002)ZI", "{case}");
        // What ran before the COMMIT committed; the write after it did not.
        assert_eq!(rows(&gw), "1", "{case}");
    }
}

/// Executes `statement` once per key, all pipelined (the futures polled together); the result
/// or SQLSTATE of each.
async fn pipelined<C: GenericClient>(
    c: &C,
    statement: &Statement,
    keys: &[i32],
) -> Vec<Result<u64, String>> {
    let params: Vec<[&(dyn ToSql + Sync); 1]> = keys.iter().map(|k| [k as _]).collect();
    join_all(params.iter().map(|p| c.execute(statement, p)))
        .await
        .into_iter()
        .map(|r| r.map_err(|e| code(&e)))
        .collect()
}

/// tokio-postgres pipelining (several execute futures joined) as the real client.
#[tokio::test(flavor = "multi_thread")]
async fn tokio_postgres_pipelines_pay_one_guard_per_transaction() {
    let gw = start();
    let dsn = format!("{} options='{}'", gw.dsn("postgres"), options(true));
    let (mut client, connection) = tokio_postgres::connect(&dsn, NoTls).await.unwrap();
    tokio::spawn(connection);
    let insert = client
        .prepare("INSERT INTO items VALUES ($1)")
        .await
        .unwrap();

    // A transaction: BEGIN, three pipelined writes (each with its own Sync), COMMIT.
    let before = guards(&gw, "before-tx");
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        pipelined(&tx, &insert, &[1, 2, 3]).await,
        [Ok(1), Ok(1), Ok(1)]
    );
    tx.commit().await.unwrap();
    assert_eq!(guards(&gw, "after-tx") - before, 1, "one transaction");
    assert_eq!(rows(&gw), "1,2,3");

    // Autocommit: each write is its own transaction, each guarded.
    assert_eq!(
        pipelined(&client, &insert, &[4, 5, 6]).await,
        [Ok(1), Ok(1), Ok(1)]
    );
    assert_eq!(guards(&gw, "after-autocommit") - before, 4);

    // A failed transaction: its writes fail until ROLLBACK; the next write is guarded again.
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        pipelined(&tx, &insert, &[1, 8]).await,
        [Err("23505".to_owned()), Err("25P02".to_owned())]
    );
    tx.rollback().await.unwrap();
    client.execute(&insert, &[&7i32]).await.unwrap();
    assert_eq!(guards(&gw, "after-failed") - before, 6);
    assert_eq!(rows(&gw), "1,2,3,4,5,6,7");
}
