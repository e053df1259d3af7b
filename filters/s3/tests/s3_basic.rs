//! Done-means 1: boto3 at default settings puts, gets, lists, copies, does a multipart
//! upload and deletes through the gateway with a current token.

mod harness;

use harness::{token, Harness};
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
