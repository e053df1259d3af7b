//! The node-wide budget for refusals: a token bucket shared by every connection of a gateway.
//!
//! A refusal costs the gateway work (judging, an audit record, a reply) and costs the refused
//! client nothing, so a client without a token can make many per second from many connections.
//! Refusals within the budget are served at once; beyond it, the connection that caused one is
//! slowed down (see [`Tarpit`](crate::Tarpit)), so a flood costs the flooder time instead of
//! costing other clients CPU. Pure: the caller passes the time.

use std::time::{Duration, Instant};

/// A token bucket of refusals: `per_second` refill, up to `burst` at once. Shared by all
/// connections of one gateway (behind a lock; [`RefusalBudget::take`] is a few arithmetic
/// operations).
#[derive(Debug, Clone)]
pub struct RefusalBudget {
    per_second: f64,
    burst: f64,
    tokens: f64,
    refilled_at: Instant,
    report_every: Duration,
    reported_at: Instant,
    /// Refusals over the budget since the last report.
    over: u64,
}

/// What [`RefusalBudget::take`] decided for one refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charge {
    /// The refusal fits in the budget: serve it without delay.
    pub within: bool,
    /// At most once per report period, on the first refusal over the budget after it: how many
    /// refusals went over the budget since the last report (this one included). The caller
    /// logs it; no other refusal over the budget needs a log line of its own.
    pub report: Option<u64>,
}

impl RefusalBudget {
    /// A full bucket at `now`. `per_second` and `burst` are at least 1 (smaller values are
    /// taken as 1); a report is due at most once per `report_every`.
    pub fn new(per_second: u32, burst: u32, report_every: Duration, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            per_second: f64::from(per_second.max(1)),
            burst,
            tokens: burst,
            refilled_at: now,
            report_every,
            // The first refusal over the budget is reported at once.
            reported_at: now.checked_sub(report_every).unwrap_or(now),
            over: 0,
        }
    }

    /// Charges one refusal at `now` (times before the last call count as that call's time).
    pub fn take(&mut self, now: Instant) -> Charge {
        let elapsed = now.saturating_duration_since(self.refilled_at);
        self.tokens = (self.tokens + elapsed.as_secs_f64() * self.per_second).min(self.burst);
        self.refilled_at = self.refilled_at.max(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Charge {
                within: true,
                report: None,
            };
        }
        self.over += 1;
        let due = now.saturating_duration_since(self.reported_at) >= self.report_every;
        let report = due.then(|| {
            self.reported_at = now;
            std::mem::take(&mut self.over)
        });
        Charge {
            within: false,
            report,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden: (milliseconds since start, refusals charged then) -> the charges, as
    /// `+` (within), `-` (over) and `-N` (over, report of N).
    #[test]
    fn golden() {
        let t0 = Instant::now();
        let mut budget = RefusalBudget::new(10, 3, Duration::from_secs(1), t0);
        let script: &[(u64, usize, &str)] = &[
            // The burst is served, then the bucket is empty: the first over is reported.
            (0, 5, "+ + + -1 -"),
            // 100 ms refill one at 10/s; a report is not due again within the period.
            (100, 2, "+ -"),
            // Half a refill is not a refusal's worth; with the next half it is.
            (150, 1, "-"),
            (250, 2, "+ -"),
            // A second later: the bucket is full (3, not 10: burst caps it), a report is due
            // and counts every over since the last one.
            (1300, 4, "+ + + -5"),
            // Time going backwards (a caller's stale `now`) refills nothing.
            (1200, 1, "-"),
            (1300, 1, "-"),
        ];
        for (at, n, expected) in script {
            let now = t0 + Duration::from_millis(*at);
            let got: Vec<String> = (0..*n)
                .map(|_| match budget.take(now) {
                    Charge { within: true, .. } => "+".to_owned(),
                    Charge { report: None, .. } => "-".to_owned(),
                    Charge {
                        report: Some(n), ..
                    } => format!("-{n}"),
                })
                .collect();
            assert_eq!(got.join(" "), *expected, "at {at} ms");
        }
    }

    #[test]
    fn a_sustained_flood_gets_the_rate_and_no_more() {
        let t0 = Instant::now();
        let mut budget = RefusalBudget::new(100, 100, Duration::from_secs(10), t0);
        let mut within = 0;
        // 10 s of 10,000 refusals per second, charged every millisecond.
        for ms in 0..10_000u64 {
            let now = t0 + Duration::from_millis(ms);
            for _ in 0..10 {
                within += u64::from(budget.take(now).within);
            }
        }
        // The burst plus 100 per second.
        assert!((1090..=1100).contains(&within), "{within}");
    }

    #[test]
    fn zero_limits_are_taken_as_one() {
        let t0 = Instant::now();
        let mut budget = RefusalBudget::new(0, 0, Duration::from_secs(1), t0);
        assert!(budget.take(t0).within);
        assert!(!budget.take(t0).within);
        assert!(budget.take(t0 + Duration::from_secs(1)).within);
    }
}
