//! A streaming decoder for `aws-chunked` bodies (SigV4 streaming uploads).
//!
//! ```text
//! <hex size>[;chunk-signature=<64 hex>]\r\n<data>\r\n ... 0[;chunk-signature=<sig>]\r\n
//! [<trailer name>:<value>\r\n ...]\r\n
//! ```
//!
//! Check-then-parse, like mini-redis's frame reader: a header line is parsed only once its
//! `\r\n` has arrived, data is passed on as zero-copy slices of the input as it arrives, and
//! every chunk signature is checked against the chain that starts at the request's signature.
//! Any byte sequence yields data or an error, never a panic (property-tested below).

use bytes::Bytes;
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::sigv4_verify::ChunkSigningContext;

/// The longest chunk header or trailer line accepted.
const MAX_LINE: usize = 4096;
/// The most trailer bytes accepted.
const MAX_TRAILER: usize = 16 * 1024;
/// The largest chunk size accepted (S3 SDKs send 64 KiB to 8 MiB).
const MAX_CHUNK: u64 = 64 * 1024 * 1024;

/// Why an `aws-chunked` body was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChunkError {
    /// A header or trailer line is not well formed.
    #[error("aws-chunked framing is malformed: {0}")]
    Framing(&'static str),
    /// A chunk's signature does not match.
    #[error("a chunk signature does not match")]
    BadSignature,
    /// The body ended before the final chunk and trailer.
    #[error("the aws-chunked body ended early")]
    Truncated,
    /// The decoded length differs from `x-amz-decoded-content-length`.
    #[error("the decoded length differs from x-amz-decoded-content-length")]
    LengthMismatch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Header,
    Data { remaining: u64 },
    DataEnd,
    Trailer,
    Done,
}

/// Decodes one `aws-chunked` body, checking chunk signatures when given a signing context.
pub struct ChunkDecoder {
    state: State,
    line: Vec<u8>,
    signing: Option<ChunkSigningContext>,
    signed_trailer: bool,
    previous_signature: String,
    expected_signature: Option<String>,
    hasher: Sha256,
    trailer_bytes: usize,
    trailers: Vec<(String, String)>,
    trailer_signature: Option<String>,
    decoded: u64,
    expected_len: Option<u64>,
}

impl ChunkDecoder {
    /// A decoder; `signing` checks chunk signatures (`STREAMING-AWS4-HMAC-SHA256-PAYLOAD*`),
    /// `signed_trailer` requires `x-amz-trailer-signature`, `expected_len` is
    /// `x-amz-decoded-content-length`.
    pub fn new(
        signing: Option<ChunkSigningContext>,
        signed_trailer: bool,
        expected_len: Option<u64>,
    ) -> Self {
        let previous_signature = signing
            .as_ref()
            .map(|s| s.seed_signature.clone())
            .unwrap_or_default();
        Self {
            state: State::Header,
            line: Vec::new(),
            signing,
            signed_trailer,
            previous_signature,
            expected_signature: None,
            hasher: Sha256::new(),
            trailer_bytes: 0,
            trailers: Vec::new(),
            trailer_signature: None,
            decoded: 0,
            expected_len,
        }
    }

    /// Feeds the next piece of the body; decoded data is appended to `out` as slices of `input`.
    pub fn feed(&mut self, input: &Bytes, out: &mut Vec<Bytes>) -> Result<(), ChunkError> {
        let mut pos = 0;
        while pos < input.len() {
            match self.state {
                State::Done => return Err(ChunkError::Framing("data after the final chunk")),
                State::Data { remaining } => {
                    let take = remaining.min((input.len() - pos) as u64) as usize;
                    let piece = input.slice(pos..pos + take);
                    if self.signing.is_some() {
                        self.hasher.update(&piece);
                    }
                    self.decoded += take as u64;
                    if self.expected_len.is_some_and(|len| self.decoded > len) {
                        return Err(ChunkError::LengthMismatch);
                    }
                    out.push(piece);
                    pos += take;
                    let remaining = remaining - take as u64;
                    self.state = if remaining == 0 {
                        self.end_of_chunk_data()?;
                        State::DataEnd
                    } else {
                        State::Data { remaining }
                    };
                }
                State::Header | State::DataEnd | State::Trailer => {
                    let Some(newline) = input[pos..].iter().position(|&b| b == b'\n') else {
                        self.push_line(&input[pos..])?;
                        return Ok(());
                    };
                    self.push_line(&input[pos..pos + newline])?;
                    pos += newline + 1;
                    let line = std::mem::take(&mut self.line);
                    let line = line
                        .strip_suffix(b"\r")
                        .ok_or(ChunkError::Framing("a line does not end with CRLF"))?;
                    self.on_line(line)?;
                }
            }
        }
        Ok(())
    }

