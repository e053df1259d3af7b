//! Done-means 7 of the Redis filter: the audit log written by refusals verifies, its CLI
//! answers, the counters count, and an edited line is named by `fencegate audit verify`.

mod support;

use redis::aio::MultiplexedConnection;
use support::redis_gateway::RedisGateway;

async fn connect(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn cmd<T: redis::FromRedisValue>(
    con: &mut MultiplexedConnection,
    args: &[&str],
) -> redis::RedisResult<T> {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async(con).await
}

#[tokio::test]
async fn audit_log_verifies_and_an_edited_line_is_named() {
    let gw = RedisGateway::start("", &[]);
    let mut new = connect(&gw.url()).await;
    let mut old = connect(&gw.url()).await;
    cmd::<()>(&mut old, &["FENCE", "fg1~3~ledger"])
        .await
        .unwrap();
    cmd::<()>(&mut new, &["FENCE", "fg1~4~ledger"])
        .await
        .unwrap();
    cmd::<()>(&mut new, &["SET", "balance", "10"])
        .await
        .unwrap();
    for _ in 0..3 {
        let e = cmd::<()>(&mut old, &["SET", "balance", "99"])
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some("FENCED"));
    }
    let mut none = connect(&gw.url()).await;
    assert!(cmd::<()>(&mut none, &["DEL", "balance"]).await.is_err());
    assert!(cmd::<()>(&mut none, &["FENCE", "nonsense"]).await.is_err());

    let dir = gw.node.audit_dir.to_str().unwrap().to_owned();
    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("ok, 5 record(s) in 1 file(s)"), "{out}");
    println!("$ fencegate audit verify\n{out}");

    let (code, out, _) = gw.cli(&["audit", "tail", "-n", "2", "--dir", &dir]);
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(
        out.contains(" missing ") && out.contains(" malformed "),
        "{out}"
    );
    println!("$ fencegate audit tail -n 2\n{out}");

    let (code, out, _) = gw.cli(&[
        "audit",
        "query",
        "--resource",
        "ledger",
        "--store",
        "redis",
        "--since",
        "10m",
        "--json",
        "--dir",
        &dir,
    ]);
    assert_eq!(code, 0);
    let records: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 3, "{out}");
    assert!(records
        .iter()
        .all(|r| r["reason"] == "stale" && r["fence"] == 4 && r["revision"] == 3));

    // Counters on the admin port: refused by store and reason, applied by store.
    let metrics_port = std::fs::read_to_string(&gw.node.config)
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("api = \"127.0.0.1:")
                .map(|p| p.trim_end_matches('"').to_owned())
        })
        .unwrap();
    let text = reqwest::get(format!("http://127.0.0.1:{metrics_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "fencegate_fenced_writes_refused_total{store=\"redis\",reason=\"stale\"} 3",
        "fencegate_fenced_writes_refused_total{store=\"redis\",reason=\"missing\"} 1",
        "fencegate_fenced_writes_refused_total{store=\"redis\",reason=\"malformed\"} 1",
        "fencegate_fenced_writes_applied_total{store=\"redis\"} 1",
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }

    // Delete the last line: the head file catches it.
    let path = gw.node.audit_dir.join("audit.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let shorter: Vec<&str> = text.lines().take(4).collect();
    std::fs::write(&path, shorter.join("\n") + "\n").unwrap();
    let (code, _, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("the log ends at seq 4 but its head file records seq 5"),
        "{err}"
    );
    std::fs::write(&path, &text).unwrap();

    // Edit one line: verify fails and names it.
    let edited: Vec<String> = text
        .lines()
        .enumerate()
        .map(|(i, l)| {
            if i == 1 {
                l.replace("\"fence\":4", "\"fence\":2")
            } else {
                l.to_owned()
            }
        })
        .collect();
    assert_ne!(edited.join("\n") + "\n", text);
    std::fs::write(&path, edited.join("\n") + "\n").unwrap();
    let (code, out, err) = gw.cli(&["audit", "verify", "--dir", &dir]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("audit.jsonl:2: record seq 2 was altered"),
        "{err}"
    );
    println!("$ fencegate audit verify   (after editing line 2)\n{err}exit code {code}");
}
