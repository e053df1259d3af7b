//! The gateway's build runs tokio's own clock, not its test clock: no normal dependency may
//! turn on tokio's `test-util` (issue 18). pingora-core does, through `tokio-test`, unless the
//! workspace's `[patch.crates-io]` replaces that crate with `patch/tokio-test`; with
//! `test-util` every clock read takes a lock and reads the system clock twice.

use std::path::Path;
use std::process::Command;

#[test]
fn no_normal_dependency_turns_on_tokios_test_clock() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let out = Command::new(cargo)
        .args(["tree", "--offline", "--manifest-path"])
        .arg(&manifest)
        .args(["-p", "fencegate", "-e", "features,normal", "-i", "tokio"])
        .output()
        .expect("running `cargo tree`");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "`cargo tree` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The tree is the one asked for: tokio with the features the gateway uses.
    assert!(
        tree.contains("tokio feature \"rt-multi-thread\""),
        "unexpected `cargo tree` output:\n{tree}"
    );
    let culprits: Vec<&str> = tree
        .lines()
        .filter(|line| line.contains("tokio feature \"test-util\""))
        .collect();
    assert!(
        culprits.is_empty(),
        "a normal dependency of fencegate turns on tokio's `test-util` (a locked clock in \
         production builds); find it with `cargo tree -p fencegate -e features,normal -i tokio` \
         and keep it out as patch/tokio-test does for pingora-core:\n{tree}"
    );
}
