//! An operator's reset of one resource's fence key (`fencegate fence reset`): a compare-and-set
//! in one script call, so a fenced write racing the reset sees the old fence or the new one.

use fencegate_core::{FenceReset, Resource};

use crate::config::RedisConfig;
use crate::error::RedisError;
use crate::frame::Frame;
use crate::rewrite::FENCE_KEY_PREFIX;
use crate::upstream::{ControlConnection, Upstream};

/// KEYS[1] the fence key; ARGV[1] the fence the operator saw ('0': none); ARGV[2] the new fence
/// ('0': remove it). Returns {1, old} when it changed the key, {0, actual} otherwise.
const RESET: &str = "local fence = redis.call('GET', KEYS[1]) or '0' \
if fence ~= ARGV[1] then return {0, fence} end \
if ARGV[2] == '0' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2]) end \
return {1, fence}";

/// Sets `resource`'s fence to `to` (0: removes it) if it is `current` (0: none) now.
pub async fn reset_fence(
    config: &RedisConfig,
    resource: &Resource,
    current: u64,
    to: u64,
) -> Result<FenceReset, RedisError> {
    let upstream = Upstream::load(config)?;
    let mut connection = ControlConnection::open(&upstream, config).await?;
    let key = format!("{FENCE_KEY_PREFIX}{{{resource}}}");
    let reply = connection
        .request(&[
            "EVAL",
            RESET,
            "1",
            &key,
            &current.to_string(),
            &to.to_string(),
        ])
        .await?;
    interpret(&reply, to)
}

fn interpret(reply: &Frame, to: u64) -> Result<FenceReset, RedisError> {
    let unexpected = || RedisError::Upstream(format!("answered the fence reset with {reply:?}"));
    let Frame::Array(items) = reply else {
        return Err(unexpected());
    };
    let fence = match items.get(1) {
        Some(Frame::Bulk(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(unexpected)?,
        _ => return Err(unexpected()),
    };
    match items.first() {
        Some(Frame::Integer(1)) => Ok(FenceReset::Done { from: fence, to }),
        Some(Frame::Integer(0)) => Ok(FenceReset::Mismatch { actual: fence }),
        _ => Err(unexpected()),
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    #[test]
    fn replies_are_read_strictly() {
        let reply = |changed: i64, fence: &'static str| {
            Frame::Array(vec![
                Frame::Integer(changed),
                Frame::Bulk(Bytes::from_static(fence.as_bytes())),
            ])
        };
        assert_eq!(
            interpret(&reply(1, "501"), 1).unwrap(),
            FenceReset::Done { from: 501, to: 1 }
        );
        assert_eq!(
            interpret(&reply(0, "7"), 1).unwrap(),
            FenceReset::Mismatch { actual: 7 }
        );
        assert!(interpret(&reply(1, "x"), 1).is_err());
        assert!(interpret(&Frame::Null, 1).is_err());
    }
}
