//! Manifest mode (bucket `ledger`) against moto: the four holes object mode cannot close, each
//! lost by the stale holder with one audit record, the manifest and every logical read showing
//! only the new holder's data; and boto3's ordinary operations on logical keys.

use crate::harness::{token, Harness};
use serde_json::{json, Value};

fn print(label: &str, results: &[Value]) {
    for (i, r) in results.iter().enumerate() {
        println!("{label} {i}: {r}");
    }
}

fn ok(results: &[Value]) {
    assert!(results.iter().all(|r| r["ok"] == true), "{results:?}");
}

/// The committed view as stored, read behind the gateway's back and replayed here: the
/// checkpoint (if any), then every log entry after its position, in order.
fn manifest(h: &Harness) -> Value {
    let checkpoint = h.direct(
        json!([{"op": "get_json", "bucket": "ledger", "key": ".fencegate/checkpoint/job"}]),
    );
    let mut view = if checkpoint[0]["ok"] == true {
        checkpoint[0]["json"].clone()
    } else {
        json!({"fence": 0, "position": 0, "keys": {}})
    };
    let listed =
        h.direct(json!([{"op": "list", "bucket": "ledger", "prefix": ".fencegate/log/job/"}]));
    let positions: Vec<String> = listed[0]["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_owned())
        .collect();
    for (n, key) in positions.iter().enumerate() {
        let position = n as u64 + 1;
        assert!(
            key.ends_with(&format!("{position:020}")),
            "log positions have no gaps: {positions:?}"
        );
        if position <= view["position"].as_u64().unwrap() {
            continue;
        }
        let entry = h.direct(json!([{"op": "get_json", "bucket": "ledger", "key": key}]))[0]
            ["json"]
            .clone();
        let fence = entry["fence"]
            .as_u64()
            .unwrap()
            .max(view["fence"].as_u64().unwrap());
        view["fence"] = json!(fence);
        view["position"] = json!(position);
        for change in entry["changes"].as_array().unwrap() {
            let key = change["key"].as_str().unwrap();
            let keys = view["keys"].as_object_mut().unwrap();
            match change.get("put") {
                Some(put) => {
                    keys.insert(key.to_owned(), put.clone());
                }
                None => {
                    keys.remove(key);
                }
            }
        }
    }
    view
}

fn assert_stale(r: &Value) {
    assert_eq!(
        (r["status"].clone(), r["code"].clone()),
        (json!(412), json!("FencingTokenStale")),
        "{r}"
    );
}

/// Hole (a): a stale holder creates a key the new holder has not touched yet. Node 2 last
/// saw the manifest at fence 7, so its write reaches the store; the commit is refused.
#[test]
fn a_stale_holder_cannot_create_a_new_key() {
    let h = Harness::start();
    let stale_node = h.second_node();
    ok(&stale_node.run(json!([
        {"op": "put", "bucket": "ledger", "key": "chunk-0", "body": "old holder 0", "token": token(7)},
    ])));
    ok(&h.run(json!([
        {"op": "put", "bucket": "ledger", "key": "chunk-1", "body": "new holder 1", "token": token(12)},
    ])));
    let late = stale_node.run(json!([
        {"op": "put", "bucket": "ledger", "key": "chunk-2", "body": "old holder 2", "token": token(7)},
    ]));
    print("late", &late);
    assert_stale(&late[0]);
    let reads = h.run(json!([
        {"op": "list_pages", "bucket": "ledger"},
        {"op": "head", "bucket": "ledger", "key": "chunk-2"},
    ]));
    print("reads", &reads);
    assert_eq!(reads[0]["keys"], json!(["chunk-0", "chunk-1"]));
    assert_eq!(reads[1]["status"], 404);
    let m = manifest(&h);
    assert_eq!(m["fence"], 12);
    assert!(m["keys"].get("chunk-2").is_none(), "{m}");
    // The refused write's physical object exists, unreferenced, for garbage collection.
    let physical =
        h.direct(json!([{"op": "list", "bucket": "ledger", "prefix": ".fencegate/data/"}]));
    assert_eq!(
        physical[0]["keys"].as_array().unwrap().len(),
        3,
        "{physical:?}"
    );
    assert_eq!(stale_node.audit.events().len(), 1);
    assert!(h.audit.events().is_empty());
}

/// Hole (b): identical bytes through two nodes; the stale node's rewrite must not land.
#[test]
fn identical_bytes_through_two_nodes_are_fenced() {
    let h = Harness::start();
    let stale_node = h.second_node();
    let first = stale_node.run(json!([
        {"op": "put", "bucket": "ledger", "key": "k", "body": "same bytes", "token": token(4)},
    ]));
    ok(&first);
    let fresh = h.run(json!([
        {"op": "put", "bucket": "ledger", "key": "k", "body": "same bytes", "token": token(6)},
    ]));
    ok(&fresh);
    assert_eq!(
        fresh[0]["etag"], first[0]["etag"],
        "identical bytes, same ETag"
    );
    let late = stale_node.run(json!([
        {"op": "put", "bucket": "ledger", "key": "k", "body": "same bytes", "token": token(4)},
        {"op": "put", "bucket": "ledger", "key": "k", "body": "late bytes", "token": token(4)},
    ]));
    print("late", &late);
    assert_stale(&late[0]);
    assert_stale(&late[1]);
    let m = manifest(&h);
    assert_eq!(
        (m["fence"].clone(), m["keys"]["k"]["revision"].clone()),
        (json!(6), json!(6))
    );
    let read = stale_node.run(json!([{"op": "get", "bucket": "ledger", "key": "k"}]));
    assert_eq!(read[0]["body"], "same bytes");
    assert_eq!(stale_node.audit.events().len(), 2);
    assert!(h.audit.events().iter().all(|e| e.reason == "stale"));
}

/// Hole (c): a stale multipart completion after the new holder wrote the key (moto ignores
/// If-Match on completion, so only the manifest commit can refuse it).
#[test]
fn a_stale_multipart_completion_is_not_committed() {
    let h = Harness::start();
    let stale_node = h.second_node();
    let created = stale_node.run(json!([
        {"op": "mpu_create", "bucket": "ledger", "key": "big", "body": "stale part", "token": token(10)},
    ]));
    ok(&created);
    ok(&h.run(json!([
        {"op": "put", "bucket": "ledger", "key": "big", "body": "new holder", "token": token(12)},
    ])));
    let late = stale_node.run(json!([
        {"op": "mpu_complete", "bucket": "ledger", "key": "big", "upload_id": created[0]["upload_id"], "part_etag": created[0]["part_etag"], "token": token(10)},
        {"op": "get", "bucket": "ledger", "key": "big"},
    ]));
    print("late", &late);
    assert_stale(&late[0]);
    assert_eq!(late[1]["body"], "new holder");
    let m = manifest(&h);
    assert_eq!(
        (m["fence"].clone(), m["keys"]["big"]["revision"].clone()),
        (json!(12), json!(12))
    );
    let events = stale_node.audit.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].operation.command, "CompleteMultipartUpload");
}

