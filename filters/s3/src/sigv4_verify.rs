//! Verifying a client's SigV4 signature (header-signed and presigned requests).
//!
//! aws-sigv4 only signs, and it picks the headers it signs itself; a verifier must rebuild the
//! canonical request from exactly the headers the *client* listed in `SignedHeaders`. So this
//! module rebuilds the canonical request and string to sign (AWS SigV4 spec, S3 flavour: no path
//! normalization, single URI encoding) and compares HMACs with the RustCrypto `hmac`/`sha2`
//! crates the signer uses, in constant time. Pure: no I/O, no clock (the caller passes `now`).

use std::collections::HashMap;

use hmac::{Hmac, Mac};
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;

type HmacSha256 = Hmac<Sha256>;

/// The hash of an empty payload.
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
/// The largest clock difference accepted between a client and the gateway.
pub const MAX_SKEW_SECS: i64 = 15 * 60;
/// The longest presigned URL lifetime S3 allows (7 days).
pub const MAX_PRESIGN_SECS: i64 = 7 * 24 * 3600;

/// Characters left as-is by AWS URI encoding: `A-Za-z0-9-_.~`.
const AWS_ENCODE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');
/// The same, keeping `/` (object key paths).
const AWS_ENCODE_PATH: &AsciiSet = &AWS_ENCODE.remove(b'/');

/// The parts of a client request the signature covers.
#[derive(Debug, Clone)]
pub struct SignedRequest<'a> {
    /// The HTTP method.
    pub method: &'a str,
    /// The path as sent (percent-encoded).
    pub raw_path: &'a str,
    /// The query string as sent, without `?` (empty if none).
    pub raw_query: &'a str,
    /// Every header, names lower-case, in arrival order (repeats allowed).
    pub headers: &'a [(String, String)],
}

/// How the body is covered by the signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PayloadMode {
    /// `UNSIGNED-PAYLOAD`: the body is not covered.
    Unsigned,
    /// A hex SHA-256 the body must hash to.
    Sha256(String),
    /// `aws-chunked` with per-chunk signatures (`STREAMING-AWS4-HMAC-SHA256-PAYLOAD`), optionally
    /// with a signed trailer (`...-PAYLOAD-TRAILER`).
    SignedChunks {
        /// Whether a signed trailer follows the last chunk.
        trailer: bool,
    },
    /// `aws-chunked` without chunk signatures and with a trailer (`STREAMING-UNSIGNED-PAYLOAD-TRAILER`).
    UnsignedChunksTrailer,
}

impl PayloadMode {
    /// Whether the body is `aws-chunked` framed.
    pub fn is_chunked(&self) -> bool {
        matches!(
            self,
            Self::SignedChunks { .. } | Self::UnsignedChunksTrailer
        )
    }
}

/// A request whose signature matched.
#[derive(Clone)]
pub struct Verified {
    /// The client's access key id.
    pub access_key: String,
    /// How the body must be checked.
    pub payload: PayloadMode,
    /// What chunk signatures chain from.
    pub chunk_context: ChunkSigningContext,
    /// Whether the request was presigned (query auth).
    pub presigned: bool,
}

impl std::fmt::Debug for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verified")
            .field("access_key", &self.access_key)
            .field("payload", &self.payload)
            .field("presigned", &self.presigned)
            .finish()
    }
}

/// What chunk and trailer signatures are computed from: the derived key, the request's
/// timestamp and scope, and the seed (request) signature.
#[derive(Clone)]
pub struct ChunkSigningContext {
    signing_key: [u8; 32],
    amz_date: String,
    scope: String,
    /// The request's signature (the first chunk's "previous signature").
    pub seed_signature: String,
}

impl ChunkSigningContext {
    /// The signature a chunk with `data` must carry after `previous`.
    pub fn chunk_signature(&self, previous: &str, data_sha256_hex: &str) -> String {
        let string_to_sign = format!(
            "AWS4-HMAC-SHA256-PAYLOAD\n{}\n{}\n{previous}\n{EMPTY_SHA256}\n{data_sha256_hex}",
            self.amz_date, self.scope
        );
        hex::encode(hmac(&self.signing_key, string_to_sign.as_bytes()))
    }

