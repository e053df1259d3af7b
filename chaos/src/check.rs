//! The checker: what the histories, the stores' final contents and the audit logs must agree on.
//!
//! Per store:
//! - the revisions of the stored records, in store order, never decrease;
//! - every acknowledged write is stored, once; no refused or never-sent write is stored; every
//!   stored record is one a worker sent;
//! - every refusal a client saw has exactly one audit record on the node that refused it (a
//!   write whose answer was lost may add one more);
//!
//! and for the whole run: `audit verify` passes on every node; granted revisions are unique and
//! increase in the order the jobs started; no job started before the lease of an earlier
//! revision had ended as that revision's own runner computed it (its stop time + margin).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

use crate::history::{parse_record, Event, Op};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum ViolationKind {
    RevisionDecreased,
    AcknowledgedLost,
    RefusedPresent,
    NeverSentPresent,
    Duplicated,
    AuditMissing,
    AuditExtra,
    AuditVerify,
    GrantDuplicated,
    GrantOrder,
    GrantBeforeStop,
}

impl fmt::Display for ViolationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ViolationKind::RevisionDecreased => "revision-decreased",
            ViolationKind::AcknowledgedLost => "acknowledged-lost",
            ViolationKind::RefusedPresent => "refused-present",
            ViolationKind::NeverSentPresent => "never-sent-present",
            ViolationKind::Duplicated => "duplicated",
            ViolationKind::AuditMissing => "audit-missing",
            ViolationKind::AuditExtra => "audit-extra",
            ViolationKind::AuditVerify => "audit-verify",
            ViolationKind::GrantDuplicated => "grant-duplicated",
            ViolationKind::GrantOrder => "grant-order",
            ViolationKind::GrantBeforeStop => "grant-before-stop",
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub kind: ViolationKind,
    pub detail: String,
}

/// A refusal record of a node's audit log, reduced to what is matched.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct AuditRow {
    pub node: u64,
    pub store: String,
    pub revision: Option<u64>,
}

/// Everything the checker looks at.
pub struct Evidence {
    pub events: Vec<Event>,
    /// Per store, the records it holds, in store order.
    pub stored: BTreeMap<String, Vec<String>>,
    pub audit: Vec<AuditRow>,
    /// Per node: `audit verify`'s verdict (`Err` with its message).
    pub verify: BTreeMap<u64, Result<(), String>>,
    /// Per revision: the end of its lease as its runner last computed it (CLOCK_MONOTONIC ns,
    /// from the runner's stop file).
    pub lease_ends: BTreeMap<u64, u64>,
}

/// Counts of one store's writes.
#[derive(Debug, Default, Clone, Serialize)]
pub struct WriteCounts {
    pub attempted: usize,
    pub acknowledged: usize,
    pub refused: usize,
    pub unknown: usize,
    pub not_sent: usize,
    pub stored: usize,
}

pub struct Verdict {
    pub writes: BTreeMap<String, WriteCounts>,
    pub violations: Vec<Violation>,
}

impl Verdict {
    pub fn by_kind(&self) -> BTreeMap<ViolationKind, usize> {
        let mut counts = BTreeMap::new();
        for v in &self.violations {
            *counts.entry(v.kind).or_insert(0) += 1;
        }
        counts
    }
}

