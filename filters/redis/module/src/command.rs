//! The two fence commands, on Redis's raw module API: read the fence key, refuse a token below
//! it, raise it, then run the wrapped command(s), all inside one command execution, so no other
//! client's command runs in between (DESIGN.md rule 1), exactly what the fence functions do in
//! Lua, without the interpreter (issue 18: the function was most of a fenced write's store CPU).
//!
//! Every write goes through `RedisModule_Call` with `!` (propagated to replicas and the AOF,
//! wrapped in one MULTI/EXEC), `C` (the caller's ACL applies to each wrapped command, as
//! `redis.call` does) and `S` (script rules: no deny-script commands, no writes without enough
//! good replicas or when the disk fails).

use std::ffi::CStr;
use std::os::raw::{c_char, c_int};

use redis_module::raw;

use crate::layout::{self, Layout};

type Ctx = *mut raw::RedisModuleCtx;
type Argv = *mut *mut raw::RedisModuleString;

const OK: c_int = raw::REDISMODULE_OK as c_int;

/// `FENCEGATE.FENCE`: the fence function's twin.
pub unsafe extern "C" fn fence(ctx: Ctx, argv: Argv, argc: c_int) -> c_int {
    run(ctx, argv, argc, false)
}

/// `FENCEGATE.FENCE_BATCH`: the batch fence function's twin (same reply: a string of `1`s where
/// a reply is a null, then each reply).
pub unsafe extern "C" fn fence_batch(ctx: Ctx, argv: Argv, argc: c_int) -> c_int {
    run(ctx, argv, argc, true)
}

/// Arguments read without an allocation: a single call from the gateway has six, its keys and
/// its command's words (ten for a `SET`); longer calls (batches, commands with many arguments)
/// go into a `Vec`. Issue 18's profile: the argument `Vec`, the command list and the copy of the
/// fence were about 400 of the module's own 1,200 instructions per fenced `SET`.
const INLINE_WORDS: usize = 16;

unsafe fn run(ctx: Ctx, argv: Argv, argc: c_int, batch: bool) -> c_int {
    let argv = std::slice::from_raw_parts(argv, argc.max(0) as usize);
    let mut inline: [&[u8]; INLINE_WORDS] = [&[]; INLINE_WORDS];
    let spilled: Vec<&[u8]>;
    let words: &[&[u8]] = if argv.len() <= INLINE_WORDS {
        for (word, s) in inline.iter_mut().zip(argv) {
            *word = bytes(*s);
        }
        &inline[..argv.len()]
    } else {
        spilled = argv.iter().map(|s| bytes(*s)).collect();
        &spilled
    };
    if raw::RedisModule_IsKeysPositionRequest.unwrap()(ctx) != 0 {
        for at in layout::keys(words) {
            raw::RedisModule_KeyAtPos.unwrap()(ctx, at as c_int);
        }
        return OK;
    }
    let layout = match if batch {
        layout::batch(words)
    } else {
        layout::single(words)
    } {
        Ok(layout) => layout,
        Err(bad) => return error(ctx, bad.message()),
    };
    // The wrapped commands' names go to RedisModule_Call as C strings: one with a NUL inside
    // would run as its prefix, a command nobody judged.
    if layout.commands.iter().any(|c| words[c.start].contains(&0)) {
        return error(ctx, c"ERR a wrapped command's name contains a NUL byte");
    }
    let fence_key = argv[layout.keys.start];
    let token = words[layout.token];
    // Judged while the key is open, on the stored bytes in place: only a refusal copies them.
    let judged = with_fence(ctx, fence_key, |fence| match fence {
        Some(fence) if layout::is_below(token, fence) => {
            let mut text = b"FENCED ".to_vec();
            text.extend_from_slice(words[layout.resource]);
            text.extend_from_slice(b" token ");
            text.extend_from_slice(token);
            text.extend_from_slice(b" is below fence ");
            text.extend_from_slice(fence);
            Fence::Above(text)
        }
        Some(fence) if fence == token => Fence::Equal,
        _ => Fence::Below,
    });
    let raise =
        match judged {
            Ok(Fence::Above(text)) => return error_bytes(ctx, text),
            Ok(Fence::Equal) => false,
            Ok(Fence::Below) => true,
            Err(()) => return error(
                ctx,
                c"WRONGTYPE the fence key holds a value that is not a string; nothing was written",
            ),
        };
    if raise {
        let set = call_fence_set(ctx, fence_key, argv[layout.token]);
        match set {
            Called::Reply(reply) => {
                let failed = reply_type(reply) == raw::REDISMODULE_REPLY_ERROR as c_int;
                if failed {
                    // The raise did not happen (OOM, replicas, ACL): nothing is written.
                    raw::RedisModule_ReplyWithCallReply.unwrap()(ctx, reply);
                }
                raw::RedisModule_FreeCallReply.unwrap()(reply);
                if failed {
                    return OK;
                }
            }
            Called::Refused(text) => return error(ctx, text),
        }
    }
    if batch {
        reply_batch(ctx, argv, &layout);
    } else {
        match call(ctx, argv, &layout, 0) {
            Called::Reply(reply) => {
                raw::RedisModule_ReplyWithCallReply.unwrap()(ctx, reply);
                raw::RedisModule_FreeCallReply.unwrap()(reply);
            }
            Called::Refused(text) => {
                error(ctx, text);
            }
        }
    }
    OK
}