    /// The signature a trailer (its `name:value\n` lines) must carry after `previous`.
    pub fn trailer_signature(&self, previous: &str, trailer_lines: &[u8]) -> String {
        let string_to_sign = format!(
            "AWS4-HMAC-SHA256-TRAILER\n{}\n{}\n{previous}\n{}",
            self.amz_date,
            self.scope,
            hex::encode(Sha256::digest(trailer_lines))
        );
        hex::encode(hmac(&self.signing_key, string_to_sign.as_bytes()))
    }
}

/// Why a request's signature was refused, mapped to S3's error codes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization` header and no `X-Amz-Signature` query parameter.
    Missing,
    /// The access key is not in the client table.
    UnknownAccessKey,
    /// The signature does not match.
    SignatureMismatch,
    /// The authorization data could not be parsed.
    Malformed(&'static str),
    /// The request time is more than 15 minutes from the gateway's clock.
    Skewed,
    /// A presigned URL past its expiry.
    Expired,
    /// A scope for another region or service.
    WrongScope,
}

impl AuthError {
    /// The HTTP status and S3 error code for this failure.
    pub fn status_and_code(&self) -> (u16, &'static str) {
        match self {
            Self::Missing => (403, "AccessDenied"),
            Self::UnknownAccessKey => (403, "InvalidAccessKeyId"),
            Self::SignatureMismatch => (403, "SignatureDoesNotMatch"),
            Self::Malformed(_) => (400, "AuthorizationHeaderMalformed"),
            Self::Skewed => (403, "RequestTimeTooSkewed"),
            Self::Expired => (403, "AccessDenied"),
            Self::WrongScope => (400, "AuthorizationHeaderMalformed"),
        }
    }

    /// A message safe to send to the client (it never repeats a signature or secret).
    pub fn message(&self) -> String {
        match self {
            Self::Missing => "Anonymous requests are not accepted by this gateway".into(),
            Self::UnknownAccessKey => {
                "The AWS Access Key Id you provided does not exist in our records.".into()
            }
            Self::SignatureMismatch => "The request signature we calculated does not match the signature you provided. Check your key and signing method.".into(),
            Self::Malformed(what) => format!("The authorization data is malformed: {what}"),
            Self::Skewed => "The difference between the request time and the current time is too large.".into(),
            Self::Expired => "Request has expired".into(),
            Self::WrongScope => "The credential scope names another region or service than this gateway's".into(),
        }
    }
}

struct AuthParts {
    access_key: String,
    date: String,
    region: String,
    service: String,
    signed_headers: Vec<String>,
    signature: String,
    amz_date: String,
    payload_hash: String,
    expires: Option<i64>,
    presigned: bool,
}

