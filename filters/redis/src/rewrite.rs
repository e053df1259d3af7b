//! The pure rewrite: a protected write plus a token becomes one call of the fence script, and a
//! pipelined run of them one call of the batch fence script.

use bytes::Bytes;
use fencegate_core::Token;

/// Prefix of every fence key; client writes to such keys are refused.
pub const FENCE_KEY_PREFIX: &str = "fencegate:fence:";

/// The fence script, as shipped in the crate.
pub const FENCE_LUA: &str = include_str!("fence.lua");

/// The name of the Redis Function library (bump the suffix when the script changes).
pub const LIBRARY_NAME: &str = "fencegate_v1";

/// The name of the fence function inside it.
pub const FUNCTION_NAME: &str = "fencegate_fence_v1";

/// The batch fence script, as shipped in the crate.
pub const BATCH_LUA: &str = include_str!("fence_batch.lua");

/// The Redis Function library of the batch fence script: a library of its own, so a gateway that
/// loads only [`LIBRARY_NAME`] (an older one sharing the server) never replaces or deletes it.
/// Function names are unique across libraries: a new version gets new library and function names.
pub const BATCH_LIBRARY_NAME: &str = "fencegate_batch_v1";

/// The name of the batch fence function inside it.
pub const BATCH_FUNCTION_NAME: &str = "fencegate_fence_batch_v1";

/// How the fence script is called on this upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScriptMode {
    /// `FCALL` of the loaded Redis Function (Redis 7 and later).
    Function,
    /// `EVALSHA` of the cached script with this SHA-1 (older servers).
    Script {
        /// The SHA-1 `SCRIPT LOAD` returned for the fence script.
        sha: String,
        /// The SHA-1 `SCRIPT LOAD` returned for the batch fence script.
        batch_sha: String,
    },
}

/// The source for `FUNCTION LOAD REPLACE`.
pub fn function_source() -> String {
    format!("#!lua name={LIBRARY_NAME}\n{FENCE_LUA}\nredis.register_function('{FUNCTION_NAME}', fencegate_fence)\n")
}

/// The source for `SCRIPT LOAD` / `EVAL`.
pub fn script_source() -> String {
    format!("{FENCE_LUA}\nreturn fencegate_fence(KEYS, ARGV)\n")
}

/// The source for `FUNCTION LOAD REPLACE` of the batch fence library.
pub fn batch_function_source() -> String {
    format!("#!lua name={BATCH_LIBRARY_NAME}\n{BATCH_LUA}\nredis.register_function('{BATCH_FUNCTION_NAME}', fencegate_fence_batch)\n")
}

/// The source for `SCRIPT LOAD` of the batch fence script.
pub fn batch_script_source() -> String {
    format!("{BATCH_LUA}\nreturn fencegate_fence_batch(KEYS, ARGV)\n")
}

/// The fence key of `token`'s resource: `fencegate:fence:{<resource>}`.
pub fn fence_key(token: &Token) -> Bytes {
    Bytes::from(format!("{FENCE_KEY_PREFIX}{{{}}}", token.resource()))
}

/// A count as a decimal argument. The counts of a fence call are small (keys, commands, each
/// command's arguments), so those below 64 come from a static table instead of an allocation
/// each (a batch of 16 writes has 18 of them).
fn count(n: usize) -> Bytes {
    const SMALL: [&str; 64] = [
        "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15", "16",
        "17", "18", "19", "20", "21", "22", "23", "24", "25", "26", "27", "28", "29", "30", "31",
        "32", "33", "34", "35", "36", "37", "38", "39", "40", "41", "42", "43", "44", "45", "46",
        "47", "48", "49", "50", "51", "52", "53", "54", "55", "56", "57", "58", "59", "60", "61",
        "62", "63",
    ];
    match SMALL.get(n) {
        Some(text) => Bytes::from_static(text.as_bytes()),
        None => Bytes::from(n.to_string()),
    }
}

/// Rewrites `args` (the original command) into the fence script call, declaring the fence key
/// and `keys`. `resp3` selects the reply protocol inside the script.
pub fn rewrite(
    mode: &ScriptMode,
    token: &Token,
    args: &[Bytes],
    keys: &[Bytes],
    resp3: bool,
) -> Vec<Bytes> {
    let mut out = Vec::with_capacity(args.len() + keys.len() + 7);
    match mode {
        ScriptMode::Function => {
            out.push(Bytes::from_static(b"FCALL"));
            out.push(Bytes::from_static(FUNCTION_NAME.as_bytes()));
        }
        ScriptMode::Script { sha, .. } => {
            out.push(Bytes::from_static(b"EVALSHA"));
            out.push(Bytes::from(sha.clone()));
        }
    }
    out.push(count(keys.len() + 1));
    out.push(fence_key(token));
    out.extend(keys.iter().cloned());
    out.push(Bytes::from(token.resource().to_string()));
    out.push(Bytes::from(token.revision().to_string()));
    out.push(Bytes::from_static(if resp3 { b"3" } else { b"2" }));
    out.extend(args.iter().cloned());
    out
}

/// One write of a batch: the original command and its keys.
#[derive(Debug, Clone, Copy)]
pub struct BatchedWrite<'a> {
    /// The command and its arguments.
    pub args: &'a [Bytes],
    /// The keys it writes (declared to Redis).
    pub keys: &'a [Bytes],
}

