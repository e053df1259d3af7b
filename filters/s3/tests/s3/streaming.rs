//! Done-means 5: a 1 GiB PUT (fenced, streamed: larger than the retry buffer) and GET through
//! the gateway keep the gateway's memory flat. The gateway runs in this test process, so the
//! process's peak RSS (VmHWM) bounds the gateway's.

use crate::harness::{token, Harness};
use serde_json::json;

fn vm_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[test]
fn one_gib_put_and_get_stream_with_flat_memory() {
    let h = Harness::start();
    let size: u64 = 1 << 30;
    // Warm up the connection pools and runtimes, then take the baseline.
    let warm = h.run(
        json!([{"op": "put", "bucket": "fenced", "key": "warm", "body": "x", "token": token(1)}]),
    );
    assert_eq!(warm[0]["ok"], true);
    let baseline = vm_kib("VmHWM:");
    let start = std::time::Instant::now();
    let results = h.run(json!([
        {"op": "put", "bucket": "fenced", "key": "big.bin", "size": size, "token": token(1)},
        {"op": "get", "bucket": "fenced", "key": "big.bin"},
        {"op": "pattern_sha256", "size": size},
    ]));
    let elapsed = start.elapsed();
    let peak = vm_kib("VmHWM:");
    for r in &results {
        let mut r = r.clone();
        r["body"] = json!("...");
        println!("{r}");
    }
    assert_eq!(results[0]["ok"], true);
    assert_eq!(results[1]["size"], size);
    assert_eq!(results[1]["sha256"], results[2]["sha256"]);
    assert_eq!(results[1]["metadata"]["fencegate-revision"], "1");
    println!(
        "1 GiB PUT + GET in {elapsed:?}; gateway process peak RSS {} MiB (baseline {} MiB, growth {} MiB)",
        peak / 1024,
        baseline / 1024,
        (peak - baseline) / 1024
    );
    assert!(
        peak - baseline < 128 * 1024,
        "peak RSS grew by {} MiB",
        (peak - baseline) / 1024
    );
}
