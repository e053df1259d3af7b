//! The gateway in front of a redis-server that loaded fencegate's module (filters/redis/module):
//! fenced writes, pipelined runs and transactions go to `FENCEGATE.FENCE(_BATCH)` instead of the
//! functions, with the same refusals, data and audit; clients cannot call the module's commands;
//! `fence_module` chooses; a module unloaded under a running gateway fails closed. That the
//! module answers exactly as the functions do is filters/redis/module/tests/differential.rs.

use std::io::{Read, Write};
use std::time::Duration;

use crate::support::gateway_node::{GatewayNode, NodeOptions};
use crate::support::redis_client::{cmd, connect, fence};
use crate::support::redis_gateway::RedisGateway;
use crate::support::redis_server::RedisServer;
use redis::aio::MultiplexedConnection;

/// Calls per command from the upstream's `INFO commandstats` (`fencegate.fence`, `fcall`, ...).
async fn calls(direct: &mut MultiplexedConnection, command: &str) -> u64 {
    let info: String = cmd(direct, &["INFO", "commandstats"]).await.unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// A gateway (every key protected, `extra` in `[redis]`) in front of a redis-server with the
/// module loaded.
fn module_gateway(extra: &str) -> RedisGateway {
    RedisGateway::start_on(
        RedisServer::start_with_module(),
        &NodeOptions::default(),
        extra,
        &[],
    )
}

#[tokio::test]
async fn fenced_writes_run_in_the_module_and_stale_ones_are_refused() {
    let gw = module_gateway("");
    let mut direct = connect(&gw.redis.url()).await;
    let mut old = connect(&gw.url()).await;
    fence(&mut old, "fg1~7~billing").await.unwrap();
    let _: () = cmd(&mut old, &["SET", "s", "old"]).await.unwrap();
    let mut new = connect(&gw.url()).await;
    fence(&mut new, "fg1~12~billing").await.unwrap();
    // A pipelined run of writes: one batch call when it arrives in one read.
    let (a, b, n): ((), (), i64) = redis::pipe()
        .cmd("SET")
        .arg("s")
        .arg("new")
        .cmd("SET")
        .arg("t")
        .arg("new")
        .cmd("INCR")
        .arg("n")
        .query_async(&mut new)
        .await
        .unwrap();
    assert_eq!((a, b, n), ((), (), 1));

    let err = cmd::<()>(&mut old, &["SET", "s", "late"])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("FENCED"), "{err}");
    assert!(
        err.to_string()
            .contains("billing token 7 is below fence 12"),
        "{err}"
    );
    // A stale pipelined run: every write refused, each audited once.
    let run: Vec<redis::RedisResult<redis::Value>> = {
        let mut replies = Vec::new();
        for args in [["SET", "s", "late"], ["SET", "t", "late"]] {
            replies.push(cmd::<redis::Value>(&mut old, &args).await);
        }
        replies
    };
    assert!(
        run.iter()
            .all(|r| r.as_ref().is_err_and(|e| e.code() == Some("FENCED"))),
        "{run:?}"
    );
    // A transaction: refused whole.
    let exec: redis::RedisResult<redis::Value> = redis::pipe()
        .atomic()
        .cmd("SET")
        .arg("m")
        .arg("late")
        .query_async(&mut old)
        .await;
    match exec {
        Err(e) => assert_eq!(e.code(), Some("FENCED"), "{e}"),
        Ok(v) => assert!(format!("{v:?}").contains("is below fence 12"), "{v:?}"),
    }

    for (key, want) in [("s", Some("new")), ("t", Some("new")), ("m", None)] {
        let got: Option<String> = cmd(&mut direct, &["GET", key]).await.unwrap();
        assert_eq!(
            got.as_deref(),
            want,
            "{key}: no refused write changed the data"
        );
    }
    let fence_value: String = cmd(&mut direct, &["GET", "fencegate:fence:{billing}"])
        .await
        .unwrap();
    assert_eq!(fence_value, "12");
    assert_eq!(
        gw.stale_records().len(),
        4,
        "one audit record per refused write"
    );
    // The module ran every fenced write; no function was called.
    let module_calls = calls(&mut direct, "fencegate.fence").await
        + calls(&mut direct, "fencegate.fence_batch").await;
    assert!(module_calls >= 5, "module calls: {module_calls}");
    assert_eq!(
        calls(&mut direct, "fcall").await,
        0,
        "no FCALL with the module loaded"
    );
    assert!(
        gw.log_text().contains("Module"),
        "the log names the mode: {}",
        gw.log_text()
    );
    let (_, health) = gw.node.healthz().await.expect("/healthz answers");
    assert_eq!(
        health["gateways"]["redis"]["fence_check"], "module",
        "{health}"
    );
}

