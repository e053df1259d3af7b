//! An `https://` upstream: moto serves HTTPS with a private certificate the gateway trusts
//! through `upstream_ca_file`; reads (pingora's rustls connector) and writes (reqwest with
//! rustls) both verify it.

mod harness;

use harness::{token, Harness};
use serde_json::json;

#[test]
fn reads_and_fenced_writes_over_an_https_upstream() {
    let h = Harness::with_tls_upstream();
    assert!(h.moto.endpoint.starts_with("https://"));
    let results = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "k", "body": "over tls upstream", "token": token(4)},
        {"op": "get", "bucket": "fenced", "key": "k"},
        {"op": "list", "bucket": "fenced"},
        {"op": "put", "bucket": "fenced", "key": "k", "body": "stale", "token": token(3)},
        {"op": "delete", "bucket": "fenced", "key": "k", "token": token(4)},
        {"op": "list", "bucket": "fenced"},
    ]));
    for r in &results {
        println!("{r}");
    }
    assert_eq!(results[0]["ok"], true);
    assert_eq!(results[1]["body"], "over tls upstream");
    assert_eq!(results[2]["keys"], json!(["k"]));
    assert_eq!(results[3]["status"], 412);
    assert_eq!(results[4]["ok"], true);
    assert_eq!(results[5]["keys"], json!([]));
}
