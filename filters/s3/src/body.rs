//! The client's request body, checked while it streams (payload SHA-256, `aws-chunked` chunk
//! signatures, CRC32 trailers); the last piece is held back until the check passes, so a
//! body that fails it never reaches the store whole.

/// The largest XML body (CompleteMultipartUpload, DeleteObjects) accepted.
pub(crate) const MAX_XML_BODY: usize = 2 * 1024 * 1024;
use std::collections::VecDeque;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use bytes::Bytes;
use pingora_proxy::Session;
use sha2::{Digest, Sha256};

use crate::chunked::{ChunkDecoder, ChunkError};
use crate::sigv4_verify::{PayloadMode, Verified};

/// A failure reading the client's body.
pub(crate) enum BodyError {
    /// The client sent something wrong: answer with this.
    Client(u16, &'static str, String),
    /// The connection failed.
    Io,
}

impl From<ChunkError> for BodyError {
    fn from(e: ChunkError) -> Self {
        match e {
            ChunkError::BadSignature => {
                BodyError::Client(403, "SignatureDoesNotMatch", e.to_string())
            }
            ChunkError::Truncated => BodyError::Client(400, "IncompleteBody", e.to_string()),
            ChunkError::LengthMismatch => BodyError::Client(400, "IncompleteBody", e.to_string()),
            ChunkError::Framing(_) => BodyError::Client(400, "InvalidRequest", e.to_string()),
        }
    }
}

/// Reads the client's body, checking it as it streams; holds back the last piece until the
/// whole body has been checked.
pub(crate) struct BodyReader {
    hash: Option<(Sha256, String)>,
    decoder: Option<ChunkDecoder>,
    queue: VecDeque<Bytes>,
    held: Option<Bytes>,
    eof: bool,
    expect_continue: bool,
    /// CRC32 of the decoded body when the client announced an `x-amz-checksum-crc32` trailer.
    crc32: Option<crc32fast::Hasher>,
}

impl BodyReader {
    pub(crate) fn new(verified: &Verified, headers: &[(String, String)]) -> Self {
        let decoded_len =
            header(headers, "x-amz-decoded-content-length").and_then(|v| v.parse().ok());
        let (hash, decoder) = match &verified.payload {
            PayloadMode::Unsigned => (None, None),
            PayloadMode::Sha256(hex) => (Some((Sha256::new(), hex.clone())), None),
            PayloadMode::SignedChunks { trailer } => (
                None,
                Some(ChunkDecoder::new(
                    Some(verified.chunk_context.clone()),
                    *trailer,
                    decoded_len,
                )),
            ),
            PayloadMode::UnsignedChunksTrailer => {
                (None, Some(ChunkDecoder::new(None, false, decoded_len)))
            }
        };
        let decoder_present = decoder.is_some();
        let expect_continue =
            header(headers, "expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue"));
        Self {
            hash,
            decoder,
            queue: VecDeque::new(),
            held: None,
            eof: false,
            expect_continue,
            crc32: (decoder_present
                && header(headers, "x-amz-trailer")
                    .is_some_and(|t| t.eq_ignore_ascii_case("x-amz-checksum-crc32")))
            .then(crc32fast::Hasher::new),
        }
    }

    pub(crate) async fn next(&mut self, session: &mut Session) -> Result<Option<Bytes>, BodyError> {
        if self.expect_continue {
            self.expect_continue = false;
            session
                .as_downstream_mut()
                .write_continue_response()
                .await
                .map_err(|_| BodyError::Io)?;
        }
        loop {
            if let Some(piece) = self.queue.pop_front() {
                if let Some(previous) = self.held.replace(piece) {
                    return Ok(Some(previous));
                }
                continue;
            }
            if self.eof {
                return Ok(self.held.take());
            }
            match session.read_request_body().await {
                Ok(Some(data)) => {
                    if let Some(decoder) = &mut self.decoder {
                        let mut out = Vec::new();
                        decoder.feed(&data, &mut out)?;
                        if let Some(crc) = &mut self.crc32 {
                            out.iter().for_each(|piece| crc.update(piece));
                        }
                        self.queue.extend(out.into_iter().filter(|b| !b.is_empty()));
                    } else {
                        if let Some((hasher, _)) = &mut self.hash {
                            hasher.update(&data);
                        }
                        if !data.is_empty() {
                            self.queue.push_back(data);
                        }
                    }
                }
                Ok(None) => {
                    self.eof = true;
                    if let Some(decoder) = &self.decoder {
                        decoder.finish()?;
                        if let Some(crc) = self.crc32.take() {
                            let want = STANDARD.encode(crc.finalize().to_be_bytes());
                            let got = decoder
                                .trailers()
                                .iter()
                                .find(|(n, _)| n == "x-amz-checksum-crc32")
                                .map(|(_, v)| v.as_str());
                            if got != Some(want.as_str()) {
                                return Err(BodyError::Client(
                                    400,
                                    "BadDigest",
                                    "The CRC32 you specified did not match the calculated checksum."
                                        .into(),
                                ));
                            }
                        }
                    }
                    if let Some((hasher, want)) = self.hash.take() {
                        if hex::encode(hasher.finalize()) != *want {
                            return Err(BodyError::Client(
                                400,
                                "XAmzContentSHA256Mismatch",
                                "The provided 'x-amz-content-sha256' header does not match what was computed.".into(),
                            ));
                        }
                    }
                }
                Err(_) => return Err(BodyError::Io),
            }
        }
    }

    /// Reads the whole body, refusing it past `limit` bytes.
    pub(crate) async fn read_all(
        &mut self,
        session: &mut Session,
        limit: usize,
    ) -> Result<Bytes, BodyError> {
        let mut pieces = Vec::new();
        let mut len = 0;
        while let Some(piece) = self.next(session).await? {
            len += piece.len();
            if len > limit {
                return Err(BodyError::Client(
                    413,
                    "EntityTooLarge",
                    format!("the body is larger than {limit} bytes"),
                ));
            }
            pieces.push(piece);
        }
        Ok(Bytes::from(pieces.concat()))
    }

    /// Trailer checksums (`x-amz-checksum-*`) of an aws-chunked body, to forward as headers.
    pub(crate) fn trailer_checksums(&self) -> Vec<(String, String)> {
        self.decoder
            .as_ref()
            .map(|d| {
                d.trailers()
                    .iter()
                    .filter(|(n, _)| n.starts_with("x-amz-checksum-"))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}

pub(crate) fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Where a write's body comes from on each attempt.
pub(crate) enum Payload {
    /// Held whole: can be resent.
    Buffered(Bytes),
    /// Streams once from the client.
    Stream(u64),
}
