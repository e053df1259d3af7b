//! Where the `fencegate` binary is, for harnesses outside the root crate's tests (which have
//! `CARGO_BIN_EXE_fencegate`): `FENCEGATE_BIN`, else beside the running executable (see
//! [`build_artifact`](crate::build_artifact)).

use std::path::PathBuf;

use crate::build_artifact::build_artifact;

/// The `fencegate` binary to start; panics with what to build when there is none.
pub fn fencegate_bin() -> PathBuf {
    build_artifact("fencegate", "FENCEGATE_BIN", "cargo build --bin fencegate")
}
