//! Ways around the fence found by trying (issue 13), each against a real `redis-server` through
//! the gateway run in-process: refused, data unchanged, exactly one audit record.
//!
//! The config mirrors a real deployment: `cache:*` unprotected, `billing:*` enforced. A holder
//! with token 9 has written, so billing's fence is 9; the "stale" client holds token 5.

use fencegate_testkit::redis_server;

use std::sync::Arc;

use fencegate_core::MemoryAuditSink;
use fencegate_redis::{ProtectMode, ProtectRule, RedisConfig};
use fencegate_testkit::redis_client::{cmd, connect};
use redis::aio::MultiplexedConnection;
use redis::{RedisError, Value};
use redis_server::RedisServer;

const FENCE_KEY: &str = "fencegate:fence:{billing}";

struct Setup {
    _server: RedisServer,
    direct: MultiplexedConnection,
    gateway_url: String,
    sink: Arc<MemoryAuditSink>,
    /// Audit records already checked.
    seen: usize,
}

async fn setup() -> Setup {
    let server = RedisServer::start();
    let config = RedisConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: server.addr.to_string(),
        protect: Some(vec![
            ProtectRule {
                pattern: "cache:*".into(),
                mode: ProtectMode::Off,
                resource: None,
            },
            ProtectRule {
                pattern: "billing:*".into(),
                mode: ProtectMode::Enforce,
                resource: Some("billing".into()),
            },
        ]),
        ..RedisConfig::default()
    };
    let (addr, sink) = super::harness::serve(config).await;
    let direct = connect(&server.url()).await;
    let s = Setup {
        _server: server,
        direct,
        gateway_url: format!("redis://{addr}/"),
        sink,
        seen: 0,
    };
    // The current holder writes with token 9: fence = 9.
    let mut holder = s.client(Some("fg1~9~billing")).await;
    cmd::<()>(&mut holder, &["SET", "billing:x", "current"])
        .await
        .unwrap();
    s
}

impl Setup {
    async fn client(&self, token: Option<&str>) -> MultiplexedConnection {
        let mut c = connect(&self.gateway_url).await;
        if let Some(token) = token {
            cmd::<()>(&mut c, &["FENCE", token]).await.unwrap();
        }
        c
    }

    async fn direct<T: redis::FromRedisValue>(&mut self, args: &[&str]) -> T {
        cmd(&mut self.direct, args).await.unwrap()
    }

    /// The fence is still 9 and billing:x still holds the current holder's value.
    async fn assert_untouched(&mut self) {
        let fence: Option<String> = self.direct(&["GET", FENCE_KEY]).await;
        assert_eq!(fence.as_deref(), Some("9"), "the fence key changed");
        let v: Option<String> = self.direct(&["GET", "billing:x"]).await;
        assert_eq!(v.as_deref(), Some("current"), "billing:x changed");
    }

    /// Exactly one audit record since the last check, for this reason and command.
    fn assert_one_record(&mut self, reason: &str, command: &str) {
        let all = self.sink.events();
        let events = &all[self.seen..];
        assert_eq!(events.len(), 1, "{events:#?}");
        assert_eq!(events[0].reason, reason, "{events:#?}");
        assert_eq!(events[0].operation.command, command, "{events:#?}");
        self.seen = all.len();
    }

    fn assert_one_unsupported_record(&mut self, command: &str) {
        self.assert_one_record("unsupported", command);
    }
}

fn assert_unfenceable(result: Result<Value, RedisError>, what: &str) {
    let err = result.expect_err(what);
    assert_eq!(err.code(), Some("UNFENCEABLE"), "{what}: {err}");
}

