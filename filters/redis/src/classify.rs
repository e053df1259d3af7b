//! Which requests need the fence: a pure function of the command table, the protection config
//! and the arguments.

use bytes::Bytes;
use fencegate_core::RejectReason;
use smallvec::SmallVec;

use crate::command_table::{CommandInfo, CommandTable, KeyError, KeyRefs};
use crate::config::{ProtectMode, RedisConfig};
use crate::rewrite::FENCE_KEY_PREFIX;

/// The most arguments a command may have to run under the fence (Lua's `unpack` limit is near
/// 8,000 values, and the script adds its own).
pub const MAX_FENCED_ARGS: usize = 7_900;

/// A fenced write's keys, owned (clones of its arguments); one or two stay inline.
pub type Keys = SmallVec<[Bytes; 2]>;

/// What to do with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// Relay unchanged: a read, a non-key command, a write to unprotected keys, or a request
    /// Redis itself will refuse (wrong arity).
    Pass,
    /// A write to at least one protected key: must run inside the fence script.
    Fence {
        /// Every key the command names, in order.
        keys: Keys,
    },
    /// Not in the upstream's command table (Redis would refuse it too; a module command loaded
    /// after the gateway connected cannot be classified). Answered with an error, not relayed.
    Unknown,
    /// Refused by the gateway (fail closed).
    Refuse {
        /// Always [`RejectReason::Unsupported`] here; token reasons are decided later.
        reason: RejectReason,
        /// Why, for the error reply and the audit record.
        detail: String,
    },
}

/// A command name, upper-cased when displayed.
struct Upper<'a>(&'a [u8]);

impl std::fmt::Display for Upper<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&String::from_utf8_lossy(self.0).to_ascii_uppercase())
    }
}

fn refuse(detail: String) -> Class {
    Class::Refuse {
        reason: RejectReason::Unsupported,
        detail,
    }
}

/// Classifies `args` (command name first).
pub fn classify(table: &CommandTable, config: &RedisConfig, args: &[Bytes]) -> Class {
    classify_command(table.lookup(args), config, args)
}

/// [`classify`], given the request's entry in the command table (`None`: not in it), which the
/// session looks up once per request for every step that needs it (issue 18).
pub fn classify_command(
    command: Option<&CommandInfo>,
    config: &RedisConfig,
    args: &[Bytes],
) -> Class {
    let enforcing = config.enforces_any();
    let Some(info) = command else {
        return if enforcing {
            Class::Unknown
        } else {
            Class::Pass
        };
    };
    if !info.arity_ok(args.len()) {
        return Class::Pass;
    }
    // Formatted only into a refusal: a request that passes or fences does not build it (an
    // allocation per request saved, issue 18).
    let name = Upper(args.first().map_or(&[][..], |n| n.as_ref()));
    let script = matches!(info.name.as_str(), "eval" | "evalsha" | "fcall");
    let keys = info.keys(args);
    if let Ok(keys) = &keys {
        if (info.writes() || script)
            && keys
                .iter()
                .any(|k| k.starts_with(FENCE_KEY_PREFIX.as_bytes()))
        {
            return refuse(format!(
                "{name} would write a fence key; fence keys are managed by fencegate"
            ));
        }
    }
    if matches!(info.name.as_str(), "fcall" | "fcall_ro")
        && args
            .get(1)
            .is_some_and(|f| f.len() >= 10 && f[..10].eq_ignore_ascii_case(b"fencegate_"))
    {
        return refuse(format!(
            "{name} of a fencegate_* function: the fence function is called only by the gateway"
        ));
    }
    if info.name.starts_with("fencegate.") {
        return refuse(format!(
            "{name}: fencegate's module commands are called only by the gateway"
        ));
    }
    if !enforcing {
        return Class::Pass;
    }
    let protected = |keys: &[&Bytes]| {
        keys.iter()
            .any(|k| config.mode_for(k) == ProtectMode::Enforce)
    };
    if script {
        return classify_script(config, &name.to_string(), &info.name, args, keys);
    }
    if let Some(class) = classify_database(&name, &info.name, args) {
        return class;
    }
    if !info.writes() {
        return Class::Pass;
    }
    if info.name.starts_with("function|") {
        // FUNCTION LOAD/DELETE/RESTORE/FLUSH could replace or remove the fence function itself.
        return refuse(format!(
            "{name} {} could change the fence function; manage Redis Functions directly on the server",
            args.get(1).map(|a| String::from_utf8_lossy(a).to_ascii_uppercase()).unwrap_or_default()
        ));
    }
    if info.keyspace_wide() {
        return refuse(format!("{name} writes keys it does not name"));
    }
    match keys {
        Err(KeyError::Unknown) => refuse(format!(
            "{name} writes keys the gateway cannot locate with certainty (an unknown key spec, or a keyword such as STORE or STREAMS given more than once or out of place)"
        )),
        // Redis refuses such a request too, but its own parser may still find keys in it
        // (`GEORADIUS k ... STOREDIST` at the very end names k): refusing costs nothing.
        Err(KeyError::BadArguments) => refuse(format!(
            "{name}: its arguments do not match the command's key positions"
        )),
        Ok(keys) if protected(&keys) => {
            if args.len() > MAX_FENCED_ARGS {
                return refuse(format!(
                    "{name} has {} arguments; at most {MAX_FENCED_ARGS} can run under the fence",
                    args.len()
                ));
            }
            if info.blocks(args) {
                return refuse(format!(
                    "{name} would block, which it cannot do under the fence; use its non-blocking form"
                ));
            }
            if info.noscript {
                return refuse(format!(
                    "{name} cannot run inside a script, so not under the fence"
                ));
            }
            Class::Fence {
                keys: keys.into_iter().cloned().collect(),
            }
        }
        Ok(_) => Class::Pass,
    }
}

