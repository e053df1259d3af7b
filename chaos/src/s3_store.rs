//! S3 in the chaos run: a record `<worker>:<seq>:<revision>` is one object
//! `records/<worker>-<seq>-<revision>` of bucket `chaos`, which every node's S3 gateway protects
//! in manifest mode. What the store applied, in order, is the manifest's commit log
//! (`.fencegate/log/job/<position>`, docs/S3_MANIFEST.md), read from moto itself at the end.
//!
//! With fencing bypassed, a worker appends its commit to that log itself with the store's
//! credentials and no fence check, as any writer holding them could: the log then shows what
//! the gateways would have refused. No physical object is written; the checker reads the log
//! only.
//!
//! Requests are signed by the S3 filter's own signer (`Upstream::sign`, aws-sigv4), as the
//! benchmarks sign theirs.

use std::time::Duration;

use fencegate_s3::manifest::{log_key, Entry, LogChange, LogEntry};
use fencegate_s3::upstream::Upstream;
use reqwest::{Method, StatusCode};

use crate::world::RESOURCE;

/// The bucket the records go to.
pub const BUCKET: &str = "chaos";
/// The prefix of the records' keys, the gateways' manifest rule.
pub const PREFIX: &str = "records/";
/// The workers' credentials, registered with every gateway (moto accepts any).
pub const ACCESS_KEY: &str = "AKIDCHAOS";
pub const SECRET: &str = "chaos-client-secret";

/// Error codes of the S3 gateway's refusals (README, S3 section).
const REFUSALS: [&str; 6] = [
    "FencingTokenRequired",
    "FencingTokenStale",
    "FencingTokenMalformed",
    "FencingTokenForged",
    "FencingTokenOutOfScope",
    "FencingUnsupportedOperation",
];

/// A bypassing writer gives up after losing this many positions to others in a row.
const APPEND_ATTEMPTS: u32 = 100;
/// The reader stops here whatever the log holds (a run writes a few thousand).
const MAX_POSITIONS: u64 = 10_000_000;

/// The key of `record` (`1:5:3` -> `records/1-5-3`).
pub fn key(record: &str) -> String {
    format!("{PREFIX}{}", record.replace(':', "-"))
}

/// The record a key names; `None` for a key outside [`PREFIX`].
pub fn record_of(key: &str) -> Option<String> {
    key.strip_prefix(PREFIX).map(|rest| rest.replace('-', ":"))
}

/// What a write got.
pub enum Answer {
    Ok,
    /// A fencing refusal, by its error code.
    Refused(String),
    /// Anything else (no answer, a timeout, a 503): it may or may not be applied.
    Other(String),
}

/// Signed requests to one S3 endpoint (a gateway, or moto itself).
pub struct S3Client {
    http: reqwest::Client,
    signer: Upstream,
}