/// Verifies `request`'s signature with the secrets in `clients` for `region`, at `now`.
pub fn verify(
    request: &SignedRequest<'_>,
    clients: &HashMap<String, String>,
    region: &str,
    now: OffsetDateTime,
) -> Result<Verified, AuthError> {
    let parts = parse_auth(request)?;
    if parts.service != "s3" || parts.region != region {
        return Err(AuthError::WrongScope);
    }
    let secret = clients
        .get(&parts.access_key)
        .ok_or(AuthError::UnknownAccessKey)?;
    let signed_at =
        parse_amz_date(&parts.amz_date).ok_or(AuthError::Malformed("bad X-Amz-Date"))?;
    if !parts.amz_date.starts_with(&parts.date) {
        return Err(AuthError::Malformed(
            "the credential date is not the request date",
        ));
    }
    let age = (now - signed_at).whole_seconds();
    match parts.expires {
        Some(expires) => {
            if !(1..=MAX_PRESIGN_SECS).contains(&expires) {
                return Err(AuthError::Malformed("X-Amz-Expires must be 1 to 604800"));
            }
            if age > expires {
                return Err(AuthError::Expired);
            }
            if age < -MAX_SKEW_SECS {
                return Err(AuthError::Skewed);
            }
        }
        None => {
            if age.abs() > MAX_SKEW_SECS {
                return Err(AuthError::Skewed);
            }
        }
    }
    let scope = format!("{}/{}/s3/aws4_request", parts.date, parts.region);
    let signing_key = signing_key(secret, &parts.date, &parts.region, "s3");
    let query = canonical_query(request.raw_query, parts.presigned);
    let headers = canonical_headers(request.headers, &parts.signed_headers)?;
    // The path as sent first; then AWS's canonical encoding of it, for clients that send a
    // character raw that they encoded when signing (or the reverse).
    let normalized = canonical_path(request.raw_path);
    let mut candidates = vec![request.raw_path.to_owned()];
    if normalized != request.raw_path {
        candidates.push(normalized);
    }
    let presented = hex::decode(&parts.signature).map_err(|_| AuthError::SignatureMismatch)?;
    for path in candidates {
        let canonical = format!(
            "{}\n{}\n{}\n{}\n{}\n{}",
            request.method,
            if path.is_empty() { "/" } else { &path },
            query,
            headers,
            parts.signed_headers.join(";"),
            parts.payload_hash
        );
        let string_to_sign = format!(
            "AWS4-HMAC-SHA256\n{}\n{}\n{}",
            parts.amz_date,
            scope,
            hex::encode(Sha256::digest(canonical.as_bytes()))
        );
        let mut mac = HmacSha256::new_from_slice(&signing_key).expect("any key length");
        mac.update(string_to_sign.as_bytes());
        if mac.verify_slice(&presented).is_ok() {
            let payload = payload_mode(&parts.payload_hash)?;
            return Ok(Verified {
                access_key: parts.access_key,
                payload,
                chunk_context: ChunkSigningContext {
                    signing_key,
                    amz_date: parts.amz_date,
                    scope,
                    seed_signature: parts.signature,
                },
                presigned: parts.presigned,
            });
        }
    }
    Err(AuthError::SignatureMismatch)
}

fn payload_mode(hash: &str) -> Result<PayloadMode, AuthError> {
    Ok(match hash {
        "UNSIGNED-PAYLOAD" => PayloadMode::Unsigned,
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD" => PayloadMode::SignedChunks { trailer: false },
        "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER" => PayloadMode::SignedChunks { trailer: true },
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER" => PayloadMode::UnsignedChunksTrailer,
        h if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
            PayloadMode::Sha256(h.to_ascii_lowercase())
        }
        _ => return Err(AuthError::Malformed("unknown x-amz-content-sha256 value")),
    })
}

fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

fn query_params(raw_query: &str) -> Vec<(String, String)> {
    raw_query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    percent_decode_str(s).decode_utf8_lossy().into_owned()
}

