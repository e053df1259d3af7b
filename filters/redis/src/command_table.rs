//! What each command does, learned from the upstream's `COMMAND` reply at connect time: whether
//! it writes, and where its keys are (key specs, Redis 7), so the gateway never relies on a
//! hand-kept list that goes stale when Redis or a module adds commands.

use std::collections::HashMap;

use bytes::Bytes;
use smallvec::SmallVec;

use crate::error::RedisError;
use crate::frame::Frame;
use crate::sharing;

/// Commands flagged `readonly` that modify stored data anyway.
pub const READ_ONLY_BUT_WRITES: &[&str] = &["pfcount"];

/// Every command the upstream knows, by lower-case name; subcommands as `container|sub`.
#[derive(Debug, Clone, Default)]
pub struct CommandTable {
    commands: Commands,
}

/// Looked up once per request: a fast hasher (a random seed per table; see Cargo.toml). Keyed by
/// the name's bytes, so a request's name is looked up as it came, lower-cased, without a UTF-8
/// check (about 54 instructions per request, issue 18).
type Commands = HashMap<Box<[u8]>, CommandInfo, foldhash::fast::RandomState>;

/// One command's arity, flags and key positions.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandInfo {
    /// Lower-case name (`set`, `object|encoding`).
    pub name: String,
    /// Redis arity: `n` exactly n arguments (name included), `-n` at least n.
    pub arity: i64,
    /// Flagged `write`.
    pub write: bool,
    /// Flagged `noscript`: cannot run inside a script, so cannot run under the fence.
    pub noscript: bool,
    /// Flagged `blocking`: may block, which it cannot do inside a script.
    pub blocking: bool,
    /// In the `@keyspace` ACL category.
    pub keyspace: bool,
    /// Has subcommands (look up `name|sub` instead).
    pub container: bool,
    /// May run on an upstream connection other sessions share ([`crate::sharing`]).
    pub shareable: bool,
    /// A module's command flagged `movablekeys`: Redis asks the module's own code where the keys
    /// are (`getkeys-api`), so its key specs (often none) do not say; the keys are unknown.
    pub keys_by_procedure: bool,
    /// Where the keys are.
    pub key_specs: Vec<KeySpec>,
}

/// A key spec: where to start looking and how to find the keys from there.
#[derive(Debug, Clone, PartialEq)]
pub struct KeySpec {
    /// How to find the first key.
    pub begin: BeginSearch,
    /// How to find the rest.
    pub find: FindKeys,
    /// Redis marks the spec as not finding every key (`incomplete`).
    pub incomplete: bool,
}

/// Key spec `begin_search`.
#[derive(Debug, Clone, PartialEq)]
pub enum BeginSearch {
    /// The first key is at this argument index (the command name is index 0).
    Index(usize),
    /// The first key follows this keyword, searched from `startfrom` (negative: from the end,
    /// backwards).
    Keyword {
        /// The keyword, upper case.
        keyword: String,
        /// Where to start searching.
        startfrom: i64,
    },
    /// Redis cannot say.
    Unknown,
}

/// Key spec `find_keys`.
#[derive(Debug, Clone, PartialEq)]
pub enum FindKeys {
    /// Keys from the first to `lastkey` (negative: from the end), every `keystep`.
    Range {
        /// Last key, relative to the first (or from the end when negative).
        lastkey: i64,
        /// Step between keys.
        keystep: i64,
        /// With a negative `lastkey`: only `1/limit` of the remaining arguments are keys.
        limit: i64,
    },
    /// The number of keys is an argument.
    Keynum {
        /// Index of the count, relative to the first.
        keynumidx: i64,
        /// Index of the first key, relative to the first.
        firstkey: i64,
        /// Step between keys.
        keystep: i64,
    },
    /// Redis cannot say.
    Unknown,
}

/// A request's keys, borrowed from its arguments: most commands name one to four, which stay
/// inline (a vector per request was one of a fenced write's allocations, issue 18).
pub type KeyRefs<'a> = SmallVec<[&'a Bytes; 4]>;

/// Why a command's keys could not be found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// A key spec is `unknown` or `incomplete`.
    Unknown,
    /// The arguments do not fit the key spec (Redis would refuse the command too).
    BadArguments,
}