    /// Checks that the body ended where the framing says it ends.
    pub fn finish(&self) -> Result<(), ChunkError> {
        if self.state != State::Done {
            return Err(ChunkError::Truncated);
        }
        if self.expected_len.is_some_and(|len| len != self.decoded) {
            return Err(ChunkError::LengthMismatch);
        }
        Ok(())
    }

    /// Trailer headers received after the final chunk (names lower-case), without the
    /// trailer signature.
    pub fn trailers(&self) -> &[(String, String)] {
        &self.trailers
    }

    /// How many payload bytes were decoded so far.
    pub fn decoded_len(&self) -> u64 {
        self.decoded
    }

    fn push_line(&mut self, piece: &[u8]) -> Result<(), ChunkError> {
        if self.line.len() + piece.len() > MAX_LINE {
            return Err(ChunkError::Framing("a header or trailer line is too long"));
        }
        self.line.extend_from_slice(piece);
        Ok(())
    }

    fn end_of_chunk_data(&mut self) -> Result<(), ChunkError> {
        if let Some(signing) = &self.signing {
            let digest = std::mem::take(&mut self.hasher).finalize();
            let want = signing.chunk_signature(&self.previous_signature, &hex::encode(digest));
            if self.expected_signature.as_deref() != Some(want.as_str()) {
                return Err(ChunkError::BadSignature);
            }
            self.previous_signature = want;
        }
        Ok(())
    }

    fn on_line(&mut self, line: &[u8]) -> Result<(), ChunkError> {
        match self.state {
            State::DataEnd => {
                if !line.is_empty() {
                    return Err(ChunkError::Framing("chunk data is longer than its size"));
                }
                self.state = State::Header;
            }
            State::Header => self.on_header(line)?,
            State::Trailer => self.on_trailer(line)?,
            State::Data { .. } | State::Done => unreachable!("lines are read only in line states"),
        }
        Ok(())
    }