#[tokio::test]
async fn georadius_store_twice_cannot_reach_the_fence_key() {
    let mut s = setup().await;
    let _: i64 = s
        .direct(&["GEOADD", "cache:g", "13.36", "38.11", "palermo"])
        .await;
    let mut attacker = s.client(None).await;
    for (command, args) in [
        (
            "GEORADIUS",
            vec![
                "GEORADIUS",
                "cache:g",
                "13",
                "38",
                "500",
                "km",
                "STORE",
                "cache:a",
                "STORE",
                FENCE_KEY,
            ],
        ),
        (
            "GEORADIUSBYMEMBER",
            vec![
                "GEORADIUSBYMEMBER",
                "cache:g",
                "palermo",
                "10",
                "km",
                "STORE",
                "cache:a",
                "STOREDIST",
                "billing:x",
            ],
        ),
    ] {
        assert_unfenceable(cmd(&mut attacker, &args).await, command);
        s.assert_untouched().await;
        s.assert_one_unsupported_record(command);
    }
    // The stale holder is still refused by the store.
    let mut stale = s.client(Some("fg1~5~billing")).await;
    let err = cmd::<()>(&mut stale, &["SET", "billing:x", "stale"])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("FENCED"), "{err}");
    s.assert_untouched().await;
    s.assert_one_record("stale", "SET");
}

#[tokio::test]
async fn xreadgroup_repeated_streams_keyword_is_refused() {
    let mut s = setup().await;
    // A consumer group literally named STREAMS on a protected stream.
    let _: () = s
        .direct(&["XGROUP", "CREATE", "billing:s", "STREAMS", "0", "MKSTREAM"])
        .await;
    let _: String = s.direct(&["XADD", "billing:s", "*", "f", "v"]).await;
    let mut attacker = s.client(None).await;
    let args = [
        "XREADGROUP",
        "COUNT",
        "1",
        "GROUP",
        "STREAMS",
        "c",
        "STREAMS",
        "billing:s",
        ">",
    ];
    assert_unfenceable(cmd(&mut attacker, &args).await, "XREADGROUP trick");
    let pending: Vec<Value> = s.direct(&["XPENDING", "billing:s", "STREAMS"]).await;
    assert_eq!(
        pending.first(),
        Some(&Value::Int(0)),
        "the group's pending list changed: {pending:?}"
    );
    s.assert_untouched().await;
    s.assert_one_unsupported_record("XREADGROUP");
}

#[tokio::test]
async fn pfcount_is_a_write() {
    let mut s = setup().await;
    let _: i64 = s.direct(&["PFADD", "billing:h", "a", "b", "c"]).await;
    // Invalidate the cached cardinality, as any PFADD of a new element does.
    let _: i64 = s.direct(&["PFADD", "billing:h", "d"]).await;
    let before: Vec<u8> = s.direct(&["GET", "billing:h"]).await;
    let mut attacker = s.client(None).await;
    let err = cmd::<i64>(&mut attacker, &["PFCOUNT", "billing:h"])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("NOFENCE"), "{err}");
    let after: Vec<u8> = s.direct(&["GET", "billing:h"]).await;
    assert_eq!(before, after, "PFCOUNT rewrote the HyperLogLog");
    s.assert_one_record("missing", "PFCOUNT");
    // With the current token it runs (under the fence) and answers the count.
    let mut holder = s.client(Some("fg1~9~billing")).await;
    let n: i64 = cmd(&mut holder, &["PFCOUNT", "billing:h"]).await.unwrap();
    assert_eq!(n, 4);
}

#[tokio::test]
async fn scripts_and_the_fence_function_are_refused() {
    let mut s = setup().await;
    let mut attacker = s.client(None).await;
    let cases: [(&str, Vec<&str>); 3] = [
        // The gateway's own function, used to lower billing's fence.
        (
            "FCALL",
            vec![
                "FCALL",
                "fencegate_fence_v1",
                "2",
                FENCE_KEY,
                "cache:x",
                "billing",
                "1",
                "2",
                "SET",
                FENCE_KEY,
                "1",
            ],
        ),
        // A script declaring only an unprotected key that writes a protected one.
        (
            "EVAL",
            vec![
                "EVAL",
                "redis.call('SET', 'billing:x', 'stale') return 1",
                "1",
                "cache:x",
            ],
        ),
        (
            "EVAL",
            vec![
                "EVAL",
                "redis.call('SET', KEYS[1], '1') return 1",
                "1",
                FENCE_KEY,
            ],
        ),
    ];
    for (command, args) in cases {
        assert_unfenceable(cmd(&mut attacker, &args).await, command);
        s.assert_untouched().await;
        s.assert_one_unsupported_record(command);
    }
    // Read-only scripts still run: Redis itself refuses writes in them.
    let v: String = cmd(
        &mut attacker,
        &[
            "EVAL_RO",
            "return redis.call('GET', KEYS[1])",
            "1",
            "billing:x",
        ],
    )
    .await
    .unwrap();
    assert_eq!(v, "current");
}

