//! Done-means 4: 16 writers with tokens 1..16 put the same key at once, 20 rounds (a fresh key
//! each round, in a versioned bucket so every applied write is kept): the final object carries
//! the highest token that wrote it, and the version history never goes down (no lower token's
//! write was applied after a higher one).
//!
//! This relies on the store applying each conditional PUT atomically, as S3 does. Plain moto
//! does not (it checks If-Match, then writes, then sets the metadata, with no lock), which
//! made this test flaky once; the harness runs moto through `tests/s3/moto_atomic.py`, which
//! applies one request at a time. The assertions are the ones S3 guarantees, unchanged.

use crate::harness::Harness;
use serde_json::json;

#[test]
fn sixteen_racing_writers_twenty_rounds() {
    let h = Harness::start();
    let out = h.run(json!([{"op": "race", "bucket": "versioned", "prefix": "race", "clients": 16, "rounds": 20}]));
    let rounds = out[0]["rounds"].as_array().expect("race output").clone();
    assert_eq!(rounds.len(), 20);
    let mut highest_won = 0;
    let mut total_applied = 0;
    for round in &rounds {
        let key = round["key"].as_str().unwrap();
        let results = round["results"].as_object().unwrap();
        let applied: Vec<u64> = results
            .iter()
            .filter(|(_, r)| *r == "applied")
            .map(|(t, _)| t.parse().unwrap())
            .collect();
        let refused_other: Vec<&String> = results
            .iter()
            .filter(|(_, r)| *r != "applied" && *r != "FencingTokenStale")
            .map(|(t, _)| t)
            .collect();
        let max = *applied.iter().max().expect("some writer applied");
        let final_revision: u64 = round["final_metadata"]["fencegate-revision"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        // The versions of this key, oldest first, as the store kept them.
        let versions = h.direct(json!([{"op": "versions", "bucket": "versioned", "key": key}]));
        let mut history: Vec<u64> = versions[0]["versions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| {
                v["metadata"]["fencegate-revision"]
                    .as_str()
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        history.reverse();
        println!(
            "{key}: applied {applied:?} -> final token {final_revision}; history {history:?}; other outcomes {refused_other:?}"
        );
        assert_eq!(final_revision, max, "{round}");
        assert_eq!(
            round["final_body"],
            format!("token {max} round {}", key.trim_start_matches("race/"))
        );
        assert!(
            history.windows(2).all(|w| w[0] <= w[1]),
            "a lower token was applied after a higher one: {history:?}"
        );
        assert_eq!(
            history.len(),
            applied.len(),
            "every applied write is one version"
        );
        assert!(
            refused_other.is_empty(),
            "only stale refusals expected: {round}"
        );
        if max == 16 {
            highest_won += 1;
        }
        total_applied += applied.len();
    }
    let refusals = h.audit.events();
    println!(
        "rounds where token 16 wrote last: {highest_won}/20; applied writes {total_applied}; stale refusals audited {}",
        refusals.len()
    );
    assert_eq!(
        refusals.len(),
        20 * 16 - total_applied,
        "one audit record per refusal"
    );
    assert!(refusals.iter().all(|e| e.reason == "stale"));
}
