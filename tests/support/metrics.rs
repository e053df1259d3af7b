//! Reading a node's `/metrics` (Prometheus text) in tests.

/// The value of the sample `series` (name and labels exactly as exposed) in `text`; `None` when
/// it is not exposed.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