/// Rewrites a run of writes under one `token` into one call of the batch fence script (see
/// `fence_batch.lua` for the argument layout). Every write's keys are declared.
pub fn rewrite_batch(
    mode: &ScriptMode,
    token: &Token,
    writes: &[BatchedWrite],
    resp3: bool,
) -> Vec<Bytes> {
    let keys: usize = writes.iter().map(|w| w.keys.len()).sum();
    let args: usize = writes.iter().map(|w| w.args.len()).sum();
    let mut out = Vec::with_capacity(8 + keys + writes.len() + args);
    match mode {
        ScriptMode::Function => {
            out.push(Bytes::from_static(b"FCALL"));
            out.push(Bytes::from_static(BATCH_FUNCTION_NAME.as_bytes()));
        }
        ScriptMode::Script { batch_sha, .. } => {
            out.push(Bytes::from_static(b"EVALSHA"));
            out.push(Bytes::from(batch_sha.clone()));
        }
    }
    out.push(count(keys + 1));
    out.push(fence_key(token));
    for write in writes {
        out.extend(write.keys.iter().cloned());
    }
    out.push(Bytes::from(token.resource().to_string()));
    out.push(Bytes::from(token.revision().to_string()));
    out.push(Bytes::from_static(if resp3 { b"3" } else { b"2" }));
    out.push(count(writes.len()));
    for write in writes {
        out.push(count(write.args.len()));
    }
    for write in writes {
        out.extend(write.args.iter().cloned());
    }
    out
}

#[cfg(test)]
mod tests {
    use fencegate_core::{Resource, Revision};

    use super::*;

    fn token() -> Token {
        Token::new(
            Resource::new("billing:2026-09-28").unwrap(),
            Revision::new(12).unwrap(),
        )
    }

    fn words(args: &[Bytes]) -> String {
        args.iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn b(text: &str) -> Vec<Bytes> {
        text.split(' ')
            .map(|a| Bytes::copy_from_slice(a.as_bytes()))
            .collect()
    }

    #[test]
    fn counts_are_their_decimal_text() {
        for n in [0, 1, 9, 10, 63, 64, 65, 1000] {
            assert_eq!(count(n), Bytes::from(n.to_string()), "{n}");
        }
    }

    #[test]
    fn golden_function_call() {
        let out = rewrite(
            &ScriptMode::Function,
            &token(),
            &b("SET k v"),
            &b("k"),
            false,
        );
        assert_eq!(
            words(&out),
            "FCALL fencegate_fence_v1 2 fencegate:fence:{billing:2026-09-28} k billing:2026-09-28 12 2 SET k v"
        );
    }

    #[test]
    fn golden_script_call_resp3_multi_key() {
        let mode = ScriptMode::Script {
            sha: "abc123".into(),
            batch_sha: "def456".into(),
        };
        let out = rewrite(&mode, &token(), &b("MSET a 1 b 2"), &b("a b"), true);
        assert_eq!(
            words(&out),
            "EVALSHA abc123 3 fencegate:fence:{billing:2026-09-28} a b billing:2026-09-28 12 3 MSET a 1 b 2"
        );
    }

    #[test]
    fn golden_batch_function_call() {
        let (set, mset, incr) = (b("SET k v"), b("MSET a 1 b 2"), b("INCR n"));
        let (ka, kb, kc) = (b("k"), b("a b"), b("n"));
        let writes = [
            BatchedWrite {
                args: &set,
                keys: &ka,
            },
            BatchedWrite {
                args: &mset,
                keys: &kb,
            },
            BatchedWrite {
                args: &incr,
                keys: &kc,
            },
        ];
        let out = rewrite_batch(&ScriptMode::Function, &token(), &writes, false);
        assert_eq!(
            words(&out),
            "FCALL fencegate_fence_batch_v1 5 fencegate:fence:{billing:2026-09-28} k a b n billing:2026-09-28 12 2 3 3 5 2 SET k v MSET a 1 b 2 INCR n"
        );
        let mode = ScriptMode::Script {
            sha: "abc123".into(),
            batch_sha: "def456".into(),
        };
        let out = rewrite_batch(&mode, &token(), &writes[..2], true);
        assert_eq!(
            words(&out),
            "EVALSHA def456 4 fencegate:fence:{billing:2026-09-28} k a b billing:2026-09-28 12 3 2 3 5 SET k v MSET a 1 b 2"
        );
    }

    #[test]
    fn binary_arguments_pass_through_untouched() {
        let args = vec![
            Bytes::from_static(b"SET"),
            Bytes::from_static(b"k\r\n"),
            Bytes::from_static(&[0, 255, 10]),
        ];
        let out = rewrite(&ScriptMode::Function, &token(), &args, &args[1..2], false);
        assert_eq!(&out[out.len() - 3..], &args[..]);
    }

    #[test]
    fn sources_embed_the_lua_file() {
        assert!(function_source().starts_with("#!lua name=fencegate_v1\n"));
        assert!(function_source()
            .contains("redis.register_function('fencegate_fence_v1', fencegate_fence)"));
        assert!(script_source().ends_with("return fencegate_fence(KEYS, ARGV)\n"));
        assert!(batch_function_source().starts_with("#!lua name=fencegate_batch_v1\n"));
        assert!(batch_function_source().contains(
            "redis.register_function('fencegate_fence_batch_v1', fencegate_fence_batch)"
        ));
        assert!(batch_script_source().ends_with("return fencegate_fence_batch(KEYS, ARGV)\n"));
        // Both libraries on one server: their function names must differ (Redis refuses a
        // library whose function another library already registered).
        assert_ne!(FUNCTION_NAME, BATCH_FUNCTION_NAME);
        assert_ne!(LIBRARY_NAME, BATCH_LIBRARY_NAME);
        assert!(BATCH_FUNCTION_NAME.starts_with("fencegate_"));
        for lua in [FENCE_LUA, BATCH_LUA] {
            assert!(!lua.contains("EXPIRE") && !lua.contains(" PX") && !lua.contains(" EX"));
        }
    }
}
