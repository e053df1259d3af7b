//! The process's open-file limit, lowered for a moment so that `accept()` fails with EMFILE.
//! Used by the gateways' accept-error tests, each in its own test binary (the limit is the
//! whole process's).

use std::process::Command;

/// The process's open file descriptors.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The soft limit on open files.
fn soft_nofile() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
        .expect("/proc/self/limits names the open-file limit")
}

fn set_soft_nofile(limit: usize) {
    let status = Command::new("prlimit")
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg(format!("--nofile={limit}:"))
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(status.success());
}

/// A lowered open-file limit; the previous one is restored on drop.
pub struct FdSqueeze {
    original: usize,
}

impl FdSqueeze {
    /// Leaves room for `room` more descriptors in this process.
    pub fn leave_room(room: usize) -> Self {
        let original = soft_nofile();
        set_soft_nofile(open_fds() + room);
        Self { original }
    }
}

impl Drop for FdSqueeze {
    fn drop(&mut self) {
        set_soft_nofile(self.original);
    }
}
