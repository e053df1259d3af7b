//! `COPY ... FROM STDIN`, followed. While the server reads a COPY's data it ignores Sync and
//! Flush, and ends the COPY with an error at any other message: a Sync sent then gets no
//! ReadyForQuery. If the gateway queued a reply for it, every later reply would be matched to
//! the wrong request (a guard's reply relayed to the client, a client's own error audited as a
//! stale refusal). The client's messages alone cannot tell which Syncs those are (a COPY may
//! fail before it reads any data, and then its Sync counts), so the gateway asks the server: a
//! message that may start a COPY FROM STDIN (an Execute of a portal bound to one, a Query
//! holding one) is watched, and the next message after it that is not copy data waits until
//! the server has either started a COPY (CopyInResponse) or answered the message in full. In
//! the COPY, a Sync is not forwarded (the server would ignore it; after an error in the copy,
//! forwarding it could end the skipping early) and anything but copy data, Flush and Sync ends
//! the session. A COPY the gateway did not expect ends the session too: fail closed.

use std::collections::HashSet;

use super::Shared;
use crate::classify::{Classified, MAX_NAME_BYTES};
use crate::error::PostgresError;

/// Past this many portals bound to a statement that may copy in, every Execute is watched.
const MAX_COPY_PORTALS: usize = 1024;

/// The portals an Execute of which may start a COPY FROM STDIN: those whose last Bind, as sent,
/// bound a statement that may ([`crate::classify::Statement::copies_in`]), by their first
/// [`MAX_NAME_BYTES`] bytes (the server keeps no more of a portal's name). A named portal stays
/// (binding its name again fails while it exists); the unnamed one is replaced by its next
/// Bind. A Bind the server skipped leaves no portal to execute: the error that made it skip
/// aborted the transaction the portal would live in.
#[derive(Debug, Default)]
pub(super) struct CopyPortals {
    names: HashSet<Box<[u8]>>,
    /// More than [`MAX_COPY_PORTALS`] were bound: every portal may copy in.
    all: bool,
}

impl CopyPortals {
    /// A Bind of `portal` to `classified` is sent now.
    #[inline]
    pub(super) fn bound(&mut self, portal: &str, classified: &Classified) {
        if classified.statements.iter().any(|s| s.copies_in) {
            if self.names.len() >= MAX_COPY_PORTALS {
                self.all = true;
            } else {
                self.names.insert(key(portal).into());
            }
        } else if portal.is_empty() && !self.names.is_empty() {
            self.names.remove(key(portal));
        }
    }

    /// Whether none may copy in (the usual case: nothing to read from an Execute).
    #[inline]
    pub(super) fn none(&self) -> bool {
        !self.all && self.names.is_empty()
    }

    /// Whether an Execute of `portal` may start a COPY FROM STDIN.
    pub(super) fn may_copy(&self, portal: &str) -> bool {
        self.all || self.names.contains(key(portal))
    }
}

fn key(name: &str) -> &[u8] {
    &name.as_bytes()[..name.len().min(MAX_NAME_BYTES)]
}

/// What the reply loop learnt of the watched message, in the session's state.
#[derive(Debug, Default)]
pub(super) struct CopyWatch {
    /// How many COPY FROM STDIN it started (CopyInResponse; a Query may hold several).
    pub(super) started: u32,
    /// It got its last reply.
    pub(super) done: bool,
    /// The reply loop ended: nothing more will be learnt.
    pub(super) closed: bool,
    /// Something above changed since the request loop was last told.
    pub(super) changed: bool,
}

impl CopyWatch {
    /// A message to watch is sent now (the last one watched is done: see [`CopyFollow`]).
    pub(super) fn watch(&mut self) {
        self.started = 0;
        self.done = false;
    }

    /// The watched message started a COPY.
    pub(super) fn started(&mut self) {
        self.started += 1;
        self.changed = true;
    }

    /// The watched message got its last reply.
    pub(super) fn ended(&mut self) {
        self.done = true;
        self.changed = true;
    }
}

/// The request loop's side: whether a watched message is out, and how many CopyDone and
/// CopyFail it sent since. At most one is out: the next message that could be watched is
/// not decided before the last one is done.
#[derive(Debug, Default)]
pub(super) struct CopyFollow {
    ends: Option<u32>,
    /// The watched message is an Execute (extended protocol).
    extended: bool,
    /// CopyData was sent since it.
    data: bool,
}

impl CopyFollow {
    /// A message to watch was sent (and [`CopyWatch::watch`] called under the same lock);
    /// `extended`: an Execute.
    pub(super) fn watching(&mut self, extended: bool) {
        self.ends = Some(0);
        self.extended = extended;
        self.data = false;
    }

    /// Whether a message with `tag` must wait for the server's word before it is decided:
    /// copy data, its end, Flush and Terminate never do.
    #[inline]
    pub(super) fn must_ask(&self, tag: u8) -> bool {
        self.ends.is_some() && !matches!(tag, b'd' | b'c' | b'f' | b'H' | b'X')
    }

