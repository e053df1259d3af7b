//! Done-means 6: two sessions with tokens n and n+1 race 1,000 single-row inserts each through
//! the gateway. No row written with n commits after n+1's first commit (commit timestamps from
//! `track_commit_timestamp`). Once with fence.sql's plpgsql guard, once with the C one
//! (`install --enforce c`), whose common case holds the fence lock instead of the fence row and
//! leaves the raise to fence.sql (its UPDATE waits for the lock through the C trigger
//! `fence_write_lock`).

mod support;

use std::sync::Arc;

use fencegate_testkit::enforce_library::enforce_library_conf;
use support::postgres_server::{function_language, install_enforce, PgGateway, PgServer};
use tokio::sync::Barrier;
use tokio_postgres::NoTls;

/// Inserts `n` rows as `who`; before row `meet.0` it waits at `meet.1` (the other writer's
/// start), so the two overlap by construction, not by timing.
async fn writer(
    dsn: String,
    who: &'static str,
    n: usize,
    meet: (usize, Arc<Barrier>),
) -> (usize, usize) {
    let (client, connection) = tokio_postgres::connect(&dsn, NoTls).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let (mut ok, mut stale) = (0, 0);
    for i in 0..n {
        if i == meet.0 {
            tokio::time::timeout(std::time::Duration::from_secs(30), meet.1.wait())
                .await
                .unwrap_or_else(|_| panic!("{who}: the other writer did not start within 30 s"));
        }
        let sql = format!("INSERT INTO race (who, i) VALUES ('{who}', {i})");
        match client.simple_query(&sql).await {
            Ok(_) => ok += 1,
            Err(e) => {
                let code = e.code().map(|c| c.code().to_owned()).unwrap_or_default();
                assert_eq!(code, "FG001", "{who}: unexpected error {e}");
                stale += 1;
            }
        }
    }
    (ok, stale)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lower_token_never_commits_after_the_higher_tokens_first_commit() {
    race(PgGateway::start("resource = \"race\"", &[])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lower_token_never_commits_after_the_higher_tokens_first_commit_with_the_c_guard() {
    let pg = PgServer::start_with_conf(&enforce_library_conf());
    let (code, out, err) = install_enforce(&pg.dsn("postgres"), "c");
    assert_eq!(code, 0, "{out}{err}");
    let gw = PgGateway::start_on(pg, "resource = \"race\"", &[]);
    assert_eq!(function_language(&gw.pg, "fencegate.guard(text)"), "c");
    race(gw).await;
}

async fn race(gw: PgGateway) {
    gw.pg.psql_as(
        "postgres",
        "CREATE TABLE race (id bigserial PRIMARY KEY, who text NOT NULL, i int NOT NULL)",
    );
    let n = 41u64;
    let dsn = |rev: u64| {
        format!(
            "{} options='-c fencegate.token=fg1~{rev}~race'",
            gw.dsn("postgres")
        )
    };
    // The old holder commits 10 rows, then waits until the new one has connected: the new
    // one's first insert then meets the old one mid-stream (990 rows to go) on any machine.
    // (Polling the table for those 10 rows and then connecting raced: on a loaded machine the
    // old holder once finished all 1,000 before the new one's first commit.)
    let meet = Arc::new(Barrier::new(2));
    let old = tokio::spawn(writer(dsn(n), "old", 1000, (10, meet.clone())));
    let new = tokio::spawn(writer(dsn(n + 1), "new", 1000, (0, meet)));
    let (old_ok, old_stale) = old.await.unwrap();
    let (new_ok, new_stale) = new.await.unwrap();
    println!("old: {old_ok} committed, {old_stale} refused (FG001); new: {new_ok} committed, {new_stale} refused");
    assert_eq!(new_ok, 1000, "the newer holder is never refused");
    assert_eq!(old_ok + old_stale, 1000);
    assert!(
        old_ok > 0,
        "the race should let the old holder commit some rows first"
    );
    assert!(
        old_stale > 0,
        "the old holder must be refused once the new one wrote"
    );
    let late = gw.pg.psql_as(
        "postgres",
        "SELECT count(*) FROM race o WHERE o.who = 'old' AND pg_xact_commit_timestamp(o.xmin) > \
         (SELECT min(pg_xact_commit_timestamp(n.xmin)) FROM race n WHERE n.who = 'new')",
    );
    assert_eq!(
        late, "0",
        "rows of the old token committed after the new token's first commit"
    );
    let late_by_order = gw.pg.psql_as(
        "postgres",
        "SELECT count(*) FROM race o WHERE o.who = 'old' AND o.id > (SELECT min(id) FROM race n WHERE n.who = 'new')",
    );
    println!("old rows with a higher id than new's first row (allocated before, committed before): {late_by_order}");
    let stale: Vec<_> = gw
        .audit_records()
        .into_iter()
        .filter(|r| r["reason"] == "stale")
        .collect();
    assert_eq!(stale.len(), old_stale, "one audit record per refusal");
    assert_eq!(
        gw.pg.psql_as(
            "postgres",
            "SELECT revision FROM fencegate.fences WHERE resource = 'race'"
        ),
        (n + 1).to_string()
    );
}
