//! The SQLSTATEs fencegate answers with, in their own class `FG` (PostgreSQL reserves no class
//! starting with `F` beyond `F0`, and accepts any five letters or digits from `RAISE`).
//!
//! | code    | meaning                                                     | decided by |
//! |---------|-------------------------------------------------------------|------------|
//! | `FG001` | stale: the token's revision is below the resource's fence   | the store (`fencegate.guard`) |
//! | `FG002` | missing: a protected write carried no token                 | the gateway |
//! | `FG003` | malformed token                                             | the gateway |
//! | `FG004` | forged or unsigned token (signature does not verify)        | the gateway |
//! | `FG005` | token for another resource than the database's              | the gateway |
//! | `FG006` | cannot be fenced: fast-path calls, writes to `fencegate.*`  | the gateway |
//! | `FG007` | the fence schema is not installed here (or is too old)     | the gateway |
//!
//! The store raises FG001-FG005 itself too: `fencegate.guard(token)` (FG001, FG003, FG004) and
//! the triggers on protected tables (FG002 no pass, FG001, FG005 table bound to another resource).
//!
//! Protocol violations by a client are answered with PostgreSQL's own `08P01` and the connection
//! is closed; a draining gateway closes idle sessions with PostgreSQL's own `57P01`.

use fencegate_core::RejectReason;

/// Stale token (below the fence); raised in the store by `fencegate.guard`.
pub const STALE: &str = "FG001";
/// A protected write without a token.
pub const MISSING: &str = "FG002";
/// A token that does not parse.
pub const MALFORMED: &str = "FG003";
/// A token whose signature does not verify, or an unsigned token where signatures are required.
pub const FORGED: &str = "FG004";
/// A token for another resource.
pub const OUT_OF_SCOPE: &str = "FG005";
/// A write that cannot run under the fence.
pub const UNSUPPORTED: &str = "FG006";
/// The fence schema (`fencegate.guard_proc`) is missing: run `fencegate postgres install`.
pub const NOT_INSTALLED: &str = "FG007";

/// FG007's text, naming `database` ("this database", or "database <name>"): the fence schema is
/// missing there, or predates the guard the gateway calls.
pub fn not_installed_message(database: &str) -> String {
    format!(
        "fencegate: the fence schema is not installed in {database}, or is older than this \
         gateway (no fencegate.guard_proc): run `fencegate postgres install --dsn ...` against it"
    )
}
/// PostgreSQL's `protocol_violation`.
pub const PROTOCOL_VIOLATION: &str = "08P01";
/// PostgreSQL's own `admin_shutdown`: the gateway is draining and closes an idle session.
pub const ADMIN_SHUTDOWN: &str = "57P01";
/// PostgreSQL's own `too_many_connections`: the gateway holds its `max_client_connections`.
pub const TOO_MANY_CONNECTIONS: &str = "53300";

/// The SQLSTATE for a refusal reason.
pub fn for_reason(reason: &RejectReason) -> &'static str {
    match reason {
        RejectReason::Stale { .. } => STALE,
        RejectReason::Missing => MISSING,
        RejectReason::Malformed => MALFORMED,
        RejectReason::Forged => FORGED,
        RejectReason::OutOfScope => OUT_OF_SCOPE,
        RejectReason::Unsupported => UNSUPPORTED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_well_formed() {
        let all = [
            STALE,
            MISSING,
            MALFORMED,
            FORGED,
            OUT_OF_SCOPE,
            UNSUPPORTED,
            NOT_INSTALLED,
        ];
        for (i, a) in all.iter().enumerate() {
            assert_eq!(a.len(), 5);
            assert!(a
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit()));
            assert!(all[i + 1..].iter().all(|b| b != a));
        }
        assert_eq!(for_reason(&RejectReason::Stale { fence: 3 }), STALE);
    }
}
