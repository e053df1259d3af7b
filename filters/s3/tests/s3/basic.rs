//! Done-means 1: boto3 at default settings puts, gets, lists, copies, does a multipart
//! upload and deletes through the gateway with a current token.

use crate::harness::{token, Harness};
use serde_json::json;

#[test]
fn boto3_round_trip_with_a_current_token() {
    let h = Harness::start();
    let t = token(5);
    let size = 11 * 1024 * 1024;
    let results = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "dir/a.txt", "body": "hello fenced world", "token": t},
        {"op": "get", "bucket": "fenced", "key": "dir/a.txt"},
        {"op": "put", "bucket": "fenced", "key": "dir/a.txt", "body": "second write, same token", "token": t},
        {"op": "list", "bucket": "fenced", "prefix": "dir/"},
        {"op": "copy", "bucket": "fenced", "key": "dir/b.txt", "source_key": "dir/a.txt", "token": t},
        {"op": "head", "bucket": "fenced", "key": "dir/b.txt"},
        {"op": "multipart", "bucket": "fenced", "key": "dir/big.bin", "size": size, "token": t},
        {"op": "get", "bucket": "fenced", "key": "dir/big.bin"},
        {"op": "pattern_sha256", "size": size, "seed": "multipart"},
        {"op": "delete", "bucket": "fenced", "key": "dir/a.txt", "token": t},
        {"op": "delete_many", "bucket": "fenced", "keys": ["dir/b.txt", "dir/big.bin"], "token": t},
        {"op": "list", "bucket": "fenced", "prefix": "dir/"},
        {"op": "put", "bucket": "open", "key": "x", "body": "no token needed here"},
        {"op": "get", "bucket": "open", "key": "x"},
    ]));
    for (i, r) in results.iter().enumerate() {
        println!("step {i}: {}", truncate(r));
        assert_eq!(r["ok"], true, "step {i} failed: {r}");
    }
    assert_eq!(results[1]["body"], "hello fenced world");
    assert_eq!(results[1]["metadata"]["fencegate-revision"], "5");
    assert_eq!(results[1]["metadata"]["fencegate-resource"], "job");
    assert_eq!(results[3]["keys"], json!(["dir/a.txt"]));
    assert_eq!(results[5]["metadata"]["fencegate-revision"], "5");
    assert_eq!(results[7]["size"], size);
    assert_eq!(results[7]["sha256"], results[8]["sha256"]);
    assert_eq!(results[7]["metadata"]["fencegate-revision"], "5");
    assert_eq!(results[10]["deleted"], json!(["dir/b.txt", "dir/big.bin"]));
    assert_eq!(results[11]["keys"], json!([]));
    assert_eq!(results[13]["body"], "no token needed here");
    assert!(h.audit.events().is_empty(), "{:?}", h.audit.events());
}

fn truncate(v: &serde_json::Value) -> String {
    let s = v.to_string();
    s.chars().take(300).collect()
}

#[test]
fn virtual_hosted_style_and_client_conditions() {
    let h = Harness::start();
    let (t, v) = (token(5), "s3.test");
    let results = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "v.txt", "body": "virtual", "token": t, "virtual_host": v},
        {"op": "get", "bucket": "fenced", "key": "v.txt", "virtual_host": v},
        {"op": "list", "bucket": "fenced", "virtual_host": v},
        {"op": "put", "bucket": "fenced", "key": "v.txt", "body": "no token", "virtual_host": v},
        // The client's own conditions are honoured, not overwritten.
        {"op": "put", "bucket": "fenced", "key": "v.txt", "body": "x", "token": t, "if_none_match": "*"},
        {"op": "put", "bucket": "fenced", "key": "v.txt", "body": "x", "token": t, "if_match": "\"0000\""},
        {"op": "put", "bucket": "fenced", "key": "new.txt", "body": "x", "token": t, "if_match": "\"0000\""},
        {"op": "head", "bucket": "fenced", "key": "v.txt"},
    ]));
    for (i, r) in results.iter().enumerate() {
        println!("step {i}: {}", truncate(r));
    }
    assert_eq!(results[0]["ok"], true);
    assert_eq!(results[1]["body"], "virtual");
    assert_eq!(results[2]["keys"], json!(["v.txt"]));
    assert_eq!(results[3]["status"], 428);
    assert_eq!(
        (results[4]["status"].clone(), results[4]["code"].clone()),
        (json!(412), json!("PreconditionFailed"))
    );
    assert_eq!(
        (results[5]["status"].clone(), results[5]["code"].clone()),
        (json!(412), json!("PreconditionFailed"))
    );
    assert_eq!(results[6]["status"], 404);
    let etag = results[7]["etag"].as_str().unwrap().to_owned();
    let matched = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "v.txt", "body": "conditional", "token": t, "if_match": etag},
        {"op": "get", "bucket": "fenced", "key": "v.txt"},
    ]));
    assert_eq!(matched[0]["ok"], true, "{matched:?}");
    assert_eq!(matched[1]["body"], "conditional");
    assert_eq!(h.audit.events().len(), 1);
}

#[test]
fn keys_with_awkward_characters() {
    let h = Harness::start();
    let t = token(5);
    let keys = [
        "a b+c&d=e.txt",
        "ünïcødé/ключ/鍵",
        "semi;colon,comma!'()*~@$",
        "tilde~/percent%20literal",
    ];
    let mut steps = Vec::new();
    for key in keys {
        steps.push(json!({"op": "put", "bucket": "fenced", "key": key, "body": key, "token": t}));
        steps.push(json!({"op": "get", "bucket": "fenced", "key": key}));
        steps.push(json!({"op": "copy", "bucket": "fenced", "key": format!("{key}.copy"), "source_key": key, "token": t}));
        steps.push(json!({"op": "delete", "bucket": "fenced", "key": key, "token": t}));
    }
    steps.push(json!({"op": "list", "bucket": "fenced"}));
    let results = h.run(serde_json::Value::Array(steps));
    for (i, r) in results.iter().enumerate() {
        println!("step {i}: {}", truncate(r));
        assert_eq!(r["ok"], true, "step {i}: {r}");
    }
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(results[4 * i + 1]["body"], *key);
    }
    let mut listed: Vec<String> = serde_json::from_value(results[16]["keys"].clone()).unwrap();
    listed.sort();
    let mut want: Vec<String> = keys.iter().map(|k| format!("{k}.copy")).collect();
    want.sort();
    assert_eq!(listed, want);
    // Stored under exactly these names (seen directly in the store, not through the gateway).
    let direct = h.direct(json!([{"op": "list", "bucket": "fenced"}]));
    let mut stored: Vec<String> = serde_json::from_value(direct[0]["keys"].clone()).unwrap();
    stored.sort();
    assert_eq!(stored, want);
}