fn parse_auth(request: &SignedRequest<'_>) -> Result<AuthParts, AuthError> {
    if let Some(auth) = header(request.headers, "authorization") {
        let rest = auth
            .strip_prefix("AWS4-HMAC-SHA256")
            .ok_or(AuthError::Malformed("only AWS4-HMAC-SHA256 is supported"))?;
        let mut credential = None;
        let mut signed_headers = None;
        let mut signature = None;
        for field in rest.split(',') {
            let field = field.trim();
            if let Some(v) = field.strip_prefix("Credential=") {
                credential = Some(v.to_owned());
            } else if let Some(v) = field.strip_prefix("SignedHeaders=") {
                signed_headers = Some(v.to_owned());
            } else if let Some(v) = field.strip_prefix("Signature=") {
                signature = Some(v.to_owned());
            }
        }
        let credential = credential.ok_or(AuthError::Malformed("no Credential"))?;
        let amz_date = header(request.headers, "x-amz-date")
            .ok_or(AuthError::Malformed("no X-Amz-Date header"))?
            .to_owned();
        let payload_hash = header(request.headers, "x-amz-content-sha256")
            .ok_or(AuthError::Malformed("no x-amz-content-sha256 header"))?
            .to_owned();
        build_parts(
            &credential,
            &signed_headers.ok_or(AuthError::Malformed("no SignedHeaders"))?,
            signature.ok_or(AuthError::Malformed("no Signature"))?,
            amz_date,
            payload_hash,
            None,
            false,
        )
    } else {
        let params: HashMap<String, String> = query_params(request.raw_query).into_iter().collect();
        if params.contains_key("AWSAccessKeyId") {
            return Err(AuthError::Malformed(
                "signature version 2 is not supported; presign with SigV4 (s3v4)",
            ));
        }
        let signature = params
            .get("X-Amz-Signature")
            .ok_or(AuthError::Missing)?
            .clone();
        if params.get("X-Amz-Algorithm").map(String::as_str) != Some("AWS4-HMAC-SHA256") {
            return Err(AuthError::Malformed(
                "X-Amz-Algorithm must be AWS4-HMAC-SHA256",
            ));
        }
        let get = |name: &'static str| {
            params
                .get(name)
                .cloned()
                .ok_or(AuthError::Malformed("a presigned URL parameter is missing"))
        };
        let expires = get("X-Amz-Expires")?
            .parse::<i64>()
            .map_err(|_| AuthError::Malformed("X-Amz-Expires is not a number"))?;
        let payload_hash = params
            .get("X-Amz-Content-Sha256")
            .cloned()
            .unwrap_or_else(|| "UNSIGNED-PAYLOAD".to_owned());
        build_parts(
            &get("X-Amz-Credential")?,
            &get("X-Amz-SignedHeaders")?,
            signature,
            get("X-Amz-Date")?,
            payload_hash,
            Some(expires),
            true,
        )
    }
}

fn build_parts(
    credential: &str,
    signed_headers: &str,
    signature: String,
    amz_date: String,
    payload_hash: String,
    expires: Option<i64>,
    presigned: bool,
) -> Result<AuthParts, AuthError> {
    let mut scope = credential.rsplitn(5, '/');
    let terminator = scope.next();
    let service = scope.next();
    let region = scope.next();
    let date = scope.next();
    let access_key = scope.next();
    let (Some("aws4_request"), Some(service), Some(region), Some(date), Some(access_key)) =
        (terminator, service, region, date, access_key)
    else {
        return Err(AuthError::Malformed(
            "Credential is not key/date/region/service/aws4_request",
        ));
    };
    if date.len() != 8 || !date.bytes().all(|b| b.is_ascii_digit()) {
        return Err(AuthError::Malformed("the credential date is not YYYYMMDD"));
    }
    if signature.len() != 64 || !signature.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(AuthError::Malformed("Signature is not 64 hex digits"));
    }
    let signed_headers: Vec<String> = signed_headers
        .split(';')
        .map(|h| h.trim().to_ascii_lowercase())
        .collect();
    if signed_headers.iter().any(String::is_empty) || !signed_headers.iter().any(|h| h == "host") {
        return Err(AuthError::Malformed("SignedHeaders must list host"));
    }
    Ok(AuthParts {
        access_key: access_key.to_owned(),
        date: date.to_owned(),
        region: region.to_owned(),
        service: service.to_owned(),
        signed_headers,
        signature,
        amz_date,
        payload_hash,
        expires,
        presigned,
    })
}

/// Parses `YYYYMMDDThhmmssZ`.
pub fn parse_amz_date(text: &str) -> Option<OffsetDateTime> {
    let format = time::macros::format_description!("[year][month][day]T[hour][minute][second]Z");
    time::PrimitiveDateTime::parse(text, &format)
        .ok()
        .map(time::PrimitiveDateTime::assume_utc)
}

