//! The upstream side: where the store is, and signing each upstream request with the
//! gateway's own credentials (aws-sigv4, the AWS SDK's signer).
//!
//! Upstream requests carry `x-amz-content-sha256: UNSIGNED-PAYLOAD`: the gateway has already
//! checked the client's payload hash or chunk signatures, and re-hashing would force it to
//! buffer whole bodies. Paths are sent path-style in AWS's canonical encoding, so the signer
//! (single encoding, no normalization: S3's rules) and the store see the same path.

use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;

use crate::error::S3Error;
use crate::sigv4_verify::encode_path;

/// Request headers never copied from a client request to the upstream one: the client's
/// signature and framing, hop-by-hop headers, and the fencing carrier.
pub const DROPPED_HEADERS: &[&str] = &[
    "authorization",
    "x-amz-date",
    "x-amz-content-sha256",
    "x-amz-security-token",
    "x-amz-decoded-content-length",
    "x-amz-trailer",
    "x-amz-sdk-checksum-algorithm",
    "host",
    "content-length",
    "transfer-encoding",
    "expect",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "upgrade",
    "fencing-token",
];

/// The store the gateway fronts and how it signs for it.
#[derive(Clone)]
pub struct Upstream {
    /// `http` or `https`.
    pub tls: bool,
    /// Host name or address.
    pub host: String,
    /// Port.
    pub port: u16,
    /// `scheme://host:port`, no trailing slash.
    pub base: String,
    region: String,
    credentials: Credentials,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("base", &self.base)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// Parses `http(s)://host[:port]` and keeps the gateway's credentials.
    pub fn new(url: &str, region: &str, access_key: &str, secret: &str) -> Result<Self, S3Error> {
        let (tls, rest) = if let Some(rest) = url.strip_prefix("https://") {
            (true, rest)
        } else if let Some(rest) = url.strip_prefix("http://") {
            (false, rest)
        } else {
            return Err(S3Error::Config(format!(
                "upstream {url:?} is not http(s)://host[:port]"
            )));
        };
        let authority = rest.trim_end_matches('/');
        if authority.contains('/') || authority.is_empty() {
            return Err(S3Error::Config(format!(
                "upstream {url:?} must not have a path"
            )));
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !host.ends_with(']') || port.parse::<u16>().is_ok() => (
                host.to_owned(),
                port.parse::<u16>()
                    .map_err(|_| S3Error::Config(format!("upstream {url:?} has a bad port")))?,
            ),
            _ => (authority.to_owned(), if tls { 443 } else { 80 }),
        };
        Ok(Self {
            tls,
            base: format!("{}://{host}:{port}", if tls { "https" } else { "http" }),
            host,
            port,
            region: region.to_owned(),
            credentials: Credentials::new(access_key, secret, None, None, "fencegate-config"),
        })
    }

    /// The `Host` header value for upstream requests.
    pub fn host_header(&self) -> String {
        match (self.tls, self.port) {
            (true, 443) | (false, 80) => self.host.clone(),
            _ => format!("{}:{}", self.host, self.port),
        }
    }

    /// The upstream path and query (path-style) for `bucket`/`key` and the client's raw query
    /// with presigning parameters removed.
    pub fn path_and_query(bucket: Option<&str>, key: Option<&str>, raw_query: &str) -> String {
        let mut path = String::from("/");
        if let Some(bucket) = bucket {
            path.push_str(&encode_path(bucket));
            if let Some(key) = key {
                path.push('/');
                path.push_str(&encode_path(key));
            }
        }
        let query: Vec<&str> = raw_query
            .split('&')
            .filter(|p| !p.is_empty() && !p.starts_with("X-Amz-") && !p.starts_with("x-amz-"))
            .collect();
        if !query.is_empty() {
            path.push('?');
            path.push_str(&query.join("&"));
        }
        path
    }

    /// Whether an HTTP client would send `path_and_query` exactly as given. URL parsers
    /// resolve `.`/`..` segments, so `/open/../billing/k` judged as a
    /// key of `open` would reach the store as `/billing/k`: such a request must be refused,
    /// never sent.
    pub fn sent_as_judged(&self, path_and_query: &str) -> bool {
        let path = path_and_query.split('?').next().unwrap_or("");
        reqwest::Url::parse(&format!("{}{path_and_query}", self.base))
            .is_ok_and(|url| url.path() == path)
    }