/// Hole (d): a stale delete (or rewrite) of a chunk the new holder saw and skipped.
#[test]
fn a_stale_delete_of_a_skipped_chunk_is_refused() {
    let h = Harness::start();
    let stale_node = h.second_node();
    ok(&stale_node.run(json!([
        {"op": "put", "bucket": "ledger", "key": "chunk-1", "body": "done by old holder", "token": token(7)},
    ])));
    // The new holder raises the fence with its first write and skips chunk-1.
    ok(&h.run(json!([
        {"op": "put", "bucket": "ledger", "key": "chunk-2", "body": "new holder", "token": token(9)},
    ])));
    let late = stale_node.run(json!([
        {"op": "delete", "bucket": "ledger", "key": "chunk-1", "token": token(7)},
        {"op": "delete_many", "bucket": "ledger", "keys": ["chunk-1", "chunk-2"], "token": token(7)},
        {"op": "get", "bucket": "ledger", "key": "chunk-1"},
    ]));
    print("late", &late);
    assert_stale(&late[0]);
    assert_eq!(late[1]["deleted"], json!([]));
    assert_eq!(late[2]["body"], "done by old holder");
    let m = manifest(&h);
    assert_eq!(m["fence"], 9);
    assert_eq!(
        m["keys"].as_object().unwrap().keys().collect::<Vec<_>>(),
        ["chunk-1", "chunk-2"]
    );
    let events = stale_node.audit.events();
    assert_eq!(events.len(), 3, "one per refused delete: {events:?}");
    assert!(events.iter().all(|e| e.reason == "stale"));
}

