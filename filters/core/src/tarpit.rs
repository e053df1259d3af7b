//! One connection's tarpit: how long it waits before its next request after a refusal that
//! went over the node's [`RefusalBudget`](crate::RefusalBudget).
//!
//! The wait doubles with every refusal over the budget since the connection's last accepted
//! write, up to a bound; an accepted write (which needs a valid token) leaves the tarpit. A
//! connection that writes with a valid token is therefore never delayed, and a flooding
//! connection pays for its refusals in time. Pure: the caller sleeps.

use std::time::Duration;

/// The tarpit state of one connection.
#[derive(Debug, Clone)]
pub struct Tarpit {
    initial: Duration,
    max: Duration,
    /// Refusals over the budget since the last accepted write.
    over: u32,
}

impl Tarpit {
    /// Out of the tarpit; the first wait is `initial`, no wait is longer than `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            over: 0,
        }
    }

    /// The connection caused a refusal; `within_budget` is the budget's
    /// [`Charge::within`](crate::Charge::within) for it. Returns how long the connection
    /// waits before its next request (none while the budget has room).
    pub fn refused(&mut self, within_budget: bool) -> Option<Duration> {
        if within_budget {
            return None;
        }
        self.over = self.over.saturating_add(1);
        // initial * 2^(over - 1), capped (the shift is capped first so it cannot overflow).
        let doublings = (self.over - 1).min(31);
        Some(
            self.initial
                .checked_mul(1 << doublings)
                .unwrap_or(self.max)
                .min(self.max),
        )
    }

    /// The connection's write was accepted (it presented a valid token): out of the tarpit.
    /// Returns whether it was in.
    pub fn accepted(&mut self) -> bool {
        std::mem::take(&mut self.over) > 0
    }

    /// Whether a refusal of this connection went over the budget since its last accepted
    /// write.
    pub fn active(&self) -> bool {
        self.over > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden: a sequence of events (`+` refusal within the budget, `-` over it, `A` accepted
    /// write) -> the waits in milliseconds (`0`: none) and whether the tarpit is active after.
    #[test]
    fn golden() {
        let cases: &[(&str, &str)] = &[
            ("+ + +", "0 0 0 out"),
            ("- - - - - - - - -", "10 20 40 80 160 320 640 1000 1000 in"),
            // Room in the budget again: no wait, but the count stays until a write is accepted.
            ("- - + -", "10 20 0 40 in"),
            ("- - A -", "10 20 out 10 in"),
            ("A +", "out 0 out"),
        ];
        for (events, expected) in cases {
            let mut t = Tarpit::new(Duration::from_millis(10), Duration::from_secs(1));
            let mut got: Vec<String> = events
                .split(' ')
                .map(|e| match e {
                    "A" => {
                        t.accepted();
                        "out".to_owned()
                    }
                    _ => t.refused(e == "+").map_or(0, |d| d.as_millis()).to_string(),
                })
                .collect();
            got.push(if t.active() { "in" } else { "out" }.to_owned());
            assert_eq!(got.join(" "), *expected, "{events}");
        }
    }

    #[test]
    fn the_wait_is_bounded_however_long_the_flood() {
        let mut t = Tarpit::new(Duration::from_millis(3), Duration::from_millis(700));
        let longest = (0..100_000).filter_map(|_| t.refused(false)).max().unwrap();
        assert_eq!(longest, Duration::from_millis(700));
        assert!(t.accepted());
        assert!(!t.accepted());
        // A bound below the first wait is raised to it.
        let mut t = Tarpit::new(Duration::from_millis(50), Duration::from_millis(5));
        assert_eq!(t.refused(false), Some(Duration::from_millis(50)));
    }
}