#[tokio::test]
async fn other_databases_cannot_carry_a_stale_value_into_database_0() {
    let mut s = setup().await;
    let mut stale = s.client(Some("fg1~5~billing")).await;
    assert_unfenceable(cmd(&mut stale, &["SELECT", "1"]).await, "SELECT 1");
    s.assert_one_unsupported_record("SELECT");
    // Still in database 0, where the fence is: the stale write is refused by the store.
    let err = cmd::<()>(&mut stale, &["SET", "billing:x", "stale"])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("FENCED"), "{err}");
    s.assert_one_record("stale", "SET");
    for (command, args) in [
        ("MOVE", vec!["MOVE", "billing:x", "1"]),
        (
            "COPY",
            vec!["COPY", "cache:y", "billing:x", "DB", "0", "REPLACE"],
        ),
        ("SWAPDB", vec!["SWAPDB", "0", "1"]),
    ] {
        assert_unfenceable(cmd(&mut stale, &args).await, command);
        s.assert_untouched().await;
        s.assert_one_unsupported_record(command);
    }
    // SELECT inside a fenced MULTI: refused, so the transaction is discarded as Redis would.
    let mut pipe = redis::pipe();
    pipe.atomic()
        .cmd("SELECT")
        .arg("1")
        .cmd("SET")
        .arg("billing:x")
        .arg("stale");
    let err = pipe
        .query_async::<Value>(&mut stale)
        .await
        .expect_err("MULTI with SELECT 1");
    assert!(
        err.to_string().contains("EXECABORT") || err.code() == Some("UNFENCEABLE"),
        "{err}"
    );
    s.assert_untouched().await;
    let selected_db_1: Option<String> = {
        let _: () = s.direct(&["SELECT", "1"]).await;
        let v = s.direct(&["GET", "billing:x"]).await;
        let _: () = s.direct(&["SELECT", "0"]).await;
        v
    };
    assert_eq!(selected_db_1, None, "something was written in database 1");
}

#[tokio::test]
async fn a_token_for_another_resource_is_out_of_scope() {
    let mut s = setup().await;
    // A higher revision of another resource's lease must not write billing's keys.
    let mut other = s.client(Some("fg1~99~payroll")).await;
    let err = cmd::<()>(&mut other, &["SET", "billing:x", "payroll wrote this"])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("BADFENCE"), "{err}");
    assert!(
        err.to_string().contains(
            "out of scope: key billing:x belongs to resource billing, the token is for payroll"
        ),
        "{err}"
    );
    s.assert_untouched().await;
    s.assert_one_record("out_of_scope", "SET");
    // Inside a transaction too: the queued write is refused and EXEC aborts.
    let mut pipe = redis::pipe();
    pipe.atomic().cmd("SET").arg("billing:x").arg("again");
    let err = pipe.query_async::<Value>(&mut other).await.unwrap_err();
    assert!(
        err.code() == Some("BADFENCE") || err.to_string().contains("EXECABORT"),
        "{err}"
    );
    s.assert_untouched().await;
    s.assert_one_record("out_of_scope", "SET");
    // Unprotected keys are anyone's.
    cmd::<()>(&mut other, &["SET", "cache:y", "1"])
        .await
        .unwrap();
}
