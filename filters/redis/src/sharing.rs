//! Which requests may run on an upstream connection that several sessions share.
//!
//! A shared connection is correct only while it stays in the state every session expects: the
//! same user, database and protocol (RESP2), no transaction, no subscription, no tracking, no
//! client flags, and exactly one reply per request, in order (replies are routed back to the
//! sessions by position). A request that could change any of that, or block the connection,
//! must run on a connection of the session's own.
//!
//! The rule is an allowlist read from the server's own `COMMAND` reply, not a list of names the
//! gateway keeps: a command shares only when none of its ACL categories or flags says it
//! touches the connection, blocks, or runs code. Redis files every command that changes a
//! connection's state under `@connection`, `@transaction` or `@pubsub` (`SELECT`, `AUTH`,
//! `HELLO`, `CLIENT ...`, `MULTI`, `WATCH`, `SUBSCRIBE`, `RESET`, `READONLY`, `ASKING`, `QUIT`),
//! and the rest of what must not share under `@blocking`, `@admin` (`MONITOR`, `CLIENT PAUSE`,
//! `DEBUG`) or `@scripting`. A misjudgment this way costs a dedicated connection, never
//! correctness, so the rule leans that way: a server that lists no categories (before Redis 6)
//! shares nothing, and a command with subcommands shares only by its subcommand's entry.
//! The test `every_shareable_command_leaves_the_connection_as_it_was` holds the rule to a real
//! server: each command it lets share runs there and `CLIENT INFO` must not change.

/// ACL categories whose commands may change the connection's state, block it, or run code.
pub const UNSHARED_CATEGORIES: &[&str] = &[
    "@connection",
    "@transaction",
    "@pubsub",
    "@blocking",
    "@admin",
    "@scripting",
];

/// Command flags that say the same (a second line in case a category is missing).
pub const UNSHARED_FLAGS: &[&str] = &["noscript", "blocking", "pubsub", "admin"];

/// The largest request that runs on a shared connection, in bytes on the wire. Redis closes a
/// connection on a bulk string over its `proto-max-bulk-len`, which can be lowered to 1 MiB
/// and no further: a request this size or smaller cannot trip it and end the connection of
/// every session on it. A larger one runs on a connection of the session's own.
pub const LARGEST_SHARED_REQUEST: usize = 1024 * 1024;

/// The most reply bytes one session may leave unread on a shared connection (beyond one reply,
/// which always fits). On a connection of its own, replies a client does not read wait in
/// Redis (under its `client-output-buffer-limit`); a shared connection's replies are read at
/// once for the other sessions' sake, so the gateway would hold every reply a client that
/// never reads asked for. Over it, the session's later replies are dropped and it ends, as
/// Redis ends a client over its output buffer limit (DESIGN rule 10).
pub const LARGEST_SHARED_BACKLOG: usize = 64 * 1024 * 1024;

/// The most request bytes waiting to be written to one shared connection. While Redis does not
/// read (a slow command of anybody's), a session that would queue more waits, as its reader
/// waits on a socket of its own whose buffers are full; without it one session could queue
/// every request its slot queue admits (4096 of up to 1 MiB) in the gateway's memory.
pub const LARGEST_SHARED_QUEUE: usize = 16 * 1024 * 1024;

/// `@connection` commands that only answer: `PING` and `ECHO` (client pools send `PING` to
/// check a connection; pinning a session for it would make sharing rare).
pub const ANSWER_ONLY: &[&str] = &["ping", "echo"];

/// Whether the command `name` (lower case; `container|sub` for a subcommand) with these flags
/// and ACL categories may run on a shared upstream connection. `container`: the entry has
/// subcommands (its own entry answers only the bare container name).
pub fn shareable(name: &str, flags: &[String], categories: &[String], container: bool) -> bool {
    if container || categories.is_empty() {
        return false;
    }
    if ANSWER_ONLY.contains(&name) {
        return true;
    }
    !categories
        .iter()
        .any(|c| UNSHARED_CATEGORIES.contains(&c.as_str()))
        && !flags.iter().any(|f| UNSHARED_FLAGS.contains(&f.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn data_commands_share_and_connection_commands_do_not() {
        let share = |name: &str, flags: &[&str], cats: &[&str]| {
            shareable(name, &strings(flags), &strings(cats), false)
        };
        // Entries as Redis 7.0 lists them.
        assert!(share(
            "get",
            &["readonly", "fast"],
            &["@read", "@string", "@fast"]
        ));
        assert!(share("ping", &["fast"], &["@fast", "@connection"]));
        assert!(!share(
            "select",
            &["loading", "stale", "fast"],
            &["@fast", "@connection"]
        ));
        assert!(!share(
            "multi",
            &["noscript", "loading", "stale", "fast", "allow_busy"],
            &["@fast", "@transaction"]
        ));
        assert!(!share(
            "blpop",
            &["write", "noscript", "blocking"],
            &["@write", "@list", "@slow", "@blocking"]
        ));
        assert!(!share(
            "eval",
            &["noscript", "stale"],
            &["@slow", "@scripting"]
        ));
        assert!(!share(
            "client|setname",
            &["noscript", "loading", "stale"],
            &["@slow", "@connection"]
        ));
        // A flag alone is enough.
        assert!(!share("made-up", &["blocking"], &["@read"]));
        // No categories (Redis 5): nothing shares.
        assert!(!share("get", &["readonly"], &[]));
        assert!(!shareable("object", &[], &strings(&["@slow"]), true));
    }
}