impl CommandTable {
    /// Builds the table from a RESP2 reply to `COMMAND`.
    pub fn from_reply(reply: &Frame) -> Result<Self, RedisError> {
        let Frame::Array(entries) = reply else {
            return Err(RedisError::Upstream(
                "COMMAND did not reply with an array".into(),
            ));
        };
        let mut commands = Commands::default();
        for entry in entries {
            add_entry(&mut commands, entry)?;
        }
        if commands.is_empty() {
            return Err(RedisError::Upstream("COMMAND returned no commands".into()));
        }
        Ok(Self { commands })
    }

    /// How many commands and subcommands are known.
    pub fn len(&self) -> usize {
        self.commands.len()
    }

    /// Every command and subcommand (subcommands named `container|sub`).
    pub fn commands(&self) -> impl Iterator<Item = &CommandInfo> {
        self.commands.values()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.commands.is_empty()
    }

    /// The entry for a request's arguments, resolving subcommands (`OBJECT ENCODING`).
    pub fn lookup(&self, args: &[Bytes]) -> Option<&CommandInfo> {
        let first = args.first()?;
        // A short ASCII name is lower-cased on the stack: no allocation per request (issue 18).
        // Anything else takes the general path below; no command name is longer or non-ASCII.
        let mut short = [0u8; 32];
        let simple = first.len() <= short.len() && first.is_ascii();
        if simple {
            let lower = &mut short[..first.len()];
            lower.copy_from_slice(first);
            lower.make_ascii_lowercase();
            let info = self.commands.get(&*lower)?;
            if !info.container {
                return Some(info);
            }
        }
        let name = String::from_utf8_lossy(first).to_ascii_lowercase();
        let info = self.commands.get(name.as_bytes())?;
        if !info.container {
            return Some(info);
        }
        match args.get(1) {
            // A container without its subcommand: Redis answers with an arity error.
            None => Some(info),
            Some(sub) => {
                let full = format!(
                    "{name}|{}",
                    String::from_utf8_lossy(sub).to_ascii_lowercase()
                );
                self.commands.get(full.as_bytes())
            }
        }
    }
}

fn add_entry(commands: &mut Commands, entry: &Frame) -> Result<(), RedisError> {
    let bad = |what: &str| RedisError::Upstream(format!("COMMAND entry is malformed: {what}"));
    let Frame::Array(fields) = entry else {
        return Err(bad("not an array"));
    };
    let name = text(fields.first().ok_or_else(|| bad("no name"))?)
        .ok_or_else(|| bad("name"))?
        .to_ascii_lowercase();
    let arity = match fields.get(1) {
        Some(Frame::Integer(n)) => *n,
        _ => return Err(bad("arity")),
    };
    let flags = list_of_text(fields.get(2));
    let categories = list_of_text(fields.get(6));
    let key_specs = match fields.get(8) {
        Some(Frame::Array(specs)) => specs.iter().map(parse_spec).collect(),
        _ => legacy_spec(fields),
    };
    let subcommands = match fields.get(9) {
        Some(Frame::Array(subs)) => subs.as_slice(),
        _ => &[],
    };
    let info = CommandInfo {
        name: name.clone(),
        arity,
        write: flags.iter().any(|f| f == "write"),
        noscript: flags.iter().any(|f| f == "noscript"),
        blocking: flags.iter().any(|f| f == "blocking"),
        keyspace: categories.iter().any(|c| c == "@keyspace"),
        container: !subcommands.is_empty(),
        shareable: sharing::shareable(&name, &flags, &categories, !subcommands.is_empty()),
        keys_by_procedure: flags.iter().any(|f| f == "module")
            && flags.iter().any(|f| f == "movablekeys"),
        key_specs,
    };
    commands.insert(name.into_bytes().into_boxed_slice(), info);
    for sub in subcommands {
        add_entry(commands, sub)?;
    }
    Ok(())
}