    fn on_header(&mut self, line: &[u8]) -> Result<(), ChunkError> {
        let line =
            std::str::from_utf8(line).map_err(|_| ChunkError::Framing("non-UTF-8 chunk header"))?;
        let (size, extension) = match line.split_once(';') {
            Some((size, ext)) => (size, Some(ext)),
            None => (line, None),
        };
        if size.is_empty() || size.len() > 16 || !size.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ChunkError::Framing("the chunk size is not hexadecimal"));
        }
        let size = u64::from_str_radix(size, 16)
            .map_err(|_| ChunkError::Framing("the chunk size is not hexadecimal"))?;
        if size > MAX_CHUNK {
            return Err(ChunkError::Framing("a chunk is larger than 64 MiB"));
        }
        let signature = match extension {
            Some(ext) => Some(
                ext.strip_prefix("chunk-signature=")
                    .filter(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
                    .ok_or(ChunkError::Framing(
                        "the chunk extension is not chunk-signature=<64 hex>",
                    ))?
                    .to_ascii_lowercase(),
            ),
            None => None,
        };
        if self.signing.is_some() && signature.is_none() {
            return Err(ChunkError::BadSignature);
        }
        self.expected_signature = signature;
        if size == 0 {
            // The final chunk: its (empty) data is signed too.
            self.end_of_chunk_data()?;
            self.state = State::Trailer;
        } else {
            self.state = State::Data { remaining: size };
        }
        Ok(())
    }

    fn on_trailer(&mut self, line: &[u8]) -> Result<(), ChunkError> {
        if line.is_empty() {
            if self.signed_trailer {
                let signing = self.signing.as_ref().ok_or(ChunkError::BadSignature)?;
                let presented = self
                    .trailer_signature
                    .as_deref()
                    .ok_or(ChunkError::BadSignature)?;
                let mut lines = Vec::new();
                for (name, value) in &self.trailers {
                    lines.extend_from_slice(format!("{name}:{value}\n").as_bytes());
                }
                if signing.trailer_signature(&self.previous_signature, &lines) != presented {
                    return Err(ChunkError::BadSignature);
                }
            }
            self.state = State::Done;
            return Ok(());
        }
        self.trailer_bytes += line.len();
        if self.trailer_bytes > MAX_TRAILER || self.trailers.len() >= 16 {
            return Err(ChunkError::Framing("the trailer is too large"));
        }
        let line =
            std::str::from_utf8(line).map_err(|_| ChunkError::Framing("non-UTF-8 trailer"))?;
        let (name, value) = line
            .split_once(':')
            .ok_or(ChunkError::Framing("a trailer line is not name:value"))?;
        let name = name.trim().to_ascii_lowercase();
        let value = value.trim().to_owned();
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(ChunkError::Framing("a trailer name is not a header name"));
        }
        if name == "x-amz-trailer-signature" {
            self.trailer_signature = Some(value.to_ascii_lowercase());
        } else {
            self.trailers.push((name, value));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn decode_all(decoder: &mut ChunkDecoder, pieces: &[&[u8]]) -> Result<Vec<u8>, ChunkError> {
        let mut out = Vec::new();
        for piece in pieces {
            decoder.feed(&Bytes::copy_from_slice(piece), &mut out)?;
        }
        decoder.finish()?;
        Ok(out.concat())
    }

    #[test]
    fn unsigned_with_trailer() {
        let body = b"5\r\nhello\r\n6\r\n world\r\n0\r\nx-amz-checksum-crc32:DUoRhQ==\r\n\r\n";
        let mut d = ChunkDecoder::new(None, false, Some(11));
        assert_eq!(decode_all(&mut d, &[body]).unwrap(), b"hello world");
        assert_eq!(
            d.trailers(),
            &[("x-amz-checksum-crc32".to_owned(), "DUoRhQ==".to_owned())]
        );
        // Any split of the input decodes the same.
        for split in 0..body.len() {
            let mut d = ChunkDecoder::new(None, false, Some(11));
            let got = decode_all(&mut d, &[&body[..split], &body[split..]]).unwrap();
            assert_eq!(got, b"hello world", "split at {split}");
        }
    }

    #[test]
    fn framing_errors() {
        let cases: &[&[u8]] = &[
            b"zz\r\nhello\r\n",
            b"5\r\nhelloX\r\n",
            b"5\nhello\r\n",
            b"5;chunk-signature=short\r\nhello\r\n",
            b"0\r\n\r\nmore",
        ];
        for body in cases {
            let mut d = ChunkDecoder::new(None, false, None);
            assert!(
                decode_all(&mut d, &[body]).is_err(),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        let mut d = ChunkDecoder::new(None, false, None);
        assert_eq!(
            decode_all(&mut d, &[b"5\r\nhel"]),
            Err(ChunkError::Truncated)
        );
        let mut d = ChunkDecoder::new(None, false, Some(3));
        assert_eq!(
            decode_all(&mut d, &[b"5\r\nhello\r\n0\r\n\r\n"]),
            Err(ChunkError::LengthMismatch)
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(pieces in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..8)) {
            let mut d = ChunkDecoder::new(None, false, None);
            let mut out = Vec::new();
            for piece in &pieces {
                if d.feed(&Bytes::copy_from_slice(piece), &mut out).is_err() {
                    break;
                }
            }
            let _ = d.finish();
        }

        #[test]
        fn chunkish_bytes_never_panic(text in "([0-9a-f]{0,3}(;chunk-signature=[0-9a-f]{0,64})?\r?\n[a-z]{0,5}\r?\n){0,5}") {
            let mut d = ChunkDecoder::new(None, false, None);
            let mut out = Vec::new();
            let _ = d.feed(&Bytes::from(text.into_bytes()), &mut out);
            let _ = d.finish();
        }

        #[test]
        fn encoded_bodies_round_trip(data in proptest::collection::vec(any::<u8>(), 0..3000), chunk in 1usize..700, split in 0usize..4000) {
            let mut body = Vec::new();
            for piece in data.chunks(chunk) {
                body.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                body.extend_from_slice(piece);
                body.extend_from_slice(b"\r\n");
            }
            body.extend_from_slice(b"0\r\n\r\n");
            let split = split.min(body.len());
            let mut d = ChunkDecoder::new(None, false, Some(data.len() as u64));
            prop_assert_eq!(decode_all(&mut d, &[&body[..split], &body[split..]]).unwrap(), data);
        }
    }
}
