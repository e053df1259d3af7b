//! The `DeleteObjects` request and result documents.

use quick_xml::events::Event;
use quick_xml::Reader;

/// The most keys one `DeleteObjects` request may name (S3's limit).
pub const MAX_KEYS: usize = 1000;

/// One object a `DeleteObjects` request names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteEntry {
    /// The key.
    pub key: String,
    /// A version id, when the client named one.
    pub version_id: Option<String>,
}

/// A parsed `<Delete>` document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteRequest {
    /// Whether only errors are reported.
    pub quiet: bool,
    /// The objects.
    pub entries: Vec<DeleteEntry>,
}

/// What happened to one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeleteOutcome {
    /// Deleted (or absent).
    Deleted,
    /// Refused or failed, with an S3 error code and message.
    Error {
        /// The error code.
        code: String,
        /// The message.
        message: String,
    },
}

/// Parses a `<Delete>` document; `None` if it is not well-formed or has no `<Object>`.
pub fn parse(xml: &[u8]) -> Option<DeleteRequest> {
    let mut reader = Reader::from_reader(xml);
    let mut path: Vec<Vec<u8>> = Vec::new();
    let mut quiet = false;
    let mut entries = Vec::new();
    let mut key: Option<String> = None;
    let mut version: Option<String> = None;
    let mut buf = Vec::new();
    loop {
        match reader.read_event_into(&mut buf).ok()? {
            Event::Start(e) => {
                let name = e.local_name().as_ref().to_vec();
                if path.is_empty() && name != b"Delete" {
                    return None;
                }
                if name == b"Object" {
                    key = None;
                    version = None;
                }
                path.push(name);
                if path.len() > 3 {
                    return None;
                }
            }
            Event::End(_) => {
                let name = path.pop()?;
                if name == b"Object" {
                    entries.push(DeleteEntry {
                        key: key.take()?,
                        version_id: version.take(),
                    });
                    if entries.len() > MAX_KEYS {
                        return None;
                    }
                }
            }
            Event::Text(t) => {
                let text = t.unescape().ok()?.into_owned();
                match path.last().map(Vec::as_slice) {
                    Some(b"Key") => key = Some(key.unwrap_or_default() + &text),
                    Some(b"VersionId") => version = Some(text),
                    Some(b"Quiet") => quiet = text.trim() == "true",
                    _ => {}
                }
            }
            Event::Eof => break,
            Event::Empty(_)
            | Event::Decl(_)
            | Event::Comment(_)
            | Event::CData(_)
            | Event::PI(_)
            | Event::DocType(_) => {}
        }
        buf.clear();
    }
    if !path.is_empty() || entries.is_empty() {
        return None;
    }
    Some(DeleteRequest { quiet, entries })
}

/// The `<DeleteResult>` document for `outcomes` (in request order).
pub fn result_xml(quiet: bool, outcomes: &[(DeleteEntry, DeleteOutcome)]) -> String {
    use quick_xml::escape::escape;
    let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<DeleteResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">");
    for (entry, outcome) in outcomes {
        match outcome {
            DeleteOutcome::Deleted if quiet => {}
            DeleteOutcome::Deleted => {
                xml.push_str(&format!(
                    "<Deleted><Key>{}</Key></Deleted>",
                    escape(&entry.key)
                ));
            }
            DeleteOutcome::Error { code, message } => xml.push_str(&format!(
                "<Error><Key>{}</Key><Code>{}</Code><Message>{}</Message></Error>",
                escape(&entry.key),
                escape(code),
                escape(message)
            )),
        }
    }
    xml.push_str("</DeleteResult>");
    xml
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_boto3_document() {
        let xml = br#"<?xml version="1.0" encoding="UTF-8"?><Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Object><Key>a&amp;b</Key></Object><Object><Key>c</Key><VersionId>v1</VersionId></Object><Quiet>true</Quiet></Delete>"#;
        let got = parse(xml).unwrap();
        assert!(got.quiet);
        assert_eq!(
            got.entries,
            vec![
                DeleteEntry {
                    key: "a&b".into(),
                    version_id: None
                },
                DeleteEntry {
                    key: "c".into(),
                    version_id: Some("v1".into())
                },
            ]
        );
    }

    #[test]
    fn refuses_bad_documents() {
        for xml in [
            &b"<Delete><Object><Key>a</Key></Object>"[..],
            b"<Nope/>",
            b"<Delete></Delete>",
            b"garbage<<",
            b"<Delete><Object></Object></Delete>",
        ] {
            assert!(parse(xml).is_none(), "{}", String::from_utf8_lossy(xml));
        }
    }

    #[test]
    fn golden_result() {
        let out = result_xml(
            false,
            &[
                (
                    DeleteEntry {
                        key: "a".into(),
                        version_id: None,
                    },
                    DeleteOutcome::Deleted,
                ),
                (
                    DeleteEntry {
                        key: "b".into(),
                        version_id: None,
                    },
                    DeleteOutcome::Error {
                        code: "FencingTokenStale".into(),
                        message: "m".into(),
                    },
                ),
            ],
        );
        assert!(out.ends_with("<Deleted><Key>a</Key></Deleted><Error><Key>b</Key><Code>FencingTokenStale</Code><Message>m</Message></Error></DeleteResult>"));
    }
}