/// Redis 6 has no key specs: first/last/step become one range spec.
fn legacy_spec(fields: &[Frame]) -> Vec<KeySpec> {
    let int = |i: usize| match fields.get(i) {
        Some(Frame::Integer(n)) => *n,
        _ => 0,
    };
    let (first, last, step) = (int(3), int(4), int(5));
    if first <= 0 {
        return Vec::new();
    }
    let lastkey = if last < 0 { last } else { last - first };
    vec![KeySpec {
        begin: BeginSearch::Index(first as usize),
        find: FindKeys::Range {
            lastkey,
            keystep: step.max(1),
            limit: 0,
        },
        incomplete: false,
    }]
}

fn text(frame: &Frame) -> Option<String> {
    match frame {
        Frame::Bulk(b) | Frame::Simple(b) => Some(String::from_utf8_lossy(b).into_owned()),
        _ => None,
    }
}

fn list_of_text(frame: Option<&Frame>) -> Vec<String> {
    match frame {
        Some(Frame::Array(items)) | Some(Frame::Set(items)) => {
            items.iter().filter_map(text).collect()
        }
        _ => Vec::new(),
    }
}

/// Looks `key` up in a RESP2 flattened map (`[k1, v1, k2, v2, ...]`) or a RESP3 map.
fn field<'a>(frame: &'a Frame, key: &str) -> Option<&'a Frame> {
    match frame {
        Frame::Array(items) => items
            .chunks(2)
            .find(|kv| kv.len() == 2 && text(&kv[0]).as_deref() == Some(key))
            .map(|kv| &kv[1]),
        Frame::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| text(k).as_deref() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

fn int_field(frame: &Frame, key: &str) -> Option<i64> {
    match field(frame, key)? {
        Frame::Integer(n) => Some(*n),
        _ => None,
    }
}

fn parse_spec(spec: &Frame) -> KeySpec {
    let incomplete = field(spec, "flags")
        .map(|f| list_of_text(Some(f)).iter().any(|f| f == "incomplete"))
        .unwrap_or(false);
    let begin = field(spec, "begin_search")
        .and_then(|b| {
            let inner = field(b, "spec")?;
            match text(field(b, "type")?)?.as_str() {
                "index" => Some(BeginSearch::Index(
                    usize::try_from(int_field(inner, "index")?).ok()?,
                )),
                "keyword" => Some(BeginSearch::Keyword {
                    keyword: text(field(inner, "keyword")?)?.to_ascii_uppercase(),
                    startfrom: int_field(inner, "startfrom")?,
                }),
                _ => None,
            }
        })
        .unwrap_or(BeginSearch::Unknown);
    let find = field(spec, "find_keys")
        .and_then(|f| {
            let inner = field(f, "spec")?;
            match text(field(f, "type")?)?.as_str() {
                "range" => Some(FindKeys::Range {
                    lastkey: int_field(inner, "lastkey")?,
                    keystep: int_field(inner, "keystep")?,
                    limit: int_field(inner, "limit")?,
                }),
                "keynum" => Some(FindKeys::Keynum {
                    keynumidx: int_field(inner, "keynumidx")?,
                    firstkey: int_field(inner, "firstkey")?,
                    keystep: int_field(inner, "keystep")?,
                }),
                _ => None,
            }
        })
        .unwrap_or(FindKeys::Unknown);
    KeySpec {
        begin,
        find,
        incomplete,
    }
}

impl CommandInfo {
    /// Whether `argc` arguments (name included) satisfy the arity.
    pub fn arity_ok(&self, argc: usize) -> bool {
        let argc = argc as i64;
        if self.arity >= 0 {
            argc == self.arity
        } else {
            argc >= -self.arity
        }
    }

    /// Whether this request would block: a `blocking` command, except `XREAD`/`XREADGROUP`,
    /// which block only with a `BLOCK` argument.
    pub fn blocks(&self, args: &[Bytes]) -> bool {
        match self.name.as_str() {
            "xread" | "xreadgroup" => args.iter().any(|a| a.eq_ignore_ascii_case(b"BLOCK")),
            _ => self.blocking,
        }
    }

    /// Whether the command may modify data: flagged `write`, or one of the few commands Redis
    /// flags read-only that still change stored bytes (`PFCOUNT` caches the cardinality in
    /// the HyperLogLog it counts).
    pub fn writes(&self) -> bool {
        self.write || READ_ONLY_BUT_WRITES.contains(&self.name.as_str())
    }

    /// Whether the command names no keys and is in `@keyspace` (`FLUSHALL`, `SWAPDB`): it
    /// writes keys it does not name.
    pub fn keyspace_wide(&self) -> bool {
        self.key_specs.is_empty() && self.keyspace && self.write
    }

    /// The keys `args` name, following Redis's key-spec rules.
    pub fn keys<'a>(&self, args: &'a [Bytes]) -> Result<KeyRefs<'a>, KeyError> {
        if self.keys_by_procedure || self.keyword_is_ambiguous(args) {
            return Err(KeyError::Unknown);
        }
        let mut keys = KeyRefs::new();
        for spec in &self.key_specs {
            if spec.incomplete {
                return Err(KeyError::Unknown);
            }
            spec.collect(args, &mut keys)?;
        }
        Ok(keys)
    }
}

