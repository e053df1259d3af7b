//! Free loopback ports for the servers a test starts.
//!
//! A port found by binding `127.0.0.1:0` comes from the kernel's ephemeral range, the same range
//! every outgoing connection takes its local port from: between the moment the test releases it
//! and the moment the server binds it, a client connection (a Raft heartbeat, a test's HTTP
//! poll) can take it, and the server then fails to start. Ports here come from below that
//! range, where no outgoing connection is ever placed, and each is handed out once per
//! process.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The range handed out: above the well-known ports and below Linux's default ephemeral range
/// (32768-60999, `/proc/sys/net/ipv4/ip_local_port_range`).
const FIRST: u32 = 10_000;
const LAST: u32 = 32_767;
const SPAN: u32 = LAST - FIRST + 1;

/// The next candidate, as an offset into the range. Starts at a place derived from the process
/// id so that test processes running side by side start far apart.
static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);

fn next_offset() -> u32 {
    let start = (std::process::id().wrapping_mul(7_919)) % SPAN;
    let _ = NEXT.compare_exchange(u32::MAX, start, Ordering::Relaxed, Ordering::Relaxed);
    NEXT.fetch_add(1, Ordering::Relaxed) % SPAN
}

/// A loopback port nobody listens on now, never handed out before by this process, and outside
/// the ephemeral range (so no outgoing connection can take it before the server binds it).
pub fn free_port() -> u16 {
    for _ in 0..SPAN {
        let port = (FIRST + next_offset()) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port between {FIRST} and {LAST}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ports_are_unique_and_outside_the_ephemeral_range() {
        let ports: Vec<u16> = (0..500).map(|_| free_port()).collect();
        let unique: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(unique.len(), ports.len(), "a port was handed out twice");
        assert!(ports
            .iter()
            .all(|p| (FIRST..=LAST).contains(&u32::from(*p))));
    }
}
