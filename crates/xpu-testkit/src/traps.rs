//! Files an attacker plants where a reader expects a small regular file (a sysfs attribute, the
//! host snapshot, a bundle's `config.json`), and the hang detectors the tests of such readers
//! run them under: a reader that blocks fails its test within a minute instead of hanging it.

use std::path::Path;
use std::process::{Child, Output};
use std::time::{Duration, Instant};

/// How long a call or a process may take before it counts as blocked: a hang detector, not a
/// timing assertion (the readers return in milliseconds).
const BLOCKED: Duration = Duration::from_secs(60);

/// A file that is not what a reader expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trap {
    /// A FIFO: a plain `open` of it blocks until a writer comes.
    Fifo,
    /// A link to `/dev/zero`: it never ends, and says it is empty.
    DevZero,
    /// A sparse 3 GB file: it costs no disk, and a reader that reads it whole runs out of memory.
    Huge,
}

impl Trap {
    pub const ALL: [Trap; 3] = [Trap::Fifo, Trap::DevZero, Trap::Huge];

    /// The words a bounded reader's refusal of it holds.
    pub fn said(self) -> &'static str {
        match self {
            Trap::Fifo => "is a FIFO, not a regular file",
            Trap::DevZero => "is a character device, not a regular file",
            Trap::Huge => "is too large",
        }
    }

    /// Replaces `path` (a file, a link, or nothing) with the trap, making its directory.
    ///
    /// # Panics
    /// When the trap cannot be made: a test helper.
    #[allow(clippy::unwrap_used)]
    pub fn plant(self, path: &Path) {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        // Nothing there yet is what most callers have.
        let _ = std::fs::remove_file(path);
        match self {
            Trap::Fifo => {
                let mode = rustix::fs::Mode::from_raw_mode(0o644);
                rustix::fs::mknodat(rustix::fs::CWD, path, rustix::fs::FileType::Fifo, mode, 0)
                    .unwrap();
            }
            Trap::DevZero => std::os::unix::fs::symlink("/dev/zero", path).unwrap(),
            Trap::Huge => std::fs::File::create(path).unwrap().set_len(3 << 30).unwrap(),
        }
    }
}

/// `f()` on a thread; panics, naming `what`, if it has not returned within a minute.
pub fn returns<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The receiver is gone only when the test already failed.
        let _ = tx.send(f());
    });
    rx.recv_timeout(BLOCKED)
        .unwrap_or_else(|_| panic!("{what} did not return within a minute: it blocks"))
}

/// The output of `child` (its stdout and stderr piped); kills it and panics, naming `what`, if
/// it has not exited within a minute.
///
/// # Panics
/// When it blocks, or cannot be waited for: a test helper.
#[allow(clippy::unwrap_used)]
pub fn exits(mut child: Child, what: &str) -> Output {
    let deadline = Instant::now() + BLOCKED;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{what} did not exit within a minute: it blocks");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}
