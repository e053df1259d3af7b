//! Done-means 1 to 4 of the Redis filter, through a real `fencegate serve` process in front of
//! a real `redis-server`.

use crate::support::redis_client::{cmd, connect, fence};
use crate::support::redis_gateway::RedisGateway;
use fencegate_redis::frame::{parse, Frame, Limits};
use redis::aio::MultiplexedConnection;
use redis::RedisResult;

#[tokio::test]
async fn current_token_applies_and_equal_token_applies_again() {
    let gw = RedisGateway::start("", &[]);
    let mut direct = connect(&gw.redis.url()).await;
    let mut a = connect(&gw.url()).await;
    fence(&mut a, "fg1~7~billing").await.unwrap();
    let _: () = cmd(&mut a, &["SET", "invoice:1", "first"]).await.unwrap();
    let _: () = cmd(&mut a, &["SET", "invoice:1", "second"]).await.unwrap();
    let _: i64 = cmd(&mut a, &["HSET", "customer:1", "billed", "yes"])
        .await
        .unwrap();
    // A second connection with the same (equal) token is accepted too.
    let mut a2 = connect(&gw.url()).await;
    fence(&mut a2, "fg1~7~billing").await.unwrap();
    let n: i64 = cmd(&mut a2, &["INCR", "counter"]).await.unwrap();
    assert_eq!(n, 1);

    let v: String = cmd(&mut direct, &["GET", "invoice:1"]).await.unwrap();
    assert_eq!(v, "second");
    let fence_value: String = cmd(&mut direct, &["GET", "fencegate:fence:{billing}"])
        .await
        .unwrap();
    assert_eq!(fence_value, "7");
    let ttl: i64 = cmd(&mut direct, &["TTL", "fencegate:fence:{billing}"])
        .await
        .unwrap();
    assert_eq!(ttl, -1, "the fence key never gets a TTL");
    // Reads pass through unchanged, with or without a token.
    let mut reader = connect(&gw.url()).await;
    let v: String = cmd(&mut reader, &["GET", "invoice:1"]).await.unwrap();
    assert_eq!(v, "second");
    assert!(gw.audit_records().is_empty());
    println!(
        "done-means 1: writes with token 7 applied, equal token 7 applied again, fence=7, ttl=-1"
    );
}

#[tokio::test]
async fn lower_token_is_refused_after_a_higher_one_wrote() {
    let gw = RedisGateway::start("", &[]);
    let mut direct = connect(&gw.redis.url()).await;
    let mut old = connect(&gw.url()).await;
    fence(&mut old, "fg1~7~billing").await.unwrap();
    let _: () = cmd(&mut old, &["SET", "s", "old"]).await.unwrap();
    let _: i64 = cmd(&mut old, &["HSET", "h", "f", "old"]).await.unwrap();
    let _: () = cmd(&mut old, &["SET", "d", "keep"]).await.unwrap();
    let _: () = cmd(&mut old, &["SET", "n", "10"]).await.unwrap();

    let mut new = connect(&gw.url()).await;
    fence(&mut new, "fg1~12~billing").await.unwrap();
    let _: () = cmd(&mut new, &["SET", "s", "new"]).await.unwrap();

    let snapshot = |direct: &mut MultiplexedConnection| {
        let mut direct = direct.clone();
        async move {
            let s: String = cmd(&mut direct, &["GET", "s"]).await.unwrap();
            let h: String = cmd(&mut direct, &["HGET", "h", "f"]).await.unwrap();
            let d: i64 = cmd(&mut direct, &["EXISTS", "d"]).await.unwrap();
            let n: String = cmd(&mut direct, &["GET", "n"]).await.unwrap();
            let m: Option<String> = cmd(&mut direct, &["GET", "m"]).await.unwrap();
            (s, h, d, n, m)
        }
    };
    let before = snapshot(&mut direct).await;

    let cases: &[&[&str]] = &[
        &["SET", "s", "late"],
        &["HSET", "h", "f", "late"],
        &["DEL", "d"],
        &["INCR", "n"],
    ];
    for (i, args) in cases.iter().enumerate() {
        let err = cmd::<redis::Value>(&mut old, args).await.unwrap_err();
        assert_eq!(err.code(), Some("FENCED"), "{args:?}: {err}");
        assert!(
            err.to_string()
                .contains("billing token 7 is below fence 12"),
            "{err}"
        );
        assert_eq!(
            gw.stale_records().len(),
            i + 1,
            "exactly one audit record per refusal"
        );
    }
    // A MULTI/EXEC block: every queued command runs under the fence; none applies.
    let exec: RedisResult<redis::Value> = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg("m")
        .arg("late")
        .cmd("INCR")
        .arg("n")
        .cmd("GET")
        .arg("s")
        .query_async(&mut old)
        .await;
    match exec {
        Err(e) => assert_eq!(e.code(), Some("FENCED"), "{e}"),
        Ok(v) => assert!(format!("{v:?}").contains("is below fence 12"), "{v:?}"),
    }
    assert_eq!(
        snapshot(&mut direct).await,
        before,
        "no refused write changed the data"
    );
    let records = gw.stale_records();
    assert_eq!(
        records.len(),
        5,
        "exactly one audit record per refusal: {records:#?}"
    );
    let ops: Vec<&str> = records
        .iter()
        .map(|r| r["operation"]["command"].as_str().unwrap())
        .collect();
    assert_eq!(&ops[..4], ["SET", "HSET", "DEL", "INCR"]);
    assert!(ops[4].starts_with("MULTI/EXEC("), "{ops:?}");
    for r in &records {
        assert_eq!(
            (
                r["resource"].as_str(),
                r["revision"].as_u64(),
                r["fence"].as_u64()
            ),
            (Some("billing"), Some(7), Some(12))
        );
        assert!(
            !r.to_string().contains("late"),
            "no data values in the audit log: {r}"
        );
    }
    println!("done-means 2: SET, HSET, DEL, INCR and MULTI/EXEC with token 7 refused after 12; data unchanged; 5 audit records");
}

