//! Fixtures shared by the integration tests: generated sparse files and ways to compare them.
// Each test binary uses part of this module (and of what it re-exports from the test kit).
#![allow(dead_code, unused_imports)]

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use testkit::{TestRng, data_extents, sha256_file, wait_for, wait_for_async};

/// A directory on a disk filesystem (not tmpfs), removed on drop.
pub fn scratch_dir() -> tempfile::TempDir {
    testkit::disk_tempdir("sparse-sync-test")
}

/// Writes a file of `size` bytes with random data pieces (4 KiB-aligned, 4 KiB to `max_piece` long) separated by
/// holes, a final unaligned tail piece when `size` is not a multiple of 4 KiB, and returns the data ranges written.
pub fn random_sparse_file(path: &Path, size: u64, max_piece: u64, seed: u64) -> Vec<Range<u64>> {
    let f = File::create(path).unwrap();
    f.set_len(size).unwrap();
    let mut rng = TestRng::new(seed);
    let mut ranges = Vec::new();
    let mut pos = rng.below(4) * 4096;
    let mut buf = Vec::new();
    while pos < size {
        let len = ((rng.below(max_piece / 4096) + 1) * 4096).min(size - pos);
        buf.resize(usize::try_from(len).unwrap(), 0);
        rng.fill(&mut buf);
        f.write_all_at(&buf, pos).unwrap();
        ranges.push(pos..pos + len);
        pos += len + (rng.below(max_piece / 4096) + 1) * 4096;
    }
    f.sync_all().unwrap();
    ranges
}

pub fn data_bytes(ranges: &[Range<u64>]) -> u64 {
    ranges.iter().map(|r| r.end - r.start).sum()
}

pub fn path_with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}
