//! One S3 object per chunk, through the gateway: SigV4-signed requests with the job's own
//! credentials plus the `Fencing-Token` header (signed with the rest).
//!
//! The bucket's prefix is in manifest mode: every write (a new key included) is a commit into
//! the resource's manifest, which holds the fence, so the job just writes. Raising the fence
//! first is one commit that changes no key: a DELETE of a key that never exists. A chunk
//! counts as written when its object holds invoices.

use anyhow::Context;
use fencegate_s3::upstream::Upstream;
use reqwest::{Method, StatusCode};

use crate::invoice::Chunk;
use crate::outcome::Outcome;

pub struct S3Store {
    http: reqwest::Client,
    signer: Upstream,
    bucket: String,
    token: String,
    day: String,
}

impl S3Store {
    pub fn new(endpoint: &str, bucket: &str, token: &str, day: &str) -> anyhow::Result<Self> {
        let key_id = std::env::var("AWS_ACCESS_KEY_ID").context("AWS_ACCESS_KEY_ID is not set")?;
        let secret =
            std::env::var("AWS_SECRET_ACCESS_KEY").context("AWS_SECRET_ACCESS_KEY is not set")?;
        let region = std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into());
        Ok(Self {
            http: reqwest::Client::new(),
            signer: Upstream::new(endpoint, &region, &key_id, &secret)?,
            bucket: bucket.to_owned(),
            token: token.to_owned(),
            day: day.to_owned(),
        })
    }

    fn key(&self, chunk: u32) -> String {
        format!("invoices/{}/chunk-{chunk:02}.json", self.day)
    }

    async fn send(
        &self,
        method: Method,
        key: &str,
        body: Vec<u8>,
    ) -> anyhow::Result<reqwest::Response> {
        let path = Upstream::path_and_query(Some(&self.bucket), Some(key), "");
        let mut headers = vec![("host".to_owned(), self.signer.host_header())];
        if method == Method::PUT || method == Method::DELETE {
            headers.push(("fencing-token".to_owned(), self.token.clone()));
        }
        headers.extend(self.signer.sign(method.as_str(), &path, &headers)?);
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.signer.base))
            .body(body);
        for (name, value) in headers.iter().filter(|(n, _)| n != "host") {
            request = request.header(name, value);
        }
        Ok(request.send().await?)
    }

    /// Whether the object holds a written chunk.
    async fn has_chunk(&self, key: &str) -> anyhow::Result<bool> {
        let answer = self.send(Method::GET, key, Vec::new()).await?;
        match answer.status() {
            StatusCode::NOT_FOUND => Ok(false),
            s if s.is_success() => {
                let body: serde_json::Value =
                    serde_json::from_slice(&answer.bytes().await?).unwrap_or_default();
                Ok(body.get("invoices").is_some())
            }
            s => anyhow::bail!("GET {key}: {s}"),
        }
    }

    /// Raises the fence before anything else: deleting a key that never exists commits the
    /// token into the manifest (a stale holder's later commit is refused) and changes no key.
    pub async fn raise_fence(&self) -> anyhow::Result<Outcome> {
        let key = format!("invoices/{}/.raise-fence", self.day);
        let answer = self.send(Method::DELETE, &key, Vec::new()).await?;
        refused_or_written(&key, answer).await
    }

    pub async fn has(&self, chunk: &Chunk) -> anyhow::Result<bool> {
        self.has_chunk(&self.key(chunk.number)).await
    }

    pub async fn write(&self, chunk: &Chunk) -> anyhow::Result<Outcome> {
        self.put(&self.key(chunk.number), chunk.to_json().into_bytes())
            .await
    }

    async fn put(&self, key: &str, body: Vec<u8>) -> anyhow::Result<Outcome> {
        let answer = self.send(Method::PUT, key, body).await?;
        refused_or_written(key, answer).await
    }
}

/// A fencing refusal, or success; anything else is an error.
async fn refused_or_written(key: &str, answer: reqwest::Response) -> anyhow::Result<Outcome> {
    let status = answer.status();
    if status.is_success() {
        return Ok(Outcome::Written);
    }
    let text = answer.text().await.unwrap_or_default();
    let code = between(&text, "<Code>", "</Code>").unwrap_or_default();
    if code.starts_with("FencingToken") {
        let message = between(&text, "<Message>", "</Message>").unwrap_or_default();
        return Ok(Outcome::Refused(format!(
            "{} {code}: {message}",
            status.as_u16()
        )));
    }
    anyhow::bail!("{key}: {status} {code}")
}

/// The text between the first `open` and the next `close`.
fn between<'a>(text: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let start = text.find(open)? + open.len();
    let len = text[start..].find(close)?;
    Some(&text[start..start + len])
}
