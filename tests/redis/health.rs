//! `/healthz` reports the Redis gateway's health: 503 naming the reason while fence keys can be
//! evicted or the upstream is down, 200 with the gateway's status otherwise.

use std::time::{Duration, Instant};

use crate::support::gateway_node::GatewayNode;
use crate::support::redis_server::RedisServer;

const PROTECT_ALL: &str = "[[redis.protect]]\npattern = \"*\"\nresource = \"*\"\n";

/// Polls `/healthz` until `done` holds for its answer (bounded: 30 s).
async fn wait_health(
    node: &GatewayNode,
    done: impl Fn(u16, &serde_json::Value) -> bool,
) -> (u16, serde_json::Value) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = node.healthz().await;
        if let Some((status, body)) = &answer {
            if done(*status, body) {
                return (*status, body.clone());
            }
        }
        assert!(
            Instant::now() < deadline,
            "/healthz never as expected; last answer {answer:?}\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn node_for(redis: &RedisServer) -> GatewayNode {
    let mut node = GatewayNode::start(
        &format!(
            "[redis]\nlisten = \"127.0.0.1:0\"\nupstream = \"{}\"\n{PROTECT_ALL}",
            redis.addr
        ),
        &[],
    );
    node.bound_port("redis gateway listening");
    node
}

#[tokio::test]
async fn a_gateway_whose_fences_can_be_evicted_makes_the_node_unhealthy() {
    let lru = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let node = node_for(&lru);
    let (status, body) = wait_health(&node, |s, b| {
        s == 503 && b["gateways"]["redis"]["ok"] == false
    })
    .await;
    let reason = body["gateways"]["redis"]["reason"].as_str().unwrap();
    assert!(reason.contains("maxmemory-policy is allkeys-lru"), "{body}");
    let message = body["message"].as_str().unwrap();
    assert!(message.starts_with("redis gateway degraded: "), "{body}");
    println!("allkeys-lru: /healthz {status} {body}");

    let safe = RedisServer::start();
    let node = node_for(&safe);
    let (status, body) = wait_health(&node, |s, _| s == 200).await;
    assert_eq!(body["gateways"]["redis"]["ok"], true, "{body}");
    assert_eq!(body["ok"], true, "{body}");
    println!("noeviction: /healthz {status} {body}");
}

#[tokio::test]
async fn an_unreachable_upstream_makes_the_node_unhealthy() {
    let redis = RedisServer::start();
    let node = node_for(&redis);
    wait_health(&node, |s, _| s == 200).await;
    drop(redis);
    // /healthz probes the upstream itself (503 at once); the gateway's own check follows
    // within its 10 s recheck (or on the next client connection).
    let (_, body) = wait_health(&node, |s, b| {
        s == 503 && b["gateways"]["redis"]["reason"].is_string()
    })
    .await;
    let reason = body["gateways"]["redis"]["reason"].as_str().unwrap();
    assert!(reason.contains("upstream"), "{body}");
    assert_eq!(
        body["gateways"]["redis"]["upstream"]["reachable"], false,
        "{body}"
    );
    println!("upstream down: /healthz 503 {body}");
}