    /// Signs a request for `path_and_query` with `headers` (which must include `host`; every
    /// header given is signed); returns the headers to add (`authorization`, `x-amz-date`,
    /// `x-amz-content-sha256`).
    pub fn sign(
        &self,
        method: &str,
        path_and_query: &str,
        headers: &[(String, String)],
    ) -> Result<Vec<(String, String)>, S3Error> {
        let mut settings = SigningSettings::default();
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        let identity = self.credentials.clone().into();
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region(&self.region)
            .name("s3")
            .time(SystemTime::now())
            .settings(settings)
            .build()
            .map_err(|e| S3Error::Sign(e.to_string()))?
            .into();
        let url = format!("{}{path_and_query}", self.base);
        let signable = SignableRequest::new(
            method,
            url,
            headers.iter().map(|(n, v)| (n.as_str(), v.as_str())),
            SignableBody::UnsignedPayload,
        )
        .map_err(|e| S3Error::Sign(e.to_string()))?;
        let (instructions, _signature) = sign(signable, &params)
            .map_err(|e| S3Error::Sign(e.to_string()))?
            .into_parts();
        Ok(instructions
            .headers()
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints() {
        let u = Upstream::new("http://127.0.0.1:9000", "us-east-1", "a", "s").unwrap();
        assert_eq!((u.tls, u.host.as_str(), u.port), (false, "127.0.0.1", 9000));
        assert_eq!(u.host_header(), "127.0.0.1:9000");
        let u =
            Upstream::new("https://s3.eu-west-1.amazonaws.com/", "eu-west-1", "a", "s").unwrap();
        assert_eq!((u.tls, u.port), (true, 443));
        assert_eq!(u.host_header(), "s3.eu-west-1.amazonaws.com");
        assert!(Upstream::new("ftp://x", "r", "a", "s").is_err());
    }

    #[test]
    fn upstream_paths_are_path_style_without_presign_params() {
        assert_eq!(
            Upstream::path_and_query(Some("b"), Some("a b/c"), "X-Amz-Signature=x&versionId=3"),
            "/b/a%20b/c?versionId=3"
        );
        assert_eq!(Upstream::path_and_query(None, None, ""), "/");
        // Keys are decoded once (from the client's path) and encoded once: a literal `%20`
        // in a key stays a literal `%20`.
        assert_eq!(
            Upstream::path_and_query(Some("b"), Some("percent%20literal"), ""),
            "/b/percent%2520literal"
        );
    }

    #[test]
    fn normalizing_paths_are_detected() {
        let u = Upstream::new("http://127.0.0.1:9000", "us-east-1", "a", "s").unwrap();
        assert!(u.sent_as_judged(&Upstream::path_and_query(Some("b"), Some("a/b c"), "x=1")));
        assert!(u.sent_as_judged(&Upstream::path_and_query(Some("b"), Some("a//b..c"), "")));
        for key in ["../billing/k", "./k", "a/../../k", "a/.."] {
            let path = Upstream::path_and_query(Some("open"), Some(key), "");
            assert!(!u.sent_as_judged(&path), "{key:?} -> {path}");
        }
    }

    #[test]
    fn signature_verifies_with_our_verifier() {
        // The signer and the verifier agree: a request signed by aws-sigv4 for a client
        // secret verifies. (Both implement the same spec; this guards the settings.)
        let u = Upstream::new("http://127.0.0.1:9000", "us-east-1", "AK", "SECRET").unwrap();
        let mut headers = vec![
            ("host".to_owned(), u.host_header()),
            ("x-amz-meta-a".to_owned(), "1".to_owned()),
        ];
        let path = Upstream::path_and_query(Some("b"), Some("k +x"), "tagging");
        headers.extend(u.sign("PUT", &path, &headers).unwrap());
        let (p, q) = path.split_once('?').unwrap();
        let clients = std::collections::HashMap::from([("AK".to_owned(), "SECRET".to_owned())]);
        let req = crate::sigv4_verify::SignedRequest {
            method: "PUT",
            raw_path: p,
            raw_query: q,
            headers: &headers,
        };
        let v = crate::sigv4_verify::verify(
            &req,
            &clients,
            "us-east-1",
            time::OffsetDateTime::now_utc(),
        )
        .unwrap();
        assert_eq!(v.payload, crate::sigv4_verify::PayloadMode::Unsigned);
    }
}
