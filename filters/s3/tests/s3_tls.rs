//! boto3 over HTTPS at default settings: it then sends every upload as aws-chunked with
//! `STREAMING-UNSIGNED-PAYLOAD-TRAILER` and a CRC32 trailer (the form recent AWS SDKs use by
//! default); the gateway decodes it, forwards the checksum, and fences the write.

mod harness;

use harness::{token, Harness};
use serde_json::json;

#[test]
fn boto3_default_chunked_uploads_over_https() {
    let h = Harness::with_tls();
    std::env::set_var("S3_CA_BUNDLE", h.ca_bundle());
    let size = 11 * 1024 * 1024;
    let results = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "tls.txt", "body": "over https, chunked", "token": token(3)},
        {"op": "get", "bucket": "fenced", "key": "tls.txt"},
        {"op": "put", "bucket": "fenced", "key": "big.bin", "size": 3 * 1024 * 1024 + 17, "token": token(3)},
        {"op": "get", "bucket": "fenced", "key": "big.bin"},
        {"op": "pattern_sha256", "size": 3 * 1024 * 1024 + 17},
        {"op": "multipart", "bucket": "fenced", "key": "mp.bin", "size": size, "token": token(3)},
        {"op": "get", "bucket": "fenced", "key": "mp.bin"},
        {"op": "pattern_sha256", "size": size, "seed": "multipart"},
        {"op": "put", "bucket": "fenced", "key": "tls.txt", "body": "stale", "token": token(2)},
        // Above the 16 MiB retry buffer: the fenced write streams its decoded body once.
        {"op": "put", "bucket": "fenced", "key": "streamed.bin", "size": 20 * 1024 * 1024 + 3, "token": token(3)},
        {"op": "get", "bucket": "fenced", "key": "streamed.bin"},
        {"op": "pattern_sha256", "size": 20 * 1024 * 1024 + 3},
        {"op": "presigned_get", "bucket": "fenced", "key": "tls.txt"},
    ]));
    for r in &results {
        let mut r = r.clone();
        if r["body"].as_str().is_some_and(|b| b.len() > 80) {
            r["body"] = json!("...");
        }
        println!("{r}");
    }
    assert_eq!(results[0]["ok"], true);
    // boto3 really sent aws-chunked with a trailer.
    assert_eq!(
        results[0]["sent"]["payload"],
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    );
    assert_eq!(results[0]["sent"]["encoding"], "aws-chunked");
    assert_eq!(results[1]["body"], "over https, chunked");
    assert_eq!(results[1]["metadata"]["fencegate-revision"], "3");
    assert_eq!(results[3]["sha256"], results[4]["sha256"]);
    assert_eq!(results[6]["sha256"], results[7]["sha256"]);
    assert_eq!(
        (results[8]["status"].clone(), results[8]["code"].clone()),
        (json!(412), json!("FencingTokenStale"))
    );
    assert_eq!(
        results[9]["sent"]["payload"],
        "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    );
    assert_eq!(results[10]["sha256"], results[11]["sha256"]);
    assert_eq!(results[10]["metadata"]["fencegate-revision"], "3");
    assert_eq!(h.audit.events().len(), 1);
}
