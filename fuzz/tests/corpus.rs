//! Every committed seed (and every input a fuzzing run has added to the corpus directories)
//! through its target's check, as ordinary tests: the smoke version of the fuzz targets that
//! needs no fuzzing toolchain.

use std::path::Path;

fn run(target: &str, check: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target);
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        check(&data);
        count += 1;
    }
    assert!(count > 0, "{} holds no seed", dir.display());
}

#[test]
fn redis_frame() {
    run("redis_frame", fencegate_fuzz::redis_frame::check);
}

#[test]
fn postgres_message() {
    run("postgres_message", fencegate_fuzz::postgres_message::check);
}

#[test]
fn postgres_shape_cache() {
    run(
        "postgres_shape_cache",
        fencegate_fuzz::postgres_shape_cache::check,
    );
}

#[test]
fn s3_chunked() {
    run("s3_chunked", fencegate_fuzz::s3_chunked::check);
}

#[test]
fn s3_sigv4() {
    run("s3_sigv4", fencegate_fuzz::s3_sigv4::check);
}

#[test]
fn token_parse() {
    run("token_parse", fencegate_fuzz::token_parse::check);
}
