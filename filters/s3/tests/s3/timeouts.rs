//! A hung store (accepts connections, never answers) is given up on within
//! `upstream_timeout_ms`: writes answer 503, reads 502/504, instead of waiting forever.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use crate::harness::{token, Harness};
use serde_json::json;

#[test]
fn a_hung_store_answers_within_the_configured_bound() {
    let hung = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = hung.local_addr().unwrap();
    // Accepts and holds every connection without reading or answering; the thread ends with
    // the test process.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in hung.incoming().take(64).flatten() {
            held.push(stream);
        }
        std::thread::park();
    });
    let h = Harness::with_config(|config| {
        config.upstream = format!("http://{address}");
        config.upstream_timeout_ms = 1_000;
    });
    let started = Instant::now();
    let results = h.run(json!([
        {"op": "raw", "method": "PUT", "path": "/fenced/k", "body": "x", "headers": {"Fencing-Token": token(5)}},
        {"op": "raw", "method": "DELETE", "path": "/open/k"},
        {"op": "raw", "method": "GET", "path": "/open/k"},
    ]));
    let elapsed = started.elapsed();
    for r in &results {
        println!("{r}");
    }
    println!("3 requests to a hung store answered in {elapsed:?}");
    assert_eq!(results[0]["status"], 503);
    assert_eq!(results[1]["status"], 503);
    assert!(
        [502, 504].contains(&results[2]["status"].as_u64().unwrap()),
        "{}",
        results[2]
    );
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
}
