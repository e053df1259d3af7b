//! Fence keys must survive: under an eviction policy that can drop them, or without an
//! append-only file, the gateway refuses to enforce and says why; with `noeviction` and AOF it
//! runs. Against real `redis-server`s.

use fencegate_testkit::redis_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_core::{MemoryAuditSink, TokenPolicy};
use fencegate_redis::{Gateway, ProtectRule, RedisConfig};
use redis::aio::MultiplexedConnection;
use redis_server::RedisServer;

async fn gateway(
    server: &RedisServer,
    tweak: impl FnOnce(&mut RedisConfig),
) -> (Arc<Gateway>, String) {
    let mut config = RedisConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: server.addr.to_string(),
        protect: Some(vec![ProtectRule::every_key()]),
        ..RedisConfig::default()
    };
    tweak(&mut config);
    let sink = Arc::new(MemoryAuditSink::default());
    let gateway = Gateway::new(config, TokenPolicy::unsigned(), sink).unwrap();
    let listener = gateway.bind().await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gateway.clone().serve(listener));
    (gateway, format!("redis://{addr}/"))
}

async fn set_with_token(url: &str) -> redis::RedisResult<()> {
    let mut c: MultiplexedConnection = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    redis::cmd("FENCE")
        .arg("fg1~3~job")
        .query_async::<()>(&mut c)
        .await?;
    redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query_async(&mut c)
        .await
}

#[tokio::test]
async fn allkeys_lru_is_refused_with_a_reason() {
    let server = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let (gateway, url) = gateway(&server, |_| {}).await;
    let err = set_with_token(&url).await.unwrap_err();
    let text = err.to_string();
    assert_eq!(err.code(), Some("UNFENCEABLE"), "{text}");
    assert!(
        text.contains("refusing to enforce") && text.contains("allkeys-lru"),
        "{text}"
    );
    let v: Option<String> = direct_get(&server).await;
    assert_eq!(v, None, "the refused SET was applied");
    let health = gateway.health().unwrap_err();
    println!("allkeys-lru: client told {text:?}; health: {health}");
    assert!(health.contains("maxmemory-policy is allkeys-lru, which can evict fence keys"));
    // Accepted explicitly: it runs.
    let (_, url) = gateway_accepting(&server).await;
    set_with_token(&url).await.unwrap();
}

async fn direct_get(server: &RedisServer) -> Option<String> {
    let mut direct = redis::Client::open(format!("redis://{}/", server.addr))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("GET")
        .arg("k")
        .query_async(&mut direct)
        .await
        .unwrap()
}

async fn gateway_accepting(server: &RedisServer) -> (Arc<Gateway>, String) {
    gateway(server, |c| c.accept_evictable_fences = true).await
}

#[tokio::test]
async fn no_append_only_file_is_refused_with_a_reason() {
    let server = RedisServer::start_with(&["--appendonly", "no"]);
    let (gateway, url) = gateway(&server, |_| {}).await;
    let err = set_with_token(&url).await.unwrap_err();
    assert_eq!(err.code(), Some("UNFENCEABLE"), "{err}");
    assert!(err.to_string().contains("appendonly is off"), "{err}");
    assert_eq!(direct_get(&server).await, None);
    assert!(gateway.health().unwrap_err().contains("appendonly is off"));
}

#[tokio::test]
async fn noeviction_runs_and_a_later_policy_change_degrades() {
    let server = RedisServer::start();
    let (gateway, url) = gateway(&server, |_| {}).await;
    set_with_token(&url).await.unwrap();
    assert_eq!(gateway.health(), Ok(()));
    println!("noeviction + appendonly yes: fenced SET applied, health ok");

    // An operator switches the policy while the gateway runs: within the recheck interval the
    // gateway degrades and refuses fenced writes on connections already open.
    let mut open: MultiplexedConnection = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("FENCE")
        .arg("fg1~3~job")
        .query_async::<()>(&mut open)
        .await
        .unwrap();
    let mut direct = redis::Client::open(format!("redis://{}/", server.addr))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lfu")
        .query_async::<()>(&mut direct)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(25);
    while gateway.health().is_ok() {
        assert!(
            Instant::now() < deadline,
            "the gateway never noticed allkeys-lfu"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let err = redis::cmd("SET")
        .arg("k")
        .arg("v2")
        .query_async::<()>(&mut open)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("UNFENCEABLE"), "{err}");
    assert!(err.to_string().contains("allkeys-lfu"), "{err}");
    let v: String = redis::cmd("GET")
        .arg("k")
        .query_async(&mut direct)
        .await
        .unwrap();
    assert_eq!(v, "v");
}