/// `EVAL`, `EVALSHA`, `FCALL` while a rule enforces. A script cannot run under the fence (the
/// fence is itself a script) and may write keys it does not declare, so only a function or
/// script the operator listed runs, and only when every key it declares is unprotected. The
/// `_RO` forms are not handled here: Redis refuses writes inside them itself.
fn classify_script(
    config: &RedisConfig,
    name: &str,
    lower: &str,
    args: &[Bytes],
    keys: Result<KeyRefs<'_>, KeyError>,
) -> Class {
    let target = args.get(1).map_or(&[][..], |a| a.as_ref());
    let allowed = match lower {
        "fcall" => config.allows_function(target),
        "evalsha" => config.allows_script(target),
        _ => false,
    };
    if !allowed {
        return refuse(format!(
            "{name} is refused while protect rules enforce: a script cannot run under the fence and may write keys it does not declare; list vetted functions in allow_functions or script SHA-1s in allow_scripts, or use {name}_RO for reads"
        ));
    }
    match keys {
        Ok(keys)
            if keys
                .iter()
                .all(|k| config.mode_for(k) == ProtectMode::Off) =>
        {
            Class::Pass
        }
        Ok(_) => refuse(format!(
            "{name} declares a protected key; a script cannot run under the fence, so it may only declare unprotected keys"
        )),
        Err(_) => refuse(format!("{name}: its declared keys could not be read")),
    }
}

