//! The gateway run in-process against a real `redis-server`, with an in-memory audit sink.
//! (The done-means tests at the workspace root go through the real `fencegate serve` process.)

use fencegate_testkit::redis_server;

use std::sync::Arc;

use fencegate_core::MemoryAuditSink;
use fencegate_testkit::redis_client::{connect, fence};
use redis::aio::MultiplexedConnection;
use redis_server::RedisServer;

struct Setup {
    _server: RedisServer,
    direct: MultiplexedConnection,
    gateway_url: String,
    sink: Arc<MemoryAuditSink>,
}

async fn setup() -> Setup {
    let server = RedisServer::start();
    let (addr, sink) = super::harness::serve_every_key(server.addr).await;
    let direct = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    Setup {
        _server: server,
        direct,
        gateway_url: format!("redis://{addr}/"),
        sink,
    }
}

#[tokio::test]
async fn current_token_applies_and_stale_is_refused() {
    let mut s = setup().await;
    let mut a = connect(&s.gateway_url).await;
    fence(&mut a, "fg1~5~job").await.unwrap();
    let _: () = redis::cmd("SET")
        .arg("k")
        .arg("v5")
        .query_async(&mut a)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("k")
        .arg("v5b")
        .query_async(&mut a)
        .await
        .unwrap();
    let fence_value: String = redis::cmd("GET")
        .arg("fencegate:fence:{job}")
        .query_async(&mut s.direct)
        .await
        .unwrap();
    assert_eq!(fence_value, "5");
    let ttl: i64 = redis::cmd("TTL")
        .arg("fencegate:fence:{job}")
        .query_async(&mut s.direct)
        .await
        .unwrap();
    assert_eq!(ttl, -1);

    let mut b = connect(&s.gateway_url).await;
    fence(&mut b, "fg1~9~job").await.unwrap();
    let _: () = redis::cmd("SET")
        .arg("k")
        .arg("v9")
        .query_async(&mut b)
        .await
        .unwrap();

    let err = redis::cmd("SET")
        .arg("k")
        .arg("late")
        .query_async::<()>(&mut a)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("FENCED"), "{err}");
    assert!(
        err.to_string().contains("job token 5 is below fence 9"),
        "{err}"
    );
    let v: String = redis::cmd("GET")
        .arg("k")
        .query_async(&mut s.direct)
        .await
        .unwrap();
    assert_eq!(v, "v9");
    let events = s.sink.events();
    assert_eq!(events.len(), 1);
    assert_eq!(
        (
            events[0].reason.as_str(),
            events[0].fence,
            events[0].revision
        ),
        ("stale", Some(9), Some(5))
    );
    assert_eq!(events[0].operation.command, "SET");

    // Reads and inner-command errors come back unchanged.
    let _: () = redis::cmd("HSET")
        .arg("h")
        .arg("f")
        .arg("1")
        .query_async(&mut b)
        .await
        .unwrap();
    let err = redis::cmd("INCR")
        .arg("h")
        .query_async::<()>(&mut b)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("WRONGTYPE"), "{err}");
    assert!(!err.to_string().contains("script"), "{err}");
}

#[tokio::test]
async fn missing_and_bad_tokens_are_refused() {
    let mut s = setup().await;
    let mut c = connect(&s.gateway_url).await;
    let err = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query_async::<()>(&mut c)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("NOFENCE"), "{err}");
    let err = fence(&mut c, "fg1~x~job").await.unwrap_err();
    assert_eq!(err.code(), Some("BADFENCE"), "{err}");
    let v: Option<String> = redis::cmd("GET")
        .arg("k")
        .query_async(&mut s.direct)
        .await
        .unwrap();
    assert_eq!(v, None);
    let err = redis::cmd("CLIENT")
        .arg("REPLY")
        .arg("OFF")
        .query_async::<()>(&mut c)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("CLIENT REPLY is not supported"),
        "{err}"
    );
    let pong: String = redis::cmd("PING").query_async(&mut c).await.unwrap();
    assert_eq!(pong, "PONG");
    let reasons: Vec<String> = s.sink.events().into_iter().map(|e| e.reason).collect();
    assert_eq!(reasons, ["missing", "malformed"], "{:#?}", s.sink.events());
}
