//! Where a file cargo built for the tests is, for harnesses outside the crate that builds it:
//! an environment variable naming it, else next to the running executable (a binary in
//! `target/debug/`) or one directory up (a test in `target/debug/deps/`).

use std::path::PathBuf;

/// The artifact `file`: `$env` when set, else the first of the candidates that exists; panics
/// saying how to `build` it when there is none.
pub(crate) fn build_artifact(file: &str, env: &str, build: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env) {
        return PathBuf::from(path);
    }
    let me = std::env::current_exe().expect("the running executable's path");
    let candidates: Vec<PathBuf> = me
        .ancestors()
        .skip(1)
        .take(2)
        .map(|d| d.join(file))
        .collect();
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "no {file} at {candidates:?}: build it with `{build}` (same profile) or set {env}"
            )
        })
}
