//! A small tmpfs for tests of what the node does when a volume fills up: mounted on a temp dir,
//! unmounted on drop (also when the test fails). Mounting needs root (CI runs as root).

use std::path::Path;
use std::process::Command;

pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts a tmpfs of `size` (`mount -o size=...`, e.g. "1m"); `None`, with the reason
    /// printed, when this process is not root, so the calling test can skip.
    pub fn mount_or_skip(size: &str, test: &str) -> Option<Self> {
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        if !root {
            eprintln!("SKIPPED {test}: it mounts a {size} tmpfs, which needs root (CI runs as root); run it as root to check it");
            return None;
        }
        Some(Self::mount(size))
    }

    /// Mounts a tmpfs of `size`; panics if it cannot.
    pub fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output();
        match out {
            Ok(out) if out.status.success() => Self { dir },
            Ok(out) => panic!(
                "cannot mount a {size} tmpfs at {} (needs root for `mount -t tmpfs`): {}",
                dir.path().display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => panic!(
                "cannot run `mount` to make a {size} tmpfs at {} (needs root and util-linux): {e}",
                dir.path().display()
            ),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(self.dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Busy (a process still has a file open): detach it now, freed when closed.
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.dir.path())
                .status();
        }
    }
}
