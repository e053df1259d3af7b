//! Done-means 2 and 3: stale writes refused with 412 and audited once each, the object
//! unchanged; missing, malformed and forged tokens; bad signatures; presigned URLs.

use crate::harness::{token, Harness};
use fencegate_core::{Resource, Revision, Token, TokenKey};
use serde_json::json;

#[test]
fn a_lower_token_is_refused_after_a_higher_one_wrote() {
    let h = Harness::start();
    // The old holder (7) wrote first and started a multipart upload; then the new holder (10)
    // wrote the object.
    let setup = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "out.csv", "body": "old holder", "token": token(7)},
        {"op": "put", "bucket": "fenced", "key": "src.csv", "body": "copy source", "token": token(7)},
        {"op": "mpu_create", "bucket": "fenced", "key": "out.csv", "body": "zombie part", "token": token(7)},
        {"op": "put", "bucket": "fenced", "key": "out.csv", "body": "new holder", "token": token(10)},
        {"op": "head", "bucket": "fenced", "key": "out.csv"},
    ]));
    assert!(setup.iter().all(|r| r["ok"] == true), "{setup:?}");
    let before = &setup[4];
    let (upload_id, part_etag) = (setup[2]["upload_id"].clone(), setup[2]["part_etag"].clone());
    let refused = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "out.csv", "body": "zombie put", "token": token(7)},
        {"op": "mpu_complete", "bucket": "fenced", "key": "out.csv", "upload_id": upload_id, "part_etag": part_etag, "token": token(7)},
        {"op": "copy", "bucket": "fenced", "key": "out.csv", "source_key": "src.csv", "token": token(7)},
        {"op": "delete", "bucket": "fenced", "key": "out.csv", "token": token(7)},
        {"op": "head", "bucket": "fenced", "key": "out.csv"},
        {"op": "get", "bucket": "fenced", "key": "out.csv"},
    ]));
    for (i, r) in refused[..4].iter().enumerate() {
        println!("refused {i}: {r}");
        assert_eq!(r["status"], 412, "{r}");
        assert_eq!(r["code"], "FencingTokenStale", "{r}");
        let message = r["message"].as_str().unwrap();
        assert!(
            message.contains("revision 7") && message.contains("fence 10"),
            "{message}"
        );
    }
    // Unchanged: same ETag, same fence, same body.
    assert_eq!(refused[4]["etag"], before["etag"]);
    assert_eq!(refused[4]["metadata"]["fencegate-revision"], "10");
    assert_eq!(refused[5]["body"], "new holder");
    let events = h.audit.events();
    for e in &events {
        println!("audit: {}", serde_json::to_string(e).unwrap());
    }
    let commands: Vec<&str> = events
        .iter()
        .map(|e| e.operation.command.as_str())
        .collect();
    assert_eq!(
        commands,
        [
            "PutObject",
            "CompleteMultipartUpload",
            "CopyObject",
            "DeleteObject"
        ]
    );
    for e in &events {
        assert_eq!(
            (e.reason.as_str(), e.revision, e.fence),
            ("stale", Some(7), Some(10))
        );
        assert_eq!(e.store, "s3");
        assert_eq!(e.operation.objects, ["fenced/out.csv"]);
        assert_eq!(e.token.as_deref(), Some("fg1~7~job"));
    }
    // Equal is accepted: the new holder keeps writing with its token.
    let again = h.run(json!([{"op": "put", "bucket": "fenced", "key": "out.csv", "body": "new holder 2", "token": token(10)}]));
    assert_eq!(again[0]["ok"], true, "{again:?}");
    // A multi-delete by the stale holder is refused per key, and audited per key.
    let many = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "low.csv", "body": "x", "token": token(3)},
        {"op": "delete_many", "bucket": "fenced", "keys": ["out.csv", "low.csv"], "token": token(7)},
        {"op": "head", "bucket": "fenced", "key": "out.csv"},
    ]));
    println!("delete_many: {}", many[1]);
    assert_eq!(many[1]["deleted"], json!(["low.csv"]));
    assert_eq!(
        many[1]["errors"],
        json!([{"key": "out.csv", "code": "FencingTokenStale"}])
    );
    assert_eq!(many[2]["ok"], true);
    assert_eq!(h.audit.events().len(), 5);
}

