//! What the stores answered: a write applied, or refused because the lock moved on. A refusal
//! is a value the job acts on, not an error.

use serde_json::{json, Map, Value};

pub enum Outcome {
    Written,
    /// The store refused the write; `detail` is its own error text.
    Refused(String),
}

/// One step's outcomes across the stores, as one event.
pub struct Report {
    pub refused: bool,
    results: Map<String, Value>,
    details: Map<String, Value>,
}

impl Report {
    pub fn of(outcomes: &[(&str, Outcome)]) -> Self {
        let mut report = Report {
            refused: false,
            results: Map::new(),
            details: Map::new(),
        };
        for (store, outcome) in outcomes {
            let result = match outcome {
                Outcome::Written => "written",
                Outcome::Refused(detail) => {
                    report.refused = true;
                    report.details.insert(store.to_string(), json!(detail));
                    "refused"
                }
            };
            report.results.insert(store.to_string(), json!(result));
        }
        report
    }

    /// `{"results": {store: written|refused}, "details": {store: why}, "chunk": n}`.
    pub fn json(&self, chunk: Option<u32>) -> Value {
        let mut v = json!({ "results": self.results, "details": self.details });
        if let Some(n) = chunk {
            v["chunk"] = json!(n);
        }
        v
    }
}