/// Commands that cross logical databases while a rule enforces. Fence keys live in database
/// 0 with the data they guard; a write in another database, then `MOVE`/`COPY ... DB`/`SWAPDB`
/// into 0, would bring a stale value past the fence. So the gateway serves database 0 only.
fn classify_database(name: &Upper, lower: &str, args: &[Bytes]) -> Option<Class> {
    let refused = match lower {
        "select" => args.get(1).is_some_and(|db| db.as_ref() != b"0"),
        "move" | "swapdb" => true,
        "copy" => args.iter().skip(3).any(|a| a.eq_ignore_ascii_case(b"DB")),
        _ => false,
    };
    refused.then(|| {
        refuse(format!(
            "{name}: while protect rules enforce, the gateway serves database 0 only (fences are per database); use key prefixes instead of databases"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command_table::tests::sample_table;
    use crate::config::ProtectRule;

    fn args(text: &str) -> Vec<Bytes> {
        text.split(' ')
            .map(|a| Bytes::copy_from_slice(a.as_bytes()))
            .collect()
    }

    fn class(config: &RedisConfig, text: &str) -> Class {
        classify(&sample_table(), config, &args(text))
    }

    fn fenced(keys: &[&str]) -> Class {
        Class::Fence {
            keys: keys
                .iter()
                .map(|k| Bytes::copy_from_slice(k.as_bytes()))
                .collect(),
        }
    }

    #[test]
    fn a_rule_for_every_key_fences_every_write() {
        let c = RedisConfig {
            protect: Some(vec![ProtectRule::every_key()]),
            ..RedisConfig::default()
        };
        assert_eq!(class(&c, "SET k v"), fenced(&["k"]));
        assert_eq!(class(&c, "MSET a 1 b 2"), fenced(&["a", "b"]));
        assert_eq!(class(&c, "GET k"), Class::Pass);
        assert_eq!(class(&c, "PING"), Class::Pass);
        assert_eq!(class(&c, "FUNCTION LIST"), Class::Pass);
        assert_eq!(
            class(&c, "SET k"),
            Class::Pass,
            "wrong arity: Redis refuses it"
        );
        assert_eq!(class(&c, "EVAL_RO body 1 k"), Class::Pass);
        assert_eq!(class(&c, "NOSUCH k"), Class::Unknown);
        assert_eq!(class(&c, "OBJECT NOSUCH k"), Class::Unknown);
        for refused in [
            "EVAL body 1 k",
            "EVAL body 0",
            "FLUSHALL",
            "SORT k STORE d",
            "DEL fencegate:fence:{x}",
            "BLPOP q 0",
            "FUNCTION LOAD REPLACE code",
            // A module's write whose keys only its own code knows.
            "MYMODULE.WRITE 1 k",
            // fencegate's own module commands (in the table when the module is loaded).
            "FENCEGATE.FENCE 2 fencegate:fence:{r} k r 99 2 SET k v",
        ] {
            assert!(
                matches!(class(&c, refused), Class::Refuse { .. }),
                "{refused}"
            );
        }
    }

    #[test]
    fn unprotected_keys_pass() {
        let c = RedisConfig {
            protect: Some(vec![
                ProtectRule {
                    pattern: "cache:*".into(),
                    mode: ProtectMode::Off,
                    resource: None,
                },
                ProtectRule {
                    pattern: "billing:*".into(),
                    mode: ProtectMode::Enforce,
                    resource: Some("billing".into()),
                },
            ]),
            ..RedisConfig::default()
        };
        assert_eq!(class(&c, "SET cache:x v"), Class::Pass);
        assert_eq!(class(&c, "SET other v"), Class::Pass);
        assert_eq!(
            class(&c, "MSET other 1 billing:1 2"),
            fenced(&["other", "billing:1"])
        );
        for refused in [
            // A script may write keys it does not declare: refused while a rule enforces.
            "EVAL body 1 cache:x",
            "EVAL body 1 billing:x",
            "EVALSHA 0123456789012345678901234567890123456789 1 cache:x",
            "FCALL myfn 1 cache:x",
            "FCALL fencegate_fence_v1 1 cache:x",
            // The keyword tricks.
            "GEORADIUS billing:g 0 0 1 km STORE cache:a STORE fencegate:fence:{billing}",
            "GEORADIUS cache:g 0 0 1 km STORE cache:a STORE billing:x",
            "XREADGROUP COUNT 1 GROUP STREAMS c STREAMS billing:s >",
            // Databases.
            "SELECT 1",
            "SELECT 00",
            "MOVE cache:x 1",
            "COPY cache:x billing:x DB 0 REPLACE",
            "COPY cache:x cache:y db 1",
        ] {
            assert!(
                matches!(class(&c, refused), Class::Refuse { .. }),
                "{refused}: {:?}",
                class(&c, refused)
            );
        }
        assert_eq!(class(&c, "SELECT 0"), Class::Pass);
        assert_eq!(class(&c, "COPY cache:x cache:y REPLACE"), Class::Pass);
        assert_eq!(class(&c, "PFCOUNT cache:h"), Class::Pass);
        assert_eq!(class(&c, "PFCOUNT billing:h"), fenced(&["billing:h"]));
        assert_eq!(
            class(&c, "GEORADIUS billing:g 0 0 1 km STORE cache:a"),
            fenced(&["billing:g", "cache:a"]),
            "one STORE: keys as Redis finds them; any protected key fences the call"
        );
    }

    #[test]
    fn named_scripts_on_the_allow_list_run_with_unprotected_keys_only() {
        let c = RedisConfig {
            protect: Some(vec![ProtectRule {
                pattern: "billing:*".into(),
                mode: ProtectMode::Enforce,
                resource: Some("billing".into()),
            }]),
            allow_functions: vec!["counter_bump".into()],
            allow_scripts: vec!["0123456789abcdef0123456789abcdef01234567".into()],
            ..RedisConfig::default()
        };
        assert_eq!(class(&c, "FCALL counter_bump 1 stats:x"), Class::Pass);
        assert_eq!(class(&c, "fcall COUNTER_BUMP 0"), Class::Pass);
        assert_eq!(
            class(
                &c,
                "EVALSHA 0123456789ABCDEF0123456789abcdef01234567 1 stats:x"
            ),
            Class::Pass
        );
        for refused in [
            "FCALL counter_bump 1 billing:x",
            "FCALL counter_bump 2 stats:x fencegate:fence:{billing}",
            "FCALL other 1 stats:x",
            "EVAL return 1 1 stats:x",
        ] {
            assert!(
                matches!(class(&c, refused), Class::Refuse { .. }),
                "{refused}"
            );
        }
    }

    #[test]
    fn nothing_enforced_passes_everything() {
        let c = RedisConfig {
            protect: Some(vec![]),
            ..RedisConfig::default()
        };
        for text in [
            "SET k v",
            "FLUSHALL",
            "NOSUCH",
            "EVAL body 0",
            "SORT k STORE d",
        ] {
            assert_eq!(class(&c, text), Class::Pass, "{text}");
        }
    }
}
