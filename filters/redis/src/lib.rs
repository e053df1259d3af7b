//! fencegate's Redis filter: a RESP2/RESP3 gateway in front of one Redis server that runs every
//! write to a protected key inside one call of the fence script (`fence.lua`), which compares the
//! client's token with the resource's fence key, raises it, and applies the write atomically.
//!
//! - [`frame`]: the RESP codec. [`command_table`]: commands, flags and key specs learned from
//!   the upstream. [`classify`] and [`rewrite`]: pure decisions and the rewrite into the fence
//!   call. [`fence_batch`]: pipelined fenced writes as one call of `fence_batch.lua`. `session`: the only I/O module, one client connection to one upstream connection.
//! - The token carrier is the gateway-local command `FENCE <token>` (`FENCE` alone clears it).
//! - Refusals: `-NOFENCE` (no token), `-FENCED <resource> token <n> is below fence <m>` (stale,
//!   decided in the store), `-BADFENCE` (malformed, forged, out of scope), `-UNFENCEABLE` (a
//!   command that cannot be classified or run under the fence, on a protected gateway). Each is
//!   reported to the [`fencegate_core::AuditSink`] before the client gets it.

#![deny(missing_docs)]

mod buffer_keep;
pub mod classify;
pub mod command_table;
pub mod config;
pub mod decide;
pub mod durability;
pub mod error;
pub mod fence_batch;
mod fence_reset;
pub mod frame;
mod gateway;
pub mod glob;
mod hand_off;
mod inbox;
pub mod request_parser;
pub mod rewrite;
pub mod scope;
mod session;
mod shared_upstream;
pub mod sharing;
mod stream;
mod text;
mod tls;
pub mod upstream;

pub use config::{FenceModule, ProtectMode, ProtectRule, RedisConfig, Scope};
pub use error::{FrameError, RedisError};
pub use fence_reset::reset_fence;
pub use gateway::Gateway;