/// boto3 unchanged against a manifest-mode bucket: put, get, head, ranges, list with
/// delimiter and pagination, copy, multipart, delete, presigned GET; the gateway's own keys
/// stay hidden and unwritable.
#[test]
fn boto3_works_unchanged_on_logical_keys() {
    let h = Harness::start();
    let t = token(3);
    let mut steps = vec![];
    for key in ["a/1", "a/2", "b/1", "c", "d/x/1", "e"] {
        steps.push(json!({"op": "put", "bucket": "ledger", "key": key, "body": format!("body of {key}"), "token": t}));
    }
    ok(&h.run(Value::Array(steps)));
    let size = 12 * 1024 * 1024;
    let results = h.run(json!([
        {"op": "get", "bucket": "ledger", "key": "a/1"},
        {"op": "head", "bucket": "ledger", "key": "a/2"},
        {"op": "get_range", "bucket": "ledger", "key": "a/1", "range": "bytes=0-3"},
        {"op": "list_pages", "bucket": "ledger", "delimiter": "/", "page_size": 2},
        {"op": "list_pages", "bucket": "ledger", "prefix": "a/", "page_size": 1},
        {"op": "copy", "bucket": "ledger", "key": "copied", "source_key": "c", "token": t},
        {"op": "get", "bucket": "ledger", "key": "copied"},
        {"op": "multipart", "bucket": "ledger", "key": "big", "size": size, "token": t},
        {"op": "get", "bucket": "ledger", "key": "big"},
        {"op": "delete", "bucket": "ledger", "key": "e", "token": t},
        {"op": "head", "bucket": "ledger", "key": "e"},
        {"op": "presigned_get", "bucket": "ledger", "key": "c"},
        {"op": "delete_many", "bucket": "ledger", "keys": ["a/2", "b/1"], "token": t},
        {"op": "list_pages", "bucket": "ledger"},
        {"op": "get", "bucket": "ledger", "key": ".fencegate/log/job/00000000000000000001"},
        {"op": "put", "bucket": "ledger", "key": ".fencegate/log/job/00000000000000000099", "body": "{}", "token": t},
    ]));
    print("boto3", &results);
    assert_eq!(results[0]["body"], "body of a/1");
    assert_eq!(results[1]["size"], 11);
    assert_eq!(
        (results[2]["body"].clone(), results[2]["status"].clone()),
        (json!("body"), json!(206))
    );
    assert_eq!(results[3]["prefixes"], json!(["a/", "b/", "d/"]));
    assert_eq!(results[3]["keys"], json!(["c", "e"]));
    assert_eq!(results[3]["pages"], 3);
    assert_eq!(results[4]["keys"], json!(["a/1", "a/2"]));
    assert_eq!(results[4]["pages"], 2);
    assert_eq!(results[6]["body"], "body of c");
    let want = h.run(json!([{"op": "pattern_sha256", "size": size, "seed": "multipart"}]));
    assert_eq!(results[8]["sha256"], want[0]["sha256"]);
    assert_eq!(results[10]["status"], 404);
    assert_eq!(
        (results[11]["status"].clone(), results[11]["body"].clone()),
        (json!(200), json!("body of c"))
    );
    assert_eq!(results[12]["deleted"], json!(["a/2", "b/1"]));
    assert_eq!(
        results[13]["keys"],
        json!(["a/1", "big", "c", "copied", "d/x/1"])
    );
    assert_eq!(results[14]["status"], 404);
    assert_eq!(results[15]["status"], 403);
    let m = manifest(&h);
    assert_eq!(m["fence"], 3);
    assert_eq!(
        h.audit.events().len(),
        1,
        "the write to the gateway's own key"
    );
}