/// The canonical query string: every parameter (but the signature) decoded, AWS-encoded,
/// sorted by name then value.
fn canonical_query(raw_query: &str, presigned: bool) -> String {
    let mut params: Vec<(String, String)> = query_params(raw_query)
        .into_iter()
        .filter(|(k, _)| !(presigned && k == "X-Amz-Signature"))
        .map(|(k, v)| (aws_encode(&k), aws_encode(&v)))
        .collect();
    params.sort();
    params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

fn canonical_headers(headers: &[(String, String)], signed: &[String]) -> Result<String, AuthError> {
    let mut names: Vec<&String> = signed.iter().collect();
    names.sort();
    let mut out = String::new();
    for name in names {
        let values: Vec<String> = headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        if values.is_empty() {
            return Err(AuthError::Malformed(
                "a signed header is missing from the request",
            ));
        }
        out.push_str(name);
        out.push(':');
        out.push_str(&values.join(","));
        out.push('\n');
    }
    Ok(out)
}

/// AWS URI encoding of a decoded string (everything but `A-Za-z0-9-_.~`).
pub fn aws_encode(text: &str) -> String {
    utf8_percent_encode(text, AWS_ENCODE).to_string()
}

/// The AWS canonical form of a raw path: decoded, then encoded keeping `/`.
pub fn canonical_path(raw_path: &str) -> String {
    encode_path(&decode(raw_path))
}

/// AWS URI encoding of a decoded path (bucket or key), keeping `/`.
pub fn encode_path(decoded: &str) -> String {
    utf8_percent_encode(decoded, AWS_ENCODE_PATH).to_string()
}

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(key).expect("any key length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

/// The SigV4 signing key for `secret` on `date` (YYYYMMDD).
pub fn signing_key(secret: &str, date: &str, region: &str, service: &str) -> [u8; 32] {
    let k_date = hmac(format!("AWS4{secret}").as_bytes(), date.as_bytes());
    let k_region = hmac(&k_date, region.as_bytes());
    let k_service = hmac(&k_region, service.as_bytes());
    hmac(&k_service, b"aws4_request")
}

#[cfg(test)]
mod tests {
    //! The examples of the AWS S3 SigV4 documentation ("Signature Calculations for the
    //! Authorization Header", "Query String Authentication", "Transferring Payload in
    //! Multiple Chunks").
    use super::*;

    const AKID: &str = "AKIAIOSFODNN7EXAMPLE";
    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";

    fn clients() -> HashMap<String, String> {
        HashMap::from([(AKID.to_owned(), SECRET.to_owned())])
    }

    fn at(text: &str) -> OffsetDateTime {
        parse_amz_date(text).unwrap()
    }

    fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn get_object_headers(signature: &str) -> Vec<(String, String)> {
        h(&[
            ("host", "examplebucket.s3.amazonaws.com"),
            ("range", "bytes=0-9"),
            ("x-amz-content-sha256", EMPTY_SHA256),
            ("x-amz-date", "20130524T000000Z"),
            ("authorization", &format!("AWS4-HMAC-SHA256 Credential={AKID}/20130524/us-east-1/s3/aws4_request,SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,Signature={signature}")),
        ])
    }

    #[test]
    fn aws_example_get_object_verifies() {
        let headers =
            get_object_headers("f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
        let request = SignedRequest {
            method: "GET",
            raw_path: "/test.txt",
            raw_query: "",
            headers: &headers,
        };
        let verified = verify(&request, &clients(), "us-east-1", at("20130524T000500Z")).unwrap();
        assert_eq!(verified.access_key, AKID);
        assert_eq!(
            verified.payload,
            PayloadMode::Sha256(EMPTY_SHA256.to_owned())
        );
    }

    #[test]
    fn tampering_is_refused() {
        let headers =
            get_object_headers("f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
        let other_path = SignedRequest {
            method: "GET",
            raw_path: "/test2.txt",
            raw_query: "",
            headers: &headers,
        };
        let now = at("20130524T000500Z");
        assert_eq!(
            verify(&other_path, &clients(), "us-east-1", now).unwrap_err(),
            AuthError::SignatureMismatch
        );
        let request = SignedRequest {
            raw_path: "/test.txt",
            ..other_path.clone()
        };
        let wrong_secret = HashMap::from([(AKID.to_owned(), "nope".to_owned())]);
        assert_eq!(
            verify(&request, &wrong_secret, "us-east-1", now).unwrap_err(),
            AuthError::SignatureMismatch
        );
        assert_eq!(
            verify(&request, &HashMap::new(), "us-east-1", now).unwrap_err(),
            AuthError::UnknownAccessKey
        );
        assert_eq!(
            verify(&request, &clients(), "us-east-1", at("20130524T002000Z")).unwrap_err(),
            AuthError::Skewed
        );
        assert_eq!(
            verify(&request, &clients(), "eu-west-1", now).unwrap_err(),
            AuthError::WrongScope
        );
    }

    #[test]
    fn aws_example_presigned_url_verifies_until_it_expires() {
        let headers = h(&[("host", "examplebucket.s3.amazonaws.com")]);
        let query = "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404";
        let request = SignedRequest {
            method: "GET",
            raw_path: "/test.txt",
            raw_query: query,
            headers: &headers,
        };
        let verified = verify(&request, &clients(), "us-east-1", at("20130524T120000Z")).unwrap();
        assert!(verified.presigned);
        assert_eq!(verified.payload, PayloadMode::Unsigned);
        assert_eq!(
            verify(&request, &clients(), "us-east-1", at("20130525T000001Z")).unwrap_err(),
            AuthError::Expired
        );
        let tampered = query.replace("86400", "86401");
        let request = SignedRequest {
            raw_query: &tampered,
            ..request
        };
        assert_eq!(
            verify(&request, &clients(), "us-east-1", at("20130524T120000Z")).unwrap_err(),
            AuthError::SignatureMismatch
        );
    }

    #[test]
    fn aws_example_chunked_upload_seed_and_chunk_signatures() {
        let headers = h(&[
            ("host", "s3.amazonaws.com"),
            ("x-amz-date", "20130524T000000Z"),
            ("x-amz-storage-class", "REDUCED_REDUNDANCY"),
            ("authorization", "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,SignedHeaders=content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;x-amz-decoded-content-length;x-amz-storage-class,Signature=4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"),
            ("x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"),
            ("content-encoding", "aws-chunked"),
            ("x-amz-decoded-content-length", "66560"),
            ("content-length", "66824"),
        ]);
        let request = SignedRequest {
            method: "PUT",
            raw_path: "/examplebucket/chunkObject.txt",
            raw_query: "",
            headers: &headers,
        };
        let verified = verify(&request, &clients(), "us-east-1", at("20130524T000000Z")).unwrap();
        assert_eq!(
            verified.payload,
            PayloadMode::SignedChunks { trailer: false }
        );
        let ctx = &verified.chunk_context;
        let first = ctx.chunk_signature(
            &ctx.seed_signature,
            &hex::encode(Sha256::digest(vec![b'a'; 65536])),
        );
        assert_eq!(
            first,
            "ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648"
        );
        let second = ctx.chunk_signature(&first, &hex::encode(Sha256::digest(vec![b'a'; 1024])));
        assert_eq!(
            second,
            "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497"
        );
        let last = ctx.chunk_signature(&second, EMPTY_SHA256);
        assert_eq!(
            last,
            "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9"
        );
    }

    #[test]
    fn canonical_query_sorts_and_encodes() {
        assert_eq!(
            canonical_query("b=2&a=1&uploads", false),
            "a=1&b=2&uploads="
        );
        assert_eq!(canonical_query("prefix=a%20b/c", false), "prefix=a%20b%2Fc");
        assert_eq!(canonical_path("/b/a b+c"), "/b/a%20b%2Bc");
    }
}