#[test]
fn missing_malformed_and_unsupported_are_refused_and_audited() {
    let h = Harness::start();
    let results = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "k", "body": "no token"},
        {"op": "put", "bucket": "fenced", "key": "k", "body": "bad token", "token": "fg1~zero~job"},
        {"op": "delete", "bucket": "fenced", "key": "k"},
        {"op": "raw", "method": "PUT", "path": "/fenced/k?tagging", "body": "<Tagging><TagSet/></Tagging>", "headers": {"Fencing-Token": token(9)}},
        {"op": "raw", "method": "DELETE", "path": "/fenced", "headers": {"Fencing-Token": token(9)}},
        {"op": "list", "bucket": "fenced"},
    ]));
    for r in &results {
        println!("{r}");
    }
    assert_eq!(
        (results[0]["status"].clone(), results[0]["code"].clone()),
        (json!(428), json!("FencingTokenRequired"))
    );
    assert_eq!(
        (results[1]["status"].clone(), results[1]["code"].clone()),
        (json!(400), json!("FencingTokenMalformed"))
    );
    assert_eq!(results[2]["status"], 428);
    assert_eq!(results[3]["status"], 403);
    assert!(results[3]["body"]
        .as_str()
        .unwrap()
        .contains("FencingUnsupportedOperation"));
    assert_eq!(results[4]["status"], 403);
    assert_eq!(results[5]["keys"], json!([]));
    let reasons: Vec<String> = h.audit.events().iter().map(|e| e.reason.clone()).collect();
    assert_eq!(
        reasons,
        [
            "missing",
            "malformed",
            "missing",
            "unsupported",
            "unsupported"
        ]
    );
}

#[test]
fn forged_tokens_are_refused_when_the_cluster_signs() {
    let key = TokenKey::new(1, &[42u8; 32]).unwrap();
    let h = Harness::with_key(&key);
    let signed = Token::new(Resource::new("job").unwrap(), Revision::new(4).unwrap())
        .signed(&key)
        .to_string();
    let other = TokenKey::new(1, &[1u8; 32]).unwrap();
    let forged = Token::new(Resource::new("job").unwrap(), Revision::new(900).unwrap())
        .signed(&other)
        .to_string();
    let results = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "k", "body": "signed", "token": signed},
        {"op": "put", "bucket": "fenced", "key": "k", "body": "forged", "token": forged},
        {"op": "put", "bucket": "fenced", "key": "k", "body": "unsigned", "token": token(5)},
        {"op": "get", "bucket": "fenced", "key": "k"},
    ]));
    for r in &results {
        println!("{r}");
    }
    assert_eq!(results[0]["ok"], true);
    assert_eq!(
        (results[1]["status"].clone(), results[1]["code"].clone()),
        (json!(403), json!("FencingTokenForged"))
    );
    assert_eq!(
        (results[2]["status"].clone(), results[2]["code"].clone()),
        (json!(403), json!("FencingTokenForged"))
    );
    assert_eq!(results[3]["body"], "signed");
    let events = h.audit.events();
    assert_eq!(events.len(), 2);
    assert!(events.iter().all(|e| e.reason == "forged"));
    // The audit record never carries the signature.
    assert!(events.iter().all(|e| e
        .token
        .as_deref()
        .is_some_and(|t| t.matches('~').count() == 2)));
}

#[test]
fn signatures_are_checked_and_presigned_urls_work() {
    let h = Harness::start();
    let results = h.run(json!([
        {"op": "put", "bucket": "open", "key": "p.txt", "body": "presigned body"},
        {"op": "put", "bucket": "open", "key": "w.txt", "body": "x", "secret": "wrong-secret"},
        {"op": "get", "bucket": "open", "key": "p.txt", "secret": "wrong-secret"},
        {"op": "put", "bucket": "fenced", "key": "w.txt", "body": "x", "secret": "wrong-secret", "token": token(1)},
        {"op": "presigned_get", "bucket": "open", "key": "p.txt"},
        {"op": "presigned_get", "bucket": "open", "key": "p.txt", "tamper": "key"},
        {"op": "presigned_get", "bucket": "open", "key": "p.txt", "tamper": "signature"},
    ]));
    for r in &results {
        println!("{r}");
    }
    assert_eq!(results[0]["ok"], true);
    for r in &results[1..4] {
        assert_eq!(
            (r["status"].clone(), r["code"].clone()),
            (json!(403), json!("SignatureDoesNotMatch")),
            "{r}"
        );
    }
    assert_eq!(
        (results[4]["status"].clone(), results[4]["body"].clone()),
        (json!(200), json!("presigned body"))
    );
    assert_eq!(results[5]["status"], 403);
    assert!(results[5]["body"]
        .as_str()
        .unwrap()
        .contains("SignatureDoesNotMatch"));
    assert_eq!(results[6]["status"], 403);
    // Unknown access key.
    let unknown = crate::harness::s3_server::run_client(
        &h.endpoint,
        "AKIDUNKNOWN",
        "x",
        json!([{"op": "list", "bucket": "open"}]),
    );
    println!("{unknown}");
    assert_eq!(
        (unknown[0]["status"].clone(), unknown[0]["code"].clone()),
        (json!(403), json!("InvalidAccessKeyId"))
    );
    assert!(h.audit.events().is_empty());
}
