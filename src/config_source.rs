//! A config file's text as parsed, so that any error found after parsing (a value out of range,
//! an unset environment variable, a missing certificate, a listener collision) names the file
//! and the line of the key it is about. Lines come from the TOML parser's spans.

use std::path::{Path, PathBuf};

use toml_edit::{ImDocument, Item};

use crate::config::ConfigError;

/// A parsed config file: its path, and where each key is written.
pub struct ConfigSource {
    path: PathBuf,
    text: String,
    /// `None` when the text is not TOML (the serde parse reports that, with its own line).
    doc: Option<ImDocument<String>>,
}

impl ConfigSource {
    /// `text`, read from `path` (used in messages only).
    pub fn new(path: &Path, text: &str) -> Self {
        Self {
            path: path.to_owned(),
            text: text.to_owned(),
            doc: ImDocument::parse(text.to_owned()).ok(),
        }
    }

    /// The 1-based line where `at` (a dotted key path such as `authority.heartbeat_ms` or
    /// `redis.protect.2.resource`, numbers indexing arrays) is written; for a key that is not
    /// written (a default), the line of the deepest table on its path; 1 if none is.
    pub fn line(&self, at: &str) -> usize {
        let Some(doc) = &self.doc else {
            return 1;
        };
        let mut offset = None;
        let mut item: &Item = doc.as_item();
        for segment in at.split('.').filter(|s| !s.is_empty()) {
            let next = match segment.parse::<usize>() {
                Ok(index) => item.get(index).map(|next| (next.span(), next)),
                Err(_) => item
                    .as_table_like()
                    .and_then(|table| table.get_key_value(segment))
                    .map(|(key, next)| (key.span().or_else(|| next.span()), next)),
            };
            let Some((span, next)) = next else {
                break;
            };
            if let Some(span) = span {
                offset = Some(span.start);
            }
            item = next;
        }
        offset.map_or(1, |offset| {
            self.text.as_bytes()[..offset.min(self.text.len())]
                .iter()
                .filter(|b| **b == b'\n')
                .count()
                + 1
        })
    }

    /// An error about the key `at`, with its file and line.
    pub fn error(&self, at: &str, message: impl std::fmt::Display) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.clone(),
            line: self.line(at),
            key: at.to_owned(),
            message: message.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(text: &str, at: &str) -> usize {
        ConfigSource::new(Path::new("t.toml"), text).line(at)
    }

    #[test]
    fn keys_tables_and_array_entries_have_their_lines() {
        let text = "[node]\nid = 1\n\n[authority]\nheartbeat_ms = 100\n\n[redis]\nlisten = \"x\"\n\n[[redis.protect]]\npattern = \"a\"\n\n[[redis.protect]]\npattern = \"b\"\nmode = \"enforce\"\n";
        assert_eq!(line(text, "node.id"), 2);
        assert_eq!(line(text, "authority.heartbeat_ms"), 5);
        // Not written: the table it would be in.
        assert_eq!(line(text, "authority.max_ttl_ms"), 4);
        assert_eq!(line(text, "redis"), 7);
        assert_eq!(line(text, "redis.protect.1"), 13);
        assert_eq!(line(text, "redis.protect.1.mode"), 15);
        assert_eq!(line(text, "s3.listen"), 1);
    }

    #[test]
    fn inline_arrays_and_dotted_headers() {
        let text = "[node]\n[authority]\nmembers = [\n  { id = 1, api = \"a:1\" },\n  { id = 2, api = \"b:2\" },\n]\n";
        assert_eq!(line(text, "authority.members"), 3);
        assert_eq!(line(text, "authority.members.1"), 5);
        let text = "[node]\n\n[[authority.members]]\nid = 1\n\n[[authority.members]]\nid = 2\n";
        assert_eq!(line(text, "authority.members.1.id"), 7);
    }
}
