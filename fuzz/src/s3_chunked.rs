//! `aws-chunked` bodies (`fencegate_s3::chunked`): any bytes decode to data or an error, never
//! a panic; the outcome (data, trailers, error) does not depend on how the body is split into
//! reads; the decoded length is what was passed on and never more than the input. Half the
//! inputs are decoded with chunk signatures checked (the context of the AWS documentation's
//! chunked-upload example), so the signature paths run too.

use std::collections::HashMap;
use std::sync::OnceLock;

use bytes::Bytes;
use fencegate_s3::chunked::{ChunkDecoder, ChunkError};
use fencegate_s3::sigv4_verify::{parse_amz_date, verify, ChunkSigningContext, SignedRequest};

/// The signing context of the AWS example "Transferring Payload in Multiple Chunks".
pub fn example_context() -> ChunkSigningContext {
    static CONTEXT: OnceLock<ChunkSigningContext> = OnceLock::new();
    CONTEXT
        .get_or_init(|| {
            let headers: Vec<(String, String)> = [
                ("host", "s3.amazonaws.com"),
                ("x-amz-date", "20130524T000000Z"),
                ("x-amz-storage-class", "REDUCED_REDUNDANCY"),
                ("authorization", "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,SignedHeaders=content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;x-amz-decoded-content-length;x-amz-storage-class,Signature=4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"),
                ("x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"),
                ("content-encoding", "aws-chunked"),
                ("x-amz-decoded-content-length", "66560"),
                ("content-length", "66824"),
            ]
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect();
            let request = SignedRequest {
                method: "PUT",
                raw_path: "/examplebucket/chunkObject.txt",
                raw_query: "",
                headers: &headers,
            };
            let clients = HashMap::from([(
                "AKIAIOSFODNN7EXAMPLE".to_owned(),
                "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".to_owned(),
            )]);
            let now = parse_amz_date("20130524T000000Z").expect("a valid date");
            verify(&request, &clients, "us-east-1", now)
                .expect("the AWS example verifies")
                .chunk_context
        })
        .clone()
}

#[derive(Debug, PartialEq)]
struct Outcome {
    data: Vec<u8>,
    trailers: Vec<(String, String)>,
    result: Result<(), ChunkError>,
}

fn decode(pieces: &[&[u8]], mode: u8, expected_len: Option<u64>) -> Outcome {
    let signing = (mode & 1 == 1).then(example_context);
    let signed_trailer = mode & 2 == 2;
    let mut decoder = ChunkDecoder::new(signing, signed_trailer, expected_len);
    let mut out = Vec::new();
    let mut result = Ok(());
    for piece in pieces {
        result = decoder.feed(&Bytes::copy_from_slice(piece), &mut out);
        if result.is_err() {
            break;
        }
    }
    if result.is_ok() {
        result = decoder.finish();
    }
    let mut data = out.concat();
    if result.is_ok() {
        assert_eq!(decoder.decoded_len(), data.len() as u64);
    } else {
        // Data passed on before a refusal depends on where reads ended; it is discarded anyway.
        data.clear();
    }
    Outcome {
        data,
        trailers: decoder.trailers().to_vec(),
        result,
    }
}

/// The fuzz target's body.
pub fn check(data: &[u8]) {
    let [mode, len, split, body @ ..] = data else {
        return;
    };
    // The declared decoded length: none, or one near the body's size.
    let expected_len = (mode & 4 == 4).then_some(u64::from(*len));
    let whole = decode(&[body], *mode, expected_len);
    assert!(whole.data.len() <= body.len());
    let split = decode(&crate::pieces(body, *split), *mode, expected_len);
    assert_eq!(whole, split, "split delivery changed the outcome");
}
