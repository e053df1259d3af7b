//! The pure rewrite: a protected write plus a token becomes one call of the fence script, and a
//! pipelined run of them one call of the batch fence script.

use bytes::{Bytes, BytesMut};
use fencegate_core::Token;

use crate::frame;

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

/// The name fencegate's Redis module (filters/redis/module) has in `MODULE LIST`.
pub const MODULE_NAME: &str = "fencegate";

/// The module's oldest version whose commands take the calls built here.
pub const MODULE_VERSION: i64 = 1;

/// How the fence script is called on this upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScriptMode {
    /// `FENCEGATE.FENCE` / `FENCEGATE.FENCE_BATCH` of fencegate's Redis module, where the
    /// server has loaded it: the functions' checks and replies, natively (same arguments after
    /// the name).
    Module,
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

impl ScriptMode {
    /// What runs the fence check, for `/healthz`: `module`, `function` or `script`.
    pub fn name(&self) -> &'static str {
        match self {
            ScriptMode::Module => "module",
            ScriptMode::Function => "function",
            ScriptMode::Script { .. } => "script",
        }
    }
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

/// A token as fence calls carry it: the arguments that depend only on the token (the fence
/// key, the resource, the revision) are encoded once, when the client sends `FENCE`, instead of
/// for every write (twelve small copies and a number formatted per call, issue 18). Built only
/// by [`FenceToken::new`], from the token itself, so the encoding cannot disagree with it.
#[derive(Debug)]
pub struct FenceToken {
    token: Token,
    /// The three arguments, encoded one after the other.
    wire: Bytes,
    /// Where the fence key argument ends and the resource argument ends in `wire`.
    ends: [usize; 2],
}

impl FenceToken {
    /// `token` with its arguments encoded.
    pub fn new(token: Token) -> Self {
        let resource = token.resource().as_str().as_bytes();
        let mut wire = BytesMut::new();
        frame::encode_argument(
            &[FENCE_KEY_PREFIX.as_bytes(), b"{", resource, b"}"],
            &mut wire,
        );
        let key_end = wire.len();
        frame::encode_argument(&[resource], &mut wire);
        let resource_end = wire.len();
        frame::encode_argument(
            &[itoa::Buffer::new()
                .format(token.revision().get())
                .as_bytes()],
            &mut wire,
        );
        Self {
            token,
            wire: wire.freeze(),
            ends: [key_end, resource_end],
        }
    }

    /// The token.
    pub fn token(&self) -> &Token {
        &self.token
    }

    fn fence_key(&self) -> &[u8] {
        &self.wire[..self.ends[0]]
    }

    fn resource(&self) -> &[u8] {
        &self.wire[self.ends[0]..self.ends[1]]
    }

    fn revision(&self) -> &[u8] {
        &self.wire[self.ends[1]..]
    }
}

/// Equal when the tokens are (the encoding follows from the token).
impl PartialEq for FenceToken {
    fn eq(&self, other: &Self) -> bool {
        self.token == other.token
    }
}

impl Eq for FenceToken {}

/// A fence token is read as the token it carries.
impl std::ops::Deref for FenceToken {
    type Target = Token;

    fn deref(&self) -> &Token {
        &self.token
    }
}

/// One argument of a fence call, as [`FenceCall::each`] hands it out.
#[derive(Debug, Clone, Copy)]
pub enum Arg<'p> {
    /// Made of these pieces, in order.
    Pieces(&'p [&'p [u8]]),
    /// Already encoded as a RESP bulk string: a constant (the command, the function's name, a
    /// small count) or a part of the token ([`FenceToken`]). One copy instead of a header, the
    /// value and the line end (issue 18).
    Wire(&'p [u8]),
}

