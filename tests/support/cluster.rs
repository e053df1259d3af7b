//! The cluster harness lives in `fencegate-testkit` (shared with `fencegate-chaos`); this
//! module keeps the name every test imports, and the binary cargo built for these tests.

#[allow(unused_imports)] // each test binary uses part of it
pub use fencegate_testkit::cluster::*;

pub const BIN: &str = env!("CARGO_BIN_EXE_fencegate");
