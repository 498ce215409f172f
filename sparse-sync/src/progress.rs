//! [`Progress`]: a counter shared between a long operation and whoever reports on it.
//!
//! Operations count logical bytes covered (data and holes alike), so `done` reaches `total` (the file size)
//! exactly when the operation finishes, whatever the file's layout.

use std::sync::atomic::{AtomicU64, Ordering};

/// Progress of one operation, in bytes. Cheap to update from several workers at once.
#[derive(Debug, Default)]
pub struct Progress {
    total: AtomicU64,
    done: AtomicU64,
}

impl Progress {
    /// A progress counter with nothing known yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the number of bytes the operation covers and resets the done count.
    pub fn start(&self, total: u64) {
        self.done.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
    }

    /// Records `bytes` more as covered.
    pub fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes covered so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Bytes the operation covers in all.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Whole percent done, 0 to 100 (100 for an empty operation that has started).
    pub fn percent(&self) -> u8 {
        let (done, total) = (self.done(), self.total());
        if total == 0 {
            return 100;
        }
        u8::try_from((u128::from(done.min(total)) * 100 / u128::from(total)).min(100)).unwrap_or(100)
    }
}