/// The constant arguments of fence calls, encoded as RESP bulk strings (a test checks each
/// against the name it encodes).
mod wire {
    pub(super) const FENCE: &[u8] = b"$15\r\nFENCEGATE.FENCE\r\n";
    pub(super) const FENCE_BATCH: &[u8] = b"$21\r\nFENCEGATE.FENCE_BATCH\r\n";
    pub(super) const FCALL: &[u8] = b"$5\r\nFCALL\r\n";
    pub(super) const EVALSHA: &[u8] = b"$7\r\nEVALSHA\r\n";
    /// [`super::FUNCTION_NAME`].
    pub(super) const FUNCTION: &[u8] = b"$18\r\nfencegate_fence_v1\r\n";
    /// [`super::BATCH_FUNCTION_NAME`].
    pub(super) const BATCH_FUNCTION: &[u8] = b"$24\r\nfencegate_fence_batch_v1\r\n";
}

/// The counts 0 to 9 encoded as RESP bulk strings: the number of keys, the protocol, a batch's
/// write and argument counts are nearly always one digit.
const DIGIT: [&[u8]; 10] = [
    b"$1\r\n0\r\n",
    b"$1\r\n1\r\n",
    b"$1\r\n2\r\n",
    b"$1\r\n3\r\n",
    b"$1\r\n4\r\n",
    b"$1\r\n5\r\n",
    b"$1\r\n6\r\n",
    b"$1\r\n7\r\n",
    b"$1\r\n8\r\n",
    b"$1\r\n9\r\n",
];

/// The value of a bulk string `wire` (`$<n>\r\n<value>\r\n`): what follows the first line
/// end, without the last.
fn wire_value(wire: &[u8]) -> &[u8] {
    let start = wire
        .windows(2)
        .position(|w| w == b"\r\n")
        .map_or(0, |at| at + 2);
    &wire[start.min(wire.len())..wire.len().saturating_sub(2).max(start)]
}

/// A fence call, described rather than built: [`FenceCall::encode`] writes it upstream with no
/// allocation (issue 18: the call's `Vec`, the fence key, resource and revision formatted into
/// strings, and a clone of each argument were most of a fenced write's allocations);
/// [`FenceCall::args`] builds it, to send it again after a reload and for the golden tests.
/// Both come from [`FenceCall::each`], so they cannot differ.
#[derive(Debug, Clone, Copy)]
pub struct FenceCall<'a> {
    mode: &'a ScriptMode,
    token: &'a FenceToken,
    writes: &'a [BatchedWrite<'a>],
    resp3: bool,
    batch: bool,
}

impl<'a> FenceCall<'a> {
    /// One write as a call of the fence script, declaring the fence key and the write's keys.
    /// `resp3` selects the reply protocol inside the script.
    pub fn single(
        mode: &'a ScriptMode,
        token: &'a FenceToken,
        write: &'a BatchedWrite<'a>,
        resp3: bool,
    ) -> Self {
        Self {
            mode,
            token,
            writes: std::slice::from_ref(write),
            resp3,
            batch: false,
        }
    }

