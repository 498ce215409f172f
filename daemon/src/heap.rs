//! Giving freed heap back to the kernel. glibc's malloc keeps what a process frees inside its arenas (one per
//! thread that allocated, up to 8 per core), and on its own returns memory only from the top of a heap.
//! A daemon hosting many replicas allocates transient buffers for every control call (gRPC requests and the
//! like) on whichever thread serves it, between allocations that live on (an lvol's metadata),
//! so after a burst of calls much of its RSS can be free memory no one uses: measured on `serve-lvstore` with 200
//! replicas and 20 snapshots each, 67.7 MiB of RSS of which `malloc_trim` released 30.2 MiB
//! (`bench/v2/README.md`). [`spawn_trimmer`] reads the resident set once a period and trims when it grew by a
//! threshold since the last trim, so an idle daemon costs one read of `/proc/self/statm` a period and a busy one at
//! most one trim (a walk of the arenas' free lists) a period. Not `mallinfo2` as the trigger: it walks every free
//! chunk, and its free-byte count moves neither when a trim releases pages nor when they are touched again.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The process's resident set in bytes (`/proc/self/statm`); 0 where it cannot be read.
pub fn resident_bytes() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page)
}

/// Returns the free pages of every arena to the kernel (`malloc_trim(0)`); whether any memory was released.
pub fn trim() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim takes the arenas' own locks; it may be called from any thread at any time.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Trims when the resident set grew by `threshold` bytes since right after the last trim (freed memory, or live
/// data: a trim tells them apart by what it gives back); returns the resident bytes to compare against next time
/// (the lower of the two when nothing was done, so a shrink moves the mark down) and whether it trimmed.
pub fn trim_if_grown(after_last: u64, threshold: u64) -> (u64, bool) {
    let rss = resident_bytes();
    if rss < after_last.saturating_add(threshold) {
        return (rss.min(after_last), false);
    }
    trim();
    (resident_bytes(), true)
}

/// A thread that calls [`trim_if_grown`] every `period` until `cancel` (a thread, not a task: a trim holds the
/// arenas' locks and must not stall a runtime worker).
pub fn spawn_trimmer(period: Duration, threshold: u64, cancel: CancellationToken) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("heap-trim".into())
        .spawn(move || {
            let mut after_last = resident_bytes();
            let mut trims = 0u64;
            while !cancel.is_cancelled() {
                std::thread::sleep(period);
                let (rss, trimmed) = trim_if_grown(after_last, threshold);
                if trimmed {
                    trims += 1;
                    tracing::debug!(
                        mark = after_last,
                        rss_after = rss,
                        trims,
                        "freed heap returned to the kernel"
                    );
                }
                after_last = rss;
            }
        })
        .map(drop)
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    #[test]
    fn memory_freed_between_live_allocations_is_given_back_by_a_trim() {
        // 64 MiB in 32 KiB blocks (below glibc's 128 KiB mmap threshold, so they come from the heap), each followed
        // by a small block that stays, as a daemon's transient and lasting allocations interleave: freeing the
        // big ones leaves holes no top-of-heap trim can give back.
        let mut keep = Vec::new();
        let mut transient = Vec::new();
        for i in 0..2048u32 {
            transient.push(vec![i.to_le_bytes()[0] | 1; 32 << 10]);
            keep.push(vec![1u8; 64]);
        }
        let full = resident_bytes();
        drop(transient);
        let freed = resident_bytes();
        assert!(
            freed + (16 << 20) > full,
            "the 64 MiB freed are still resident before a trim ({freed} of {full} bytes): the test shows nothing"
        );
        // Below the threshold: nothing done.
        let (_, trimmed) = trim_if_grown(freed, 1 << 40);
        assert!(!trimmed);
        let (after, trimmed) = trim_if_grown(0, 16 << 20);
        assert!(
            trimmed,
            "resident {freed} bytes, above the threshold, yet no trim"
        );
        assert!(
            after + (48 << 20) <= freed,
            "a trim gave back less than 48 of the 64 MiB freed: {freed} -> {after} bytes resident"
        );
        assert_eq!(keep.iter().map(|k| k[0] as usize).sum::<usize>(), 2048);
    }
}
