//! Counted locks and payload copies along the data path (issue 16), for `bench/datapath/run.sh COUNT=1`.
//!
//! With the `io-counters` feature (off by default; the engine's and the replica's features of the same name turn
//! it on) every lock the IO path takes in Corral's own code and every `memcpy` of payload bytes calls [`lock`] or
//! [`copy`] where it happens, and the bytes handed to or taken from the kernel by a socket or file syscall call
//! [`kernel`] (each such byte is copied once by the kernel: into a socket buffer, out of one, or between the page
//! cache and user memory). The daemons show the totals on `/metrics` (`corral_io_counter_*`). Without the feature
//! every function here is an empty inline function: the data path pays nothing.
//!
//! Not counted: locks inside tokio (scheduler, timers, the I/O driver's readiness) and inside the kernel, and
//! atomic read-modify-writes (the epoch gate, modes, metrics) — those are not locks.

#[cfg(feature = "io-counters")]
mod imp {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    pub(super) static LOCKS: AtomicU64 = AtomicU64::new(0);
    pub(super) static COPIES: AtomicU64 = AtomicU64::new(0);
    pub(super) static COPIED_BYTES: AtomicU64 = AtomicU64::new(0);
    pub(super) static KERNEL_BYTES: AtomicU64 = AtomicU64::new(0);

    pub(super) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    pub(super) fn get(c: &AtomicU64) -> u64 {
        c.load(Relaxed)
    }
}

/// Whether this build counts (the `io-counters` feature).
pub const ENABLED: bool = cfg!(feature = "io-counters");

/// Totals since the process started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoCounts {
    /// Lock acquisitions (mutex, read or write side of an rwlock) on the IO path.
    pub locks: u64,
    /// User-space copies of payload bytes (each `memcpy` of a payload, or of part of one, counts once).
    pub copies: u64,
    /// Bytes those copies moved.
    pub copied_bytes: u64,
    /// Bytes passed through read/write syscalls on sockets and files (each is one copy in the kernel).
    pub kernel_bytes: u64,
}

/// One lock acquisition on the IO path.
#[inline(always)]
pub fn lock() {
    #[cfg(feature = "io-counters")]
    imp::add(&imp::LOCKS, 1);
}

/// One user-space copy of `bytes` payload bytes (nothing when `bytes` is 0).
#[inline(always)]
pub fn copy(bytes: usize) {
    #[cfg(feature = "io-counters")]
    if bytes > 0 {
        imp::add(&imp::COPIES, 1);
        imp::add(&imp::COPIED_BYTES, bytes as u64);
    }
    #[cfg(not(feature = "io-counters"))]
    let _ = bytes;
}

/// `bytes` that crossed a read or write syscall (socket or file): copied once by the kernel.
#[inline(always)]
pub fn kernel(bytes: usize) {
    #[cfg(feature = "io-counters")]
    imp::add(&imp::KERNEL_BYTES, bytes as u64);
    #[cfg(not(feature = "io-counters"))]
    let _ = bytes;
}

/// The totals (all zero without the feature).
pub fn snapshot() -> IoCounts {
    #[cfg(feature = "io-counters")]
    {
        IoCounts {
            locks: imp::get(&imp::LOCKS),
            copies: imp::get(&imp::COPIES),
            copied_bytes: imp::get(&imp::COPIED_BYTES),
            kernel_bytes: imp::get(&imp::KERNEL_BYTES),
        }
    }
    #[cfg(not(feature = "io-counters"))]
    IoCounts::default()
}

/// The totals as `(metric name, help, value)` for a daemon's `/metrics` (empty without the feature).
pub fn metrics() -> Vec<(&'static str, &'static str, u64)> {
    if !ENABLED {
        return Vec::new();
    }
    let c = snapshot();
    vec![
        (
            "io_counter_locks",
            "Locks taken on the IO path (io-counters build)",
            c.locks,
        ),
        (
            "io_counter_copies",
            "User-space payload copies on the IO path (io-counters build)",
            c.copies,
        ),
        (
            "io_counter_copied_bytes",
            "Bytes of those copies (io-counters build)",
            c.copied_bytes,
        ),
        (
            "io_counter_kernel_bytes",
            "Bytes through socket and file read/write syscalls, each copied once by the kernel (io-counters build)",
            c.kernel_bytes,
        ),
    ]
}

#[cfg(all(test, feature = "io-counters"))]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up() {
        let before = snapshot();
        lock();
        copy(4096);
        copy(0);
        kernel(100);
        let after = snapshot();
        // Other tests in this process may count too: at least ours.
        assert!(after.locks > before.locks);
        assert!(after.copies > before.copies);
        assert!(after.copied_bytes >= before.copied_bytes + 4096);
        assert!(after.kernel_bytes >= before.kernel_bytes + 100);
    }
}
