//! The C `fencegate.enforce()` and `fencegate.guard(text)` (filters/postgres/ext), built with
//! PGXS for the tests that run the store's triggers and guard in both implementations. Built once
//! per source version into a directory the `postgres` OS user can read, shared by every test
//! process; a [`PgServer`] started with [`PgServer::start_with_conf`] and
//! [`enforce_library_conf`] loads it.
//!
//! [`PgServer`]: crate::postgres_server::PgServer
//! [`PgServer::start_with_conf`]: crate::postgres_server::PgServer::start_with_conf

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::postgres_server::bin_dir;

/// The extension's sources in this repository.
fn source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../filters/postgres/ext")
}

/// The directory holding `fencegate_enforce.so`, built on first use.
pub fn enforce_library_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(build)
}

/// A postgresql.conf line that lets the server load the library (besides its own `$libdir`).
pub fn enforce_library_conf() -> String {
    format!(
        "dynamic_library_path = '$libdir:{}'",
        enforce_library_dir().display()
    )
}

fn build() -> PathBuf {
    let src = source_dir();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&src)
        .unwrap_or_else(|e| panic!("read {}: {e}", src.display()))
        .map(|entry| entry.expect("read the sources' directory").path())
        // Sources only: an in-tree build leaves objects beside them.
        .filter(|path| {
            path.file_name().is_some_and(|n| n == "Makefile")
                || path.extension().is_some_and(|e| e == "c" || e == "h")
        })
        .collect();
    files.sort();
    for file in files {
        file.file_name().hash(&mut hasher);
        std::fs::read(&file)
            .unwrap_or_else(|e| panic!("read {}: {e}", file.display()))
            .hash(&mut hasher);
    }
    let dir = std::env::temp_dir().join(format!("fencegate-enforce-{:016x}", hasher.finish()));
    if dir.join("fencegate_enforce.so").exists() {
        return dir;
    }
    // Built beside it and renamed into place, so a concurrent test process never sees half a
    // build (if another one won the race, its copy is the same).
    let staging = tempfile::Builder::new()
        .prefix("fencegate-enforce-build-")
        .tempdir()
        .expect("temp dir");
    let pg_config = bin_dir().join("pg_config");
    let out = Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(staging.path())
        .arg("-f")
        .arg(src.join("Makefile"))
        .arg(format!("VPATH={}", src.display()))
        .arg(format!("PG_CONFIG={}", pg_config.display()))
        .output()
        .expect("run make");
    assert!(
        out.status.success(),
        "building filters/postgres/ext failed (needs make, a C compiler and \
         postgresql-server-dev for the server's version):\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    {
        use std::os::unix::fs::PermissionsExt;
        // The server runs as the `postgres` OS user.
        std::fs::set_permissions(staging.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod the library directory");
    }
    let staged = staging.keep();
    if std::fs::rename(&staged, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&staged);
        assert!(
            dir.join("fencegate_enforce.so").exists(),
            "{} has no fencegate_enforce.so",
            dir.display()
        );
    }
    dir
}