impl S3Client {
    /// A client of `addr` (`host:port`) whose requests give up after `timeout`.
    pub fn new(addr: &str, timeout: Duration) -> Result<Self, String> {
        let signer = Upstream::new(&format!("http://{addr}"), "us-east-1", ACCESS_KEY, SECRET)
            .map_err(|e| e.to_string())?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(1))
            .timeout(timeout)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self { http, signer })
    }

    /// Sends a signed request for `key` of the bucket; returns the status and body.
    async fn send(
        &self,
        method: Method,
        key: &str,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Result<(StatusCode, String), String> {
        let path = Upstream::path_and_query(Some(BUCKET), Some(key), "");
        let host = self.signer.host_header();
        let signed = self
            .signer
            .sign(method.as_str(), &path, &[("host".to_owned(), host)])
            .map_err(|e| e.to_string())?;
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.signer.base))
            .body(body);
        for (name, value) in signed {
            request = request.header(name, value);
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let answer = request.send().await.map_err(|e| e.to_string())?;
        let status = answer.status();
        let text = answer.text().await.map_err(|e| e.to_string())?;
        Ok((status, text))
    }

    /// PUT of `record` through a gateway with `token` in `Fencing-Token`.
    pub async fn put_record(&self, record: &str, token: &str) -> Answer {
        let headers = [("fencing-token", token)];
        match self
            .send(Method::PUT, &key(record), &headers, record.into())
            .await
        {
            Err(e) => Answer::Other(e),
            Ok((status, _)) if status.is_success() => Answer::Ok,
            Ok((status, body)) => match error_code(&body) {
                Some(code) if REFUSALS.contains(&code) => Answer::Refused(code.to_owned()),
                code => Answer::Other(format!("{status} {}", code.unwrap_or("(no code)"))),
            },
        }
    }

    /// The first free position of the log (positions are taken in order, without gaps: each
    /// is created with `If-None-Match: *` only after the one before it exists).
    pub async fn log_end(&self) -> Result<u64, String> {
        self.log_end_after(0).await
    }

    /// The first free position of the log, knowing that `taken` (0: none) is taken.
    async fn log_end_after(&self, taken: u64) -> Result<u64, String> {
        let exists = |position: u64| async move {
            match self
                .send(Method::HEAD, &log_key(RESOURCE, position), &[], Vec::new())
                .await?
            {
                (StatusCode::OK, _) => Ok(true),
                (StatusCode::NOT_FOUND, _) => Ok(false),
                (status, _) => Err(format!("HEAD of log position {position}: {status}")),
            }
        };
        // Doubling the step to a free position, then a binary search below it.
        let (mut taken, mut step) = (taken, 1);
        let mut free = taken + step;
        while exists(free).await? {
            taken = free;
            step *= 2;
            free = taken + step;
            if free > MAX_POSITIONS {
                return Err(format!("the log has more than {MAX_POSITIONS} entries"));
            }
        }
        while free - taken > 1 {
            let middle = taken + (free - taken) / 2;
            if exists(middle).await? {
                taken = middle;
            } else {
                free = middle;
            }
        }
        Ok(free)
    }

    /// Appends a commit of `record` under `revision` at the first free position from `*next`,
    /// with no fence check (fencing bypassed); `*next` moves past the positions it finds taken.
    /// A lost position sends the writer to the log's end at once (a few HEADs): stepping one
    /// position at a time, a writer woken from a pause would spend its short life catching up.
    pub async fn append_unfenced(&self, next: &mut u64, record: &str, revision: u64) -> Answer {
        let entry = LogEntry {
            fence: revision,
            changes: vec![LogChange {
                key: key(record),
                put: Some(Entry {
                    physical: String::new(),
                    etag: String::new(),
                    size: record.len() as u64,
                    modified: String::new(),
                    revision,
                }),
            }],
            reset_to: None,
        };
        let body = serde_json::to_vec(&entry).expect("a log entry always serializes");
        for _ in 0..APPEND_ATTEMPTS {
            let position = *next;
            let answer = self
                .send(
                    Method::PUT,
                    &log_key(RESOURCE, position),
                    &[("if-none-match", "*")],
                    body.clone(),
                )
                .await;
            match answer {
                Err(e) => return Answer::Other(e),
                Ok((status, _)) if status.is_success() => {
                    *next = position + 1;
                    return Answer::Ok;
                }
                // Another writer took this position: go to the end.
                Ok((StatusCode::PRECONDITION_FAILED, _)) => {
                    match self.log_end_after(position).await {
                        Ok(end) => *next = end,
                        Err(e) => return Answer::Other(e),
                    }
                }
                Ok((status, body)) => {
                    return Answer::Other(format!(
                        "{status} {}",
                        error_code(&body).unwrap_or("(no code)")
                    ))
                }
            }
        }
        Answer::Other(format!(
            "{APPEND_ATTEMPTS} appends in a row lost their position"
        ))
    }

    /// The records the log commits, in log order (each entry's changes in order); a key outside
    /// [`PREFIX`] is returned as it is, so the checker reports it.
    pub async fn log_records(&self) -> Result<Vec<String>, String> {
        let mut records = Vec::new();
        for position in 1..=MAX_POSITIONS {
            let (status, body) = self
                .send(Method::GET, &log_key(RESOURCE, position), &[], Vec::new())
                .await?;
            match status {
                StatusCode::OK => {}
                StatusCode::NOT_FOUND => return Ok(records),
                status => return Err(format!("GET of log position {position}: {status}")),
            }
            let entry: LogEntry = serde_json::from_str(&body)
                .map_err(|e| format!("log position {position} does not parse: {e}"))?;
            for change in entry.changes.iter().filter(|c| c.put.is_some()) {
                records.push(record_of(&change.key).unwrap_or_else(|| change.key.clone()));
            }
        }
        Err(format!("the log has more than {MAX_POSITIONS} entries"))
    }
}

/// The `<Code>` of an S3 XML error body.
fn error_code(body: &str) -> Option<&str> {
    let start = body.find("<Code>")? + "<Code>".len();
    let len = body[start..].find("</Code>")?;
    Some(&body[start..start + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_records_round_trip() {
        assert_eq!(key("1:5:3"), "records/1-5-3");
        assert_eq!(record_of("records/1-5-3").as_deref(), Some("1:5:3"));
        assert_eq!(record_of("other/1-5-3"), None);
    }

    #[test]
    fn error_codes_are_read_and_junk_is_none() {
        let body = "<?xml version=\"1.0\"?><Error><Code>FencingTokenStale</Code></Error>";
        assert_eq!(error_code(body), Some("FencingTokenStale"));
        assert_eq!(error_code("<Code>cut"), None);
        assert_eq!(error_code(""), None);
    }
}