/// Runs every command, then replies `[nulls, reply...]` as fence_batch.lua does; an error
/// answers its own command only.
unsafe fn reply_batch(ctx: Ctx, argv: &[*mut raw::RedisModuleString], layout: &Layout) {
    let replies: Vec<Called> = (0..layout.commands.len())
        .map(|i| call(ctx, argv, layout, i))
        .collect();
    // As in Lua: only a RESP3 null is a Lua nil (marked `1`); a RESP2 null bulk is `false`
    // there, sent back as the same null bulk.
    let nulls: Vec<u8> = replies
        .iter()
        .map(|r| match r {
            Called::Reply(reply)
                if layout.resp3 && reply_type(*reply) == raw::REDISMODULE_REPLY_NULL as c_int =>
            {
                b'1'
            }
            _ => b'0',
        })
        .collect();
    raw::RedisModule_ReplyWithArray.unwrap()(ctx, (replies.len() + 1) as std::os::raw::c_long);
    raw::RedisModule_ReplyWithStringBuffer.unwrap()(
        ctx,
        nulls.as_ptr().cast::<c_char>(),
        nulls.len(),
    );
    for reply in replies {
        match reply {
            Called::Reply(reply) => {
                raw::RedisModule_ReplyWithCallReply.unwrap()(ctx, reply);
                raw::RedisModule_FreeCallReply.unwrap()(reply);
            }
            Called::Refused(text) => {
                error(ctx, text);
            }
        }
    }
}

