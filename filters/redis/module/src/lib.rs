//! fencegate's Redis module: `FENCEGATE.FENCE` and `FENCEGATE.FENCE_BATCH`, native twins of the
//! fence functions the gateway loads (filters/redis/src/fence.lua, fence_batch.lua). Optional:
//! where Redis can load modules (`loadmodule` in redis.conf, or `MODULE LOAD`), the fence check
//! costs the store a fraction of the Lua function's CPU; where it cannot (managed services), the
//! functions remain. See docs/REDIS_MODULE.md.

use std::os::raw::c_int;

use redis_module::{raw, redis_module, Context, RedisString, Status};

mod command;
pub mod layout;

/// The module's name in `MODULE LIST`, and its version: the gateway calls the commands only when
/// this name is loaded at this version or later.
pub const NAME: &str = "fencegate";
/// Bumped whenever a command's arguments or replies change.
pub const VERSION: i32 = 1;

/// Whether each named RedisModule API function was found by the load (the values are read, not
/// referenced: they are `static mut`).
macro_rules! present {
    ($($name:ident),*) => { true $(&& { let f = raw::$name; f.is_some() })* };
}

fn init(ctx: &Context, _args: &[RedisString]) -> Status {
    // Every API function the commands call, checked once here rather than per call: a Redis
    // without one refuses the module instead of crashing on a write.
    let present = unsafe {
        present!(
            RedisModule_Call,
            RedisModule_CallReplyType,
            RedisModule_ReplyWithCallReply,
            RedisModule_FreeCallReply,
            RedisModule_OpenKey,
            RedisModule_KeyType,
            RedisModule_StringDMA,
            RedisModule_CloseKey,
            RedisModule_StringPtrLen,
            RedisModule_ReplyWithError,
            RedisModule_ReplyWithArray,
            RedisModule_ReplyWithStringBuffer,
            RedisModule_IsKeysPositionRequest,
            RedisModule_KeyAtPos,
            RedisModule_CreateCommand
        )
    };
    if !present {
        ctx.log_warning("fencegate: this Redis lacks a module API function the fence commands need (Redis 7 or later is required)");
        return Status::Err;
    }
    let commands: [(&std::ffi::CStr, raw::RedisModuleCmdFunc); 2] = [
        (c"fencegate.fence", Some(command::fence)),
        (c"fencegate.fence_batch", Some(command::fence_batch)),
    ];
    for (name, handler) in commands {
        // `getkeys-api`: the declared keys (numkeys, as FCALL) are what ACL, cluster routing and
        // COMMAND GETKEYS see; `write deny-oom`: refused on a read-only replica and over
        // maxmemory before anything runs, as a function without flags is.
        let created = unsafe {
            raw::RedisModule_CreateCommand.unwrap()(
                ctx.ctx,
                name.as_ptr(),
                handler,
                c"write deny-oom getkeys-api".as_ptr(),
                0,
                0,
                0,
            )
        };
        if created != raw::REDISMODULE_OK as c_int {
            ctx.log_warning("fencegate: could not create the fence commands (another module may own their names)");
            return Status::Err;
        }
    }
    Status::Ok
}

redis_module! {
    name: NAME,
    version: VERSION,
    allocator: (std::alloc::System, std::alloc::System),
    data_types: [],
    init: init,
}
