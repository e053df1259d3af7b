//! The summary printed after each seed and after the whole run, plus its JSON form.

use std::fmt::Write;

use serde_json::{json, Value};

use crate::nemesis::FaultKind;
use crate::run::SeedReport;

/// At most this many violations are listed one by one per seed.
const SHOWN: usize = 10;

/// One seed's tables: faults and unavailability by kind, writes per store, violations.
pub fn seed_text(report: &SeedReport, bypass: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n== seed {} ({:?}, {} lock runs{}) ==",
        report.seed,
        report.duration,
        report.runs,
        if bypass { ", FENCING BYPASSED" } else { "" }
    );
    let _ = writeln!(
        out,
        "| fault | injected | unavailable after it, mean ms | max ms |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|");
    for kind in FaultKind::ALL {
        let n = report.faults.get(&kind).copied().unwrap_or(0);
        let u = report
            .unavailability
            .get(&kind)
            .cloned()
            .unwrap_or_default();
        let mean = if n > 0 { u.total_ms / n as u64 } else { 0 };
        let _ = writeln!(out, "| {kind} | {n} | {mean} | {} |", u.max_ms);
    }
    let _ = writeln!(
        out,
        "\n| store | attempted | acknowledged | stored | refused | unknown | not sent |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|");
    for (store, w) in &report.verdict.writes {
        let _ = writeln!(
            out,
            "| {store} | {} | {} | {} | {} | {} | {} |",
            w.attempted, w.acknowledged, w.stored, w.refused, w.unknown, w.not_sent
        );
    }
    let by_kind = report.verdict.by_kind();
    if by_kind.is_empty() {
        let _ = writeln!(out, "\nviolations: 0");
    } else {
        let _ = writeln!(out, "\nviolations: {}", report.verdict.violations.len());
        for (kind, n) in &by_kind {
            let _ = writeln!(out, "  {kind}: {n}");
        }
        for v in report.verdict.violations.iter().take(SHOWN) {
            let _ = writeln!(out, "  - {}: {}", v.kind, v.detail);
        }
    }
    if report.torn_lines > 0 {
        let _ = writeln!(out, "history lines cut by a kill: {}", report.torn_lines);
    }
    out
}

/// One row per seed, and the totals.
pub fn overall_text(reports: &[SeedReport]) -> String {
    let mut out = String::from(
        "\n| seed | faults | attempted | acknowledged | stored | refused | unknown | violations |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut totals = [0usize; 7];
    for r in reports {
        let faults: usize = r.faults.values().sum();
        let sum = |f: fn(&crate::check::WriteCounts) -> usize| -> usize {
            r.verdict.writes.values().map(f).sum()
        };
        let row = [
            faults,
            sum(|w| w.attempted),
            sum(|w| w.acknowledged),
            sum(|w| w.stored),
            sum(|w| w.refused),
            sum(|w| w.unknown),
            r.verdict.violations.len(),
        ];
        for (t, v) in totals.iter_mut().zip(row) {
            *t += v;
        }
        let _ = writeln!(
            out,
            "| {} | {} |",
            r.seed,
            row.map(|v| v.to_string()).join(" | ")
        );
    }
    let _ = writeln!(
        out,
        "| all | {} |",
        totals.map(|v| v.to_string()).join(" | ")
    );
    out
}

/// The whole run as JSON (for tests and scripts).
pub fn json(reports: &[SeedReport]) -> Value {
    let seeds: Vec<Value> = reports
        .iter()
        .map(|r| {
            json!({
                "seed": r.seed,
                "runs": r.runs,
                "faults": r.faults.iter().map(|(k, n)| (k.to_string(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
                "unavailability": r.unavailability.iter().map(|(k, u)| (k.to_string(), u.clone())).collect::<std::collections::BTreeMap<_, _>>(),
                "writes": r.verdict.writes,
                "violations": r.verdict.violations,
                "violations_by_kind": r.verdict.by_kind().iter().map(|(k, n)| (k.to_string(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
            })
        })
        .collect();
    let violations: usize = reports.iter().map(|r| r.verdict.violations.len()).sum();
    json!({ "seeds": seeds, "violations": violations })
}