/// 16 writers with tokens 1..16 put the same fresh key at once (group commit shares their
/// manifest writes): the committed entry is the highest token that committed, every other
/// outcome is a stale refusal, audited once each.
#[test]
fn sixteen_racing_writers_commit_in_fence_order() {
    let h = Harness::start();
    let out = h.run(
        json!([{"op": "race", "bucket": "ledger", "prefix": "race", "clients": 16, "rounds": 5}]),
    );
    let rounds = out[0]["rounds"].as_array().expect("race output").clone();
    let mut applied_total = 0;
    for round in &rounds {
        let results = round["results"].as_object().unwrap();
        let applied: Vec<u64> = results
            .iter()
            .filter(|(_, r)| *r == "applied")
            .map(|(t, _)| t.parse().unwrap())
            .collect();
        println!(
            "{}: applied {applied:?}, final {}",
            round["key"], round["final_body"]
        );
        assert!(results
            .values()
            .all(|r| r == "applied" || r == "FencingTokenStale"));
        let max = *applied.iter().max().expect("some writer applied");
        let key = round["key"].as_str().unwrap();
        assert_eq!(
            round["final_body"],
            format!("token {max} round {}", key.trim_start_matches("race/"))
        );
        applied_total += applied.len();
    }
    let m = manifest(&h);
    assert_eq!(m["fence"], 16);
    let events = h.audit.events();
    assert_eq!(
        events.len(),
        16 * 5 - applied_total,
        "one audit record per refusal"
    );
    assert!(events.iter().all(|e| e.reason == "stale"));
}