#[tokio::test]
async fn missing_and_malformed_tokens_are_refused() {
    let gw = RedisGateway::start("", &[]);
    let mut direct = connect(&gw.redis.url()).await;
    let mut c = connect(&gw.url()).await;
    let err = cmd::<()>(&mut c, &["SET", "k", "v"]).await.unwrap_err();
    assert_eq!(err.code(), Some("NOFENCE"), "{err}");
    for bad in [
        "fg1~0~job",
        "fg1~x~job",
        "fg2~5~job",
        "fg1~5~bad resource",
        "fg1~5~job~short",
    ] {
        let err = fence(&mut c, bad).await.unwrap_err();
        assert_eq!(err.code(), Some("BADFENCE"), "{bad}: {err}");
    }
    // An invalid token leaves the connection's token unchanged (here: none).
    let err = cmd::<()>(&mut c, &["SET", "k", "v"]).await.unwrap_err();
    assert_eq!(err.code(), Some("NOFENCE"), "{err}");
    // FENCE alone clears a token.
    fence(&mut c, "fg1~3~job").await.unwrap();
    let _: () = redis::cmd("FENCE").query_async(&mut c).await.unwrap();
    let err = cmd::<()>(&mut c, &["SET", "k", "v"]).await.unwrap_err();
    assert_eq!(err.code(), Some("NOFENCE"), "{err}");
    let v: Option<String> = cmd(&mut direct, &["GET", "k"]).await.unwrap();
    assert_eq!(v, None);
    // Floods of tokenless or malformed refusals from one client may be written as one
    // aggregate record per second that counts them; every refusal is accounted for.
    crate::support::audit::wait_for_refusals(
        &gw.node.audit_dir,
        &[("missing", 3), ("malformed", 5)],
    );
    println!(
        "done-means 3: missing token -> NOFENCE, malformed tokens -> BADFENCE, 8 audit records"
    );
}