#[tokio::test]
async fn clients_cannot_call_the_module_through_the_gateway() {
    let gw = module_gateway("");
    let mut direct = connect(&gw.redis.url()).await;
    let mut client = connect(&gw.url()).await;
    fence(&mut client, "fg1~3~billing").await.unwrap();
    let _: () = cmd(&mut client, &["SET", "k", "v"]).await.unwrap();
    // A forged revision handed straight to the module would raise the fence and write.
    for name in [
        "FENCEGATE.FENCE",
        "fencegate.fence",
        "FENCEGATE.FENCE_BATCH",
    ] {
        let err = cmd::<redis::Value>(
            &mut client,
            &[
                name,
                "2",
                "fencegate:fence:{billing}",
                "k",
                "billing",
                "999",
                "2",
                "SET",
                "k",
                "forged",
            ],
        )
        .await
        .unwrap_err();
        assert!(
            err.to_string().contains("called only by the gateway"),
            "{name}: {err}"
        );
    }
    let v: String = cmd(&mut direct, &["GET", "k"]).await.unwrap();
    assert_eq!(v, "v");
    let fence_value: String = cmd(&mut direct, &["GET", "fencegate:fence:{billing}"])
        .await
        .unwrap();
    assert_eq!(fence_value, "3");
}

#[tokio::test]
async fn fence_module_off_keeps_the_functions_and_require_needs_the_module() {
    let off = module_gateway("fence_module = \"off\"");
    let mut direct = connect(&off.redis.url()).await;
    let mut client = connect(&off.url()).await;
    fence(&mut client, "fg1~3~billing").await.unwrap();
    let _: () = cmd(&mut client, &["SET", "k", "v"]).await.unwrap();
    assert_eq!(calls(&mut direct, "fencegate.fence").await, 0);
    assert_eq!(calls(&mut direct, "fcall").await, 1);
    let (_, health) = off.node.healthz().await.expect("/healthz answers");
    assert_eq!(
        health["gateways"]["redis"]["fence_check"], "function",
        "{health}"
    );

    // Without the module, "require" refuses every protected write, and says why.
    let redis = RedisServer::start();
    let mut node = GatewayNode::start(
        &format!(
            "[redis]\nlisten = \"127.0.0.1:0\"\nupstream = \"{}\"\nfence_module = \"require\"\n\n[[redis.protect]]\npattern = \"*\"\nresource = \"*\"\n",
            redis.addr
        ),
        &[],
    );
    node.wait_for_log(
        "fence_module = \"require\", but fencegate's Redis module is not loaded",
        Duration::from_secs(30),
    );
    let port = node.bound_port("redis gateway listening");
    // The session cannot start (the upstream is not ready for it): raw bytes, since a client
    // library's handshake fails first.
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = raw.write_all(b"FENCE fg1~3~billing\r\nSET k v\r\n");
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    assert!(
        !String::from_utf8_lossy(&answer).contains("+OK"),
        "a protected write without the required module: {:?}",
        String::from_utf8_lossy(&answer)
    );
    let mut direct = connect(&redis.url()).await;
    let stored: Option<String> = cmd(&mut direct, &["GET", "k"]).await.unwrap();
    assert_eq!(stored, None, "nothing written without the module");
}

#[tokio::test]
async fn a_module_unloaded_under_the_gateway_fails_closed() {
    // Redis 7 allows MODULE UNLOAD only when configured to.
    let gw = RedisGateway::start_on(
        RedisServer::start_with_module_and(&["--enable-module-command", "local"]),
        &NodeOptions::default(),
        "",
        &[],
    );
    let mut direct = connect(&gw.redis.url()).await;
    let mut client = connect(&gw.url()).await;
    fence(&mut client, "fg1~3~billing").await.unwrap();
    let _: () = cmd(&mut client, &["SET", "k", "v"]).await.unwrap();
    let _: () = cmd(&mut direct, &["MODULE", "UNLOAD", "fencegate"])
        .await
        .unwrap();
    let err = cmd::<()>(&mut client, &["SET", "k", "after"])
        .await
        .unwrap_err();
    let v: String = cmd(&mut direct, &["GET", "k"]).await.unwrap();
    assert_eq!(
        v, "v",
        "the write did not apply without its fence check: {err}"
    );
}