/// `s3 gc` removes exactly the physical objects no manifest names (a refused commit's, an
/// overwritten one's); `s3 export` copies the committed view to plain keys.
#[test]
fn gc_keeps_what_the_manifest_names_and_export_copies_it() {
    let h = Harness::start();
    let stale_node = h.second_node();
    ok(&stale_node.run(json!([
        {"op": "put", "bucket": "ledger", "key": "k", "body": "first", "token": token(2)},
    ])));
    ok(&h.run(json!([
        {"op": "put", "bucket": "ledger", "key": "k", "body": "second", "token": token(3)},
        {"op": "put", "bucket": "ledger", "key": "dir/j", "body": "other key", "token": token(3)},
    ])));
    let late = stale_node.run(json!([
        {"op": "put", "bucket": "ledger", "key": "z", "body": "refused", "token": token(2)},
    ]));
    assert_stale(&late[0]);
    let maintenance = fencegate_s3::Maintenance::new(h.config()).unwrap();
    assert_eq!(
        maintenance.manifests(),
        [("ledger".to_owned(), "job".to_owned())]
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let hour = std::time::Duration::from_secs(3600);
    let young = runtime
        .block_on(maintenance.gc("ledger", "job", hour, false))
        .unwrap();
    println!("grace 1 h: {young:?}");
    assert_eq!(
        (
            young.listed,
            young.referenced,
            young.too_young,
            young.removed
        ),
        (4, 2, 2, 0)
    );
    let report = runtime
        .block_on(maintenance.gc("ledger", "job", std::time::Duration::ZERO, false))
        .unwrap();
    println!("grace 0: {report:?}");
    assert_eq!(
        (report.listed, report.referenced, report.removed),
        (4, 2, 2)
    );
    let physical =
        h.direct(json!([{"op": "list", "bucket": "ledger", "prefix": ".fencegate/data/"}]));
    assert_eq!(physical[0]["keys"].as_array().unwrap().len(), 2);
    let exported = runtime
        .block_on(maintenance.export("ledger", "job", "", "open", "export/"))
        .unwrap();
    assert_eq!(exported, 2);
    let reads = h.run(json!([
        {"op": "get", "bucket": "ledger", "key": "k"},
        {"op": "get", "bucket": "ledger", "key": "dir/j"},
        {"op": "get", "bucket": "open", "key": "export/k"},
        {"op": "get", "bucket": "open", "key": "export/dir/j"},
    ]));
    let bodies: Vec<&Value> = reads.iter().map(|r| &r["body"]).collect();
    assert_eq!(bodies, ["second", "other key", "second", "other key"]);
    assert!(runtime
        .block_on(maintenance.export("ledger", "job", "", "fenced", "copy/"))
        .is_err());
}

/// Two gateway nodes commit into one resource's log at the same time (12 writes each, same
/// token): every log position is held by exactly one commit, no gap, and both nodes and the
/// stored log show all 24 keys. Past 64 commits a checkpoint is written, and a node that
/// never saw the resource reads the same view from it.
#[test]
fn two_nodes_committing_at_once_never_share_a_log_position() {
    let h = Harness::start();
    let other = h.second_node();
    let t = token(5);
    let puts = |node: &str| {
        Value::Array(
            (0..12)
                .map(|i| json!({"op": "put", "bucket": "ledger", "key": format!("{node}/{i:02}"), "body": format!("{node} {i}"), "token": t}))
                .collect(),
        )
    };
    let (first, second) = std::thread::scope(|s| {
        let a = s.spawn(|| h.run(puts("a")));
        let b = s.spawn(|| other.run(puts("b")));
        (a.join().unwrap(), b.join().unwrap())
    });
    ok(&first);
    ok(&second);
    let m = manifest(&h);
    println!("log positions after the race: {}", m["position"]);
    assert_eq!(m["keys"].as_object().unwrap().len(), 24, "{m}");
    assert_eq!(m["fence"], 5);
    for node_reads in [
        h.run(json!([{"op": "list_pages", "bucket": "ledger", "prefix": "b/"}])),
        other.run(json!([{"op": "list_pages", "bucket": "ledger", "prefix": "a/"}])),
    ] {
        assert_eq!(node_reads[0]["keys"].as_array().unwrap().len(), 12);
    }
    // 64 more commits from one writer (no grouping): a checkpoint appears.
    let steps: Vec<Value> = (0..64)
        .map(|i| json!({"op": "put", "bucket": "ledger", "key": format!("c/{i:02}"), "body": "c", "token": t}))
        .collect();
    ok(&h.run(Value::Array(steps)));
    let checkpoint = h.direct(
        json!([{"op": "get_json", "bucket": "ledger", "key": ".fencegate/checkpoint/job"}]),
    );
    println!("checkpoint position: {}", checkpoint[0]["json"]["position"]);
    assert!(checkpoint[0]["json"]["position"].as_u64().unwrap() >= 64);
    let m = manifest(&h);
    assert_eq!(m["keys"].as_object().unwrap().len(), 88);
    let cold = h.second_node();
    let read = cold.run(json!([
        {"op": "list_pages", "bucket": "ledger"},
        {"op": "get", "bucket": "ledger", "key": "a/03"},
    ]));
    assert_eq!(read[0]["keys"].as_array().unwrap().len(), 88);
    assert_eq!(read[1]["body"], "a 3");
    assert!(h.audit.events().is_empty() && other.audit.events().is_empty());
}

/// A bucket written by the first layout (one manifest object) is converted on first use: its
/// keys read back, its fence still refuses a stale token (audited once), and the old object is
/// replaced by a marker that a gateway of the first layout cannot commit over.
#[test]
fn a_first_layout_manifest_is_converted_on_first_use() {
    let h = Harness::start();
    let first_layout = json!({"fence": 8, "seq": 3, "keys": {"old/k": {
        "physical": ".fencegate/data/job/00000000000000000008-first", "etag": "\"x\"", "size": 9,
        "modified": "2026-11-30T00:00:00.000Z", "revision": 8}}});
    ok(&h.direct(json!([
        {"op": "put", "bucket": "ledger", "key": ".fencegate/data/job/00000000000000000008-first", "body": "old bytes"},
        {"op": "put", "bucket": "ledger", "key": ".fencegate/manifest/job", "body": first_layout.to_string()},
    ])));
    let results = h.run(json!([
        {"op": "get", "bucket": "ledger", "key": "old/k"},
        {"op": "put", "bucket": "ledger", "key": "new", "body": "stale", "token": token(7)},
        {"op": "put", "bucket": "ledger", "key": "new", "body": "current", "token": token(8)},
        {"op": "list_pages", "bucket": "ledger"},
    ]));
    print("converted", &results);
    assert_eq!(results[0]["body"], "old bytes");
    assert_stale(&results[1]);
    assert_eq!(results[2]["ok"], true);
    assert_eq!(results[3]["keys"], json!(["new", "old/k"]));
    let stored = h.direct(json!([
        {"op": "get_json", "bucket": "ledger", "key": ".fencegate/manifest/job"},
        {"op": "get_json", "bucket": "ledger", "key": ".fencegate/checkpoint/job"},
    ]));
    assert!(stored[0]["json"].get("fence").is_none(), "{}", stored[0]);
    assert_eq!(stored[0]["json"]["converted_to_log"]["fence"], 8);
    assert_eq!(
        (
            stored[1]["json"]["position"].clone(),
            stored[1]["json"]["fence"].clone()
        ),
        (json!(0), json!(8))
    );
    let m = manifest(&h);
    assert_eq!(m["keys"]["new"]["revision"], 8);
    assert_eq!(h.audit.events().len(), 1);
}