#[tokio::test]
async fn forged_and_unsigned_tokens_are_refused_when_a_key_is_configured() {
    use fencegate_core::{Resource, Revision, Token, TokenKey};
    let secret = "an-example-secret-of-32-bytes-or-more!";
    let gw = RedisGateway::start(
        "\n[authority]\ntoken_key_env = \"FG_TEST_KEY\"\n",
        &[("FG_TEST_KEY", secret)],
    );
    let token = Token::new(Resource::new("job").unwrap(), Revision::new(5).unwrap());
    let good = token
        .clone()
        .signed(&TokenKey::new(0, secret.as_bytes()).unwrap())
        .to_string();
    let other = TokenKey::new(0, b"another cluster's key, 32 bytes!").unwrap();
    let forged = token.clone().signed(&other).to_string();
    let mut c = connect(&gw.url()).await;
    for bad in [forged.as_str(), "fg1~5~job"] {
        let err = fence(&mut c, bad).await.unwrap_err();
        assert_eq!(err.code(), Some("BADFENCE"), "{err}");
    }
    fence(&mut c, &good).await.unwrap();
    let _: () = cmd(&mut c, &["SET", "k", "v"]).await.unwrap();
    let records = gw.audit_records();
    let reasons: Vec<&str> = records
        .iter()
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, ["forged", "forged"]);
    let log = serde_json::to_string(&records).unwrap();
    let signature = forged.rsplit('~').next().unwrap();
    assert!(
        !log.contains(signature),
        "signatures never reach the audit log"
    );
    assert!(
        !gw.log_text().contains(signature),
        "signatures never reach the logs"
    );
}

#[tokio::test]
async fn racing_writers_n_and_n_plus_1() {
    let gw = RedisGateway::start("", &[]);
    let mut direct = connect(&gw.redis.url()).await;
    let url = gw.url();
    // n+1 starts once n has applied 100 writes, so the two really overlap (no sleeps: n's
    // progress is the signal).
    let n_progress = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let writer = |name: &'static str, token: &'static str| {
        let url = url.clone();
        let n_progress = n_progress.clone();
        tokio::spawn(async move {
            let mut con = connect(&url).await;
            fence(&mut con, token).await.unwrap();
            if name == "n+1" {
                let _ = n_progress.acquire().await.unwrap();
            }
            let mut refused = 0;
            for i in 0..1000 {
                if name == "n" && i == 100 {
                    n_progress.add_permits(1);
                }
                // The data itself records the order writes applied in.
                let entry = format!("{name}:{i}");
                let r: RedisResult<i64> = cmd(&mut con, &["RPUSH", "race:log", &entry]).await;
                let s: RedisResult<()> =
                    cmd(&mut con, &["SET", &format!("race:key:{}", i % 10), &entry]).await;
                match (r, s) {
                    (Ok(_), Ok(())) => {}
                    (r, s) => {
                        for e in [r.err(), s.err()].into_iter().flatten() {
                            assert_eq!(e.code(), Some("FENCED"), "{e}");
                            refused += 1;
                        }
                    }
                }
            }
            refused
        })
    };
    let a = writer("n", "fg1~41~race");
    let b = writer("n+1", "fg1~42~race");
    let (refused_a, refused_b) = (a.await.unwrap(), b.await.unwrap());
    assert_eq!(refused_b, 0, "the higher token is never refused");
    let log: Vec<String> = cmd(&mut direct, &["LRANGE", "race:log", "0", "-1"])
        .await
        .unwrap();
    let first_new = log
        .iter()
        .position(|e| e.starts_with("n+1:"))
        .expect("n+1 wrote");
    let late_old: Vec<&String> = log[first_new..]
        .iter()
        .filter(|e| e.starts_with("n:"))
        .collect();
    assert!(
        late_old.is_empty(),
        "writes of n applied after n+1's first write: {late_old:?}"
    );
    assert_eq!(log.iter().filter(|e| e.starts_with("n+1:")).count(), 1000);
    assert!(
        first_new >= 100,
        "n applied its first 100 writes before n+1 started"
    );
    for k in 0..10 {
        let v: String = cmd(&mut direct, &["GET", &format!("race:key:{k}")])
            .await
            .unwrap();
        assert!(v.starts_with("n+1:"), "race:key:{k} = {v}");
    }
    assert_eq!(
        gw.stale_records().len(),
        refused_a,
        "one audit record per refusal"
    );
    println!(
        "done-means 4: n applied {} entries, all before n+1's first write; n refused {} writes; n+1 applied all 1000",
        first_new, refused_a
    );
}

