//! The job's events: one JSON object per line on stdout, flushed at once, so whoever watches
//! the job (the story test, the demo) sees each step as it happens, even just before a SIGSTOP.

use std::io::Write;

use serde_json::Value;

pub struct Events;

impl Events {
    pub fn new() -> Self {
        Self
    }

    /// Prints `{"event": name, ...fields}`.
    pub fn emit(&self, name: &str, fields: Value) {
        let mut line = serde_json::json!({ "event": name });
        if let (Some(line), Value::Object(fields)) = (line.as_object_mut(), fields) {
            line.extend(fields);
        }
        let mut out = std::io::stdout().lock();
        // A closed stdout must not stop the billing.
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}
