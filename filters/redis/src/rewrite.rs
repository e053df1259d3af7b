//! The pure rewrite: a protected write plus a token becomes one call of the fence script.

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

/// How the fence script is called on this upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScriptMode {
    /// `FCALL` of the loaded Redis Function (Redis 7 and later).
    Function,
    /// `EVALSHA` of the cached script with this SHA-1 (older servers).
    Script {
        /// The SHA-1 `SCRIPT LOAD` returned.
        sha: String,
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

/// The fence key of `token`'s resource: `fencegate:fence:{<resource>}`.
pub fn fence_key(token: &Token) -> Bytes {
    Bytes::from(format!("{FENCE_KEY_PREFIX}{{{}}}", token.resource()))
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
        ScriptMode::Script { sha } => {
            out.push(Bytes::from_static(b"EVALSHA"));
            out.push(Bytes::from(sha.clone()));
        }
    }
    out.push(Bytes::from((keys.len() + 1).to_string()));
    out.push(fence_key(token));
    out.extend(keys.iter().cloned());
    out.push(Bytes::from(token.resource().to_string()));
    out.push(Bytes::from(token.revision().to_string()));
    out.push(Bytes::from_static(if resp3 { b"3" } else { b"2" }));
    out.extend(args.iter().cloned());
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
        };
        let out = rewrite(&mode, &token(), &b("MSET a 1 b 2"), &b("a b"), true);
        assert_eq!(
            words(&out),
            "EVALSHA abc123 3 fencegate:fence:{billing:2026-09-28} a b billing:2026-09-28 12 3 MSET a 1 b 2"
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
        assert!(
            !FENCE_LUA.contains("EXPIRE")
                && !FENCE_LUA.contains(" PX")
                && !FENCE_LUA.contains(" EX")
        );
    }
}
