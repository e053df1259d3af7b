//! Object mode without its walk-arounds (issue 14): each test here reproduces a way around the
//! fence that the gateway used to let through, against moto, and checks it is refused, audited
//! once, and that the protected data is unchanged.

use crate::harness::{token, Harness};
use serde_json::json;

fn print(results: &[serde_json::Value]) {
    for (i, r) in results.iter().enumerate() {
        println!("{i}: {r}");
    }
}

/// `PUT /open/../fenced/k` was judged as key `../fenced/k` of the unprotected bucket `open`,
/// while the HTTP client towards the store resolved it to `/fenced/k`.
#[test]
fn dot_segments_cannot_reach_a_protected_key() {
    let h = Harness::start();
    let setup = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "k", "body": "holder", "token": token(5)},
    ]));
    assert_eq!(setup[0]["ok"], true, "{setup:?}");
    let results = h.run(json!([
        {"op": "put", "bucket": "open", "key": "../fenced/k", "body": "tokenless"},
        {"op": "delete", "bucket": "open", "key": "../fenced/k"},
        {"op": "delete_many", "bucket": "open", "keys": ["../fenced/k"]},
    ]));
    print(&results);
    assert_eq!(
        (results[0]["status"].clone(), results[0]["code"].clone()),
        (json!(403), json!("FencingUnsupportedOperation"))
    );
    assert_eq!(results[1]["status"], 403, "{}", results[1]);
    assert_eq!(
        results[2]["errors"],
        json!([{"key": "../fenced/k", "code": "FencingUnsupportedOperation"}])
    );
    let after = h.direct(json!([{"op": "get", "bucket": "fenced", "key": "k"}]));
    assert_eq!(after[0]["body"], "holder");
    assert_eq!(after[0]["metadata"]["fencegate-revision"], "5");
    let events = h.audit.events();
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(events.iter().all(|e| e.reason == "unsupported"));
}

/// Bucket-level writes passed tokenless when the bucket's first rule was `mode = "off"`.
#[test]
fn bucket_level_writes_are_refused_when_any_rule_protects() {
    let h = Harness::start();
    let versioning = "<VersioningConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Status>Enabled</Status></VersioningConfiguration>";
    let results = h.run(json!([
        {"op": "raw", "method": "PUT", "path": "/mixed?versioning", "body": versioning},
        {"op": "raw", "method": "PUT", "path": "/mixed?versioning", "body": versioning, "headers": {"Fencing-Token": token(5)}},
        {"op": "raw", "method": "DELETE", "path": "/mixed?lifecycle"},
        {"op": "put", "bucket": "mixed", "key": "tmp/scratch", "body": "off prefix, no token"},
    ]));
    print(&results);
    for r in &results[..3] {
        assert_eq!(r["status"], 403, "{r}");
        assert!(r["body"]
            .as_str()
            .unwrap()
            .contains("FencingUnsupportedOperation"));
    }
    assert_eq!(results[3]["ok"], true, "{}", results[3]);
    let after = h.direct(json!([{"op": "bucket_versioning", "bucket": "mixed"}]));
    assert_eq!(after[0]["status"], "", "{after:?}");
    let events = h.audit.events();
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(events.iter().all(|e| e.reason == "unsupported"));
}

/// DeleteObjects checked the token against the first protected rule only; a token for one
/// prefix's resource deleted keys of another resource.
#[test]
fn delete_objects_judges_each_key_by_its_own_rule() {
    let h = Harness::start();
    let setup = h.run(json!([
        {"op": "put", "bucket": "mixed", "key": "tmp/x", "body": "scratch"},
        {"op": "put", "bucket": "mixed", "key": "data/x", "body": "job data", "token": token(5)},
        {"op": "put", "bucket": "mixed", "key": "other/x", "body": "other data", "token": "fg1~5~other"},
    ]));
    assert!(setup.iter().all(|r| r["ok"] == true), "{setup:?}");
    let results = h.run(json!([
        {"op": "delete_many", "bucket": "mixed", "keys": ["tmp/x", "data/x", "other/x"], "token": token(6)},
        {"op": "put", "bucket": "mixed", "key": "other/y", "body": "wrong job", "token": token(6)},
    ]));
    print(&results);
    assert_eq!(results[0]["deleted"], json!(["data/x", "tmp/x"]));
    assert_eq!(
        results[0]["errors"],
        json!([{"key": "other/x", "code": "FencingTokenOutOfScope"}])
    );
    assert_eq!(
        (results[1]["status"].clone(), results[1]["code"].clone()),
        (json!(403), json!("FencingTokenOutOfScope"))
    );
    let after = h.direct(json!([
        {"op": "get", "bucket": "mixed", "key": "other/x"},
        {"op": "list", "bucket": "mixed"},
    ]));
    assert_eq!(after[0]["body"], "other data");
    assert_eq!(after[1]["keys"], json!(["other/x"]));
    let events = h.audit.events();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events.iter().all(|e| e.reason == "out_of_scope"));
    assert_eq!(events[0].operation.objects, ["mixed/other/x"]);
}