    /// A run of writes under one `token` as one call of the batch fence script (see
    /// `fence_batch.lua` for the argument layout). Every write's keys are declared.
    pub fn batch(
        mode: &'a ScriptMode,
        token: &'a FenceToken,
        writes: &'a [BatchedWrite<'a>],
        resp3: bool,
    ) -> Self {
        Self {
            mode,
            token,
            writes,
            resp3,
            batch: true,
        }
    }

    /// How many arguments the call has (its name included).
    pub fn len(&self) -> usize {
        let keys: usize = self.writes.iter().map(|w| w.keys.len()).sum();
        let args: usize = self.writes.iter().map(|w| w.args.len()).sum();
        let counts = if self.batch { 1 + self.writes.len() } else { 0 };
        // The command, numkeys, the fence key, resource, revision, protocol; a script's name.
        let named = usize::from(!matches!(self.mode, ScriptMode::Module));
        6 + named + keys + counts + args
    }

    /// Whether the call has no arguments (never: it names its script).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Hands each argument, in order, to `argument`.
    pub fn each(&self, mut argument: impl FnMut(Arg<'_>)) {
        let (command, script): (&'static [u8], Option<Arg>) = match (self.mode, self.batch) {
            (ScriptMode::Module, false) => (wire::FENCE, None),
            (ScriptMode::Module, true) => (wire::FENCE_BATCH, None),
            (ScriptMode::Function, false) => (wire::FCALL, Some(Arg::Wire(wire::FUNCTION))),
            (ScriptMode::Function, true) => (wire::FCALL, Some(Arg::Wire(wire::BATCH_FUNCTION))),
            (ScriptMode::Script { sha, .. }, false) => {
                (wire::EVALSHA, Some(Arg::Pieces(&[sha.as_bytes()])))
            }
            (ScriptMode::Script { batch_sha, .. }, true) => {
                (wire::EVALSHA, Some(Arg::Pieces(&[batch_sha.as_bytes()])))
            }
        };
        argument(Arg::Wire(command));
        if let Some(script) = script {
            argument(script);
        }
        let mut number = itoa::Buffer::new();
        let mut count = |n: usize, argument: &mut dyn FnMut(Arg<'_>)| match DIGIT.get(n) {
            Some(wire) => argument(Arg::Wire(wire)),
            None => argument(Arg::Pieces(&[number.format(n).as_bytes()])),
        };
        let keys: usize = self.writes.iter().map(|w| w.keys.len()).sum();
        count(keys + 1, &mut argument);
        argument(Arg::Wire(self.token.fence_key()));
        for key in self.writes.iter().flat_map(|w| w.keys) {
            argument(Arg::Pieces(&[key]));
        }
        argument(Arg::Wire(self.token.resource()));
        argument(Arg::Wire(self.token.revision()));
        argument(Arg::Wire(DIGIT[if self.resp3 { 3 } else { 2 }]));
        if self.batch {
            count(self.writes.len(), &mut argument);
            for write in self.writes {
                count(write.args.len(), &mut argument);
            }
        }
        for arg in self.writes.iter().flat_map(|w| w.args) {
            argument(Arg::Pieces(&[arg]));
        }
    }

    /// Appends the call to `out` as a RESP command.
    pub fn encode(&self, out: &mut BytesMut) {
        frame::encode_command_header(self.len(), out);
        self.each(|arg| match arg {
            Arg::Pieces(pieces) => frame::encode_argument(pieces, out),
            Arg::Wire(wire) => out.extend_from_slice(wire),
        });
    }

    /// The call's arguments.
    pub fn args(&self) -> Vec<Bytes> {
        let mut args = Vec::with_capacity(self.len());
        self.each(|arg| {
            args.push(match arg {
                Arg::Pieces(pieces) => Bytes::from(pieces.concat()),
                Arg::Wire(wire) => Bytes::copy_from_slice(wire_value(wire)),
            })
        });
        args
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
    let token = FenceToken::new(token.clone());
    FenceCall::single(mode, &token, &BatchedWrite { args, keys }, resp3).args()
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
    FenceCall::batch(mode, &FenceToken::new(token.clone()), writes, resp3).args()
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

    /// What [`FenceCall::encode`] writes is the command [`FenceCall::args`] builds.
    fn encoded_is_built(call: FenceCall) {
        let mut encoded = BytesMut::new();
        call.encode(&mut encoded);
        let mut built = BytesMut::new();
        frame::encode_command(&call.args(), &mut built);
        assert_eq!(encoded, built);
        assert_eq!(call.args().len(), call.len());
    }

    #[test]
    fn encoding_writes_the_built_call() {
        let script = ScriptMode::Script {
            sha: "abc123".into(),
            batch_sha: "def456".into(),
        };
        let (set, mset) = (b("SET k v"), b("MSET a 1 b 2"));
        let (k, ab) = (b("k"), b("a b"));
        let binary = vec![
            Bytes::from_static(b"SET"),
            Bytes::from_static(b"k\r\n"),
            Bytes::from_static(&[0, 255, 10]),
        ];
        // Past every one-digit count: 70 writes of 12 arguments.
        let long = b("MSET a 1 b 2 c 3 d 4 e 5 f");
        let writes: Vec<BatchedWrite> = (0..70)
            .map(|_| BatchedWrite {
                args: &long,
                keys: &ab,
            })
            .collect();
        let one = BatchedWrite {
            args: &set,
            keys: &k,
        };
        let two = [
            one,
            BatchedWrite {
                args: &mset,
                keys: &ab,
            },
        ];
        let bin = BatchedWrite {
            args: &binary,
            keys: &binary[1..2],
        };
        let token = FenceToken::new(token());
        for mode in [ScriptMode::Module, ScriptMode::Function, script] {
            for resp3 in [false, true] {
                encoded_is_built(FenceCall::single(&mode, &token, &one, resp3));
                encoded_is_built(FenceCall::single(&mode, &token, &bin, resp3));
                encoded_is_built(FenceCall::batch(&mode, &token, &two, resp3));
                encoded_is_built(FenceCall::batch(&mode, &token, &writes, resp3));
            }
        }
    }

    /// Each constant is the encoding of the name or count it stands for; the function names
    /// are the ones loaded.
    #[test]
    fn constant_wires_encode_their_values() {
        let encoded = |value: &[u8]| {
            let mut out = BytesMut::new();
            frame::encode_argument(&[value], &mut out);
            out
        };
        for (wire, value) in [
            (wire::FENCE, "FENCEGATE.FENCE"),
            (wire::FENCE_BATCH, "FENCEGATE.FENCE_BATCH"),
            (wire::FCALL, "FCALL"),
            (wire::EVALSHA, "EVALSHA"),
            (wire::FUNCTION, FUNCTION_NAME),
            (wire::BATCH_FUNCTION, BATCH_FUNCTION_NAME),
        ] {
            assert_eq!(wire, &encoded(value.as_bytes())[..], "{value}");
            assert_eq!(wire_value(wire), value.as_bytes());
        }
        for (n, wire) in DIGIT.iter().enumerate() {
            assert_eq!(*wire, &encoded(n.to_string().as_bytes())[..], "{n}");
            assert_eq!(wire_value(wire), n.to_string().as_bytes());
        }
    }

    /// The token's encoded arguments are the fence key, the resource and the revision, for
    /// any revision width and resource length (two-digit and three-digit headers) and every
    /// character a resource may hold.
    #[test]
    fn a_fence_token_encodes_its_own_arguments() {
        let longest = "r".repeat(Resource::MAX_LEN);
        for (resource, revision) in [
            ("a", 1),
            ("billing:2026-09-28", 12),
            ("x/y.z_A-9:", 1_000_000_007),
            (longest.as_str(), u64::MAX >> 1),
        ] {
            let token = Token::new(
                Resource::new(resource).unwrap(),
                Revision::new(revision).unwrap(),
            );
            let fenced = FenceToken::new(token.clone());
            assert_eq!(fenced.token(), &token);
            let value = |wire: &[u8]| String::from_utf8(wire_value(wire).to_vec()).unwrap();
            assert_eq!(
                value(fenced.fence_key()),
                format!("fencegate:fence:{{{resource}}}")
            );
            assert_eq!(value(fenced.resource()), resource);
            assert_eq!(value(fenced.revision()), revision.to_string());
            let mut whole = BytesMut::new();
            for part in [
                format!("fencegate:fence:{{{resource}}}"),
                resource.to_owned(),
                revision.to_string(),
            ] {
                frame::encode_argument(&[part.as_bytes()], &mut whole);
            }
            assert_eq!(&fenced.wire[..], &whole[..]);
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
    fn golden_module_calls() {
        let out = rewrite(&ScriptMode::Module, &token(), &b("SET k v"), &b("k"), false);
        assert_eq!(
            words(&out),
            "FENCEGATE.FENCE 2 fencegate:fence:{billing:2026-09-28} k billing:2026-09-28 12 2 SET k v"
        );
        let (set, incr) = (b("SET k v"), b("INCR n"));
        let (ka, kc) = (b("k"), b("n"));
        let writes = [
            BatchedWrite {
                args: &set,
                keys: &ka,
            },
            BatchedWrite {
                args: &incr,
                keys: &kc,
            },
        ];
        let out = rewrite_batch(&ScriptMode::Module, &token(), &writes, true);
        assert_eq!(
            words(&out),
            "FENCEGATE.FENCE_BATCH 3 fencegate:fence:{billing:2026-09-28} k n billing:2026-09-28 12 3 2 3 2 SET k v INCR n"
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
