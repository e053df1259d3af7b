//! A Redis client for tests: one connection and one command from a slice of words, so that each
//! test file does not write its own.

use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, RedisResult};

/// A multiplexed connection to `url` (a gateway or a redis-server); panics if it cannot connect,
/// since a test without its connection has nothing to assert.
pub async fn connect(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Sends `args` (the command name first) and returns the reply, an error reply included, so
/// that a test can assert a refusal.
pub async fn cmd<T: FromRedisValue>(
    con: &mut MultiplexedConnection,
    args: &[&str],
) -> RedisResult<T> {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async(con).await
}

/// Sends the gateway's `FENCE token` on `con`.
pub async fn fence(con: &mut MultiplexedConnection, token: &str) -> RedisResult<()> {
    redis::cmd("FENCE").arg(token).query_async(con).await
}