impl CommandInfo {
    /// Whether a keyword key spec could be resolved differently by Redis than by a keyword
    /// search: Redis's own argument parsers (`GEORADIUS ... STORE a STORE b` stores into the
    /// last; `XREADGROUP GROUP STREAMS c STREAMS k` skips the group's arguments) do not search,
    /// so the search is trusted only when the command names exactly one of its keywords, once,
    /// at or after where the spec starts looking.
    fn keyword_is_ambiguous(&self, args: &[Bytes]) -> bool {
        let mut hits = 0usize;
        let mut seen = Vec::new();
        for spec in &self.key_specs {
            let BeginSearch::Keyword { keyword, startfrom } = &spec.begin else {
                continue;
            };
            if seen.contains(&keyword) {
                continue;
            }
            seen.push(keyword);
            for (i, arg) in args.iter().enumerate().skip(1) {
                if arg.eq_ignore_ascii_case(keyword.as_bytes()) {
                    hits += 1;
                    if *startfrom >= 0 && (i as i64) < *startfrom {
                        return true;
                    }
                }
            }
        }
        hits > 1
    }
}

impl KeySpec {
    fn collect<'a>(&self, args: &'a [Bytes], out: &mut KeyRefs<'a>) -> Result<(), KeyError> {
        let argc = args.len() as i64;
        let first = match &self.begin {
            BeginSearch::Unknown => return Err(KeyError::Unknown),
            BeginSearch::Index(i) => {
                let i = *i as i64;
                if i >= argc {
                    // Optional keys that were not given.
                    return Ok(());
                }
                i
            }
            BeginSearch::Keyword { keyword, startfrom } => {
                let hit = |i: i64| args[i as usize].eq_ignore_ascii_case(keyword.as_bytes());
                let found = if *startfrom >= 0 {
                    (*startfrom..argc).find(|&i| hit(i))
                } else {
                    let start = argc + startfrom;
                    (1..=start.max(0)).rev().find(|&i| i < argc && hit(i))
                };
                match found {
                    Some(i) => i + 1,
                    None => return Ok(()),
                }
            }
        };
        let (last, step) = match &self.find {
            FindKeys::Unknown => return Err(KeyError::Unknown),
            FindKeys::Range {
                lastkey,
                keystep,
                limit,
            } => {
                let last = if *lastkey >= 0 {
                    first + lastkey
                } else if *limit <= 1 {
                    argc + lastkey
                } else {
                    first + ((argc - first) / limit + lastkey)
                };
                (last, *keystep)
            }
            FindKeys::Keynum {
                keynumidx,
                firstkey,
                keystep,
            } => {
                let idx = first + keynumidx;
                let count = args
                    .get(usize::try_from(idx).map_err(|_| KeyError::BadArguments)?)
                    .and_then(|a| std::str::from_utf8(a).ok()?.parse::<i64>().ok())
                    .filter(|n| *n >= 0)
                    .ok_or(KeyError::BadArguments)?;
                let start = first + firstkey;
                if count == 0 {
                    return Ok(());
                }
                return push_range(args, start, start + (count - 1) * keystep, *keystep, out);
            }
        };
        push_range(args, first, last, step, out)
    }
}

