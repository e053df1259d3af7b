//! Which requests need the fence: a pure function of the command table, the protection config
//! and the arguments.

use bytes::Bytes;
use fencegate_core::RejectReason;

use crate::command_table::{CommandTable, KeyError};
use crate::config::{ProtectMode, RedisConfig};
use crate::rewrite::FENCE_KEY_PREFIX;

/// The most arguments a command may have to run under the fence (Lua's `unpack` limit is near
/// 8,000 values, and the script adds its own).
pub const MAX_FENCED_ARGS: usize = 7_900;

/// What to do with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// Relay unchanged: a read, a non-key command, a write to unprotected keys, or a request
    /// Redis itself will refuse (wrong arity).
    Pass,
    /// A write to at least one protected key: must run inside the fence script.
    Fence {
        /// Every key the command names, in order.
        keys: Vec<Bytes>,
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

fn refuse(detail: String) -> Class {
    Class::Refuse {
        reason: RejectReason::Unsupported,
        detail,
    }
}

/// Classifies `args` (command name first).
pub fn classify(table: &CommandTable, config: &RedisConfig, args: &[Bytes]) -> Class {
    let name = args
        .first()
        .map(|n| String::from_utf8_lossy(n).to_ascii_uppercase())
        .unwrap_or_default();
    let enforcing = config.enforces_any();
    let Some(info) = table.lookup(args) else {
        return if enforcing {
            Class::Unknown
        } else {
            Class::Pass
        };
    };
    if !info.arity_ok(args.len()) {
        return Class::Pass;
    }
    let keys = info.keys(args);
    if let Ok(keys) = &keys {
        if info.write
            && keys
                .iter()
                .any(|k| k.starts_with(FENCE_KEY_PREFIX.as_bytes()))
        {
            return refuse(format!(
                "{name} would write a fence key; fence keys are managed by fencegate"
            ));
        }
    }
    let protected = |keys: &[&Bytes]| {
        keys.iter()
            .any(|k| config.mode_for(k) == ProtectMode::Enforce)
    };
    if matches!(info.name.as_str(), "eval" | "evalsha" | "fcall") {
        return match keys {
            Ok(keys) if !protected(&keys) && (!keys.is_empty() || !enforcing) => Class::Pass,
            _ => refuse(format!(
                "{name} may write protected keys and cannot run under the fence; use {name}_RO for reads"
            )),
        };
    }
    if !info.write {
        return Class::Pass;
    }
    if enforcing && info.name.starts_with("function|") {
        // FUNCTION LOAD/DELETE/RESTORE/FLUSH could replace or remove the fence function itself.
        return refuse(format!(
            "{name} {} could change the fence function; manage Redis Functions directly on the server",
            args.get(1).map(|a| String::from_utf8_lossy(a).to_ascii_uppercase()).unwrap_or_default()
        ));
    }
    if info.keyspace_wide() {
        return if enforcing {
            refuse(format!("{name} writes keys it does not name"))
        } else {
            Class::Pass
        };
    }
    match keys {
        Err(KeyError::Unknown) if enforcing => {
            refuse(format!("{name} writes keys whose positions are unknown"))
        }
        Err(_) => Class::Pass,
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
    fn default_config_fences_every_write() {
        let c = RedisConfig::default();
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
            protect: vec![
                ProtectRule {
                    pattern: "cache:*".into(),
                    mode: ProtectMode::Off,
                },
                ProtectRule {
                    pattern: "billing:*".into(),
                    mode: ProtectMode::Enforce,
                },
            ],
            ..RedisConfig::default()
        };
        assert_eq!(class(&c, "SET cache:x v"), Class::Pass);
        assert_eq!(class(&c, "SET other v"), Class::Pass);
        assert_eq!(
            class(&c, "MSET other 1 billing:1 2"),
            fenced(&["other", "billing:1"])
        );
        assert_eq!(class(&c, "EVAL body 1 cache:x"), Class::Pass);
        assert!(matches!(
            class(&c, "EVAL body 1 billing:x"),
            Class::Refuse { .. }
        ));
    }

    #[test]
    fn nothing_enforced_passes_everything() {
        let c = RedisConfig {
            protect: vec![],
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