pub fn check(evidence: &Evidence) -> Verdict {
    let mut violations = Vec::new();
    let mut writes = BTreeMap::new();
    let mut flag = |kind, detail: String| violations.push(Violation { kind, detail });

    let stores: BTreeSet<&String> = evidence
        .stored
        .keys()
        .chain(evidence.events.iter().filter_map(|e| e.store.as_ref()))
        .collect();
    for store in stores {
        let events: Vec<&Event> = evidence
            .events
            .iter()
            .filter(|e| e.store.as_ref() == Some(store))
            .collect();
        let stored = evidence.stored.get(store).cloned().unwrap_or_default();
        let with = |op: Op| -> BTreeSet<String> {
            events
                .iter()
                .filter(|e| e.op == op)
                .filter_map(|e| e.record())
                .collect()
        };
        let (invoked, acked, refused, unknown, not_sent) = (
            with(Op::Invoke),
            with(Op::Ok),
            with(Op::Refused),
            with(Op::Unknown),
            with(Op::Fail),
        );
        // An invoke with no outcome (the worker died waiting) is unknown too.
        let answered: BTreeSet<&String> = acked.iter().chain(&refused).chain(&unknown).collect();
        let unanswered = invoked.iter().filter(|r| !answered.contains(r)).count();

        let mut last: Option<(u64, &str)> = None;
        let mut seen = BTreeSet::new();
        for record in &stored {
            let Some((_, _, rev)) = parse_record(record) else {
                flag(
                    ViolationKind::NeverSentPresent,
                    format!("{store}: unparseable record {record:?}"),
                );
                continue;
            };
            if let Some((prev, prev_record)) = last {
                if rev < prev {
                    flag(
                        ViolationKind::RevisionDecreased,
                        format!("{store}: {record} stored after {prev_record}"),
                    );
                }
            }
            last = Some((rev, record));
            if !seen.insert(record.as_str()) {
                flag(ViolationKind::Duplicated, format!("{store}: {record}"));
            }
            if refused.contains(record) {
                flag(ViolationKind::RefusedPresent, format!("{store}: {record}"));
            } else if not_sent.contains(record) || !invoked.contains(record) {
                flag(
                    ViolationKind::NeverSentPresent,
                    format!("{store}: {record}"),
                );
            }
        }
        for record in acked.iter().filter(|r| !seen.contains(r.as_str())) {
            flag(
                ViolationKind::AcknowledgedLost,
                format!("{store}: {record}"),
            );
        }

        // Refusals seen by clients against audit records, per (node, revision).
        let mut client: BTreeMap<(u64, u64), (usize, usize)> = BTreeMap::new();
        for e in &events {
            let Some(node) = e.node.filter(|n| *n != 0) else {
                continue;
            };
            match e.op {
                Op::Refused => client.entry((node, e.rev)).or_default().0 += 1,
                Op::Unknown => client.entry((node, e.rev)).or_default().1 += 1,
                _ => {}
            }
        }
        for e in events.iter().filter(|e| e.op == Op::Invoke) {
            let node = e.node.unwrap_or(0);
            if node != 0 && !answered.contains(&e.record().unwrap_or_default()) {
                client.entry((node, e.rev)).or_default().1 += 1;
            }
        }
        let mut audited: BTreeMap<(u64, u64), usize> = BTreeMap::new();
        for row in evidence.audit.iter().filter(|r| &r.store == store) {
            *audited
                .entry((row.node, row.revision.unwrap_or(0)))
                .or_default() += 1;
        }
        let keys: BTreeSet<(u64, u64)> = client.keys().chain(audited.keys()).copied().collect();
        for key in keys {
            let (seen_refused, maybe) = client.get(&key).copied().unwrap_or_default();
            let records = audited.get(&key).copied().unwrap_or_default();
            let (node, rev) = key;
            if records < seen_refused {
                flag(
                    ViolationKind::AuditMissing,
                    format!("{store}: node {node}, revision {rev}: {seen_refused} refusal(s) seen, {records} audit record(s)"),
                );
            } else if records > seen_refused + maybe {
                flag(
                    ViolationKind::AuditExtra,
                    format!("{store}: node {node}, revision {rev}: {seen_refused} refusal(s) seen (+{maybe} unanswered), {records} audit record(s)"),
                );
            }
        }

        writes.insert(
            store.clone(),
            WriteCounts {
                attempted: invoked.len(),
                acknowledged: acked.len(),
                refused: refused.len(),
                unknown: unknown.len() + unanswered,
                not_sent: not_sent.len(),
                stored: stored.len(),
            },
        );
    }

    for (node, verdict) in &evidence.verify {
        if let Err(message) = verdict {
            flag(
                ViolationKind::AuditVerify,
                format!("node {node}: {message}"),
            );
        }
    }

    let mut starts: Vec<&Event> = evidence
        .events
        .iter()
        .filter(|e| e.op == Op::Start)
        .collect();
    starts.sort_by_key(|e| e.t);
    let mut granted = BTreeSet::new();
    for pair in starts.windows(2) {
        if pair[1].rev <= pair[0].rev {
            flag(
                ViolationKind::GrantOrder,
                format!(
                    "worker {} started with revision {} after worker {} with {}",
                    pair[1].worker, pair[1].rev, pair[0].worker, pair[0].rev
                ),
            );
        }
    }
    // A job starts after its grant, so a start before an earlier lease's end proves a grant
    // before it (a start after proves nothing either way: the check is sound, not complete).
    for start in &starts {
        let earlier = evidence
            .lease_ends
            .range(..start.rev)
            .max_by_key(|(_, end)| **end);
        if let Some((rev, end)) = earlier.filter(|(_, end)| start.t < **end) {
            flag(
                ViolationKind::GrantBeforeStop,
                format!(
                    "worker {} started with revision {} {} ms before the lease of revision {rev} ended as its runner knew it",
                    start.worker,
                    start.rev,
                    (end - start.t) / 1_000_000
                ),
            );
        }
    }
    for start in &starts {
        if !granted.insert(start.rev) {
            flag(
                ViolationKind::GrantDuplicated,
                format!("revision {} granted twice", start.rev),
            );
        }
    }
    Verdict { writes, violations }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(t: u64, worker: u32, rev: u64, op: Op, seq: Option<u64>, node: u64) -> Event {
        Event {
            t,
            worker,
            rev,
            op,
            seq,
            store: seq.map(|_| "redis".to_owned()),
            node: Some(node),
            detail: None,
            pid: None,
        }
    }

    /// Worker 1 (revision 1) writes seq 1 and 2; worker 2 (revision 3) writes seq 1; worker 1's
    /// seq 3 is refused by node 2, which audits it once. Worker 1's runner knew its lease to
    /// end at t 9, before worker 2 started.
    fn clean() -> Evidence {
        let mut events = vec![
            event(1, 1, 1, Op::Start, None, 0),
            event(10, 2, 3, Op::Start, None, 0),
        ];
        for (t, w, rev, seq, node, outcome) in [
            (2, 1, 1, 1, 1, Op::Ok),
            (3, 1, 1, 2, 2, Op::Ok),
            (11, 2, 3, 1, 3, Op::Ok),
            (12, 1, 1, 3, 2, Op::Refused),
        ] {
            events.push(event(t, w, rev, Op::Invoke, Some(seq), node));
            events.push(event(t, w, rev, outcome, Some(seq), node));
        }
        Evidence {
            events,
            stored: [(
                "redis".to_owned(),
                vec!["1:1:1".into(), "1:2:1".into(), "2:1:3".into()],
            )]
            .into(),
            audit: vec![AuditRow {
                node: 2,
                store: "redis".into(),
                revision: Some(1),
            }],
            verify: [(1, Ok(())), (2, Ok(())), (3, Ok(()))].into(),
            lease_ends: [(1, 9), (3, 20)].into(),
        }
    }

    fn kinds(evidence: &Evidence) -> Vec<ViolationKind> {
        check(evidence).by_kind().into_keys().collect()
    }

    #[test]
    fn a_clean_history_has_no_violation() {
        let verdict = check(&clean());
        assert!(verdict.violations.is_empty(), "{:?}", verdict.violations);
        let w = &verdict.writes["redis"];
        assert_eq!(
            (w.attempted, w.acknowledged, w.refused, w.stored),
            (4, 3, 1, 3)
        );
    }

    #[test]
    fn each_violation_kind_is_caught() {
        type BreakIt = Box<dyn Fn(&mut Evidence)>;
        let cases: Vec<(ViolationKind, BreakIt)> = vec![
            (
                ViolationKind::RevisionDecreased,
                Box::new(|e| e.stored.get_mut("redis").unwrap().swap(1, 2)),
            ),
            (
                ViolationKind::AcknowledgedLost,
                Box::new(|e| {
                    e.stored.get_mut("redis").unwrap().pop();
                }),
            ),
            (
                ViolationKind::RefusedPresent,
                Box::new(|e| e.stored.get_mut("redis").unwrap().insert(2, "1:3:1".into())),
            ),
            (
                ViolationKind::NeverSentPresent,
                Box::new(|e| e.stored.get_mut("redis").unwrap().push("2:9:3".into())),
            ),
            (
                ViolationKind::Duplicated,
                Box::new(|e| e.stored.get_mut("redis").unwrap().push("2:1:3".into())),
            ),
            (ViolationKind::AuditMissing, Box::new(|e| e.audit.clear())),
            (
                ViolationKind::AuditExtra,
                Box::new(|e| {
                    let row = e.audit[0].clone();
                    e.audit.push(row);
                }),
            ),
            (
                ViolationKind::AuditVerify,
                Box::new(|e| {
                    e.verify
                        .insert(2, Err("chain broken at audit.jsonl:3".into()));
                }),
            ),
            (ViolationKind::GrantOrder, Box::new(|e| e.events[1].rev = 0)),
            (
                ViolationKind::GrantBeforeStop,
                // Worker 1's runner renewed once more: its lease ran until after worker 2
                // started (t 10).
                Box::new(|e| {
                    e.lease_ends.insert(1, 11);
                }),
            ),
            (
                ViolationKind::GrantDuplicated,
                Box::new(|e| {
                    let again = event(20, 3, 3, Op::Start, None, 0);
                    e.events.push(again);
                }),
            ),
        ];
        for (kind, break_it) in cases {
            let mut evidence = clean();
            break_it(&mut evidence);
            assert!(
                kinds(&evidence).contains(&kind),
                "{kind} not caught: {:?}",
                check(&evidence).violations
            );
        }
    }

    #[test]
    fn a_lost_answer_may_add_one_audit_record() {
        let mut evidence = clean();
        evidence
            .events
            .push(event(13, 1, 1, Op::Invoke, Some(4), 2));
        evidence.audit.push(evidence.audit[0].clone());
        assert!(check(&evidence).violations.is_empty());
    }
}
