//! Where the `fencegate` binary is, for harnesses outside the root crate's tests (which have
//! `CARGO_BIN_EXE_fencegate`): `FENCEGATE_BIN`, else next to the running executable (a binary
//! in `target/debug/`) or one directory up (a test in `target/debug/deps/`).

use std::path::PathBuf;

/// The `fencegate` binary to start; panics with what to build when there is none.
pub fn fencegate_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("FENCEGATE_BIN") {
        return PathBuf::from(path);
    }
    let me = std::env::current_exe().expect("the running executable's path");
    let candidates: Vec<PathBuf> = me
        .ancestors()
        .skip(1)
        .take(2)
        .map(|dir| dir.join("fencegate"))
        .collect();
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "no fencegate binary at {candidates:?}: build it with `cargo build --bin fencegate` \
                 (same profile) or set FENCEGATE_BIN"
            )
        })
}
