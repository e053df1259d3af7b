//! The decide step: what the gateway does with one request outside a fenced transaction, as a
//! pure function of the command table, the config, the connection's token and the upstream's
//! health, so every refusal is golden-tested without a server. The refusal words live here.

use bytes::Bytes;
use fencegate_core::{RejectReason, Token};

use crate::classify::{classify_command, Class, Keys};
use crate::command_table::CommandInfo;
use crate::config::RedisConfig;
use crate::scope;

/// What decide looks at besides the request.
pub struct Inputs<'a> {
    /// The request's entry in the upstream's command table (`CommandTable::lookup`; `None`:
    /// not in it), looked up once by the caller.
    pub command: Option<&'a CommandInfo>,
    /// The gateway's config.
    pub config: &'a RedisConfig,
    /// The connection's token, if `FENCE` set one.
    pub token: Option<&'a Token>,
    /// Why fence keys are at risk upstream now (eviction, no persistence), if they are.
    pub fences_at_risk: Option<&'a str>,
}

/// What to do with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Relay unchanged.
    Pass,
    /// Answer like Redis answers an unknown command (not a refused write: not audited).
    Unknown,
    /// Run inside the fence script with the connection's token (`Inputs::token`, never
    /// `None` then; not copied here: issue 18), declaring these keys.
    Fence {
        /// The command's keys.
        keys: Keys,
    },
    /// Refuse (audited), answering [`refusal_text`].
    Refuse {
        /// Why, for the audit record and the word.
        reason: RejectReason,
        /// The rest of the error line.
        detail: String,
    },
}

/// Decides a request (`args`: command name first).
pub fn decide(inputs: &Inputs, args: &[Bytes]) -> Decision {
    let name = || {
        args.first()
            .map(|n| String::from_utf8_lossy(n).to_ascii_uppercase())
            .unwrap_or_default()
    };
    match classify_command(inputs.command, inputs.config, args) {
        Class::Pass => Decision::Pass,
        Class::Unknown => Decision::Unknown,
        Class::Refuse { reason, detail } => Decision::Refuse { reason, detail },
        Class::Fence { .. } if inputs.fences_at_risk.is_some() => Decision::Refuse {
            reason: RejectReason::Unsupported,
            detail: at_risk(inputs.fences_at_risk.unwrap_or_default()),
        },
        Class::Fence { keys } => match inputs.token {
            None => Decision::Refuse {
                reason: RejectReason::Missing,
                detail: format!(
                    "{} writes a protected key; send FENCE <token> on this connection first",
                    name()
                ),
            },
            Some(token) => match scope::check(inputs.config, token, &keys) {
                Err(detail) => Decision::Refuse {
                    reason: RejectReason::OutOfScope,
                    detail,
                },
                Ok(()) => Decision::Fence { keys },
            },
        },
    }
}

/// The detail of a refusal while fence keys are at risk.
pub fn at_risk(why: &str) -> String {
    format!("protected writes are refused while fence keys are at risk upstream: {why}")
}

/// The error word clients match on, per reason.
pub fn refusal_word(reason: &RejectReason) -> &'static str {
    match reason {
        RejectReason::Missing => "NOFENCE",
        RejectReason::Malformed | RejectReason::Forged | RejectReason::OutOfScope => "BADFENCE",
        RejectReason::Stale { .. } => "FENCED",
        RejectReason::Unsupported => "UNFENCEABLE",
    }
}

/// The whole error line of a refusal.
pub fn refusal_text(reason: &RejectReason, detail: &str) -> String {
    format!("{} {detail}", refusal_word(reason))
}

#[cfg(test)]
mod tests {
    use fencegate_core::{Resource, Revision};

    use super::*;
    use crate::command_table::tests::sample_table;
    use crate::config::{ProtectMode, ProtectRule};

    fn run(token: Option<&str>, at_risk: Option<&str>, text: &str) -> String {
        let table = sample_table();
        let config = RedisConfig {
            protect: Some(vec![
                ProtectRule {
                    pattern: "cache:*".into(),
                    mode: ProtectMode::Off,
                    resource: None,
                },
                ProtectRule {
                    pattern: "billing:*:*".into(),
                    mode: ProtectMode::Enforce,
                    resource: Some("billing:{1}".into()),
                },
            ]),
            ..RedisConfig::default()
        };
        let token = token.map(|r| Token::new(Resource::new(r).unwrap(), Revision::new(7).unwrap()));
        let args: Vec<Bytes> = text
            .split(' ')
            .map(|a| Bytes::copy_from_slice(a.as_bytes()))
            .collect();
        let inputs = Inputs {
            command: table.lookup(&args),
            config: &config,
            token: token.as_ref(),
            fences_at_risk: at_risk,
        };
        match decide(&inputs, &args) {
            Decision::Pass => "pass".into(),
            Decision::Unknown => "unknown".into(),
            Decision::Fence { keys } => format!(
                "fence {} with {}",
                keys.iter()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .collect::<Vec<_>>()
                    .join(","),
                token.as_ref().expect("fenced under a token").resource()
            ),
            Decision::Refuse { reason, detail } => refusal_text(&reason, &detail),
        }
    }

    #[test]
    fn golden() {
        let d = "billing:2026-09-28";
        let cases: &[(Option<&str>, Option<&str>, &str, &str)] = &[
            (None, None, "SET cache:x 1", "pass"),
            (None, None, "GET billing:2026-09-28:1", "pass"),
            (None, None, "NOSUCH x", "unknown"),
            (None, None, "SET billing:2026-09-28:1 v", "NOFENCE SET writes a protected key; send FENCE <token> on this connection first"),
            (Some(d), None, "SET billing:2026-09-28:1 v", "fence billing:2026-09-28:1 with billing:2026-09-28"),
            (Some(d), None, "MSET billing:2026-09-28:1 a cache:x b", "fence billing:2026-09-28:1,cache:x with billing:2026-09-28"),
            (Some(d), None, "SET billing:2026-09-29:1 v", "BADFENCE out of scope: key billing:2026-09-29:1 belongs to resource billing:2026-09-29, the token is for billing:2026-09-28"),
            (Some(d), Some("maxmemory-policy is allkeys-lru"), "SET billing:2026-09-28:1 v", "UNFENCEABLE protected writes are refused while fence keys are at risk upstream: maxmemory-policy is allkeys-lru"),
            (Some(d), Some("maxmemory-policy is allkeys-lru"), "SET cache:x v", "pass"),
            (Some(d), None, "BLPOP billing:2026-09-28:q 0", "UNFENCEABLE BLPOP would block, which it cannot do under the fence; use its non-blocking form"),
            (Some(d), None, "DEL fencegate:fence:{billing:2026-09-28}", "UNFENCEABLE DEL would write a fence key; fence keys are managed by fencegate"),
            (Some(d), None, "SELECT 1", "UNFENCEABLE SELECT: while protect rules enforce, the gateway serves database 0 only (fences are per database); use key prefixes instead of databases"),
            (None, None, "GEORADIUS cache:g 0 0 1 km STORE cache:a STORE billing:2026-09-28:1", "UNFENCEABLE GEORADIUS writes keys the gateway cannot locate with certainty (an unknown key spec, or a keyword such as STORE or STREAMS given more than once or out of place)"),
            (None, None, "PFCOUNT billing:2026-09-28:h", "NOFENCE PFCOUNT writes a protected key; send FENCE <token> on this connection first"),
        ];
        for (token, risk, text, expected) in cases {
            assert_eq!(run(*token, *risk, text), *expected, "{text}");
        }
    }
}
