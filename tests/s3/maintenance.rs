//! `fencegate s3 gc` and `fencegate s3 export` as real processes against a node's manifest-mode
//! bucket in moto: gc keeps every referenced object and the young unreferenced ones and removes
//! the old unreferenced ones; export writes exactly the committed view.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::support::s3_gateway::S3Node;
use serde_json::{json, Value};

fn token(revision: u64) -> String {
    format!("fg1~{revision}~job")
}

fn put(key: &str, body: &str, revision: u64) -> Value {
    json!({"op": "put", "bucket": "ledger", "key": key, "body": body, "token": token(revision)})
}

fn assert_ok(results: &[Value]) {
    for r in results {
        assert_eq!(r["ok"], true, "{r}");
    }
}

fn assert_stale(r: &Value) {
    assert_eq!(
        (r["status"].as_u64(), r["code"].as_str()),
        (Some(412), Some("FencingTokenStale")),
        "{r}"
    );
}

/// The physical objects of the manifest-mode rule, read from moto directly.
fn physical(node: &S3Node) -> BTreeSet<String> {
    let listed =
        node.direct(json!([{"op": "list", "bucket": "ledger", "prefix": ".fencegate/data/"}]));
    listed[0]["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_owned())
        .collect()
}

/// What the gateway shows for the committed keys.
fn committed_bodies(node: &S3Node) -> Vec<String> {
    let reads = node.run(json!(["a", "b", "c", "d", "z"]
        .iter()
        .map(|k| json!({"op": "get", "bucket": "ledger", "key": format!("data/{k}")}))
        .collect::<Vec<_>>()));
    reads
        .iter()
        .map(|r| r["body"].as_str().unwrap_or("<missing>").to_owned())
        .collect()
}

const COMMITTED: [&str; 5] = ["a2", "b9", "c7", "d9", "z5"];

#[test]
fn gc_removes_only_old_unreferenced_objects_and_export_writes_the_committed_view() {
    let node = S3Node::start();
    // A node whose cached manifest lags: its late writes reach the store as physical objects,
    // then their commits are refused (a single node would refuse them before writing).
    let stale = node.second_node();
    let config = node.config();

    // Old objects: holder 5 commits z; holder 7 commits a (twice: a1 becomes unreferenced),
    // b and c; holder 5's late write of z is refused and leaves its object unreferenced.
    assert_ok(&stale.run(json!([put("data/z", "z5", 5)])));
    assert_ok(&node.run(json!([
        put("data/a", "a1", 7),
        put("data/b", "b1", 7),
        put("data/a", "a2", 7),
        put("data/c", "c7", 7),
    ])));
    assert_stale(&stale.run(json!([put("data/z", "stale z", 5)]))[0]);
    let old = physical(&node);
    assert_eq!(old.len(), 6, "{old:?}");

    // The default grace (24 h) keeps everything.
    let (code, out, err) = node.cli(&["s3", "gc", "--config", &config]);
    println!("{out}{err}");
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("objects kept 6 (referenced 4, young 2), removed 0"),
        "{out}"
    );

    // Age the objects above past the grace period. The margins allow for moto's 1 s
    // LastModified resolution and for a slow machine between the young writes and gc.
    let grace = "10s";
    std::thread::sleep(Duration::from_secs(11));

    // Young objects: d7 (overwritten at once by d9: young, unreferenced), b9 (b1 becomes
    // unreferenced, but it is old), and holder 7's late write of y, refused by the fence 9.
    assert_ok(&node.run(json!([
        put("data/d", "d7", 9),
        put("data/d", "d9", 9),
        put("data/b", "b9", 9),
    ])));
    assert_stale(&stale.run(json!([put("data/y", "stale y", 7)]))[0]);

    // A dry run counts and removes nothing.
    let (code, dry, err) = node.cli(&[
        "s3",
        "gc",
        "--config",
        &config,
        "--grace",
        grace,
        "--dry-run",
    ]);
    println!("{dry}{err}");
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = node.cli(&["s3", "gc", "--config", &config, "--grace", grace]);
    println!("{out}{err}");
    assert_eq!(code, 0, "{err}");
    assert!(
        dry.contains("objects kept 7 (referenced 5, young 2), to remove 3"),
        "{dry}"
    );
    assert!(
        out.contains("objects kept 7 (referenced 5, young 2), removed 3"),
        "{out}"
    );
    let left = physical(&node);
    assert_eq!(left.len(), 7, "{left:?}");
    assert_eq!(left.difference(&old).count(), 4, "every young object kept");
    assert_eq!(left.intersection(&old).count(), 3, "old a2, c7, z5 kept");
    assert_eq!(
        crate::support::audit::records(&stale.node.audit_dir)
            .iter()
            .filter(|r| r["reason"] == "stale")
            .count(),
        2,
        "one audit record per refused commit"
    );
    // Every committed key still reads, with the committed bytes.
    assert_eq!(committed_bodies(&node), COMMITTED);

    // Export: exactly the committed view, under plain keys a reader can GET from the store.
    let (code, out, err) = node.cli(&[
        "s3",
        "export",
        "--config",
        &config,
        "--bucket",
        "ledger",
        "--prefix",
        "data/",
        "--to-prefix",
        "export/",
    ]);
    println!("{out}{err}");
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("5 object(s) exported from 1 manifest(s)"),
        "{out}"
    );
    let mut steps = vec![json!({"op": "list", "bucket": "ledger", "prefix": "export/"})];
    for k in ["a", "b", "c", "d", "z"] {
        steps.push(json!({"op": "get", "bucket": "ledger", "key": format!("export/{k}")}));
    }
    let exported = node.direct(json!(steps));
    // Not y (its commit was refused), and z holds z5, not the refused "stale z".
    assert_eq!(
        exported[0]["keys"],
        json!(["export/a", "export/b", "export/c", "export/d", "export/z"])
    );
    let bodies: Vec<&Value> = exported[1..].iter().map(|r| &r["body"]).collect();
    assert_eq!(bodies, COMMITTED);

    // A destination under a fencing rule is refused before anything is copied.
    let (code, out, err) = node.cli(&[
        "s3",
        "export",
        "--config",
        &config,
        "--bucket",
        "ledger",
        "--prefix",
        "data/",
        "--to-prefix",
        "data/copy/",
    ]);
    println!("{out}{err}");
    assert_eq!(code, 2);
    assert!(err.contains("is protected by a fencing rule"), "{err}");
    let copies = node.direct(json!([{"op": "list", "bucket": "ledger", "prefix": "data/copy/"}]));
    assert_eq!(copies[0]["keys"], json!([]));
}

#[test]
fn s3_maintenance_errors_say_what_to_do() {
    let node = S3Node::start();
    let config = node.config();
    let (code, _, err) = node.cli(&["s3", "gc", "--config", "/nonexistent/fencegate.toml"]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/fencegate.toml"), "{err}");
    let (code, _, err) = node.cli(&["s3", "gc", "--config", &config, "--bucket", "fenced"]);
    println!("{err}");
    assert_eq!(code, 2);
    assert!(
        err.contains("no mode = \"manifest\" rule for bucket fenced"),
        "{err}"
    );
    let (code, _, err) = node.cli(&[
        "s3",
        "export",
        "--config",
        &config,
        "--bucket",
        "fenced",
        "--to-prefix",
        "x/",
    ]);
    println!("{err}");
    assert_eq!(code, 2);
    assert!(
        err.contains("export reads manifest-mode keys only"),
        "{err}"
    );
    // Without the upstream secret nothing is sent, and the message names the variable.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fencegate"))
        .args(["s3", "gc", "--config", &config])
        .env_remove("S3_UPSTREAM_SECRET")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{err}");
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("S3_UPSTREAM_SECRET"), "{err}");
}
