//! What the in-process gateway tests share: the filter served in front of a real redis-server.

use std::net::SocketAddr;
use std::sync::Arc;

use fencegate_core::{MemoryAuditSink, TokenPolicy};
use fencegate_redis::{Gateway, ProtectRule, RedisConfig};

/// Serves the Redis filter on a free loopback port in front of `upstream`, protecting every
/// key (any resource's token, unsigned tokens accepted); returns its address and audit sink.
pub async fn serve_every_key(upstream: SocketAddr) -> (SocketAddr, Arc<MemoryAuditSink>) {
    let config = RedisConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream: upstream.to_string(),
        protect: Some(vec![ProtectRule::every_key()]),
        ..RedisConfig::default()
    };
    serve(config).await
}

/// Serves the Redis filter with `config` (unsigned tokens accepted); returns its address and
/// audit sink.
pub async fn serve(config: RedisConfig) -> (SocketAddr, Arc<MemoryAuditSink>) {
    let sink = Arc::new(MemoryAuditSink::default());
    let gateway = Gateway::new(config, TokenPolicy::unsigned(), sink.clone()).unwrap();
    let listener = gateway.bind().await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(gateway.serve(listener));
    (addr, sink)
}