#[tokio::test]
async fn transactions_keep_their_meaning() {
    let gw = RedisGateway::start("", &[]);
    let mut direct = connect(&gw.redis.url()).await;
    // Without a token, a protected write in MULTI aborts the whole transaction, as Redis does
    // for a command refused at queue time.
    let mut c = connect(&gw.url()).await;
    let exec: RedisResult<redis::Value> = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg("a")
        .arg("1")
        .query_async(&mut c)
        .await;
    let err = exec.unwrap_err();
    assert!(
        err.to_string().contains("NOFENCE") || err.code() == Some("EXECABORT"),
        "{err}"
    );
    let a: Option<String> = cmd(&mut direct, &["GET", "a"]).await.unwrap();
    assert_eq!(a, None);

    // With a token, MULTI/EXEC applies every command, replies unchanged.
    fence(&mut c, "fg1~2~tx").await.unwrap();
    let (x, y, z): (String, i64, String) = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg("a")
        .arg("1")
        .ignore()
        .cmd("GET")
        .arg("a")
        .cmd("INCR")
        .arg("n")
        .cmd("ECHO")
        .arg("e")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!((x.as_str(), y, z.as_str()), ("1", 1, "e"));

    // WATCH still aborts EXEC when a watched key changed.
    let _: () = cmd(&mut c, &["WATCH", "a"]).await.unwrap();
    let mut other = connect(&gw.url()).await;
    fence(&mut other, "fg1~2~tx").await.unwrap();
    let _: () = cmd(&mut other, &["SET", "a", "changed"]).await.unwrap();
    let _: () = cmd(&mut c, &["MULTI"]).await.unwrap();
    let queued: String = cmd(&mut c, &["SET", "a", "mine"]).await.unwrap();
    assert_eq!(queued, "QUEUED");
    let exec: redis::Value = cmd(&mut c, &["EXEC"]).await.unwrap();
    assert_eq!(exec, redis::Value::Nil);
    let a: String = cmd(&mut direct, &["GET", "a"]).await.unwrap();
    assert_eq!(a, "changed");
}

#[tokio::test]
async fn the_fence_function_is_reloaded_after_a_flush() {
    let gw = RedisGateway::start("", &[]);
    let mut direct = connect(&gw.redis.url()).await;
    let mut c = connect(&gw.url()).await;
    fence(&mut c, "fg1~5~job").await.unwrap();
    let _: () = cmd(&mut c, &["SET", "k", "1"]).await.unwrap();
    let _: () = cmd(&mut direct, &["FUNCTION", "FLUSH"]).await.unwrap();
    let _: () = cmd(&mut c, &["SET", "k", "2"]).await.unwrap();
    let v: String = cmd(&mut direct, &["GET", "k"]).await.unwrap();
    assert_eq!(v, "2");
    // Pipelined writes behind a missing function: replies stay in order, and writes apply in
    // request order; one that cannot be resent without overtaking later ones gets TRYAGAIN.
    let _: () = cmd(&mut direct, &["FUNCTION", "FLUSH"]).await.unwrap();
    let replies = raw_pipeline(&gw, "fg1~5~job", 2_000);
    assert_eq!(replies.len(), 4_000);
    let mut last = 0;
    for (i, reply) in replies.iter().enumerate() {
        match reply {
            Frame::Simple(ok) if i % 2 == 0 && &ok[..] == b"OK" => {}
            Frame::Integer(n) if i % 2 == 1 => {
                assert!(*n > last, "INCR {i} applied out of order: {n} after {last}");
                last = *n;
            }
            Frame::Error(e) if e.starts_with(b"TRYAGAIN ") => {}
            other => panic!("reply {i}: {other:?}"),
        }
    }
    let applied = replies
        .iter()
        .filter(|r| matches!(r, Frame::Integer(_)))
        .count() as i64;
    assert_eq!(last, applied, "every applied INCR counted once, in order");
    let _: () = cmd(&mut c, &["SET", "after", "ok"]).await.unwrap();
    let libs: redis::Value = cmd(&mut direct, &["FUNCTION", "LIST"]).await.unwrap();
    assert!(format!("{libs:?}").contains("fencegate_v1"), "{libs:?}");
    assert!(gw.log_text().contains("reloaded"), "{}", gw.log_text());
}

