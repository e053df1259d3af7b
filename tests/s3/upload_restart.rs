//! Object mode: a fenced multipart upload's revision outlives the gateway process. The gateway
//! stamps it in the store at CreateMultipartUpload; after a restart (SIGKILL, nothing kept in
//! memory) the holder's completion works, and a stale one is still refused and audited.

use crate::support::s3_gateway::S3Node;
use serde_json::{json, Value};

fn token(revision: u64) -> String {
    format!("fg1~{revision}~job")
}

fn create(key: &str, body: &str, revision: u64) -> Value {
    json!({"op": "mpu_create", "bucket": "fenced", "key": key, "body": body, "token": token(revision)})
}

fn complete(key: &str, created: &Value, revision: u64) -> Value {
    json!({"op": "mpu_complete", "bucket": "fenced", "key": key, "token": token(revision),
           "upload_id": created["upload_id"], "part_etag": created["part_etag"]})
}

fn stamps(node: &S3Node) -> usize {
    let listed =
        node.direct(json!([{"op": "list", "bucket": "fenced", "prefix": ".fencegate/uploads/"}]));
    listed[0]["keys"].as_array().unwrap().len()
}

#[test]
fn upload_revision_is_recovered_after_a_restart_and_stale_completion_is_refused() {
    let mut node = S3Node::start();
    let created = node.run(json!([
        create("out/a", "holder 5 wrote a", 5),
        create("out/b", "holder 5 wrote b", 5),
        create("out/c", "holder 5 wrote c", 5),
    ]));
    for c in &created {
        assert_eq!(c["ok"], true, "{c}");
    }

    node.restart();

    // The holder completes after the restart: the stamp says the upload is revision 5's.
    let done = node.run(json!([complete("out/a", &created[0], 5)]));
    assert_eq!(done[0]["ok"], true, "{}", done[0]);

    // A newer holder raises the fence of out/b; holder 5's completion is then stale.
    let newer = node.run(json!([
        {"op": "put", "bucket": "fenced", "key": "out/b", "body": "holder 6 wrote b", "token": token(6)},
    ]));
    assert_eq!(newer[0]["ok"], true, "{}", newer[0]);
    let late = node.run(json!([complete("out/b", &created[1], 5)]));
    assert_eq!(
        (late[0]["status"].as_u64(), late[0]["code"].as_str()),
        (Some(412), Some("FencingTokenStale")),
        "{}",
        late[0]
    );

    // Another node never saw the upload of out/c: it finds the stamp too.
    let other = node.second_node();
    let done = other.run(json!([complete("out/c", &created[2], 5)]));
    assert_eq!(done[0]["ok"], true, "{}", done[0]);

    let reads = node.run(json!([
        {"op": "get", "bucket": "fenced", "key": "out/a"},
        {"op": "get", "bucket": "fenced", "key": "out/b"},
        {"op": "get", "bucket": "fenced", "key": "out/c"},
    ]));
    let bodies: Vec<&Value> = reads.iter().map(|r| &r["body"]).collect();
    assert_eq!(
        bodies,
        ["holder 5 wrote a", "holder 6 wrote b", "holder 5 wrote c"],
        "nothing of the refused completion is visible"
    );
    assert_eq!(reads[0]["metadata"]["fencegate-revision"], "5");
    assert_eq!(reads[1]["metadata"]["fencegate-revision"], "6");

    let refusals = node.refusals();
    for r in &refusals {
        println!("audit: {r}");
    }
    assert_eq!(refusals.len(), 1, "exactly one audit record");
    assert_eq!(
        (
            refusals[0]["reason"].as_str(),
            refusals[0]["revision"].as_u64(),
            refusals[0]["fence"].as_u64()
        ),
        (Some("stale"), Some(5), Some(6))
    );
    // Completed uploads' stamps are gone; the refused one's upload (and stamp) stays open
    // until it is aborted.
    assert_eq!(stamps(&node), 1);
    let aborted = node.run(json!([
        {"op": "abort", "bucket": "fenced", "key": "out/b", "upload_id": created[1]["upload_id"], "token": token(5)},
    ]));
    assert_eq!(aborted[0]["ok"], true, "{}", aborted[0]);
    assert_eq!(stamps(&node), 0);
}

/// Clients cannot forge or remove a stamp: `.fencegate/` is the gateway's in any bucket with
/// a fencing rule.
#[test]
fn clients_cannot_write_upload_stamps() {
    let node = S3Node::start();
    let results = node.run(json!([
        {"op": "put", "bucket": "fenced", "key": ".fencegate/uploads/forged", "body": "{}", "token": token(9)},
        {"op": "delete", "bucket": "fenced", "key": ".fencegate/uploads/forged", "token": token(9)},
    ]));
    for r in &results {
        assert_eq!(
            (r["status"].as_u64(), r["code"].as_str()),
            (Some(403), Some("FencingUnsupportedOperation")),
            "{r}"
        );
    }
    assert_eq!(stamps(&node), 0);
}