/// UploadPart, UploadPartCopy and AbortMultipartUpload on protected keys needed no token.
#[test]
fn multipart_steps_need_a_token_for_the_rules_resource() {
    let h = Harness::start();
    let created = h.run(json!([
        {"op": "mpu_create", "bucket": "fenced", "key": "m", "body": "holder part", "token": token(5)},
    ]));
    assert_eq!(created[0]["ok"], true, "{created:?}");
    let (upload_id, part_etag) = (
        created[0]["upload_id"].clone(),
        created[0]["part_etag"].clone(),
    );
    let results = h.run(json!([
        {"op": "upload_part", "bucket": "fenced", "key": "m", "upload_id": upload_id, "body": "swapped"},
        {"op": "upload_part", "bucket": "fenced", "key": "m", "upload_id": upload_id, "body": "swapped", "token": "fg1~9~other"},
        {"op": "abort", "bucket": "fenced", "key": "m", "upload_id": upload_id},
        {"op": "mpu_complete", "bucket": "fenced", "key": "m", "upload_id": upload_id, "part_etag": part_etag, "token": token(5)},
        {"op": "get", "bucket": "fenced", "key": "m"},
    ]));
    print(&results);
    assert_eq!(results[0]["status"], 428);
    assert_eq!(
        (results[1]["status"].clone(), results[1]["code"].clone()),
        (json!(403), json!("FencingTokenOutOfScope"))
    );
    assert_eq!(results[2]["status"], 428);
    assert_eq!(results[3]["ok"], true, "{}", results[3]);
    assert_eq!(results[4]["body"], "holder part");
    let reasons: Vec<String> = h.audit.events().iter().map(|e| e.reason.clone()).collect();
    assert_eq!(reasons, ["missing", "out_of_scope", "missing"]);
}

/// Completing an upload through another key's URL landed it on the key it was created for,
/// over the new holder's data (fence 12 -> 10).
#[test]
fn an_upload_completes_only_through_its_own_key() {
    let h = Harness::start();
    let setup = h.run(json!([
        {"op": "mpu_create", "bucket": "fenced", "key": "a", "body": "stale part", "token": token(10)},
        {"op": "put", "bucket": "fenced", "key": "a", "body": "new holder", "token": token(12)},
    ]));
    assert!(setup.iter().all(|r| r["ok"] == true), "{setup:?}");
    let results = h.run(json!([
        {"op": "mpu_complete", "bucket": "fenced", "key": "b", "upload_id": setup[0]["upload_id"], "part_etag": setup[0]["part_etag"], "token": token(10)},
    ]));
    print(&results);
    assert_eq!(results[0]["status"], 403, "{}", results[0]);
    let after = h.direct(json!([
        {"op": "get", "bucket": "fenced", "key": "a"},
        {"op": "head", "bucket": "fenced", "key": "b"},
    ]));
    assert_eq!(after[0]["body"], "new holder");
    assert_eq!(after[0]["metadata"]["fencegate-revision"], "12");
    assert_eq!(after[1]["status"], 404);
    assert_eq!(h.audit.events().len(), 1);
}

/// 10,000 uploads created by anyone with a valid token flushed the in-memory upload map, so
/// the holder's own completion was refused.
#[test]
fn a_flood_of_uploads_cannot_flush_the_holders() {
    let h = Harness::start();
    let created = h.run(json!([
        {"op": "mpu_create", "bucket": "fenced", "key": "h", "body": "holder part", "token": token(5)},
        {"op": "mpu_flood", "bucket": "fenced", "prefix": "junk/", "count": 10_000, "token": token(5)},
    ]));
    assert_eq!(created[1]["created"], 10_000, "{created:?}");
    let done = h.run(json!([
        {"op": "mpu_complete", "bucket": "fenced", "key": "h", "upload_id": created[0]["upload_id"], "part_etag": created[0]["part_etag"], "token": token(5)},
        {"op": "get", "bucket": "fenced", "key": "h"},
    ]));
    print(&done);
    assert_eq!(done[0]["ok"], true);
    assert_eq!(done[1]["body"], "holder part");
    assert!(h.audit.events().is_empty());
}

/// Hole (b) in object mode: node 1 remembered the ETag of the stale holder's bytes; node 2's
/// new holder wrote identical bytes (same ETag, higher fence); node 1's next stale write
/// matched its remembered ETag and lowered the fence.
#[test]
fn a_remembered_etag_is_never_trusted_across_nodes() {
    let h = Harness::start();
    let node2 = h.second_node();
    let stale = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "c", "body": "same bytes", "token": token(4)},
    ]));
    assert_eq!(stale[0]["ok"], true);
    let fresh = node2.run(json!([
        {"op": "put", "bucket": "fenced", "key": "c", "body": "same bytes", "token": token(6)},
    ]));
    assert_eq!(fresh[0]["ok"], true);
    assert_eq!(
        fresh[0]["etag"], stale[0]["etag"],
        "identical bytes, same ETag"
    );
    let late = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "c", "body": "late write", "token": token(4)},
    ]));
    print(&late);
    assert_eq!(
        (late[0]["status"].clone(), late[0]["code"].clone()),
        (json!(412), json!("FencingTokenStale"))
    );
    let after = h.direct(json!([{"op": "get", "bucket": "fenced", "key": "c"}]));
    assert_eq!(after[0]["body"], "same bytes");
    assert_eq!(after[0]["metadata"]["fencegate-revision"], "6");
    assert_eq!(h.audit.events().len(), 1);
    assert!(node2.audit.events().is_empty());
}