fn push_range<'a>(
    args: &'a [Bytes],
    first: i64,
    last: i64,
    step: i64,
    out: &mut KeyRefs<'a>,
) -> Result<(), KeyError> {
    let argc = args.len() as i64;
    if step <= 0 || last >= argc || first < 1 {
        return Err(KeyError::BadArguments);
    }
    let mut i = first;
    while i <= last {
        out.push(&args[i as usize]);
        i += step;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A table with a handful of real Redis 7.0 entries (from `COMMAND INFO`), enough for unit
    /// tests without a server.
    pub(crate) fn sample_table() -> CommandTable {
        let s = |t: &str| Frame::Simple(Bytes::copy_from_slice(t.as_bytes()));
        let b = |t: &str| Frame::Bulk(Bytes::copy_from_slice(t.as_bytes()));
        let arr = Frame::Array;
        let range = |index: i64, lastkey: i64, step: i64, limit: i64| {
            arr(vec![
                b("flags"),
                arr(vec![s("RW")]),
                b("begin_search"),
                arr(vec![
                    b("type"),
                    b("index"),
                    b("spec"),
                    arr(vec![b("index"), Frame::Integer(index)]),
                ]),
                b("find_keys"),
                arr(vec![
                    b("type"),
                    b("range"),
                    b("spec"),
                    arr(vec![
                        b("lastkey"),
                        Frame::Integer(lastkey),
                        b("keystep"),
                        Frame::Integer(step),
                        b("limit"),
                        Frame::Integer(limit),
                    ]),
                ]),
            ])
        };
        let keynum = |index: i64| {
            arr(vec![
                b("flags"),
                arr(vec![s("RW")]),
                b("begin_search"),
                arr(vec![
                    b("type"),
                    b("index"),
                    b("spec"),
                    arr(vec![b("index"), Frame::Integer(index)]),
                ]),
                b("find_keys"),
                arr(vec![
                    b("type"),
                    b("keynum"),
                    b("spec"),
                    arr(vec![
                        b("keynumidx"),
                        Frame::Integer(0),
                        b("firstkey"),
                        Frame::Integer(1),
                        b("keystep"),
                        Frame::Integer(1),
                    ]),
                ]),
            ])
        };
        let keyword = |word: &str, startfrom: i64, lastkey: i64, limit: i64| {
            arr(vec![
                b("flags"),
                arr(vec![s("OW")]),
                b("begin_search"),
                arr(vec![
                    b("type"),
                    b("keyword"),
                    b("spec"),
                    arr(vec![
                        b("keyword"),
                        b(word),
                        b("startfrom"),
                        Frame::Integer(startfrom),
                    ]),
                ]),
                b("find_keys"),
                arr(vec![
                    b("type"),
                    b("range"),
                    b("spec"),
                    arr(vec![
                        b("lastkey"),
                        Frame::Integer(lastkey),
                        b("keystep"),
                        Frame::Integer(1),
                        b("limit"),
                        Frame::Integer(limit),
                    ]),
                ]),
            ])
        };
        let unknown = arr(vec![
            b("flags"),
            arr(vec![s("OW")]),
            b("begin_search"),
            arr(vec![b("type"), b("unknown"), b("spec"), arr(vec![])]),
            b("find_keys"),
            arr(vec![b("type"), b("unknown"), b("spec"), arr(vec![])]),
        ]);
        let entry = |name: &str,
                     arity: i64,
                     flags: &[&str],
                     cats: &[&str],
                     specs: Vec<Frame>,
                     subs: Vec<Frame>| {
            arr(vec![
                b(name),
                Frame::Integer(arity),
                arr(flags.iter().map(|f| s(f)).collect()),
                Frame::Integer(0),
                Frame::Integer(0),
                Frame::Integer(0),
                arr(cats.iter().map(|c| s(c)).collect()),
                arr(vec![]),
                arr(specs),
                arr(subs),
            ])
        };
        let reply = arr(vec![
            entry(
                "set",
                -3,
                &["write", "denyoom"],
                &["@write", "@string"],
                vec![range(1, 0, 1, 0)],
                vec![],
            ),
            entry(
                "get",
                2,
                &["readonly", "fast"],
                &["@read", "@string"],
                vec![range(1, 0, 1, 0)],
                vec![],
            ),
            entry(
                "mset",
                -3,
                &["write"],
                &["@write"],
                vec![range(1, -1, 2, 0)],
                vec![],
            ),
            entry(
                "del",
                -2,
                &["write"],
                &["@keyspace", "@write"],
                vec![range(1, -1, 1, 0)],
                vec![],
            ),
            entry(
                "hset",
                -4,
                &["write"],
                &["@write", "@hash"],
                vec![range(1, 0, 1, 0)],
                vec![],
            ),
            entry(
                "incr",
                2,
                &["write"],
                &["@write", "@string"],
                vec![range(1, 0, 1, 0)],
                vec![],
            ),
            entry(
                "blpop",
                -3,
                &["write", "blocking"],
                &["@write", "@list", "@blocking"],
                vec![range(1, -2, 1, 0)],
                vec![],
            ),
            entry("ping", -1, &["fast"], &["@connection"], vec![], vec![]),
            entry(
                "function",
                -2,
                &[],
                &["@slow"],
                vec![],
                vec![
                    entry(
                        "function|load",
                        -3,
                        &["write", "denyoom", "noscript"],
                        &["@write", "@scripting"],
                        vec![],
                        vec![],
                    ),
                    entry(
                        "function|list",
                        -2,
                        &["noscript"],
                        &["@scripting"],
                        vec![],
                        vec![],
                    ),
                ],
            ),
            entry(
                "flushall",
                -1,
                &["write"],
                &["@keyspace", "@write"],
                vec![],
                vec![],
            ),
            entry(
                "zunionstore",
                -4,
                &["write", "movablekeys"],
                &["@write"],
                vec![range(1, 0, 1, 0), keynum(2)],
                vec![],
            ),
            entry(
                "eval",
                -3,
                &["noscript", "movablekeys"],
                &["@scripting"],
                vec![keynum(2)],
                vec![],
            ),
            entry(
                "eval_ro",
                -3,
                &["noscript", "readonly", "movablekeys"],
                &["@scripting"],
                vec![keynum(2)],
                vec![],
            ),
            entry(
                "sort",
                -2,
                &["write", "movablekeys"],
                &["@write"],
                vec![range(1, 0, 1, 0), unknown.clone()],
                vec![],
            ),
            entry(
                "georadius",
                -6,
                &["write", "movablekeys"],
                &["@write", "@geo"],
                vec![
                    range(1, 0, 1, 0),
                    keyword("STORE", 6, 0, 0),
                    keyword("STOREDIST", 6, 0, 0),
                ],
                vec![],
            ),
            entry(
                "xreadgroup",
                -7,
                &["write", "blocking", "movablekeys"],
                &["@write", "@stream"],
                vec![keyword("STREAMS", 4, -1, 2)],
                vec![],
            ),
            entry(
                "pfcount",
                -2,
                &["readonly"],
                &["@read", "@hyperloglog"],
                vec![range(1, -1, 1, 0)],
                vec![],
            ),
            entry(
                "select",
                2,
                &["loading", "stale", "fast"],
                &["@connection"],
                vec![],
                vec![],
            ),
            entry(
                "move",
                3,
                &["write", "fast"],
                &["@keyspace", "@write"],
                vec![range(1, 0, 1, 0)],
                vec![],
            ),
            entry(
                "copy",
                -3,
                &["write", "denyoom"],
                &["@keyspace", "@write"],
                vec![range(1, 0, 1, 0), range(2, 0, 1, 0)],
                vec![],
            ),
            entry(
                "fcall",
                -3,
                &["noscript", "movablekeys"],
                &["@scripting"],
                vec![keynum(2)],
                vec![],
            ),
            entry(
                "evalsha",
                -3,
                &["noscript", "movablekeys"],
                &["@scripting"],
                vec![keynum(2)],
                vec![],
            ),
            // A module command whose keys its own code finds (`getkeys-api`): no key specs.
            entry(
                "mymodule.write",
                -2,
                &["write", "module", "movablekeys"],
                &["@write"],
                vec![],
                vec![],
            ),
            entry(
                "fencegate.fence",
                -7,
                &["write", "denyoom", "module", "movablekeys"],
                &["@write"],
                vec![],
                vec![],
            ),
            entry(
                "subscribe",
                -2,
                &["pubsub", "noscript"],
                &["@pubsub"],
                vec![],
                vec![],
            ),
            entry(
                "object",
                -2,
                &[],
                &["@slow"],
                vec![],
                vec![entry(
                    "object|encoding",
                    3,
                    &["readonly"],
                    &["@keyspace", "@read"],
                    vec![range(2, 0, 1, 0)],
                    vec![],
                )],
            ),
        ]);
        CommandTable::from_reply(&reply).unwrap()
    }

    fn args(text: &str) -> Vec<Bytes> {
        text.split(' ')
            .map(|a| Bytes::copy_from_slice(a.as_bytes()))
            .collect()
    }

    fn keys(table: &CommandTable, text: &str) -> Result<Vec<String>, KeyError> {
        let a = args(text);
        let info = table.lookup(&a).unwrap();
        info.keys(&a).map(|k| {
            k.iter()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .collect()
        })
    }

    #[test]
    fn finds_keys_by_spec() {
        let t = sample_table();
        assert_eq!(keys(&t, "SET k v EX 10").unwrap(), ["k"]);
        assert_eq!(keys(&t, "MSET a 1 b 2 c 3").unwrap(), ["a", "b", "c"]);
        assert_eq!(keys(&t, "DEL a b").unwrap(), ["a", "b"]);
        assert_eq!(
            keys(&t, "ZUNIONSTORE dst 2 s1 s2 WEIGHTS 1 2").unwrap(),
            ["dst", "s1", "s2"]
        );
        assert_eq!(keys(&t, "EVAL body 2 k1 k2 a1").unwrap(), ["k1", "k2"]);
        assert_eq!(keys(&t, "EVAL body 0").unwrap(), Vec::<String>::new());
        assert_eq!(keys(&t, "OBJECT ENCODING k").unwrap(), ["k"]);
        assert_eq!(keys(&t, "SORT k STORE dst"), Err(KeyError::Unknown));
        // Its specs (none) would say "no keys"; only the module's code knows.
        assert_eq!(keys(&t, "MYMODULE.WRITE 1 k"), Err(KeyError::Unknown));
        assert_eq!(keys(&t, "EVAL body x"), Err(KeyError::BadArguments));
        assert_eq!(
            keys(&t, "GEORADIUS g 0 0 1 km STORE a").unwrap(),
            ["g", "a"]
        );
        assert_eq!(
            keys(&t, "XREADGROUP GROUP g c COUNT 1 STREAMS s1 s2 > >").unwrap(),
            ["s1", "s2"]
        );
    }

    #[test]
    fn keywords_redis_may_resolve_differently_are_unknown() {
        let t = sample_table();
        for text in [
            // Redis stores into the last STORE/STOREDIST; a search finds the first.
            "GEORADIUS g 0 0 1 km STORE a STORE b",
            "GEORADIUS g 0 0 1 km STORE a STOREDIST b",
            "GEORADIUS g 0 0 1 km STOREDIST a STORE b",
            // GROUP takes two arguments, so the first STREAMS here is a group name.
            "XREADGROUP COUNT 1 GROUP STREAMS c STREAMS k >",
            "XREADGROUP GROUP g c STREAMS streams >",
            // The keyword before where the spec starts looking (Redis's parser sees it).
            "GEORADIUS g 0 0 1 STORE x",
        ] {
            assert_eq!(keys(&t, text), Err(KeyError::Unknown), "{text}");
        }
    }

    #[test]
    fn flags_and_arity() {
        let t = sample_table();
        let set = t.lookup(&args("set k v")).unwrap();
        assert!(set.write && set.arity_ok(3) && !set.arity_ok(2));
        assert!(!t.lookup(&args("GET k")).unwrap().write);
        assert!(t.lookup(&args("FLUSHALL")).unwrap().keyspace_wide());
        assert!(!t.lookup(&args("DEL k")).unwrap().keyspace_wide());
        assert!(t.lookup(&args("NOSUCHCMD")).is_none());
        assert!(t.lookup(&args("OBJECT NOSUCH k")).is_none());
    }
}