enum Called {
    Reply(*mut raw::RedisModuleCallReply),
    /// Redis did not run the command; why, from errno.
    Refused(&'static CStr),
}

/// Runs wrapped command `i` in the protocol the client asked for (`0`: the caller's, which is
/// the client's when it asked for RESP3; RESP2 otherwise, as Lua without `setresp(3)`).
unsafe fn call(
    ctx: Ctx,
    argv: &[*mut raw::RedisModuleString],
    layout: &Layout,
    i: usize,
) -> Called {
    let command = &layout.commands[i];
    let name = raw::RedisModule_StringPtrLen.unwrap()(argv[command.start], std::ptr::null_mut());
    let format: &CStr = if layout.resp3 { c"CS!0v" } else { c"CS!v" };
    let args = argv.as_ptr().add(command.start + 1);
    let reply = raw::RedisModule_Call.unwrap()(ctx, name, format.as_ptr(), args, command.len() - 1);
    called(reply)
}

/// `SET <fence key> <token>`, under the same rules as the wrapped writes.
unsafe fn call_fence_set(
    ctx: Ctx,
    key: *mut raw::RedisModuleString,
    token: *mut raw::RedisModuleString,
) -> Called {
    let reply = raw::RedisModule_Call.unwrap()(ctx, c"SET".as_ptr(), c"CS!ss".as_ptr(), key, token);
    called(reply)
}

fn called(reply: *mut raw::RedisModuleCallReply) -> Called {
    if !reply.is_null() {
        return Called::Reply(reply);
    }
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    Called::Refused(match errno {
        libc::EACCES => c"NOPERM this user has no permissions to run the wrapped command or to access one of its keys",
        libc::ENOSPC => c"OOM command not allowed when used memory > 'maxmemory'",
        libc::ESPIPE => c"CROSSSLOT the wrapped command's keys don't hash to the fence key's slot",
        libc::EROFS => c"READONLY the wrapped write cannot run here (a replica, or a cluster node that does not own the slot)",
        libc::EINVAL | libc::ENOENT => {
            c"ERR unknown command or wrong number of arguments for the wrapped command"
        }
        _ => c"ERR the wrapped command could not run (not enough good replicas, a failing disk, or a command scripts may not call)",
    })
}

/// The stored fence against the token.
enum Fence {
    /// Above the token: the refusal's text.
    Above(Vec<u8>),
    /// The token itself: nothing to raise.
    Equal,
    /// Below the token, or no fence yet: raise it.
    Below,
}

/// `judge` of the fence key's value (`None` when it does not exist), read in place while the key
/// is open; `Err` when the key holds another type.
unsafe fn with_fence<T>(
    ctx: Ctx,
    key: *mut raw::RedisModuleString,
    judge: impl FnOnce(Option<&[u8]>) -> T,
) -> Result<T, ()> {
    let handle = raw::RedisModule_OpenKey.unwrap()(ctx, key, raw::REDISMODULE_READ as c_int)
        .cast::<raw::RedisModuleKey>();
    if handle.is_null() {
        return Ok(judge(None));
    }
    let kind = raw::RedisModule_KeyType.unwrap()(handle);
    let judged = if kind == raw::REDISMODULE_KEYTYPE_EMPTY as c_int {
        Ok(judge(None))
    } else if kind == raw::REDISMODULE_KEYTYPE_STRING as c_int {
        let mut len = 0usize;
        let at =
            raw::RedisModule_StringDMA.unwrap()(handle, &mut len, raw::REDISMODULE_READ as c_int);
        // Valid until the key is closed, below; nothing writes in between.
        Ok(judge(Some(if at.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(at.cast::<u8>(), len)
        })))
    } else {
        Err(())
    };
    raw::RedisModule_CloseKey.unwrap()(handle);
    judged
}

unsafe fn bytes<'a>(s: *mut raw::RedisModuleString) -> &'a [u8] {
    let mut len = 0usize;
    let at = raw::RedisModule_StringPtrLen.unwrap()(s, &mut len);
    if at.is_null() {
        return &[];
    }
    std::slice::from_raw_parts(at.cast::<u8>(), len)
}

unsafe fn reply_type(reply: *mut raw::RedisModuleCallReply) -> c_int {
    raw::RedisModule_CallReplyType.unwrap()(reply)
}

unsafe fn error(ctx: Ctx, text: &CStr) -> c_int {
    raw::RedisModule_ReplyWithError.unwrap()(ctx, text.as_ptr());
    OK
}

/// An error reply built from client bytes: NULs would end it early, so they become `?` (Redis
/// itself turns CR and LF into spaces).
unsafe fn error_bytes(ctx: Ctx, mut text: Vec<u8>) -> c_int {
    for b in &mut text {
        if *b == 0 {
            *b = b'?';
        }
    }
    text.push(0);
    let text = CStr::from_bytes_with_nul(&text).unwrap_or(c"FENCED");
    error(ctx, text)
}