/// Sends `FENCE token` and `n` pairs of `SET p:<i> <i>`, `INCR p:count` in one write on a raw
/// connection and returns the replies after FENCE's.
fn raw_pipeline(gw: &RedisGateway, token: &str, n: usize) -> Vec<Frame> {
    let mut commands = vec![vec!["FENCE".to_owned(), token.to_owned()]];
    for i in 0..n {
        commands.push(vec!["SET".into(), format!("p:{i}"), i.to_string()]);
        commands.push(vec!["INCR".into(), "p:count".into()]);
    }
    let mut frames = raw_exchange(gw, commands);
    assert_eq!(frames[0], Frame::simple("OK"));
    frames.split_off(1)
}

/// Sends `commands` in one write on a raw connection (so the gateway reads them together) and
/// returns one reply per command.
fn raw_exchange(gw: &RedisGateway, commands: Vec<Vec<String>>) -> Vec<Frame> {
    use std::io::{Read, Write};
    let expected = commands.len();
    let mut request = Vec::new();
    for args in commands {
        request.extend_from_slice(&Frame::command(args).to_bytes());
    }
    let mut s = std::net::TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let writer = {
        let mut s = s.try_clone().unwrap();
        std::thread::spawn(move || s.write_all(&request).unwrap())
    };
    let (mut buf, mut frames, mut chunk) = (Vec::new(), Vec::new(), [0u8; 65536]);
    while frames.len() < expected {
        let got = s.read(&mut chunk).unwrap();
        assert!(got > 0, "gateway closed after {} replies", frames.len());
        buf.extend_from_slice(&chunk[..got]);
        while let Some((frame, len)) = parse(&buf, &Limits::default()).unwrap() {
            buf.drain(..len);
            frames.push(frame);
        }
    }
    writer.join().unwrap();
    frames
}

/// A connection that changes its token mid-pipeline is judged under each token in turn: the
/// writes sent after `FENCE` of a lower token are refused by the store, the runs of fenced
/// writes (one batch call per run) never mix two tokens, and going back to the higher token
/// writes again. The gateway encodes each token's part of the fence call once, at `FENCE`: this
/// is the test that a write never goes out with the previous token's encoding.
#[tokio::test]
async fn a_token_changed_mid_pipeline_fences_the_writes_after_it() {
    let gw = RedisGateway::start("", &[]);
    let mut direct = connect(&gw.redis.url()).await;
    let command = |args: &[&str]| -> Vec<String> { args.iter().map(|a| a.to_string()).collect() };
    let replies = raw_exchange(
        &gw,
        vec![
            command(&["FENCE", "fg1~12~billing"]),
            command(&["SET", "t:a", "twelve"]),
            command(&["SET", "t:b", "twelve"]),
            command(&["FENCE", "fg1~7~billing"]),
            command(&["SET", "t:a", "seven"]),
            command(&["SET", "t:b", "seven"]),
            command(&["SET", "t:c", "seven"]),
            command(&["FENCE", "fg1~12~billing"]),
            command(&["SET", "t:c", "twelve"]),
        ],
    );
    let ok = Frame::simple("OK");
    assert_eq!(
        &replies[..4],
        [ok.clone(), ok.clone(), ok.clone(), ok.clone()]
    );
    for refused in &replies[4..7] {
        let text = format!("{refused:?}");
        assert!(
            matches!(refused, Frame::Error(_))
                && text.contains("FENCED billing token 7 is below fence 12"),
            "{text}"
        );
    }
    assert_eq!(&replies[7..], [ok.clone(), ok]);
    for (key, value) in [("t:a", "twelve"), ("t:b", "twelve"), ("t:c", "twelve")] {
        let v: String = cmd(&mut direct, &["GET", key]).await.unwrap();
        assert_eq!(v, value, "{key}");
    }
    let fence_value: String = cmd(&mut direct, &["GET", "fencegate:fence:{billing}"])
        .await
        .unwrap();
    assert_eq!(fence_value, "12");
    let records = gw.stale_records();
    assert_eq!(
        records.len(),
        3,
        "one audit record per refused write: {records:#?}"
    );
    for r in &records {
        assert_eq!(
            (r["revision"].as_u64(), r["fence"].as_u64()),
            (Some(7), Some(12))
        );
    }
}
