//! The classic Prometheus text format (0.0.4) from prometheus-client's OpenMetrics text.
//!
//! prometheus-client writes only OpenMetrics, whose counters are declared without their
//! `_total` suffix and which ends with `# EOF`; served as `text/plain; version=0.0.4`, that
//! fails `promtool check metrics` and confuses scrapers that parse the classic format. The
//! differences are in the comment lines only, so they are rewritten here line by line.

/// Rewrites OpenMetrics text as classic text: counter families get their samples' `_total`
/// name, `info`/`unknown` families become `gauge`/`untyped`, `# UNIT` and `# EOF` go.
pub fn classic(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, "counter")) = rest.split_once(' ') {
                counters.insert(name.to_owned());
            }
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let rewritten = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            let name = if counters.contains(name) && !name.ends_with("_total") {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            let tail = match (*prefix, tail) {
                ("# TYPE ", "info") => "gauge",
                ("# TYPE ", "unknown") => "untyped",
                _ => tail,
            };
            Some(format!("{prefix}{name} {tail}"))
        });
        match rewritten {
            Some(line) => out.push_str(&line),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::classic;

    #[test]
    fn counters_take_their_samples_name_and_eof_goes() {
        let om = "# HELP x_requests Requests.\n# TYPE x_requests counter\nx_requests_total 3\n# HELP x_up Up.\n# TYPE x_up gauge\nx_up 1\n# EOF\n";
        assert_eq!(
            classic(om),
            "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\nx_requests_total 3\n# HELP x_up Up.\n# TYPE x_up gauge\nx_up 1\n"
        );
    }
}