    /// A message with `tag` was forwarded.
    #[inline]
    pub(super) fn relayed(&mut self, tag: u8) {
        match (&mut self.ends, tag) {
            (Some(ends), b'c' | b'f') => *ends += 1,
            (Some(_), b'd') => self.data = true,
            _ => {}
        }
    }

    /// A message the server reads during a COPY FROM STDIN (other than copy data, Flush and
    /// Terminate, which are relayed): a Sync is dropped (`Ok`); anything else ends the session,
    /// and so does a Sync among an extended-protocol COPY's data. The server may have ended that
    /// COPY with an error in the data already, and would then end its skipping at this Sync:
    /// before any data it cannot have (drivers send their Sync right after the Execute).
    pub(super) fn in_copy(&self, tag: u8) -> Result<(), PostgresError> {
        match tag {
            b'S' if !(self.extended && self.data) => Ok(()),
            b'S' => Err(PostgresError::Protocol(
                "a Sync was sent among the data of an extended-protocol COPY FROM STDIN: send CopyDone or CopyFail first".to_owned(),
            )),
            _ => Err(PostgresError::Protocol(format!(
                "a message of type {:?} was sent during COPY FROM STDIN, where only CopyData, CopyDone, CopyFail, Flush and Sync may be: end the copy with CopyDone or CopyFail first",
                char::from(tag)
            ))),
        }
    }

    /// Waits for the server's word on the watched message: `true` if the server reads the
    /// client's next message as part of a COPY (it started one the client has not ended),
    /// `false` once the message was answered in full (nothing is watched any more).
    pub(super) async fn ask(&mut self, shared: &Shared) -> Result<bool, PostgresError> {
        let Some(ends) = self.ends else {
            return Ok(false);
        };
        loop {
            {
                let state = shared.lock();
                let watch = &state.copy;
                if watch.done {
                    self.ends = None;
                    return Ok(false);
                }
                if watch.started > ends {
                    return Ok(true);
                }
                if watch.closed {
                    return Err(PostgresError::Protocol(
                        "the server connection ended during a COPY".to_owned(),
                    ));
                }
            }
            // A permit stored by a notification since the check above wakes this at once.
            shared.copy_changed.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::classify;

    #[test]
    fn portals_follow_their_last_bind() {
        let mut portals = CopyPortals::default();
        assert!(portals.none());
        portals.bound("", &classify("SELECT 1"));
        assert!(portals.none(), "nothing to remember");
        portals.bound("", &classify("COPY t FROM STDIN"));
        portals.bound("p", &classify("COPY t FROM STDIN"));
        assert!(portals.may_copy("") && portals.may_copy("p"));
        assert!(!portals.may_copy("q"));
        // The unnamed portal is replaced by its next Bind; a named one stays.
        portals.bound("", &classify("SELECT 1"));
        portals.bound("p", &classify("SELECT 1"));
        assert!(!portals.may_copy(""));
        assert!(portals.may_copy("p"));
    }

    #[test]
    fn portal_names_compare_as_the_server_keeps_them() {
        let mut portals = CopyPortals::default();
        let long = "p".repeat(MAX_NAME_BYTES);
        portals.bound(&format!("{long}a"), &classify("COPY t FROM STDIN"));
        assert!(portals.may_copy(&format!("{long}b")));
    }

    #[test]
    fn too_many_portals_make_every_execute_watched() {
        let mut portals = CopyPortals::default();
        for i in 0..=MAX_COPY_PORTALS {
            portals.bound(&format!("p{i}"), &classify("COPY t FROM STDIN"));
        }
        assert!(portals.may_copy("never bound"));
    }

    #[test]
    fn the_request_side_counts_copy_ends_and_asks_only_for_the_rest() {
        let mut follow = CopyFollow::default();
        assert!(!follow.must_ask(b'S'), "nothing watched");
        follow.watching(true);
        for tag in [b'd', b'c', b'f', b'H', b'X'] {
            assert!(!follow.must_ask(tag), "{}", char::from(tag));
        }
        for tag in [b'S', b'Q', b'P', b'B', b'E', b'D', b'C', b'F'] {
            assert!(follow.must_ask(tag), "{}", char::from(tag));
        }
        follow.relayed(b'd');
        follow.relayed(b'c');
        assert_eq!(follow.ends, Some(1));
    }

    #[test]
    fn only_sync_may_come_during_a_copy_and_not_among_extended_data() {
        for extended in [false, true] {
            let mut follow = CopyFollow::default();
            follow.watching(extended);
            assert!(follow.in_copy(b'S').is_ok(), "the driver's Sync");
            for tag in [b'Q', b'P', b'B', b'E', b'F', b'D', b'C'] {
                assert!(follow.in_copy(tag).is_err(), "{}", char::from(tag));
            }
            follow.relayed(b'd');
            assert_eq!(follow.in_copy(b'S').is_ok(), !extended);
        }
    }
}
